#include "moe_bench_fill.h"

#include "backend/cuda/cuda_check.h"

namespace moe_bench {
namespace {

__device__ __forceinline__ uint32_t mix(uint64_t i, uint32_t seed) {
  uint64_t x = i * 0x9e3779b97f4a7c15ull + seed * 0xbf58476d1ce4e5b9ull + 1;
  x ^= x >> 31;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 29;
  return uint32_t(x);
}

__global__ void fill_e4m3_kernel(uint8_t* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t b = mix(i, seed) & 0xffu;
    if ((b & 0x7fu) == 0x7fu) b ^= 1u;
    p[i] = uint8_t(b);
  }
}

__global__ void fill_bytes_kernel(uint8_t* p, size_t n, int lo, int hi, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    p[i] = uint8_t(lo + int(mix(i, seed) % uint32_t(hi - lo + 1)));
  }
}

__global__ void fill_f32_kernel(float* p, size_t n, float scale, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    p[i] = (float(mix(i, seed) >> 8) * (1.0f / 8388608.0f) - 1.0f) * scale;
  }
}

__global__ void row_max_kernel(const uint8_t* s, int64_t rows, int64_t cols, uint8_t* out) {
  for (int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; r < rows; r += int64_t(gridDim.x) * blockDim.x) {
    uint8_t m = 0;
    for (int64_t c = 0; c < cols; ++c) m = s[r * cols + c] > m ? s[r * cols + c] : m;
    out[r] = m;
  }
}

}  // namespace

void row_max_bytes(const uint8_t* scale, int64_t rows, int64_t cols, uint8_t* out, cudaStream_t stream) {
  row_max_kernel<<<256, 128, 0, stream>>>(scale, rows, cols, out);
  M3_CUDA_CHECK_LAUNCH();
}

void fill_e4m3(uint8_t* p, size_t n, uint32_t seed, cudaStream_t stream) {
  fill_e4m3_kernel<<<4096, 256, 0, stream>>>(p, n, seed);
  M3_CUDA_CHECK_LAUNCH();
}
void fill_bytes(uint8_t* p, size_t n, int lo, int hi, uint32_t seed, cudaStream_t stream) {
  fill_bytes_kernel<<<4096, 256, 0, stream>>>(p, n, lo, hi, seed);
  M3_CUDA_CHECK_LAUNCH();
}
void fill_f32(float* p, size_t n, float scale, uint32_t seed, cudaStream_t stream) {
  fill_f32_kernel<<<4096, 256, 0, stream>>>(p, n, scale, seed);
  M3_CUDA_CHECK_LAUNCH();
}

}  // namespace moe_bench
