// Embedding gather, Gemma RMSNorm, partial NeoX RoPE, residual add and KV-cache scatter for
// F32 device tensors; one block per row, fp32 throughout (parity with the CPU reference).

#include <cmath>
#include <string>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_internal.h"
#include "backend/cuda/row_ops.cuh"

namespace m3::cuda {
namespace {


// Rows of 4-byte words (F32 values, or I32 ids when the table maps ids), copied bit for bit.
__global__ void embedding_gather_kernel(const int32_t* ids, const uint32_t* table, uint32_t* out, int64_t dim,
                                        int64_t rows, int64_t first_id) {
  const int64_t t = blockIdx.x, row = int64_t(ids[t]) - first_id;
  if (row < 0 || row >= rows) {  // another rank's slice of the vocabulary
    for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) out[t * dim + i] = 0u;
    return;
  }
  const uint32_t* src = table + row * dim;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) out[t * dim + i] = src[i];
}

__global__ void rms_norm_gemma_kernel(const float* x, const float* w, float* y, int64_t dim, float eps) {
  __shared__ float partial[32];
  const int64_t row = blockIdx.x;
  const float* xr = x + row * dim;
  float sum = 0.0f;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) sum += xr[i] * xr[i];
  const float inv = gemma_inv_rms(cta_sum(sum, partial), dim, eps);
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) y[row * dim + i] = gemma_norm(xr[i], inv, w[i]);
}

// One block per token; threads over the rotary pairs, each rotating every head.
__global__ void rope_neox_kernel(float* x, const int32_t* positions, int64_t heads, int64_t head_dim, int half,
                                 RopeInvFreq inv_freq) {
  const int64_t t = blockIdx.x;
  const float pos = float(positions[t]);
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    float c, s;
    rope_cos_sin(pos, inv_freq.v[i], c, s);
    for (int64_t h = 0; h < heads; ++h) {
      float* v = x + (t * heads + h) * head_dim;
      rope_rotate(c, s, v[i], v[i + half]);
    }
  }
}

__global__ void add_kernel(float* x, const float* y, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) x[i] += y[i];
}

// F32 rows into an F32, BF16 or F8E4M3 cache (store_cache); one block per token.
__global__ void kv_write_kernel(const float* src, const int64_t* slots, void* cache, CacheType dt, int64_t row) {
  const int64_t t = blockIdx.x;
  const int64_t slot = slots[t];
  if (slot < 0) return;  // padding token: nothing to cache
  for (int64_t i = threadIdx.x; i < row; i += blockDim.x) store_cache(cache, dt, slot * row + i, src[t * row + i]);
}

void launch_embedding_gather(const int32_t* ids, int num_tokens, const TensorView& table, const TensorView& out,
                             int64_t first_id) {
  if (num_tokens == 0) return;
  embedding_gather_kernel<<<num_tokens, 256, 0, current_stream()>>>(ids, table.as<const uint32_t>(), out.as<uint32_t>(),
                                                                    table.shape[1], table.shape[0], first_id);
  M3_CUDA_CHECK_LAUNCH();
}

void launch_rms_norm_gemma(const TensorView& x, const TensorView& w, float eps, const TensorView& y) {
  if (x.shape[0] == 0) return;
  rms_norm_gemma_kernel<<<unsigned(x.shape[0]), 256, 0, current_stream()>>>(x.as<const float>(), w.as<const float>(), y.as<float>(),
                                                       x.shape[1], eps);
  M3_CUDA_CHECK_LAUNCH();
}

void launch_rope(const TensorView& x, const int32_t* positions, int rotary_dim, double theta) {
  if (x.shape[0] == 0) return;
  const int half = rotary_dim / 2;
  const RopeInvFreq inv = rope_inv_freq(rotary_dim, theta);
  rope_neox_kernel<<<unsigned(x.shape[0]), 64, 0, current_stream()>>>(x.as<float>(), positions, x.shape[1], x.shape[2], half, inv);
  M3_CUDA_CHECK_LAUNCH();
}

void launch_add(const TensorView& x, const TensorView& y) {
  const int64_t n = x.numel();
  if (n == 0) return;
  add_kernel<<<unsigned((n + 255) / 256), 256, 0, current_stream()>>>(x.as<float>(), y.as<const float>(), n);
  M3_CUDA_CHECK_LAUNCH();
}

void launch_kv_write(const TensorView& src, const int64_t* slot_mapping, const TensorView& cache) {
  const int64_t tokens = src.shape[0];
  if (tokens == 0) return;
  const int64_t row = src.numel() / tokens;
  kv_write_kernel<<<unsigned(tokens), 128, 0, current_stream()>>>(src.as<const float>(), slot_mapping, cache.data,
                                                                  cache_type(cache.dtype), row);
  M3_CUDA_CHECK_LAUNCH();
}

}  // namespace

RopeInvFreq rope_inv_freq(int rotary_dim, double theta) {
  RopeInvFreq inv{};
  for (int i = 0; i < rotary_dim / 2 && i < kMaxRotaryHalf; ++i)
    inv.v[i] = 1.0f / std::pow(float(theta), float(2 * i) / float(rotary_dim));
  return inv;
}

std::string need_cuda_f32(const ops::Problem& p) {
  if (p.device != Device::kCuda) return "tensors are not in device memory";
  if (p.dtype != DType::kF32) return "written for F32, got " + std::string(dtype_name(p.dtype));
  return "";
}

void register_elementwise(ops::KernelTable& table) {
  table.embedding.add({"embedding.gather.sm90", "device F32 (or I32: an id map) table, device token ids",
                       [](const ops::Problem& p) -> std::string {
                         if (p.dtype == DType::kI32) {
                           ops::Problem f = p;
                           f.dtype = DType::kF32;  // the same 4-byte rows
                           return need_cuda_f32(f);
                         }
                         return need_cuda_f32(p);
                       },
                       launch_embedding_gather});
  table.rms_norm.add({"rms_norm.gemma.sm90", "device F32 rows", need_cuda_f32, launch_rms_norm_gemma});
  table.rope.add({"rope.neox_partial.sm90",
                  "device F32, device positions, even rotary_dim <= min(head_dim, 256); inv_freq from the CPU "
                  "entry's host expression, fp32 angle, cosf/sinf",
                  [](const ops::Problem& p) -> std::string {
                    std::string why = need_cuda_f32(p);
                    if (!why.empty()) return why;
                    if (p.extra <= 0 || p.extra % 2 || p.extra > p.k) return "rotary_dim must be even and <= head_dim";
                    if (p.extra > 2 * kMaxRotaryHalf) return "rotary_dim above 256";
                    return "";
                  },
                  launch_rope});
  table.add.add({"add.inplace.sm90", "device F32", need_cuda_f32, launch_add});
  table.kv_write.add({"kv_write.scatter.sm90",
                      "device F32 rows into an F32, BF16 (RNE) or F8E4M3 (RNE, saturating) cache, device slot "
                      "mapping (-1 skipped)",
                      [](const ops::Problem& p) -> std::string {
                        if (p.device != Device::kCuda) return "tensors are not in device memory";
                        if (p.dtype != DType::kF32 && p.dtype != DType::kBF16 && p.dtype != DType::kF8E4M3)
                          return "cache dtype " + std::string(dtype_name(p.dtype)) + " not supported";
                        return "";
                      },
                      launch_kv_write});
}

}  // namespace m3::cuda
