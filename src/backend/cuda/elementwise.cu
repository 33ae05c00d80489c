// Embedding gather, Gemma RMSNorm and residual add for F32 device tensors: the first CUDA
// entries; one block per row, fp32 throughout (parity with the CPU reference).
#include <string>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_check.h"

namespace m3::cuda {
namespace {

__global__ void embedding_gather_kernel(const int32_t* ids, const float* table, float* out, int64_t dim) {
  const int64_t t = blockIdx.x;
  const float* src = table + int64_t(ids[t]) * dim;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) out[t * dim + i] = src[i];
}

__global__ void rms_norm_gemma_kernel(const float* x, const float* w, float* y, int64_t dim, float eps) {
  __shared__ float partial[32];
  const int64_t row = blockIdx.x;
  const float* xr = x + row * dim;
  float sum = 0.0f;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) sum += xr[i] * xr[i];
  for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = sum;
  __syncthreads();
  if (threadIdx.x < 32) {
    sum = threadIdx.x < (blockDim.x + 31) / 32 ? partial[threadIdx.x] : 0.0f;
    for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    if (threadIdx.x == 0) partial[0] = sum;
  }
  __syncthreads();
  const float inv = rsqrtf(partial[0] / float(dim) + eps);
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) y[row * dim + i] = (xr[i] * inv) * (1.0f + w[i]);
}

__global__ void add_kernel(float* x, const float* y, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) x[i] += y[i];
}

std::string need_cuda_f32(const ops::Problem& p) {
  if (p.device != Device::kCuda) return "tensors are not in device memory";
  if (p.dtype != DType::kF32) return "written for F32, got " + std::string(dtype_name(p.dtype));
  return "";
}

void launch_embedding_gather(const int32_t* ids, int num_tokens, const TensorView& table, const TensorView& out) {
  if (num_tokens == 0) return;
  embedding_gather_kernel<<<num_tokens, 256>>>(ids, table.as<const float>(), out.as<float>(), table.shape[1]);
  M3_CUDA_CHECK_LAUNCH();
}

void launch_rms_norm_gemma(const TensorView& x, const TensorView& w, float eps, const TensorView& y) {
  if (x.shape[0] == 0) return;
  rms_norm_gemma_kernel<<<unsigned(x.shape[0]), 256>>>(x.as<const float>(), w.as<const float>(), y.as<float>(),
                                                       x.shape[1], eps);
  M3_CUDA_CHECK_LAUNCH();
}

void launch_add(const TensorView& x, const TensorView& y) {
  const int64_t n = x.numel();
  if (n == 0) return;
  add_kernel<<<unsigned((n + 255) / 256), 256>>>(x.as<float>(), y.as<const float>(), n);
  M3_CUDA_CHECK_LAUNCH();
}

}  // namespace

void register_cuda_kernels(ops::KernelTable& table) {
  table.embedding.add({"embedding.gather.sm90", "device F32 table", need_cuda_f32, launch_embedding_gather});
  table.rms_norm.add({"rms_norm.gemma.sm90", "device F32 rows", need_cuda_f32, launch_rms_norm_gemma});
  table.add.add({"add.inplace.sm90", "device F32", need_cuda_f32, launch_add});
}

}  // namespace m3::cuda
