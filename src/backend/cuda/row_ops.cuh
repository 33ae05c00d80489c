// Device steps shared by the per-row kernels (elementwise.cu) and their fusions (fused_rows.cu).
// A fusion must give the bits of the kernels it replaces, so each order of operations is written
// once, here.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "core/dtype.h"

namespace m3::cuda {

// Sum over a warp by xor butterfly (offsets 16, 8, 4, 2, 1); every lane gets the same value.
__device__ __forceinline__ float xor_fold(float s) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
  return s;
}

// Sum over the CTA (every thread gets it): each warp folds its lanes, then warp 0 folds the warp
// sums the same way. partial: 32 floats of shared memory. rms_norm_gemma's order.
__device__ __forceinline__ float cta_sum(float sum, float* partial) {
  sum = xor_fold(sum);
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = sum;
  __syncthreads();
  if (threadIdx.x < 32) {
    sum = threadIdx.x < (blockDim.x + 31) / 32 ? partial[threadIdx.x] : 0.0f;
    sum = xor_fold(sum);
    if (threadIdx.x == 0) partial[0] = sum;
  }
  __syncthreads();
  return partial[0];
}

// Gemma RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + w), from the row's sum of squares.
__device__ __forceinline__ float gemma_inv_rms(float sum_sq, int64_t dim, float eps) {
  return rsqrtf(sum_sq / float(dim) + eps);
}
__device__ __forceinline__ float gemma_norm(float x, float inv, float w) { return (x * inv) * (1.0f + w); }

// NeoX rotation of the pair (a, b) = (x[i], x[i + half]) by the angle pos * inv_freq[i]; the
// products rounded separately (no FMA contraction), as the CPU reference computes them.
__device__ __forceinline__ void rope_cos_sin(float pos, float inv_freq, float& c, float& s) {
  const float angle = pos * inv_freq;
  c = cosf(angle);
  s = sinf(angle);
}
__device__ __forceinline__ void rope_rotate(float c, float s, float& a, float& b) {
  const float a0 = a, b0 = b;
  a = __fsub_rn(__fmul_rn(a0, c), __fmul_rn(b0, s));
  b = __fadd_rn(__fmul_rn(b0, c), __fmul_rn(a0, s));
}

// KV-cache element types: F32 as is, BF16 round to nearest even (f32_to_bf16), F8E4M3 RNE with
// saturation to +-448 (f32_to_fp8_e4m3).
enum class CacheType : int { kF32 = 0, kBF16 = 1, kF8E4M3 = 2 };
inline CacheType cache_type(DType dt) {
  return dt == DType::kBF16 ? CacheType::kBF16 : dt == DType::kF8E4M3 ? CacheType::kF8E4M3 : CacheType::kF32;
}
__device__ __forceinline__ void store_cache(void* cache, CacheType dt, int64_t i, float v) {
  if (dt == CacheType::kBF16) {
    static_cast<__nv_bfloat16*>(cache)[i] = __float2bfloat16_rn(v);
  } else if (dt == CacheType::kF8E4M3) {
    static_cast<__nv_fp8_storage_t*>(cache)[i] = __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
  } else {
    static_cast<float*>(cache)[i] = v;
  }
}

}  // namespace m3::cuda
