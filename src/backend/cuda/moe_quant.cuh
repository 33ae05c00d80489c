#pragma once
// The activation rows' conversion both MoE launch paths run (moe_mxfp8.cu's prep kernels, and the
// router's select kernel when it hands the experts their inputs: moe_router.cu): x -> f16 or e4m3
// with a power-of-two scale per row. Kept C++17 (included by .cu files only).
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "backend/cuda/mma_operands.cuh"

namespace m3::cuda::moe_mxfp8 {

// Row conversion with a power-of-two scale per row (one CTA per row): out = x * 2^k as f16 (|.|
// < 2^15) or e4m3 (|.| <= 448), scale[row] = 2^-k. Power-of-two scaling is exact, so the only
// rounding is the conversion itself; a row's result depends on that row alone.
constexpr int kQuantThreads = 256;

// kL2: through L2 only (ld.global.cg), for rows written by a kernel this one did not wait for (the
// router's select kernel reads x before its wait: see moe_router.cu).
template <class In, bool kL2 = false>
__device__ __forceinline__ float4 load4(const In* p) {
  if constexpr (std::is_same<In, float>::value) {
    if constexpr (kL2) return __ldcg(reinterpret_cast<const float4*>(p));
    return *reinterpret_cast<const float4*>(p);
  } else {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    const float2 lo = __half22float2(*reinterpret_cast<const __half2*>(&u.x));
    const float2 hi = __half22float2(*reinterpret_cast<const __half2*>(&u.y));
    return make_float4(lo.x, lo.y, hi.x, hi.y);
  }
}

// The power of two k a row with this amax is multiplied by: |x| * 2^k < 2^15 (f16) or <= 448 (e4m3).
template <bool kFp8>
__device__ __forceinline__ int row_scale_exp(float amax) {
  int k = 0;
  if (amax > 0.0f && amax <= 3.0e38f) {  // zero, inf or NaN rows keep scale 1 (and propagate)
    int ex = 0;
    frexpf(amax, &ex);  // amax in [2^(ex-1), 2^ex)
    k = kFp8 ? 9 - ex : 15 - ex;
    if (kFp8 && ldexpf(amax, k) > 448.0f) --k;
    k = max(-126, min(126, k));
  }
  return k;
}

// One row by the whole CTA (any multiple of 32 threads up to 1024). kPerm (f16 only): columns in
// the wgmma W8A16 operand order (wg_col). Rows of up to kQuantCache float4 per thread are loaded
// once, all before the amax (one memory round trip), and converted from registers; longer rows
// are read twice.
constexpr int kQuantCache = 8;
template <class In, bool kFp8, bool kPerm = false, bool kL2 = false>
__device__ __forceinline__ void quant_row(const In* xr, int cols, void* out_row, float* scale) {
  const int nt = int(blockDim.x), tid = int(threadIdx.x);
  const bool cached = cols <= 4 * nt * kQuantCache;
  auto amax4 = [](float a, const float4& v) {
    return fmaxf(a, fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
  };
  float amax = 0.0f;
  float4 cache[kQuantCache];
  if (cached) {
#pragma unroll
    for (int i = 0; i < kQuantCache; ++i) {
      const int c = 4 * (tid + i * nt);
      if (c < cols) cache[i] = load4<In, kL2>(xr + c);
    }
#pragma unroll
    for (int i = 0; i < kQuantCache; ++i) {
      if (4 * (tid + i * nt) < cols) amax = amax4(amax, cache[i]);
    }
  } else {
    for (int c = 4 * tid; c < cols; c += 4 * nt) amax = amax4(amax, load4<In, kL2>(xr + c));
  }
  amax = mma_ops::cta_amax(amax, nt / 32);
  const int k = row_scale_exp<kFp8>(amax);
  const float mul = ldexpf(1.0f, k);
  if (tid == 0) *scale = ldexpf(1.0f, -k);
  auto put = [&](int c, const float4& v) {
    if constexpr (kFp8) {
      const __nv_fp8x2_storage_t lo = __nv_cvt_float2_to_fp8x2(make_float2(v.x * mul, v.y * mul), __NV_SATFINITE, __NV_E4M3);
      const __nv_fp8x2_storage_t hi = __nv_cvt_float2_to_fp8x2(make_float2(v.z * mul, v.w * mul), __NV_SATFINITE, __NV_E4M3);
      *reinterpret_cast<uint32_t*>(static_cast<uint8_t*>(out_row) + c) = uint32_t(lo) | (uint32_t(hi) << 16);
    } else {
      const __half2 lo = __floats2half2_rn(v.x * mul, v.y * mul), hi = __floats2half2_rn(v.z * mul, v.w * mul);
      if constexpr (kPerm) {
        *reinterpret_cast<__half2*>(static_cast<__half*>(out_row) + mma_ops::wg_col(c)) = lo;
        *reinterpret_cast<__half2*>(static_cast<__half*>(out_row) + mma_ops::wg_col(c + 2)) = hi;
      } else {
        uint2 u;
        u.x = *reinterpret_cast<const uint32_t*>(&lo);
        u.y = *reinterpret_cast<const uint32_t*>(&hi);
        *reinterpret_cast<uint2*>(static_cast<__half*>(out_row) + c) = u;
      }
    }
  };
  if (cached) {
#pragma unroll
    for (int i = 0; i < kQuantCache; ++i) {
      const int c = 4 * (tid + i * nt);
      if (c < cols) put(c, cache[i]);
    }
  } else {
    for (int c = 4 * tid; c < cols; c += 4 * nt) put(c, load4<In, kL2>(xr + c));
  }
}

}  // namespace m3::cuda::moe_mxfp8
