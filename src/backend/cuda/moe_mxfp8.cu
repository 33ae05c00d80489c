// MXFP8 MoE experts on Hopper: routing, activation conversion, the W8A16 (mma.sync) and W8A8
// (wgmma) grouped GEMMs with fused SwiGLU-OAI, and the combine. See moe_mxfp8.h for the contract,
// docs/moe_kernels.md for the design and docs/adr/0003-moe-mxfp8-kernels.md for the choices.
//
// Data flow of one call (everything on current_stream(), nothing read back by the host):
//   route   one CTA: counting sort of the (token, slot) assignments into expert-contiguous rows in
//           the CPU reference's order (routed experts ascending, shared expert last with every
//           token, each expert's rows in (token, slot) order), work items of <= BT rows for the
//           non-empty experts only;
//   prep    one CTA per token: x -> f16 (W8A16) or e4m3 (W8A8) with a power-of-two scale per token;
//   gate_up grouped GEMM over the items, h = swiglu_oai(gate, up) * hscale written as f16
//           (hscale: a power of two from the SwiGLU clamp, so |h| stays < 2^15);
//   [W8A8]  h -> e4m3 with a power-of-two scale per row;
//   down    grouped GEMM, y[row] (F32; bf16 on W8A8; permuted order);
//   combine one CTA per token: out[t] = sum of w * y over t's rows, ascending expert, shared last.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_internal.h"
#include "backend/cuda/moe_route.cuh"
#include "backend/cuda/mma_operands.cuh"
#include "backend/cuda/moe_mxfp8.h"
#include "backend/cuda/moe_timeline.cuh"
#include "backend/cuda/pdl.cuh"
#include "backend/cuda/tile_queue.cuh"
#include "backend/cuda/wgmma.cuh"

namespace m3::cuda::moe_mxfp8 {
namespace {

using namespace mma_ops;

constexpr int kMaxExperts = 256;  // routed + shared in one launch (kernel-parameter table)
constexpr int kMaxTopK = 64;

struct Act {
  float alpha, limit, beta;
};

// One expert matrix: e4m3 [n, k], its e8m0 scales [n, k / 32], and each scale row's largest
// byte [n] (LinearWeight::scale_max) or null (the W8A16 kernels then scan the scale rows).
struct Mat {
  const uint8_t* w;
  const uint8_t* s;
  const uint8_t* ref;
};

// Per-expert matrices and sizes, passed by value (11 KB of kernel parameters; CUDA >= 12.1
// allows 32 KB), so nothing is uploaded or cached per call. gate_up: a = gate, b = up,
// n = intermediate, k = hidden; down: a = down, n = hidden, k = intermediate.
struct Group {
  Mat a[kMaxExperts];
  Mat b[kMaxExperts];
  int n[kMaxExperts];
  int k[kMaxExperts];
};

// ---------------------------------------------------------------------------------------------
// Device helpers.

__device__ __forceinline__ float swiglu(float g, float u, const Act& p) {  // ops::swiglu_oai
  const float gc = fminf(g, p.limit);
  const float uc = fminf(fmaxf(u, -p.limit), p.limit);
  return (uc + p.beta) * gc * (1.0f / (1.0f + expf(-p.alpha * gc)));
}

// Streaming 16-byte weight load: read once, not kept in L1 (L2::256B as cp_async16_w).
__device__ __forceinline__ uint4 ld_stream16(const void* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}


// ---------------------------------------------------------------------------------------------
// Routing: one CTA of 1024 threads for any token count (a few microseconds per 1024
// assignments; prefill-sized calls spend well under 1% of the block here).
constexpr int kRouteThreads = 1024;
constexpr int kRouteWarps = kRouteThreads / 32;

// The mma.sync W8A16 grid (items of <= 64 rows) lists the shared expert's items first: they hold
// the most rows, so a grid of a CTA per item starts the heaviest ones first (T = 128: 1959-1962 ->
// 1946-1951 us); the persistent wgmma kernels (128-row items) balance better with its heavy tiles
// among the routed ones (W8A16 wgmma T = 512: 2240-2246 -> 2282-2292 us first).
__device__ __forceinline__ bool shared_items_first(int rows_per_item) { return rows_per_item <= 64; }

// route_body's result for at most 32 assignments (decode: tokens * top_k <= 32), by one warp
// with lane a holding assignment a: no shared memory and no CTA barrier (the general path's scan,
// item pass and rank round are ~10 barriers of 1024 threads, a few microseconds on the critical
// path of every small decode step). Same perm, pos, items and meta as the general path.
__device__ __forceinline__ void route_warp(const int32_t* ids, int tokens, int top_k, int routed, int has_shared,
                                           int rows_per_item, int32_t* perm, int32_t* pos, int4* items, int* meta) {
  const int lane = int(threadIdx.x) & 31, n_assign = tokens * top_k;
  const int e0 = lane < n_assign ? ids[lane] : -1;
  const bool valid = e0 >= 0 && e0 < routed;
  const int e = valid ? e0 : -1;
  const unsigned peers = __match_any_sync(0xffffffffu, e);
  const int rank = __popc(peers & ((1u << lane) - 1u)), count = __popc(peers);
  const bool leader = valid && rank == 0;
  const int ni = leader ? (count + rows_per_item - 1) / rows_per_item : 0;  // this expert's items
  // Rows and items of the experts below e: sums over the other lanes (leaders for the items).
  int below_rows = 0, below_items = 0, n_valid = 0;
  for (int j = 0; j < 32; ++j) {
    const int ej = __shfl_sync(0xffffffffu, e, j), nij = __shfl_sync(0xffffffffu, ni, j);
    n_valid += ej >= 0;
    below_rows += (ej >= 0 && ej < e);
    below_items += (ej >= 0 && ej < e) ? nij : 0;
  }
  int routed_items = ni;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) routed_items += __shfl_xor_sync(0xffffffffu, routed_items, off);
  const int shared_items = has_shared ? (tokens + rows_per_item - 1) / rows_per_item : 0;
  const bool shared_first = shared_items_first(rows_per_item);
  if (valid) {
    const int p = below_rows + rank;
    perm[p] = lane / top_k;
    pos[lane] = p;
    if (leader) {
      const int i0 = below_items + (shared_first ? shared_items : 0);
      for (int g = 0; g < ni; ++g) {
        items[i0 + g] = expert_item(e, below_rows, count, g, rows_per_item);
      }
    }
  } else if (lane < n_assign) {
    pos[lane] = -1;
  }
  if (has_shared) {
    const int i0 = shared_first ? 0 : routed_items;
    for (int g = lane; g < shared_items; g += 32) {
      items[i0 + g] = expert_item(routed, n_valid, tokens, g, rows_per_item);
    }
    for (int t = lane; t < tokens; t += 32) perm[n_valid + t] = t;
  }
  if (lane == 0) {
    meta[0] = routed_items + shared_items;
    meta[1] = n_valid;
  }
}

// Needs exactly kRouteThreads threads.
__device__ __forceinline__ void route_body(const int32_t* ids, int tokens, int top_k, int routed, int has_shared,
                                           int rows_per_item, int32_t* perm, int32_t* pos, int4* items, int* meta) {
  __shared__ int cnt[kMaxExperts], start[kMaxExperts], item_start[kMaxExperts], run[kMaxExperts];
  __shared__ int wtab[kRouteWarps][kMaxExperts];  // per chunk: count, then exclusive offset, per (warp, expert)
  const int tid = int(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  const int n_assign = tokens * top_k;
  if (n_assign <= 32) {
    if (warp == 0) route_warp(ids, tokens, top_k, routed, has_shared, rows_per_item, perm, pos, items, meta);
    return;
  }
  for (int e = tid; e < kMaxExperts; e += kRouteThreads) cnt[e] = run[e] = 0;
  __syncthreads();
  for (int a = tid; a < n_assign; a += kRouteThreads) {
    const int e = ids[a];
    if (e >= 0 && e < routed) atomicAdd(&cnt[e], 1);  // counts only: order-independent
  }
  __syncthreads();
  scan_and_emit_items(cnt, start, item_start, routed, has_shared, tokens, rows_per_item, items, &meta[0], &meta[1],
                      shared_items_first(rows_per_item));
  // Ranks in assignment order, 1024 assignments per round: rank = rows of earlier rounds +
  // rows of earlier warps in this round + earlier lanes of this warp with the same expert.
  for (int base = 0; base < n_assign; base += kRouteThreads) {
    const int a = base + tid;
    const int e = a < n_assign ? ids[a] : -1;
    const bool valid = e >= 0 && e < routed;
    for (int i = lane; i < kMaxExperts; i += 32) wtab[warp][i] = 0;
    __syncwarp();
    const unsigned peers = __match_any_sync(0xffffffffu, valid ? e : -1);
    const int lrank = __popc(peers & ((1u << lane) - 1u));
    if (valid && lrank == 0) wtab[warp][e] = __popc(peers);
    __syncthreads();
    int round_total = 0;
    if (tid < routed) {
      for (int w = 0; w < kRouteWarps; ++w) {
        const int c = wtab[w][tid];
        wtab[w][tid] = round_total;
        round_total += c;
      }
    }
    __syncthreads();
    if (valid) {
      const int p = start[e] + run[e] + wtab[warp][e] + lrank;
      perm[p] = a / top_k;
      pos[a] = p;
    } else if (a < n_assign) {
      pos[a] = -1;
    }
    __syncthreads();
    if (tid < routed) run[tid] += round_total;
  }
  if (has_shared) {
    const int sb = start[routed];
    for (int t = tid; t < tokens; t += kRouteThreads) perm[sb + t] = t;
  }
}

__global__ void __launch_bounds__(kRouteThreads) route_kernel(const int32_t* ids, int tokens, int top_k, int routed,
                                                               int has_shared, int rows_per_item, int32_t* perm,
                                                               int32_t* pos, int4* items, int* meta) {
  route_body(ids, tokens, top_k, routed, has_shared, rows_per_item, perm, pos, items, meta);
}

// ---------------------------------------------------------------------------------------------
// Row conversion with a power-of-two scale per row (one CTA per row): out = x * 2^k as f16 (|.|
// < 2^15) or e4m3 (|.| <= 448), scale[row] = 2^-k. Power-of-two scaling is exact, so the only
// rounding is the conversion itself; a row's result depends on that row alone.
constexpr int kQuantThreads = 256;

template <class In>
__device__ __forceinline__ float4 load4(const In* p) {
  if constexpr (std::is_same<In, float>::value) {
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
template <class In, bool kFp8, bool kPerm = false>
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
      if (c < cols) cache[i] = load4(xr + c);
    }
#pragma unroll
    for (int i = 0; i < kQuantCache; ++i) {
      if (4 * (tid + i * nt) < cols) amax = amax4(amax, cache[i]);
    }
  } else {
    for (int c = 4 * tid; c < cols; c += 4 * nt) amax = amax4(amax, load4(xr + c));
  }
  amax = cta_amax(amax, nt / 32);
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
        *reinterpret_cast<__half2*>(static_cast<__half*>(out_row) + wg_col(c)) = lo;
        *reinterpret_cast<__half2*>(static_cast<__half*>(out_row) + wg_col(c + 2)) = hi;
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
    for (int c = 4 * tid; c < cols; c += 4 * nt) put(c, load4(xr + c));
  }
}

template <class In, bool kFp8, bool kPerm = false>
__global__ void __launch_bounds__(kQuantThreads) quant_rows_kernel(const In* x, int64_t ldx, int cols, void* out,
                                                                    int64_t ldo, float* scale) {
  const int64_t r = blockIdx.x;
  quant_row<In, kFp8, kPerm>(x + r * ldx, cols, static_cast<uint8_t*>(out) + r * ldo * (kFp8 ? 1 : 2), scale + r);
}

// f16 rows -> e4m3 (W8A8's h), a warp per row and 8 rows per CTA, the row held in registers
// between its amax and its conversion (one read; the CTA-per-row kernel read it twice and ran
// 2 560 CTAs of 256 threads for T = 512). The same bytes and scales as quant_row<__half, true>.
// Rows of at most kWarpRowChunks * 256 columns (cols % 256 == 0).
constexpr int kWarpRowChunks = 16;  // 16-byte chunks (8 halves) per lane: 4096 columns
__global__ void __launch_bounds__(kQuantThreads) quant_h_rows_kernel(const __half* h, int64_t ldh, int rows, int cols,
                                                                      uint8_t* out, int64_t ldo, float* scale) {
  const int lane = int(threadIdx.x) & 31;
  const int64_t r = int64_t(blockIdx.x) * (kQuantThreads / 32) + (threadIdx.x >> 5);
  if (r >= rows) return;
  const int n = cols / 256;  // chunks per lane
  const uint4* src = reinterpret_cast<const uint4*>(h + r * ldh);
  uint4 v[kWarpRowChunks];
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < kWarpRowChunks; ++i) {
    if (i < n) v[i] = src[lane + 32 * i];
  }
#pragma unroll
  for (int i = 0; i < kWarpRowChunks; ++i) {
    if (i < n) {
      const __half2* p = reinterpret_cast<const __half2*>(&v[i]);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 f = __half22float2(p[j]);
        amax = fmaxf(amax, fmaxf(fabsf(f.x), fabsf(f.y)));
      }
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  const int k = row_scale_exp<true>(amax);
  const float mul = ldexpf(1.0f, k);
  if (lane == 0) scale[r] = ldexpf(1.0f, -k);
  uint2* dst = reinterpret_cast<uint2*>(out + r * ldo);
#pragma unroll
  for (int i = 0; i < kWarpRowChunks; ++i) {
    if (i < n) {
      const __half2* p = reinterpret_cast<const __half2*>(&v[i]);
      uint32_t w[2];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const float2 a = __half22float2(p[2 * j]), b = __half22float2(p[2 * j + 1]);
        const __nv_fp8x2_storage_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a.x * mul, a.y * mul), __NV_SATFINITE, __NV_E4M3);
        const __nv_fp8x2_storage_t hi = __nv_cvt_float2_to_fp8x2(make_float2(b.x * mul, b.y * mul), __NV_SATFINITE, __NV_E4M3);
        w[j] = uint32_t(lo) | (uint32_t(hi) << 16);
      }
      dst[lane + 32 * i] = make_uint2(w[0], w[1]);
    }
  }
}

// Routing (block 0) and the activation conversion (block 1 + t for token t) in one launch: one
// kernel boundary less on the decode path.
template <bool kFp8, bool kPerm = false>
__global__ void __launch_bounds__(kRouteThreads) route_prep_kernel(const int32_t* ids, int tokens, int top_k, int routed,
                                                                    int has_shared, int rows_per_item, int32_t* perm,
                                                                    int32_t* pos, int4* items, int* meta, const float* x,
                                                                    int hidden, void* xc, float* xs) {
  M3_MOE_TL_SCOPE(moe_tl::kRoute);
  pdl_wait();  // the router's ids (launched as its programmatic dependent)
  M3_MOE_TL_WAITED(moe_tl::kRoute);
  if (blockIdx.x == 0) {
    route_body(ids, tokens, top_k, routed, has_shared, rows_per_item, perm, pos, items, meta);
  } else {
    const int64_t t = int64_t(blockIdx.x) - 1;
    quant_row<float, kFp8, kPerm>(x + t * hidden, hidden, static_cast<uint8_t*>(xc) + t * hidden * (kFp8 ? 1 : 2), xs + t);
  }
}

// ---------------------------------------------------------------------------------------------
// Combine: one CTA per token (and slice of hidden below kCombineWholeRow tokens). Assignments in
// ascending (expert, slot) order, then the shared row with weight 1, as acc = fadd(acc, fmul(w, y))
// from 0 (the CPU reference's order).
constexpr int kCombineThreads = 256;
constexpr int64_t kCombineWholeRow = 256;
constexpr int kCombineBatch = 8;  // y rows loaded together (top_k + 1 <= 8 for M3: one batch)

__device__ __forceinline__ float4 load_y4(const float* p) { return __ldcg(reinterpret_cast<const float4*>(p)); }
__device__ __forceinline__ float4 load_y4(const __nv_bfloat16* p) {
  const uint2 u = __ldcg(reinterpret_cast<const uint2*>(p));
  const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
  const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
  return make_float4(lo.x, lo.y, hi.x, hi.y);
}

// Y: float (the W8A16 paths) or bf16 (W8A8's down projection).
template <class Y>
__global__ void __launch_bounds__(kCombineThreads) combine_kernel(const Y* y, const float* w, const int32_t* ids,
                                                                   const int32_t* pos, int top_k, const int* meta,
                                                                   int has_shared, float* out, int hidden) {
  __shared__ int s_row[kMaxTopK + 1];
  __shared__ float s_w[kMaxTopK + 1];
  __shared__ int s_n;
  M3_MOE_TL_SCOPE(moe_tl::kCombine);
  const int64_t t = blockIdx.x;
  // The routing (ids, pos, weights, meta) is from kernels that completed before the GEMMs began;
  // only y is the down projection's, which this launch may overlap.
  if (threadIdx.x == 0) s_n = combine_rows(ids, pos, w, t, top_k, has_shared ? meta[1] + int(t) : -1, s_row, s_w);
  pdl_wait();
  M3_MOE_TL_WAITED(moe_tl::kCombine);
  __syncthreads();
  const int n = s_n;
  // CTA (token, slice of hidden): small batches spread a token's rows over several SMs.
  for (int d = 4 * (int(blockIdx.y) * kCombineThreads + int(threadIdx.x)); d < hidden;
       d += 4 * kCombineThreads * int(gridDim.y)) {
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    // The rows' loads of a batch are all issued before the first add (one memory round trip per
    // batch; a load per add made the combine a chain of n round trips per 4 columns).
    for (int i0 = 0; i0 < n; i0 += kCombineBatch) {
      float4 v[kCombineBatch];
#pragma unroll
      for (int j = 0; j < kCombineBatch; ++j) {
        if (i0 + j < n) v[j] = load_y4(y + int64_t(s_row[i0 + j]) * hidden + d);
      }
#pragma unroll
      for (int j = 0; j < kCombineBatch; ++j) {
        if (i0 + j >= n) break;
        const float wi = s_w[i0 + j];
        acc.x = __fadd_rn(acc.x, __fmul_rn(wi, v[j].x));
        acc.y = __fadd_rn(acc.y, __fmul_rn(wi, v[j].y));
        acc.z = __fadd_rn(acc.z, __fmul_rn(wi, v[j].z));
        acc.w = __fadd_rn(acc.w, __fmul_rn(wi, v[j].w));
      }
    }
    *reinterpret_cast<float4*>(out + t * hidden + d) = acc;
  }
}

// ---------------------------------------------------------------------------------------------
// W8A16 grouped GEMM (decode and any batch-invariant call).
//
// CTA = 8 warps (4 in the launches of < 64 tokens: kW16NarrowWarps) over one (work item, column
// tile). Weights are the MMA's A operand (16 weight rows per warp), tokens its N (8 per m16n8k16,
// kTMT sub-tiles = up to 8 * kTMT rows). Each weight element is used by one warp only: the wide
// tile loads weights global -> registers with 16-byte streaming loads ahead of use, the narrow
// tile through a shared-memory ring copied as whole lines (see w8a16_body); the item's activation
// rows (f16) go through a cp.async ring shared by the CTA's warps.
//
// K order inside a 64-wide chunk: lane (g, tig) loads bytes [16 tig, 16 tig + 16) of weight
// rows g and g + 8; MMA step s (0..3) takes its bytes 4s..4s+3 as the fragment's k = 2tig,
// 2tig+1, 2tig+8, 2tig+9, and reads the same real k of the activation rows. Any fixed
// permutation of k inside a chunk is the same dot product; this one needs no shuffles.
//
// Dequantisation: e4m3 -> f16 is exact (cvt.rn.f16x2.e4m3x2); the block scale 2^(s_b - 127) is
// split into 2^(s_b - ref) folded into the f16 value (exact while s_b >= ref - 15, and below
// that the rounding is < 2^-25 of the row's largest block unit) and 2^(ref - 127) applied to
// the fp32 result, ref = the row's largest scale byte. Activations are f16 scaled per token by
// a power of two. Accumulation: fp32 in the tensor core, fixed sequence of MMAs per output.
//
// Fused (gate_up): warp w owns output columns col0 + 8w .. + 7: MMA row g = gate row, g + 8 =
// the up row of the same column, so the SwiGLU pair sits in one thread's accumulators.
// Plain (down): warp w owns weight rows col0 + 16w .. + 15.
constexpr int kW16Threads = 256;
constexpr int kW16Warps = kW16Threads / 32;
constexpr int kW16Stages = 3;   // activation stages in shared memory
constexpr int kW16Kc = 128;     // K per stage (two 64-wide chunks)
constexpr int kXRowHalves = kW16Kc + 8;  // 272-byte smem rows: conflict-free 16-byte reads
constexpr int kW16Deep = 4;     // shared-memory weight stages of the narrow tile
// Warps of the narrow-tile kernel (batches of < 64 tokens): 4 warps over 64 weight rows, four
// CTAs per SM, so that a launch's last partial wave of CTAs is half as long as with 8 warps over
// 128 rows (M3 at 4 tokens: 17 experts x 48 tiles = 816 CTAs of 8 warps, 3.09 waves of 264).
// The batches of >= 64 tokens choose between the narrow and the wide tile per item in one
// 8-warp kernel.
constexpr int kW16NarrowWarps = 4;

// Dynamic shared memory of a W8A16 body: token tile 8 * tmt rows, weights in registers (deep 0)
// or through the shared-memory ring (deep > 0).
constexpr size_t w16_body_smem(int tmt, int deep, int warps = kW16Warps) {
  return deep > 0 ? size_t(deep) * 32 * warps * (4 * 16 + 8) + size_t(deep) * 8 * tmt * kXRowHalves * 2
                  : size_t(kW16Stages) * 8 * tmt * kXRowHalves * 2;
}
// Of the kernel for a token tile (2, 8, or 0 = chosen per item between 2 and 8). (A third,
// 32-row tile with the ring was slower at 128 tokens and no faster at 512: its 107 KB of shared
// memory per CTA leaves almost no L1 for the activation gathers.)
constexpr size_t w16_smem_bytes(int tmt) {
  const size_t narrow = w16_body_smem(2, kW16Deep), wide = w16_body_smem(8, 0);
  return tmt == 2 ? w16_body_smem(2, kW16Deep, kW16NarrowWarps) : tmt == 8 ? wide : (narrow > wide ? narrow : wide);
}
static_assert(2 * (w16_smem_bytes(0) + 1024) <= 233472, "two W8A16 CTAs per SM");
static_assert(8 / kW16NarrowWarps * 2 * (w16_smem_bytes(2) + 1024) <= 233472, "narrow CTAs per SM");
// Threads of the kernel for a token tile (w8a16_kernel's kTMT).
constexpr int w16_threads(int tmt) { return tmt == 2 ? 32 * kW16NarrowWarps : kW16Threads; }

struct W16Args {
  const __half* x;         // activation rows (gate_up: x16 [tokens, hidden]; down: h16 [rows, ldx])
  const int32_t* gather;   // x row of permuted row p (gate_up: perm), or null (row p itself)
  int64_t ldx;
  const float* row_scale;  // per x row (gate_up: token scale), or null
  float out_mul;           // gate_up: hscale; down: 1 / hscale
  void* out;               // gate_up: __half h [rows, ldo]; down: float y [rows, ldo]
  int64_t ldo;
  const int4* items;
  const int* num_items;
  Act act;
  Group g;
  // Per-item arrivals between the two projections, counted in items[i].w (the routing writes it
  // 0): every gate_up CTA adds one once its h columns are written, and a down CTA waits for its
  // own item's item_tiles arrivals instead of for the whole gate_up grid (0: pdl_wait), so the
  // items gate_up finished early start their down projection during its last wave.
  int item_tiles;
};


// A counter another CTA releases (fence, then atomic): loads after this one see what it wrote.
__device__ __forceinline__ int ld_acquire_gpu(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// kDeep = 0: weights global -> registers, kRing - 1 stages ahead (fewer with the wide token
// tile, whose accumulators need the registers). kDeep = D > 0: weights and scales go through a
// D-stage cp.async ring in shared memory (weights copied as whole lines, each thread reading its
// fragment bytes back; scales through a ring of their own, up to 4 stages per copy), D - 1
// stages ahead, with the activations in the same commit groups: more bytes in flight per SM than
// registers allow, for the narrow tile.
template <bool kFused, int kTMT, int kDeep, int kWarps = kW16Warps>
__device__ __forceinline__ void w8a16_body(const W16Args& a) {
  static_assert(kDeep > 0 || kWarps == kW16Warps, "the register-ring tiles run 8 warps");
  constexpr int kThreads = 32 * kWarps;
  constexpr int kRows = 16 * kWarps;  // weight rows of the CTA (fused: kRows / 2 gate, then the same up rows)
  constexpr int kBT = 8 * kTMT;
  constexpr int kW16Ring = kTMT >= 8 ? 2 : 3;
  constexpr int kXStages = kDeep > 0 ? kDeep : kW16Stages;
  extern __shared__ __align__(16) unsigned char w16_smem[];
  uint4* const wq_s = reinterpret_cast<uint4*>(w16_smem);  // kDeep: [kDeep][kRows][8 chunks]
  // kDeep: the scale ring, [kDeep slots][kRows][16 bytes].
  unsigned char* const sc_s = w16_smem + size_t(kDeep) * kRows * 128;
  __half* xs = reinterpret_cast<__half*>(w16_smem + size_t(kDeep) * kThreads * (4 * 16 + 8));  // [kXStages][kBT][..]
  pdl_launch_dependents();  // the down projection may start streaming its weights meanwhile
  // The routing's words (item count, gather, token scales) through L2 (ld.global.cg), not the
  // read-only path: the same values (the routing completed before the launch), but ptxas then
  // fits the 8-warp kernels in 113 registers without a stack frame (128 + 32 bytes with
  // ld.global.nc): T = 64 / 128 GEMMs 0.9-1.2 % faster on the H100 (sixty-third session).
  if (int(blockIdx.x) >= __ldcg(a.num_items)) return;
  const int4 item = a.items[blockIdx.x];
  const int e = item.x, r0 = item.y, nrows = item.z - item.y;
  const int n = a.g.n[e], K = a.g.k[e];
  const int col0 = int(blockIdx.y) * (kFused ? 8 * kWarps : 16 * kWarps);
  const int tid = int(threadIdx.x), warp = tid >> 5, lane = tid & 31, g = lane >> 2, tig = lane & 3;
  // items[i].w as the item's arrival counter (the x, y, z the kernels read never change here).
  int* const arrivals = const_cast<int*>(reinterpret_cast<const int*>(a.items + blockIdx.x)) + 3;
  if (col0 >= n) {  // whole CTA: this expert is narrower than the widest one (it still arrives)
    if (kFused && tid == 0) atomicAdd(arrivals, 1);
    return;
  }
  const int row_lo = kFused ? col0 + 8 * warp + g : col0 + 16 * warp + g;
  const int row_hi = kFused ? row_lo : row_lo + 8;
  const Mat m_lo = a.g.a[e];
  const Mat m_hi = kFused ? a.g.b[e] : a.g.a[e];
  const uint8_t* w_lo = m_lo.w + int64_t(row_lo) * K + 16 * tig;
  const uint8_t* w_hi = m_hi.w + int64_t(row_hi) * K + 16 * tig;
  const uint32_t* s_lo = reinterpret_cast<const uint32_t*>(m_lo.s + int64_t(row_lo) * (K / 32));
  const uint32_t* s_hi = reinterpret_cast<const uint32_t*>(m_hi.s + int64_t(row_hi) * (K / 32));
  const int nst = K / kW16Kc;

  // Each row's largest scale byte: loaded at once when the weight has it, else scanned once the
  // weight loads are in flight (1-1.7 % of the block at T = 1-8 on the H100).
  const bool has_ref = m_lo.ref != nullptr && m_hi.ref != nullptr;
  int ref_lo = has_ref ? int(__ldg(m_lo.ref + row_lo)) : 0, ref_hi = has_ref ? int(__ldg(m_hi.ref + row_hi)) : 0;
  // Activation rows of the item: only the 8-row sub-tiles that hold rows are loaded (rows past
  // the end of the last one are zero-filled).
  const int rows_alloc = min(kBT, (nrows + 7) & ~7);
  auto load_x = [&](int st, int buf) {
    __half* dst = xs + buf * kBT * kXRowHalves;
    const int k0 = st * kW16Kc;
    for (int c = tid; c < rows_alloc * (kW16Kc / 8); c += kThreads) {
      const int r = c / (kW16Kc / 8), ch = c % (kW16Kc / 8);
      const bool live = r < nrows;
      const int src_row = live ? (a.gather ? __ldcg(a.gather + r0 + r) : r0 + r) : 0;
      cp_async16(smem_u32(dst + r * kXRowHalves + ch * 8), a.x + int64_t(src_row) * a.ldx + k0 + ch * 8, live ? 16u : 0u);
    }
  };
  // The ring (kDeep > 0): this thread's activation chunks are the same every stage (chunk c = tid +
  // kThreads i of the tile's rows_alloc x 16), so their sources and shared-memory offsets are found
  // once, and only live rows are copied per stage: the rows past the item (7 of 8 at one token)
  // are zeroed in every slot once, here, and never rewritten. Same bytes in shared memory as
  // load_x, without its per-stage division, gather load and address arithmetic. (The 64-row
  // register tile keeps load_x: its four chunks' pointers would not fit beside its accumulators.)
  constexpr int kXPer = kDeep > 0 ? (kBT * (kW16Kc / 8) + kThreads - 1) / kThreads : 1;
  const __half* x_src[kXPer];
  uint32_t x_dst[kXPer];
  bool x_live[kXPer];
  if constexpr (kDeep > 0) {
#pragma unroll
    for (int i = 0; i < kXPer; ++i) {
      const int c = tid + kThreads * i, r = c / (kW16Kc / 8), ch = c % (kW16Kc / 8);
      x_live[i] = c < rows_alloc * (kW16Kc / 8) && r < nrows;
      const int src_row = x_live[i] ? (a.gather ? __ldcg(a.gather + r0 + r) : r0 + r) : 0;
      x_src[i] = a.x + int64_t(src_row) * a.ldx + ch * 8;
      x_dst[i] = uint32_t((r * kXRowHalves + ch * 8) * 2);
      if (c < rows_alloc * (kW16Kc / 8) && !x_live[i]) {
        for (int b = 0; b < kXStages; ++b) {
          *reinterpret_cast<uint4*>(reinterpret_cast<unsigned char*>(xs + b * kBT * kXRowHalves) + x_dst[i]) =
              make_uint4(0u, 0u, 0u, 0u);
        }
      }
    }
  }
  auto load_x_live = [&](int st, int buf) {
    const uint32_t base = smem_u32(xs + buf * kBT * kXRowHalves);
    const int k0 = st * kW16Kc;
#pragma unroll
    for (int i = 0; i < kXPer; ++i) {
      if (x_live[i]) cp_async16(base + x_dst[i], x_src[i] + k0, 16u);
    }
  };
  // Weight stage st: per row, bytes [16 tig, +16) of both 64-wide chunks, and the 4 scale bytes.
  auto load_w = [&](int st, uint4 (&q)[4], uint32_t (&s)[2]) {
    const int k0 = st * kW16Kc;
    q[0] = ld_stream16(w_lo + k0);
    q[1] = ld_stream16(w_lo + k0 + 64);
    q[2] = ld_stream16(w_hi + k0);
    q[3] = ld_stream16(w_hi + k0 + 64);
    s[0] = __ldg(s_lo + st);
    s[1] = __ldg(s_hi + st);
  };

  float acc[kTMT][4];
#pragma unroll
  for (int j = 0; j < kTMT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;

  // The ring's weight stage: the CTA's kRows rows (fused: kRows / 2 gate rows, then the same up
  // rows) x 128 bytes, copied as whole lines (8 lanes per row, 4 rows per warp and copy:
  // fragment-order copies, 64 bytes of 8 rows each, streamed 1.6-2.2 % slower in tools/mem_bench)
  // into rows of 8 16-byte chunks, chunk ^ 4 on odd rows so that the fragment reads (rows g, g + 1
  // of a phase at one chunk) fall in distinct banks. Thread tid copies chunk tid % 8 of rows
  // tid / 8 + (kThreads / 8) j.
  const uint8_t* w_src[4];
  uint32_t w_dst[4];
  if constexpr (kDeep > 0) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int rr = tid / 8 + kThreads / 8 * j, ch = tid % 8;
      const Mat& m = (kFused && rr >= kRows / 2) ? m_hi : m_lo;
      const int row = col0 + (kFused ? rr % (kRows / 2) : rr);
      w_src[j] = m.w + int64_t(row) * K + 16 * ch;
      w_dst[j] = uint32_t(rr * 128 + ((ch ^ ((rr & 1) << 2)) * 16));
    }
  }
  const int r_lo = kFused ? 8 * warp + g : 16 * warp + g, r_hi = kFused ? kRows / 2 + r_lo : r_lo + 8;
  // The ring's scale words: thread rr < kRows copies the words of 2^sw_log consecutive stages of
  // the CTA's row rr (16, 8 or 4 bytes: the widest that K and the scales' alignment allow) into
  // slot (st >> sw_log) % kDeep every 2^sw_log stages. A 4-byte copy per (thread, row, stage) put
  // 2 x 256 requests per stage beside the weights' 1024; now at most 128 every 4 stages. kDeep
  // slots: a slot is rewritten kDeep - 1 stages ahead only after every thread is past its last
  // stage (slots * 2^sw_log > 2^sw_log + kDeep - 2).
  constexpr int kScSlots = kDeep > 0 ? kDeep : 1;
  const uint8_t* sc_src = nullptr;
  int sw_log = 0;
  if constexpr (kDeep > 0) {
    sw_log = scale_copy_log(reinterpret_cast<uintptr_t>(m_lo.s) | reinterpret_cast<uintptr_t>(m_hi.s), K);
    if (tid < kRows) {
      const Mat& m = (kFused && tid >= kRows / 2) ? m_hi : m_lo;
      sc_src = m.s + int64_t(col0 + (kFused ? tid % (kRows / 2) : tid)) * (K / 32);
    }
  }
  auto w_frag_off = [&](int rr, int ch) { return rr * 128 + ((ch ^ ((rr & 1) << 2)) * 16); };
  auto load_w_smem = [&](int st, int buf) {
    const int k0 = st * kW16Kc;
    const uint32_t base = smem_u32(wq_s + size_t(buf) * 8 * kRows);
#pragma unroll
    for (int j = 0; j < 4; ++j) cp_async16_w(base + w_dst[j], w_src[j] + k0);
    if (tid < kRows && (st & ((1 << sw_log) - 1)) == 0) {
      cp_async_words(smem_u32(sc_s) + uint32_t(((st >> sw_log) % kScSlots) * kRows * 16 + tid * 16), sc_src + 4 * st, sw_log);
    }
  };

  auto compute = [&](int buf, const uint4 (&q)[4], const uint32_t (&s)[2]) {
    const __half* xb = xs + buf * kBT * kXRowHalves;
#pragma unroll
    for (int c = 0; c < 2; ++c) {  // 64-wide chunk; this lane's bytes are in block 2c + tig / 2
      const int sh = 8 * (2 * c + (tig >> 1));
      const __half2 mul_lo = pow2_h2(int((s[0] >> sh) & 0xffu) - ref_lo);
      const __half2 mul_hi = pow2_h2(int((s[1] >> sh) & 0xffu) - ref_hi);
      uint32_t af[4][4];
#pragma unroll
      for (int st = 0; st < 4; ++st) {
        const uint32_t wl = word_of(q[c], st), wh = word_of(q[2 + c], st);
        af[st][0] = e4m3x2_scaled(wl, mul_lo);
        af[st][1] = e4m3x2_scaled(wh, mul_hi);
        af[st][2] = e4m3x2_scaled<true>(wl, mul_lo);
        af[st][3] = e4m3x2_scaled<true>(wh, mul_hi);
      }
#pragma unroll
      for (int j = 0; j < kTMT; ++j) {
        if (8 * j < nrows) {  // warp-uniform: sub-tiles without rows are skipped
          const uint4* xr = reinterpret_cast<const uint4*>(xb + (8 * j + g) * kXRowHalves + 64 * c + 16 * tig);
          const uint4 b0 = xr[0], b1 = xr[1];
          mma_16816(acc[j], af[0], b0.x, b0.y);
          mma_16816(acc[j], af[1], b0.z, b0.w);
          mma_16816(acc[j], af[2], b1.x, b1.y);
          mma_16816(acc[j], af[3], b1.z, b1.w);
        }
      }
    }
  };

  uint4 wq[kDeep > 0 ? 1 : kW16Ring][4];
  uint32_t ws[kDeep > 0 ? 1 : kW16Ring][2];
  if constexpr (kDeep > 0) {
    for (int d = 0; d < kDeep - 1; ++d) {
      if (d < nst) load_w_smem(d, d);
      cp_async_commit();
    }
  } else {
#pragma unroll
    for (int d = 0; d < kW16Ring - 1; ++d) {
      if (d < nst) load_w(d, wq[d], ws[d]);
    }
  }
  // Each row's largest scale byte (the quad of lanes sharing a row splits the scan).
  if (!has_ref) {
    const uint32_t* const rows[2] = {s_lo, s_hi};
    int r[2];
    rows_max_byte<2, kTMT <= 2 ? 16 : 1>(rows, K / 128, tig, r);  // the 64-row tiles have no registers to spare
    ref_lo = r[0];
    ref_hi = r[1];
  }

  // Items, weights and scales come from before the previous kernel; its output (the activation
  // rows, for the down projection) only after this: the whole grid, or this item's gate_up CTAs
  // (their fence and arrival before, this acquire and barrier after; h is read through L2).
  if (!kFused && a.item_tiles > 0) {
    if (tid == 0) {
      while (ld_acquire_gpu(arrivals) < a.item_tiles) __nanosleep(128);
    }
    __syncthreads();
  } else {
    pdl_wait();
  }
  M3_MOE_TL_WAITED(kFused ? moe_tl::kGateUp : moe_tl::kDown);
  for (int s = 0; s < kXStages - 1; ++s) {
    if (s < nst) {
      if constexpr (kDeep > 0) {
        load_x_live(s, s);
      } else {
        load_x(s, s);
      }
    }
    cp_async_commit();
  }
  if constexpr (kDeep > 0) {
    for (int st = 0; st < nst; ++st) {
      cp_async_wait<kDeep - 2>();  // this thread's weights and every thread's x of stage st
      __syncthreads();             // x visible to all warps; all are done with stage st - 1
      if (st == 0) M3_MOE_TL_MID(kFused ? moe_tl::kGateUp : moe_tl::kDown);  // the first stage landed
      const int nx = st + kDeep - 1;
      if (nx < nst) {
        load_w_smem(nx, nx % kDeep);
        load_x_live(nx, nx % kDeep);
      }
      cp_async_commit();
      const int b = st % kDeep;
      uint4 q[4];
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const unsigned char* stage = reinterpret_cast<const unsigned char*>(wq_s + size_t(b) * 8 * kRows);
        q[c] = *reinterpret_cast<const uint4*>(stage + w_frag_off(c < 2 ? r_lo : r_hi, 4 * (c & 1) + tig));
      }
      const uint32_t* sl = reinterpret_cast<const uint32_t*>(sc_s + ((st >> sw_log) % kScSlots) * kRows * 16) + (st & ((1 << sw_log) - 1));
      const uint32_t sc[2] = {sl[4 * r_lo], sl[4 * r_hi]};
      compute(b, q, sc);
    }
  } else {
    for (int st0 = 0; st0 < nst; st0 += kW16Ring) {
#pragma unroll
      for (int d = 0; d < kW16Ring; ++d) {
        const int st = st0 + d;
        if (st < nst) {
          constexpr int kAhead = kW16Ring - 1;
          if (st + kAhead < nst) load_w(st + kAhead, wq[(d + kAhead) % kW16Ring], ws[(d + kAhead) % kW16Ring]);
          cp_async_wait<kW16Stages - 2>();
          __syncthreads();  // stage st visible to all warps; all are done with stage st - 1
          if (st + kW16Stages - 1 < nst) load_x(st + kW16Stages - 1, (st + kW16Stages - 1) % kW16Stages);
          cp_async_commit();
          compute(st % kW16Stages, wq[d], ws[d]);
        }
      }
    }
  }
  cp_async_wait<0>();

  // Epilogue: c0, c1 = (row g, tokens 2tig, 2tig+1), c2, c3 = (row g + 8, same tokens).
  const float fr_lo = ldexpf(1.0f, ref_lo - 127), fr_hi = ldexpf(1.0f, ref_hi - 127);
#pragma unroll
  for (int j = 0; j < kTMT; ++j) {
#pragma unroll
    for (int cc = 0; cc < 2; ++cc) {
      const int b = 8 * j + 2 * tig + cc;
      if (b >= nrows) continue;
      const int64_t p = r0 + b;
      const float tok = a.row_scale ? __ldcg(a.row_scale + (a.gather ? __ldcg(a.gather + p) : p)) : 1.0f;
      if constexpr (kFused) {
        const float h = swiglu(acc[j][cc] * fr_lo * tok, acc[j][2 + cc] * fr_hi * tok, a.act) * a.out_mul;
        static_cast<__half*>(a.out)[p * a.ldo + col0 + 8 * warp + g] = __float2half_rn(h);
      } else {
        float* y = static_cast<float*>(a.out) + p * a.ldo + col0 + 16 * warp + g;
        y[0] = acc[j][cc] * fr_lo * tok * a.out_mul;
        y[8] = acc[j][2 + cc] * fr_hi * tok * a.out_mul;
      }
    }
  }
  if (kFused) {
    __threadfence();  // this thread's h stores, before the CTA's arrival
    __syncthreads();
    if (tid == 0) atomicAdd(arrivals, 1);
  }
}

// kTMT 2 (4 warps; items of <= 8 rows take one 8-row sub-tile) or 8: one token tile for every
// item. kTMT 0 (batches of >= 64 tokens, items of up to
// 64 rows): per item, the 16-row tile with the shared-memory weight ring when it has <= 16 rows,
// as most routed experts do, and the 64-row register tile for the rest (the shared expert).
// A row's MMA sequence is the same in every tile, so the choice changes no bit.
template <bool kFused, int kTMT>
__global__ void __launch_bounds__(w16_threads(kTMT), 2 * kW16Threads / w16_threads(kTMT))
    w8a16_kernel(const __grid_constant__ W16Args a) {
  M3_MOE_TL_SCOPE(kFused ? moe_tl::kGateUp : moe_tl::kDown);
  if constexpr (kTMT == 2) {
    // Items of <= 8 rows (most at these sizes) take one 8-row token sub-tile: the second
    // sub-tile's MMAs and loads were issued predicated off at every stage.
    if (int(blockIdx.x) < __ldg(a.num_items)) {
      const int4 item = a.items[blockIdx.x];
      if (item.z - item.y <= 8) {
        w8a16_body<kFused, 1, kW16Deep, kW16NarrowWarps>(a);
        return;
      }
    }
    w8a16_body<kFused, 2, kW16Deep, kW16NarrowWarps>(a);
  } else if constexpr (kTMT == 0) {
    if (int(blockIdx.x) < __ldg(a.num_items)) {
      const int4 item = a.items[blockIdx.x];
      if (item.z - item.y <= 16) {
        w8a16_body<kFused, 2, kW16Deep>(a);
        return;
      }
    }
    w8a16_body<kFused, 8, 0>(a);
  } else {
    w8a16_body<kFused, 8, 0>(a);
  }
}

// ---------------------------------------------------------------------------------------------
// W8A8 grouped GEMM (prefill, batch invariance off): persistent CTAs of 3 warpgroups.
//   WG0 (producer, 56 registers): 16-byte cp.async of the weight tile (A: 128 rows x 128 K), the
//       token tile (B: up to 128 rows x 128 K, gathered through perm for gate_up; rows past the
//       item repeat its first row) into 128B-swizzled shared memory, and the tile's e8m0 scales
//       (4 bytes per weight row); each thread arrives on the stage's mbarrier when its copies land.
//   WG1, WG2 (consumers, 224 registers): 64 weight rows each; per 32-wide K step one
//       wgmma m64nNk32 e4m3 into a fresh fp32 fragment, then acc += P * 2^(s - 127) with the
//       weight row's block scale; the steps roll over two fragments (see w8_consume), and the two
//       consumers' wgmmas and FMAs overlap as well.
//       The per-token activation scale is constant over K and applied once in the epilogue.
// Weights are the A operand so each thread needs 2 block scales per K step (its 2 rows), not
// one per column. N (tokens per tile) is 32, 64, 96 or 128, picked per tile from the item's
// rows. Tiles: (item, column tile), column tile fastest, so the CTAs running together share an
// item's token rows, and consecutive items of one expert share its weight tiles, in L2.
// Fused (gate_up): A rows 16w + g are gate rows and 16w + g + 8 the up rows of the same output
// column (the producer interleaves 8-row groups), so the SwiGLU pair is thread-local.
// K order per output is fixed (ascending 32-wide steps), so a token's result does not depend on
// the tile it ran in; but the W8A16/W8A8 choice depends on the token count.
constexpr int kW8Threads = 384;
// Pipeline depth: 6 stages while the weight stream bounds the call (few tokens per expert: more
// bytes in flight per SM), 4 once the MMAs and promotions do (kW8DeepMaxTokens).
// H200, GEMMs alone, 4 -> 6 stages: T = 256 1889 -> 1827 us, 512 1954 -> 1908, 1024 2291 -> 2210;
// 2048 2928 -> 3031, 4096 5190 -> 5364.
constexpr int kW8StagesDeep = 6, kW8StagesShallow = 4;
constexpr int64_t kW8DeepMaxTokens = 1024;
constexpr int kW8Bk = 128;
constexpr int kW8ARows = 128;
constexpr int kW8MaxTok = 128;
constexpr int kATile = kW8ARows * kW8Bk;    // bytes per stage
constexpr int kBTile = kW8MaxTok * kW8Bk;
// A-row scale words: a ring of kW8ScSlots slots of 16 bytes per A row; the producer copies the
// words of 2^s_log consecutive stages of a row at once (16, 8 or 4 bytes, W8Args::s_log), so the
// scales add 128 requests per 4 stages, not per stage. A slot is rewritten (producing global
// stage n) only after the consumers released stage n - stages, past its last reader:
// kW8ScSlots 2^s_log >= stages + 2^s_log - 1.
constexpr int kW8ScSlots = 8;
constexpr int kW8ScSlot = kW8ARows * 16;
static_assert(kW8ScSlots >= kW8StagesDeep && kW8ScSlots >= kW8StagesShallow, "the scale ring at one word per copy");
constexpr size_t w8_smem_bytes(int stages) {
  return size_t(stages) * (kATile + kBTile) + size_t(kW8ScSlots) * kW8ScSlot + 2 * size_t(stages) * 8 + kTileQueueBytes + 1024;
}
static_assert(w8_smem_bytes(kW8StagesDeep) <= 232448, "W8A8 kernel: shared memory per CTA");
constexpr int kProducerRegs = 56, kConsumerRegs = 224;  // 128 * 56 + 256 * 224 <= 65536

struct W8Args {
  const uint8_t* x;         // e4m3 activation rows (gate_up: xq [tokens, hidden]; down: hq [rows, ldx])
  const int32_t* gather;    // gate_up: perm; down: null
  int64_t ldx;
  const float* row_scale;   // per x row: the activation's power-of-two scale
  float out_mul;            // gate_up: hscale; down: 1 / hscale
  void* out;                // gate_up: __half h [rows, ldo]; down: bf16 y [rows, ldo]
  int64_t ldo;
  const int4* items;
  const int* num_items;
  int col_tiles;            // column tiles of the widest expert
  int s_log;                // log2 of the scale words per copy (every expert's K / 128 a multiple of 2^s_log)
  unsigned* tile_ctr;       // the tiles' counter (ws_persistent), zeroed before the launch
  Act act;
  Group g;
};

template <int N>
struct Wgmma;
template <>
struct Wgmma<32> {
  __device__ __forceinline__ static void run(float (&d)[16], uint64_t da, uint64_t db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "l"(da), "l"(db), "r"(0));
  }
};

template <>
struct Wgmma<64> {
  __device__ __forceinline__ static void run(float (&d)[32], uint64_t da, uint64_t db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(da), "l"(db), "r"(0));
  }
};

template <>
struct Wgmma<96> {
  __device__ __forceinline__ static void run(float (&d)[48], uint64_t da, uint64_t db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %50, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n96k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}, %48, %49, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])
        : "l"(da), "l"(db), "r"(0));
  }
};

template <>
struct Wgmma<128> {
  __device__ __forceinline__ static void run(float (&d)[64], uint64_t da, uint64_t db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db), "r"(0));
  }
};

// e8m0 byte i of a word as 2^(s - 127) (s = 0 reads as 0 rather than 2^-127: negligible; s = 255
// as inf where the reference has NaN).
__device__ __forceinline__ float e8m0_byte(uint32_t w, int i) { return __uint_as_float(((w >> (8 * i)) & 0xffu) << 23); }

template <int R>
__device__ __forceinline__ void scale_add(float (&acc)[R], const float (&p)[R], float s_lo, float s_hi) {
#pragma unroll
  for (int i = 0; i < R; i += 4) {
    acc[i] = fmaf(p[i], s_lo, acc[i]);
    acc[i + 1] = fmaf(p[i + 1], s_lo, acc[i + 1]);
    acc[i + 2] = fmaf(p[i + 2], s_hi, acc[i + 2]);
    acc[i + 3] = fmaf(p[i + 3], s_hi, acc[i + 3]);
  }
}

// Shared-memory (not generic) addresses, found once: converting a generic pointer per stage cost
// the consumers a dozen uniform instructions and made the scale loads generic (long-scoreboard) loads.
struct W8Smem {
  uint32_t a, b, s;      // stage 0 of the A tiles, B tiles and A-row scale words
  uint32_t full, empty;  // the barrier arrays (8 bytes each)
};

__device__ __forceinline__ uint32_t lds_u32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(addr));
  return v;
}

template <int kStages>
struct Pipe {
  int stage = 0;
  uint32_t phase = 0;
  uint32_t n = 0;  // stages passed (the W8A8 scale ring's position)
  __device__ __forceinline__ void advance() {
    ++n;
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1u;
    }
  }
};

// One tile of a grouped GEMM: its expert, rows [r0, r0 + nrows), first column, K.
struct GemmTile {
  int e, r0, nrows, n0, K;
};
// Tile `tile` of a grouped GEMM: item tile / col_tiles, columns cols wide (column tile fastest);
// false when the item's expert is narrower than this column tile. Both wgmma kernels (Args:
// W8Args, WgArgs). (Groups of 4-16 items with the item fastest inside a group, so that an
// expert's items read each weight tile together, measured no better: fifty-sixth session.)
template <class Args>
__device__ __forceinline__ bool item_tile(const Args& a, int tile, int cols, GemmTile& t) {
  const int4 item = a.items[tile / a.col_tiles];
  t.e = item.x;
  t.r0 = item.y;
  t.nrows = item.z - item.y;
  t.n0 = (tile % a.col_tiles) * cols;
  t.K = a.g.k[t.e];
  return t.n0 < a.g.n[t.e];
}

// The token rows a producer thread copies chunk `chunk` (16 bytes) of: tile rows rb + 16 i (i < 8),
// gathered through `gather` when given, found once per tile (the stage loop only advances the
// pointers: computing the gathered addresses per stage made the W8A8 producer ~300 instructions
// per stage and warp). Rows past the item copy its first row: their output columns are discarded,
// and real values keep the products finite.
template <class T>
__device__ __forceinline__ void tile_token_rows(const T* x, const int32_t* gather, int64_t ldx, const GemmTile& t,
                                                int rb, int chunk, const T* (&src)[8]) {
  const int64_t first = gather ? __ldg(gather + t.r0) : t.r0;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int b = rb + 16 * i;
    const int64_t row = b < t.nrows ? (gather ? __ldg(gather + t.r0 + b) : t.r0 + b) : first;
    src[i] = x + row * ldx + chunk * int(16 / sizeof(T));
  }
}

// Consumer warpgroup cw (0, 1): A rows 64 cw .. 64 cw + 63 of the tile, all N tokens.
template <bool kFused, int N, class P>
__device__ __forceinline__ void w8_consume(const W8Args& a, const W8Smem& sm, P& pipe, const GemmTile& t, int cw,
                                           int tw) {
  constexpr int R = N / 2;
  const int w4 = tw >> 5, lane = tw & 31, g = lane >> 2, tig = lane & 3;
  const int rlo = 64 * cw + 16 * w4 + g, rhi = rlo + 8;
  float acc[R], p0[R], p1[R];
#pragma unroll
  for (int i = 0; i < R; ++i) acc[i] = p0[i] = p1[i] = 0.0f;
  const int nk = t.K / kW8Bk;
  // Each 32-wide K step is a wgmma into a fresh fragment (scale-d off), folded into acc with its
  // rows' block scales by one FMA per element: as many FMAs as the tensor cores do per SM-cycle,
  // so they must run while the tensor cores work. The steps roll over two fragments: step s + 1
  // is issued before step s is waited for, so this warpgroup's FMAs on step s overlap its own next
  // wgmma as well as the other warpgroup's. Stages go in pairs, so that the second one's first
  // step also covers the first one's last FMAs; a loop-carried wgmma (one still in flight across
  // the back edge) would make ptxas serialise every wgmma (C7514), hence the unrolled pair and the
  // drained tail.
  auto stage_desc = [&](int st, uint64_t& da, uint64_t& db) {
    da = wgmma::desc_sw128(sm.a + uint32_t(st * kATile + cw * (kATile / 2)));
    db = wgmma::desc_sw128(sm.b + uint32_t(st * kBTile));
  };
  // Waits for the current stage; its descriptors and this thread's two rows' scale words.
  auto open = [&](uint64_t& da, uint64_t& db, uint32_t& lo, uint32_t& hi) {
    const int st = pipe.stage;
    mbar_wait(sm.full + 8u * uint32_t(st), pipe.phase);
    wgmma::fence_proxy_async();  // the copies were generic-proxy writes; wgmma reads through the async proxy
    stage_desc(st, da, db);
    const uint32_t sw = sm.s + ((pipe.n >> a.s_log) % kW8ScSlots) * kW8ScSlot + (pipe.n & ((1u << a.s_log) - 1u)) * 4u;
    lo = lds_u32(sw + uint32_t(rlo * 16));
    hi = lds_u32(sw + uint32_t(rhi * 16));
    return st;
  };
  auto issue = [&](float(&p)[R], uint64_t da, uint64_t db) {  // +2 on a descriptor: +32 bytes along K
    wgmma::fence();
    Wgmma<N>::run(p, da, db);
    wgmma::commit();
  };
  auto fold = [&](float(&p)[R], uint32_t lo, uint32_t hi, int i) {
    wgmma::fence_regs(p);
    scale_add(acc, p, e8m0_byte(lo, i), e8m0_byte(hi, i));
  };
  auto release = [&](int st) {
    if (lane == 0) mbar_arrive(sm.empty + 8u * uint32_t(st));  // every step of the stage is read
  };
  // Steps 1-3 of a stage whose step 0 is in flight in p0; leaves step 3 in flight in p1.
  auto steps123 = [&](uint64_t da, uint64_t db, uint32_t lo, uint32_t hi) {
    issue(p1, da + 2, db + 2);
    wgmma::wait<1>();
    fold(p0, lo, hi, 0);
    issue(p0, da + 4, db + 4);
    wgmma::wait<1>();
    fold(p1, lo, hi, 1);
    issue(p1, da + 6, db + 6);
    wgmma::wait<1>();
    fold(p0, lo, hi, 2);
  };
  int kt = 0;
  for (; kt + 2 <= nk; kt += 2) {
    uint64_t da, db, ea, eb;
    uint32_t lo, hi, lo2, hi2;
    const int sa = open(da, db, lo, hi);
    issue(p0, da, db);
    steps123(da, db, lo, hi);
    pipe.advance();
    const int sb = open(ea, eb, lo2, hi2);
    issue(p0, ea, eb);
    wgmma::wait<1>();
    release(sa);
    fold(p1, lo, hi, 3);
    steps123(ea, eb, lo2, hi2);
    wgmma::wait<0>();
    release(sb);
    fold(p1, lo2, hi2, 3);
    pipe.advance();
  }
  if (kt < nk) {  // an odd stage count: the last stage alone
    uint64_t da, db;
    uint32_t lo, hi;
    const int st = open(da, db, lo, hi);
    issue(p0, da, db);
    steps123(da, db, lo, hi);
    wgmma::wait<0>();
    release(st);
    fold(p1, lo, hi, 3);
    pipe.advance();
  }

  // Epilogue: acc[4j + 0/1] = (row rlo, tokens 8j + 2tig + 0/1), acc[4j + 2/3] = (row rhi, same).
#pragma unroll
  for (int j = 0; j < N / 8; ++j) {
#pragma unroll
    for (int cc = 0; cc < 2; ++cc) {
      const int b = 8 * j + 2 * tig + cc;
      if (b >= t.nrows) continue;
      const int64_t p = t.r0 + b;
      const float tok = __ldg(a.row_scale + (a.gather ? __ldg(a.gather + p) : p));
      if constexpr (kFused) {
        const float h = swiglu(acc[4 * j + cc] * tok, acc[4 * j + 2 + cc] * tok, a.act) * a.out_mul;
        static_cast<__half*>(a.out)[p * a.ldo + t.n0 + 32 * cw + 8 * w4 + g] = __float2half_rn(h);
      } else {  // y as bf16: the e4m3 activations already bound its precision; half the bytes
        __nv_bfloat16* y = static_cast<__nv_bfloat16*>(a.out) + p * a.ldo + t.n0 + rlo;
        y[0] = __float2bfloat16_rn(acc[4 * j + cc] * tok * a.out_mul);
        y[8] = __float2bfloat16_rn(acc[4 * j + 2 + cc] * tok * a.out_mul);
      }
    }
  }
}

template <bool kFused, class P>
__device__ __forceinline__ void w8_produce(const W8Args& a, const W8Smem& sm, const GemmTile& t, P& pipe, int tid) {
  const int c8 = tid & 7, rb = tid >> 3;  // this thread's 16-byte chunk and first row (0..15)
  const int ntok = min(kW8MaxTok, (t.nrows + 31) & ~31);
  // A rows rb + 16 i (i < 8). Fused: row r holds gate (r % 16 < 8) or up row n0 + 32 (r / 64) +
  // 8 ((r / 16) % 4) + r % 8, which for r = rb + 16 i is n0 + 8 i + rb % 8.
  const Mat& ma = (kFused && rb >= 8) ? a.g.b[t.e] : a.g.a[t.e];
  const uint8_t* a_src = ma.w + int64_t(t.n0 + (kFused ? (rb & 7) : rb)) * t.K + 16 * c8;
  const int64_t a_step = int64_t(kFused ? 8 : 16) * t.K;
  // The scale row of A row `tid` (same mapping).
  int srow;
  const Mat* ms;
  if (kFused) {
    const int within = tid & 15;
    ms = within < 8 ? &a.g.a[t.e] : &a.g.b[t.e];
    srow = t.n0 + 32 * (tid >> 6) + 8 * ((tid >> 4) & 3) + (within & 7);
  } else {
    ms = &a.g.a[t.e];
    srow = t.n0 + tid;
  }
  const uint8_t* s_src = ms->s + int64_t(srow) * (t.K / 32);
  // Source rows, found once per tile (tile_token_rows).
  const uint8_t* asrc[8];
  const uint8_t* bsrc[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) asrc[i] = a_src + i * a_step;
  tile_token_rows(a.x, a.gather, a.ldx, t, rb, c8, bsrc);
  const int nb = ntok >> 4;  // B rows rb + 16 i < ntok for i < nb (ntok is a multiple of 32)
  const uint32_t sw = uint32_t((c8 ^ (rb & 7)) << 4);  // swizzled chunk offset (r & 7 == rb & 7)
  for (int k0 = 0; k0 < t.K; k0 += kW8Bk) {
    const int st = pipe.stage;
    mbar_wait(sm.empty + 8u * uint32_t(st), pipe.phase ^ 1u);
    const uint32_t a_dst = sm.a + uint32_t(st * kATile + rb * kW8Bk) + sw;
    const uint32_t b_dst = sm.b + uint32_t(st * kBTile + rb * kW8Bk) + sw;
#pragma unroll
    for (int i = 0; i < 8; ++i) cp_async16_w(a_dst + uint32_t(16 * i * kW8Bk), asrc[i] + k0);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if (i < nb) cp_async16(b_dst + uint32_t(16 * i * kW8Bk), bsrc[i] + k0, 16u);
    }
    if ((pipe.n & ((1u << a.s_log) - 1u)) == 0) {  // this row's words of stages n .. n + 2^s_log - 1
      cp_async_words(sm.s + ((pipe.n >> a.s_log) % kW8ScSlots) * kW8ScSlot + uint32_t(tid * 16), s_src + k0 / 32, a.s_log);
    }
    cp_async_arrive_noinc(sm.full + 8u * uint32_t(st));
    pipe.advance();
  }
}

// The warp-specialised persistent loop both wgmma kernels run (384 threads): the stage ring's
// barriers (full: one cp.async arrival per producer thread; empty: one per consumer warp), then
// warpgroup 0 produces and warpgroups 1-2 consume the tiles taken in order from the call's counter
// `ctr` (tile_queue.cuh; `ring`: kTileQueueBytes of shared memory). A fixed tile per CTA
// (blockIdx.x + k gridDim.x) let the CTAs drift apart, so an expert's items stopped reading its
// weight tiles together: H100, T = 4096, the gate+up GEMM read 8.2 GB from DRAM for 5.0 GB of
// weights, 7.1 GB with the counter; the down GEMM 3.7 -> 2.8 GB for 2.5 GB (docs/moe_kernels.md,
// fifty-sixth session). tile_of(i, t) fills t and is false for a tile past a narrower expert;
// produce(t, pipe, tid); consume(t, pipe, cw, tw, n) with n a std::integral_constant of the token
// tile (the item's rows rounded up to 32, at most kW8MaxTok = 128).
template <int kStages, class TileOf, class Produce, class Consume>
__device__ __forceinline__ void ws_persistent(uint32_t full, uint32_t empty, uint32_t ring, unsigned* ctr, int total,
                                              TileOf&& tile_of, Produce&& produce, Consume&& consume) {
  static_assert(kTileQueueRing > kStages, "the producer runs at most a stage ring, so as many tiles, ahead");
  const int tid = int(threadIdx.x), wg = tid >> 7;
  const TileQueue queue(ring);
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full + 8u * uint32_t(s), 128);
      mbar_init(empty + 8u * uint32_t(s), 8);
    }
    queue.init(8);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  Pipe<kStages> pipe;
  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegs));
    TileQueueProducer tiles(queue, ctr, total);
    for (int tile; (tile = tiles.take(tid)) >= 0;) {
      GemmTile t;
      if (tile_of(tile, t)) produce(t, pipe, tid);
    }
    cp_async_wait<0>();
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegs));
    const int cw = wg - 1, tw = tid - 128 * wg;
    TileQueueConsumer tiles(queue);
    for (int tile; (tile = tiles.take(tw & 31)) >= 0;) {
      GemmTile t;
      if (!tile_of(tile, t)) continue;
      switch (min(kW8MaxTok, (t.nrows + 31) & ~31)) {
        case 32: consume(t, pipe, cw, tw, std::integral_constant<int, 32>{}); break;
        case 64: consume(t, pipe, cw, tw, std::integral_constant<int, 64>{}); break;
        case 96: consume(t, pipe, cw, tw, std::integral_constant<int, 96>{}); break;
        default: consume(t, pipe, cw, tw, std::integral_constant<int, 128>{}); break;
      }
    }
  }
}

template <bool kFused, int kStages>
__global__ void __launch_bounds__(kW8Threads, 1) w8a8_kernel(const __grid_constant__ W8Args a) {
  extern __shared__ unsigned char w8_smem[];
  W8Smem sm;
  sm.a = smem_u32(wgmma::align_1024(w8_smem));
  sm.b = sm.a + uint32_t(kStages * kATile);
  sm.s = sm.b + uint32_t(kStages * kBTile);
  sm.full = sm.s + uint32_t(kW8ScSlots * kW8ScSlot);
  sm.empty = sm.full + 8u * kStages;
  ws_persistent<kStages>(
      sm.full, sm.empty, sm.empty + 8u * kStages, a.tile_ctr, __ldg(a.num_items) * a.col_tiles,
      [&](int tile, GemmTile& t) { return item_tile(a, tile, kFused ? kW8ARows / 2 : kW8ARows, t); },
      [&](const GemmTile& t, auto& pipe, int tid) { w8_produce<kFused>(a, sm, t, pipe, tid); },
      [&](const GemmTile& t, auto& pipe, int cw, int tw, auto n) { w8_consume<kFused, decltype(n)::value>(a, sm, pipe, t, cw, tw); });
}

// ---------------------------------------------------------------------------------------------
// W8A16 on wgmma (calls of >= kW8A16WgMinTokens tokens, batch-invariant or not): the W8A16
// kernel's numerics, bit for bit, at tensor-core rate. A wgmma m64nNk16 (f16, A from registers)
// chain gives the same fp32 bits as the mma.sync m16n8k16 chain on the same operands in the same
// order (tools/wgmma_probe/wgmma_identity_probe.cu on the H200: 0 of 138,240 outputs differ over f16/bf16,
// N = 8/32, K up to 6144, wide exponent ranges; the mma.sync chain in reversed step order differs
// in 98 % of them), so this kernel builds each thread's A fragments exactly as the mma.sync kernel
// does (same weight bytes per lane, same exact e4m3 -> f16 conversion with the block scale folded
// in, same row reference scale) and reads the activations, stored in wg_col order, from shared
// memory. A token's output is then the same whichever kernel ran it (kernels_cuda_moe checks every
// case).
// Persistent CTAs of 3 warpgroups:
//   WG0 (producer, 56 registers): cp.async of the token tile (B: up to 128 rows x 128 K, two
//       64-wide chunks of 128-byte swizzled rows, gathered through perm for gate_up; rows past the
//       item repeat its first row) into a 4-stage ring; arrives on the stage's mbarrier.
//   WG1, WG2 (consumers): two 64-row MMA blocks each, 256 weight rows per CTA (fused gate_up: 128
//       output columns; warp w4 of consumer cw, block b: columns 64 cw + 32 b + 8 w4 + g, gate row
//       g / up row g + 8 of the MMA as in W8A16). Two blocks per warpgroup let each token tile in
//       shared memory serve twice the weight rows (the 128-row tile was 11-20 % slower).
// Tiles: (item, column tile), column tile fastest.
constexpr int kWgThreads = 384;
constexpr int kWgStages = 4;
constexpr int kWgMaxTok = 128;
constexpr int kWgChunk = kWgMaxTok * 128;  // bytes of one 64-wide K chunk of the token tile
static_assert(kWgThreads == kW8Threads && kWgMaxTok == kW8MaxTok, "both kernels run ws_persistent");
constexpr int kWgBTile = 2 * kWgChunk;     // per 128-K stage

struct WgArgs {
  const __half* x;          // f16 rows in wg_col order (gate_up: xc [tokens, hidden]; down: h16 [rows, ldx])
  const int32_t* gather;    // gate_up: perm; down: null
  int64_t ldx;              // in halves
  const float* row_scale;   // gate_up: per token; down: null
  float out_mul;            // gate_up: hscale; down: 1 / hscale
  void* out;                // gate_up: __half h [rows, ldo] in wg_col order; down: float y [rows, ldo]
  int64_t ldo;
  const int4* items;
  const int* num_items;
  int col_tiles;
  unsigned* tile_ctr;       // the tiles' counter (ws_persistent), zeroed before the launch
  Act act;
  Group g;
};

struct WgSmem {
  uint32_t b, w, full, empty;  // token ring, weight ring, barriers
};

__device__ __forceinline__ void wg_produce(const WgArgs& a, const WgSmem& sm, const GemmTile& t, Pipe<kWgStages>& pipe,
                                           int tid) {
  const int c8 = tid & 7, rb = tid >> 3;  // 16-byte chunk and first row (0..15)
  const int ntok = min(kWgMaxTok, (t.nrows + 31) & ~31);
  const int nb = ntok >> 4;
  const __half* src[8];
  tile_token_rows(a.x, a.gather, a.ldx, t, rb, c8, src);
  const uint32_t sw = uint32_t((c8 ^ (rb & 7)) << 4);
  for (int k0 = 0; k0 < t.K; k0 += 128) {
    const int st = pipe.stage;
    mbar_wait(sm.empty + 8u * uint32_t(st), pipe.phase ^ 1u);
    const uint32_t dst = sm.b + uint32_t(st * kWgBTile + rb * 128) + sw;
#pragma unroll
    for (int c = 0; c < 2; ++c)
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        if (i < nb) cp_async16(dst + uint32_t(c * kWgChunk + 16 * i * 128), src[i] + k0 + 64 * c, 16u);
      }
    cp_async_arrive_noinc(sm.full + 8u * uint32_t(st));
    pipe.advance();
  }
}

// Weights: the accumulators of two blocks leave no registers for a weight prefetch, so they go
// through shared memory (cp.async, kWgWStages - 1 stages ahead). For token tiles of <= 64 rows
// (bandwidth-bound) each consumer warp copies its 32 weight rows x 128 bytes per stage into its
// own 4 KB as whole lines (8 lanes per row; fragment-order copies, each thread its own bytes,
// streamed slower, tools/mem_bench), and each lane reads its fragment bytes back after a
// __syncwarp (a warpgroup barrier per stage cost 3-6 % at 4096 tokens): warp row 16 b + 8 h + g
// is block b's row of lane group g, lo (h = 0) or hi (h = 1), its 8 chunks stored chunk ^ 4 on
// odd rows so that a fragment read's 8-lane phase (rows g, g + 1) hits 8 bank groups. Wider tiles
// (compute-bound) keep each thread's own fragment bytes in its own slots.
constexpr int kWgWStages = 3;
constexpr int kWgWStage = 8 * 256 * 16;  // 8 16-byte slots per consumer thread
constexpr size_t kWgSmemBytes =
    size_t(kWgStages) * kWgBTile + size_t(kWgWStages) * kWgWStage + 2 * kWgStages * 8 + kTileQueueBytes + 1024;
static_assert(kWgSmemBytes <= 232448, "W8A16 wgmma kernel: shared memory per CTA");

template <bool kFused, int N>
__device__ __forceinline__ void wg_consume(const WgArgs& a, const WgSmem& sm, Pipe<kWgStages>& pipe, const GemmTile& t, int cw,
                                           int tw) {
  constexpr int R = N / 2;
  const int w4 = tw >> 5, lane = tw & 31, g = lane >> 2, tig = lane & 3;
  const int K = t.K, nk = K / 128, n = a.g.n[t.e];
  const Mat m_lo = a.g.a[t.e];
  const Mat m_hi = kFused ? a.g.b[t.e] : a.g.a[t.e];
  int col[2], row_lo[2];
  bool live[2];
  const uint32_t* s_lo[2];
  const uint32_t* s_hi[2];
#pragma unroll
  for (int b = 0; b < 2; ++b) {
    col[b] = t.n0 + 64 * cw + 32 * b + 8 * w4 + g;
    const int blk0 = kFused ? t.n0 + 64 * cw + 32 * b : t.n0 + 128 * cw + 64 * b;
    // A block past the matrix (the last 128 rows of a plain tile when n % 256 == 128) runs on
    // in-range rows and stores nothing: a branch around its wgmmas made ptxas serialise them all
    // (C7520).
    live[b] = blk0 < n;
    row_lo[b] = live[b] ? (kFused ? col[b] : blk0 + 16 * w4 + g) : (kFused ? t.n0 + 8 * w4 + g : t.n0 + 16 * w4 + g);
    const int row_hi = kFused ? row_lo[b] : row_lo[b] + 8;
    s_lo[b] = reinterpret_cast<const uint32_t*>(m_lo.s + int64_t(row_lo[b]) * (K / 32));
    s_hi[b] = reinterpret_cast<const uint32_t*>(m_hi.s + int64_t(row_hi) * (K / 32));
  }
  // Line copies (kLine, token tiles of <= 64 rows, where the weight stream sets the pace): this
  // lane copies chunk lane % 8 of its warp's rows lane / 8 + 4 j (j < 8): block j / 4, half
  // (j / 2) % 2, lane group lane / 8 + 4 (j % 2), into the warp's 4 KB. Otherwise (compute-bound
  // wide tiles, where the line copies' extra address arithmetic cost 1-2 %) each thread copies
  // its own fragment bytes into its own slots of the same 4 KB: slot 4 b + 2 h + c at lane * 16 +
  // slot * 512. Either way a warp touches only its own 4 KB, so a persistent CTA may switch modes
  // between tiles: a lane's last reads of a tile precede the tile's last (warp-convergent) wgmma.
  // p[b][h]: the row pointer each mode's copies start from.
  constexpr bool kLine = N <= 64;
  const uint8_t* p[2][2];
  const int cp_ch = lane % 8, cp_g = lane / 8;
#pragma unroll
  for (int b = 0; b < 2; ++b) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if constexpr (kLine) {
        const int blk0 = kFused ? t.n0 + 64 * cw + 32 * b : t.n0 + 128 * cw + 64 * b;
        const int lo = blk0 < n ? (kFused ? t.n0 + 64 * cw + 32 * b + 8 * w4 + cp_g : blk0 + 16 * w4 + cp_g)
                                : (kFused ? t.n0 + 8 * w4 + cp_g : t.n0 + 16 * w4 + cp_g);
        p[b][h] = (h ? m_hi : m_lo).w + int64_t(kFused ? lo : lo + 8 * h) * K + 16 * cp_ch;
      } else {
        p[b][h] = (h ? m_hi : m_lo).w + int64_t(kFused ? row_lo[b] : row_lo[b] + 8 * h) * K + 16 * tig;
      }
    }
  }
  const uint32_t warp_w = uint32_t((4 * cw + w4) * (kWgWStage / 8));  // this warp's 4 KB
  const uint32_t cp_dst = warp_w + uint32_t(kLine ? cp_g * 128 + ((cp_ch ^ ((cp_g & 1) << 2)) * 16) : lane * 16);
  const int64_t cp_four = 4 * int64_t(K);  // lane groups g and g + 4: four rows apart
  auto copy_w = [&](int st, int buf) {
    if (st < nk) {
      const int k0 = st * 128;
      const uint32_t base = sm.w + uint32_t(buf * kWgWStage) + cp_dst;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        if constexpr (kLine) {
          cp_async16_w(base + uint32_t(j * 4 * 128), p[j / 4][(j / 2) % 2] + (j % 2) * cp_four + k0);
        } else {
          cp_async16_w(base + uint32_t(j * 512), p[j / 4][(j / 2) % 2] + 64 * (j % 2) + k0);
        }
      }
    }
    cp_async_commit();  // one group per stage, empty or not, so wait_group counts stages
  };
  // Where this thread's fragment bytes sit: block b, lo/hi h, 64-wide chunk c (kLine: warp row
  // 16 b + 8 h + g, chunk 4 c + tig).
  auto frag_off = [&](int b, int h, int c) {
    if constexpr (kLine) {
      const int wr = 16 * b + 8 * h + g, ch = 4 * c + tig;
      return warp_w + uint32_t(wr * 128 + ((ch ^ ((wr & 1) << 2)) * 16));
    } else {
      return cp_dst + uint32_t((4 * b + 2 * h + c) * 512);
    }
  };
  uint32_t sc[2][4];  // scale words of the next stages (even / odd), [2b] lo and [2b + 1] hi rows
  auto load_s = [&](int st, uint32_t (&ss)[4]) {
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      ss[2 * b] = __ldg(s_lo[b] + st);
      ss[2 * b + 1] = __ldg(s_hi[b] + st);
    }
  };
  copy_w(0, 0);
  copy_w(1, 1);
  load_s(0, sc[0]);
  if (nk > 1) load_s(1, sc[1]);
  int ref[4];
  if (m_lo.ref != nullptr && m_hi.ref != nullptr) {  // the load-time reference (Mat::ref)
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      ref[2 * b] = __ldg(m_lo.ref + row_lo[b]);
      ref[2 * b + 1] = __ldg(m_hi.ref + (kFused ? row_lo[b] : row_lo[b] + 8));
    }
  } else {
    const uint32_t* const rows[4] = {s_lo[0], s_hi[0], s_lo[1], s_hi[1]};
    rows_max_byte<4, 4>(rows, K / 128, tig, ref);
  }
  float acc[2][R];
#pragma unroll
  for (int b = 0; b < 2; ++b)
#pragma unroll
    for (int i = 0; i < R; ++i) acc[b][i] = 0.0f;

  // Per 64-wide chunk: the A fragments of both blocks (32 registers: the accumulators of two blocks
  // leave no room for a whole stage's), then its 8 wgmmas.
  auto stage = [&](int kt, uint32_t (&ss)[4]) {
    const int buf = kt % kWgWStages;
    cp_async_wait<1>();  // this thread's weights of stage kt (stage kt + 1's may still be in flight)
    // kLine: the warp's copies of stage kt are visible to all its lanes, and all are done reading
    // stage kt - 1, whose buffer the copy below refills.
    if constexpr (kLine) __syncwarp();
    uint32_t s_now[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) s_now[i] = ss[i];
    // The buffer of stage kt + 2 was last read (into registers) by stage kt - 1.
    copy_w(kt + 2, (kt + 2) % kWgWStages);
    if (kt + 2 < nk) load_s(kt + 2, ss);
    const int st = pipe.stage;
    mbar_wait(sm.full + 8u * uint32_t(st), pipe.phase);
    wgmma::fence_proxy_async();
    const uint32_t b0 = sm.b + uint32_t(st * kWgBTile);
    const uint32_t wbase = sm.w + uint32_t(buf * kWgWStage);
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      uint32_t af[2][4][4];
      const int sh = 8 * (2 * c + (tig >> 1));
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        uint4 ql, qh;  // w8a16_body's q[c] and q[2 + c]
        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(ql.x), "=r"(ql.y), "=r"(ql.z), "=r"(ql.w)
                     : "r"(wbase + frag_off(b, 0, c)));
        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(qh.x), "=r"(qh.y), "=r"(qh.z), "=r"(qh.w)
                     : "r"(wbase + frag_off(b, 1, c)));
        const __half2 mul_lo = pow2_h2(int((s_now[2 * b] >> sh) & 0xffu) - ref[2 * b]);
        const __half2 mul_hi = pow2_h2(int((s_now[2 * b + 1] >> sh) & 0xffu) - ref[2 * b + 1]);
#pragma unroll
        for (int s4 = 0; s4 < 4; ++s4) {
          const uint32_t wl = word_of(ql, s4), wh = word_of(qh, s4);
          af[b][s4][0] = e4m3x2_scaled(wl, mul_lo);
          af[b][s4][1] = e4m3x2_scaled(wh, mul_hi);
          af[b][s4][2] = e4m3x2_scaled<true>(wl, mul_lo);
          af[b][s4][3] = e4m3x2_scaled<true>(wh, mul_hi);
        }
      }
      wgmma::fence_regs(acc[0]);
      wgmma::fence_regs(acc[1]);
      wgmma::fence();
#pragma unroll
      for (int s4 = 0; s4 < 4; ++s4)
#pragma unroll
        for (int b = 0; b < 2; ++b) wgmma::WgmmaRS<false, N>::run(acc[b], af[b][s4], wgmma::desc_sw128(b0 + uint32_t(c * kWgChunk + 32 * s4)));
      wgmma::commit();
      wgmma::wait<0>();
      wgmma::fence_regs(acc[0]);
      wgmma::fence_regs(acc[1]);
    }
    if (lane == 0) mbar_arrive(sm.empty + 8u * uint32_t(st));
    pipe.advance();
  };
  for (int kt = 0; kt < nk; kt += 2) {
    stage(kt, sc[0]);
    if (kt + 1 < nk) stage(kt + 1, sc[1]);
  }
  cp_async_wait<0>();

#pragma unroll
  for (int b = 0; b < 2; ++b) {
    if (!live[b]) continue;
    const float fr_lo = ldexpf(1.0f, ref[2 * b] - 127), fr_hi = ldexpf(1.0f, ref[2 * b + 1] - 127);
#pragma unroll
    for (int j = 0; j < N / 8; ++j) {
#pragma unroll
      for (int cc = 0; cc < 2; ++cc) {
        const int r = 8 * j + 2 * tig + cc;
        if (r >= t.nrows) continue;
        const int64_t p = t.r0 + r;
        const float tok = a.row_scale ? __ldg(a.row_scale + (a.gather ? __ldg(a.gather + p) : p)) : 1.0f;
        if constexpr (kFused) {
          const float h =
              swiglu(acc[b][4 * j + cc] * fr_lo * tok, acc[b][4 * j + 2 + cc] * fr_hi * tok, a.act) * a.out_mul;
          static_cast<__half*>(a.out)[p * a.ldo + wg_col(col[b])] = __float2half_rn(h);
        } else {
          float* y = static_cast<float*>(a.out) + p * a.ldo + row_lo[b];
          y[0] = acc[b][4 * j + cc] * fr_lo * tok * a.out_mul;
          y[8] = acc[b][4 * j + 2 + cc] * fr_hi * tok * a.out_mul;
        }
      }
    }
  }
}

template <bool kFused>
__global__ void __launch_bounds__(kWgThreads, 1) w16wg_kernel(const __grid_constant__ WgArgs a) {
  extern __shared__ unsigned char wg_smem[];
  WgSmem sm;
  sm.b = smem_u32(wgmma::align_1024(wg_smem));
  sm.w = sm.b + uint32_t(kWgStages * kWgBTile);
  sm.full = sm.w + uint32_t(kWgWStages * kWgWStage);
  sm.empty = sm.full + 8u * kWgStages;
  ws_persistent<kWgStages>(
      sm.full, sm.empty, sm.empty + 8u * kWgStages, a.tile_ctr, __ldg(a.num_items) * a.col_tiles,
      [&](int tile, GemmTile& t) { return item_tile(a, tile, kFused ? 128 : 256, t); },
      [&](const GemmTile& t, Pipe<kWgStages>& pipe, int tid) { wg_produce(a, sm, t, pipe, tid); },
      [&](const GemmTile& t, Pipe<kWgStages>& pipe, int cw, int tw, auto n) { wg_consume<kFused, decltype(n)::value>(a, sm, pipe, t, cw, tw); });
}

// ---------------------------------------------------------------------------------------------
// Host side.

size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }
bool aligned(const void* p, uintptr_t a) { return (reinterpret_cast<uintptr_t>(p) % a) == 0; }

int max_inter_of(const ops::ExpertWeights& ex) {
  int64_t m = 0;
  for (int e = 0; e < ex.num_routed + (ex.has_shared ? 1 : 0); ++e) m = std::max(m, ex.gate[e].out_features());
  return int(m);
}

// Workspace carve-up; every size is a function of shapes only.
struct Layout {
  int64_t tokens = 0, top_k = 0, n_assign = 0, rows = 0, items = 0, hidden = 0, inter = 0;
  int bt = 0;
  size_t perm = 0, pos = 0, item = 0, meta = 0, xs = 0, xc = 0, h16 = 0, hq = 0, hs = 0, y = 0, bytes = 0;
};

Layout plan(int64_t tokens, int64_t top_k, const ops::ExpertWeights& ex, int64_t hidden, Path path) {
  Layout l;
  l.tokens = tokens;
  l.top_k = top_k;
  l.n_assign = tokens * top_k;
  l.rows = l.n_assign + (ex.has_shared ? tokens : 0);
  l.bt = rows_per_item(path, tokens);
  l.items = item_bound(tokens, top_k, ex.num_routed + (ex.has_shared ? 1 : 0), l.bt);
  l.hidden = hidden;
  l.inter = max_inter_of(ex);
  const bool w8 = path == Path::kW8A8;
  size_t off = 0;
  auto take = [&](size_t bytes) {
    const size_t at = off;
    off = round_up(off + std::max<size_t>(bytes, 16), 256);
    return at;
  };
  l.perm = take(size_t(l.rows) * 4);
  l.pos = take(size_t(l.n_assign) * 4);
  l.item = take(size_t(l.items) * 16);
  l.meta = take(16);  // number of items, the shared expert's first row, the persistent GEMMs' two tile counters
  l.xs = take(size_t(tokens) * 4);
  l.xc = take(size_t(tokens) * size_t(hidden) * (w8 ? 1 : 2));
  l.h16 = take(size_t(l.rows) * size_t(l.inter) * 2);
  if (w8) {
    l.hq = take(size_t(l.rows) * size_t(l.inter));
    l.hs = take(size_t(l.rows) * 4);
  }
  l.y = take(size_t(l.rows) * size_t(hidden) * (w8 ? 2 : 4));  // W8A8: bf16 y
  l.bytes = off;
  return l;
}

Mat mat_of(const ops::LinearWeight& w) {
  return Mat{w.data.as<const uint8_t>(), w.scale.as<const uint8_t>(), w.scale_max.as<const uint8_t>()};
}

Group make_group(const ops::ExpertWeights& ex, bool gate_up, int64_t hidden) {
  Group g{};
  for (int e = 0; e < ex.num_routed + (ex.has_shared ? 1 : 0); ++e) {
    const int inter = int(ex.gate[e].out_features());
    if (gate_up) {
      g.a[e] = mat_of(ex.gate[e]);
      g.b[e] = mat_of(ex.up[e]);
      g.n[e] = inter;
      g.k[e] = int(hidden);
    } else {
      g.a[e] = mat_of(ex.down[e]);
      g.b[e] = g.a[e];
      g.n[e] = int(hidden);
      g.k[e] = inter;
    }
  }
  return g;
}

// W8A8's scale words per copy (log2), one for the whole launch: the widest every expert allows.
int scale_words_log(const Group& g, int experts) {
  int lg = 2;
  for (int e = 0; e < experts; ++e) {
    lg = std::min(lg, scale_copy_log(reinterpret_cast<uintptr_t>(g.a[e].s) | reinterpret_cast<uintptr_t>(g.b[e].s), g.k[e]));
  }
  return lg;
}

// The fields the W8A16 and W8A8 argument structs share (gate_up: x rows gathered through perm,
// h out; down: h rows in, y out).
template <class Args, class In>
Args grouped_args(const In* x, const int32_t* gather, int64_t ldx, const float* row_scale, float out_mul, void* out,
                  int64_t ldo, const int4* items, const int* num_items, Act act, const Group& g) {
  Args r{};
  r.x = x;
  r.gather = gather;
  r.ldx = ldx;
  r.row_scale = row_scale;
  r.out_mul = out_mul;
  r.out = out;
  r.ldo = ldo;
  r.items = items;
  r.num_items = num_items;
  r.act = act;
  r.g = g;
  return r;
}

// The down projection (kFused false) is launched with programmatic stream serialisation: its CTAs
// may become resident during gate+up's tail and prefetch weights before waiting (on created
// streams; the legacy stream keeps plain ordering).
template <bool kFused>
void launch_w16(int tmt, dim3 grid, const W16Args& a) {
  const size_t smem = w16_smem_bytes(tmt);
  auto kernel = tmt == 2 ? w8a16_kernel<kFused, 2> : tmt == 0 ? w8a16_kernel<kFused, 0> : w8a16_kernel<kFused, 8>;
  allow_dynamic_smem(reinterpret_cast<const void*>(kernel), smem);
  launch_kernel(kernel, grid, dim3(unsigned(w16_threads(tmt))), smem, !kFused, a);
}

template <bool kFused>
void launch_wg(const WgArgs& a) {
  const int sms = allow_dynamic_smem(reinterpret_cast<const void*>(w16wg_kernel<kFused>), kWgSmemBytes);
  w16wg_kernel<kFused><<<unsigned(sms), kWgThreads, kWgSmemBytes, current_stream()>>>(a);
  M3_CUDA_CHECK_LAUNCH();
}

template <bool kFused>
void launch_w8(const W8Args& a, bool deep) {
  auto kernel = deep ? w8a8_kernel<kFused, kW8StagesDeep> : w8a8_kernel<kFused, kW8StagesShallow>;
  const size_t smem = w8_smem_bytes(deep ? kW8StagesDeep : kW8StagesShallow);
  const int sms = allow_dynamic_smem(reinterpret_cast<const void*>(kernel), smem);
  kernel<<<unsigned(sms), kW8Threads, smem, current_stream()>>>(a);
  M3_CUDA_CHECK_LAUNCH();
}

[[noreturn]] void fail(const std::string& why) { throw std::runtime_error("moe_mxfp8: " + why); }

}  // namespace

// |swiglu_oai| <= (|limit| + |beta|) * max(|limit|, 0.2785 / alpha) (g * sigmoid(alpha g) >=
// -0.2785 / alpha), so h * 2^k with bound * 2^k <= 2^15 fits f16 for every input.
float intermediate_scale(const ops::SwigluParams& p) {
  const double lim = std::fabs(double(p.limit));
  const double bound = (lim + std::fabs(double(p.beta))) * std::max(lim, 0.2785 / double(p.alpha));
  if (!(p.alpha > 0.0f) || !std::isfinite(bound) || !(bound > 0.0)) {
    throw std::runtime_error("moe_mxfp8: needs a finite SwiGLU limit and alpha > 0 (the f16 intermediate is scaled by its bound)");
  }
  int ex = 0;
  std::frexp(bound, &ex);  // bound < 2^ex
  return std::ldexp(1.0f, 15 - ex);
}

int rows_per_item(Path path, int64_t tokens) {
  if (path == Path::kW8A8) return kW8MaxTok;
  if (path == Path::kW8A16Wg) return kWgMaxTok;
  return tokens < 64 ? 16 : 64;  // W8A16: 2 or 8 sub-tiles of 8 rows (kTMT)
}

GemmPlan gemm_plan(Path path, int64_t tokens, int64_t inter, int64_t hidden) {
  GemmPlan p;
  p.path = path;
  p.rows_per_item = rows_per_item(path, tokens);
  if (path == Path::kW8A16) {
    p.token_tile = p.rows_per_item == 16 ? 2 : 0;  // 64-row items: the tile follows each item's rows
    p.threads = w16_threads(p.token_tile);
    p.gu_cols = 8 * (p.threads / 32);   // a warp's 8 gate rows and their 8 up rows
    p.dn_cols = 16 * (p.threads / 32);  // a warp's 16 weight rows
    p.stages = kW16Deep;
  } else if (path == Path::kW8A16Wg) {
    p.threads = kWgThreads;
    p.persistent = true;
    p.gu_cols = 128;
    p.dn_cols = 256;
    p.stages = kWgStages;
  } else {
    p.threads = kW8Threads;
    p.persistent = true;
    p.gu_cols = kW8ARows / 2;  // gate and up rows interleaved in one 128-row tile
    p.dn_cols = kW8ARows;
    p.stages = tokens <= kW8DeepMaxTokens ? kW8StagesDeep : kW8StagesShallow;
  }
  p.gu_col_tiles = (inter + p.gu_cols - 1) / p.gu_cols;
  p.dn_col_tiles = (hidden + p.dn_cols - 1) / p.dn_cols;
  // Small batches spread a token's hidden over several CTAs (more SMs reading y); from
  // kCombineWholeRow tokens a CTA takes the whole row, so its setup (the token's rows and
  // weights, read by one thread) is paid once per token.
  p.combine_ctas_per_token = tokens >= kCombineWholeRow ? 1 : (hidden + 4 * kCombineThreads - 1) / (4 * kCombineThreads);
  return p;
}

std::string plan_text(const GemmPlan& p) {
  const auto n = [](int64_t v) { return std::to_string(v); };
  std::string s;
  if (p.path == Path::kW8A16) {
    s = "W8A16 mma.sync, items of <= " + n(p.rows_per_item) + " rows, ";
    s += p.token_tile == 2 ? "16-token tiles (8 for items of <= 8 rows) with a " + n(p.stages) + "-stage shared-memory weight ring"
                           : "per item a 16-token tile with a " + n(p.stages) +
                                 "-stage shared-memory weight ring (<= 16 rows) or a 64-token tile with weights in registers";
    s += "; gate+up: CTAs of " + n(p.threads / 32) + " warps over " + n(p.gu_cols) + " columns, " + n(p.gu_col_tiles) +
         " per item; down: " + n(p.dn_cols) + " columns, " + n(p.dn_col_tiles) +
         " per item, each CTA starting once its item's gate+up CTAs have arrived";
  } else {
    s = std::string(p.path == Path::kW8A8 ? "W8A8 wgmma e4m3" : "W8A16 wgmma f16") + ", items of <= " + n(p.rows_per_item) +
        " rows, persistent CTAs (a producer and two consumer warpgroups) taking the tiles in order from a counter, " +
        n(p.stages) +
        "-stage pipeline, 32..128-token tiles per item; gate+up: " + n(p.gu_cols) + "-column tiles, " + n(p.gu_col_tiles) +
        " per item; ";
    if (p.path == Path::kW8A8) s += "h to e4m3 per row; ";
    s += "down: " + n(p.dn_cols) + "-column tiles, " + n(p.dn_col_tiles) + " per item";
    if (p.path == Path::kW8A8) s += ", y in bf16";
  }
  s += "; combine: " + n(p.combine_ctas_per_token) + (p.combine_ctas_per_token == 1 ? " CTA" : " CTAs") + " per token";
  return s;
}

int64_t item_bound(int64_t tokens, int64_t top_k, int total_experts, int rows_per_item) {
  const int64_t rows = tokens * (top_k + 1);
  return (rows + rows_per_item - 1) / rows_per_item + std::min<int64_t>(total_experts, rows);
}

std::string check(const ops::ExpertWeights& ex, int64_t hidden, int64_t top_k) {
  const int total = ex.num_routed + (ex.has_shared ? 1 : 0);
  if (ex.num_routed < 1 || total > kMaxExperts) return "needs 1..256 experts including the shared one";
  if (top_k < 1 || top_k > kMaxTopK) return "top_k must be in [1, 64]";
  if (hidden % 128 != 0 || hidden > (int64_t(1) << 24)) return "hidden size must be a multiple of 128";
  for (int e = 0; e < total; ++e) {
    const int64_t inter = ex.gate[e].out_features();
    if (inter < 128 || inter % 128 != 0 || inter > (int64_t(1) << 24)) {
      return "expert " + std::to_string(e) + ": intermediate size must be a positive multiple of 128";
    }
    const ops::LinearWeight* ws[3] = {&ex.gate[e], &ex.up[e], &ex.down[e]};
    for (int i = 0; i < 3; ++i) {
      const ops::LinearWeight& w = *ws[i];
      if (w.data.dtype != DType::kF8E4M3 || w.data.shape.rank() != 2 || !w.data.data) {
        return "expert " + std::to_string(e) + ": weights must be 2-D F8E4M3";
      }
      const int64_t out = i < 2 ? inter : hidden, in = i < 2 ? hidden : inter;
      if (w.out_features() != out || w.in_features() != in) {
        return "expert " + std::to_string(e) + ": gate/up must be [inter, hidden] and down [hidden, inter]";
      }
      if (!w.scale.data || w.scale.dtype != DType::kU8 || w.scale.shape.rank() != 2 || w.scale.shape[0] != out ||
          w.scale.shape[1] != in / 32) {
        return "expert " + std::to_string(e) + ": needs a U8 e8m0 scale [out, in / 32]";
      }
      if (!aligned(w.data.data, 16) || !aligned(w.scale.data, 4)) {
        return "expert " + std::to_string(e) + ": weight data must be 16-byte and scales 4-byte aligned";
      }
      if (!w.scale_max_fits()) return "expert " + std::to_string(e) + ": scale_max must be U8 [out]";
    }
  }
  return "";
}

size_t workspace_bytes(int64_t tokens, int64_t top_k, const ops::ExpertWeights& experts, int64_t hidden, Path path) {
  return plan(tokens, top_k, experts, hidden, path).bytes;
}

void route(const int32_t* ids, int tokens, int top_k, int routed, bool has_shared, int rpi, int32_t* perm,
           int32_t* pos, void* items, int* meta) {
  route_kernel<<<1, kRouteThreads, 0, current_stream()>>>(ids, tokens, top_k, routed, has_shared ? 1 : 0, rpi, perm,
                                                          pos, static_cast<int4*>(items), meta);
  M3_CUDA_CHECK_LAUNCH();
}

void run(const TensorView& x, const TensorView& expert_ids, const TensorView& expert_weights,
         const ops::ExpertWeights& experts, const ops::SwigluParams& act, const TensorView& out, Path path,
         void* workspace, unsigned stages) {
  if (x.shape.rank() != 2 || expert_ids.shape.rank() != 2) fail("x and expert_ids must be 2-D");
  const int64_t tokens = x.shape[0], hidden = x.shape[1], top_k = expert_ids.shape[1];
  if (tokens == 0) return;
  const std::string why = check(experts, hidden, top_k);
  if (!why.empty()) fail(why);
  if (x.dtype != DType::kF32 || out.dtype != DType::kF32 || !(out.shape == x.shape)) fail("x and out must be F32 [tokens, hidden]");
  if (expert_ids.shape[0] != tokens || expert_weights.shape.rank() != 2 || expert_weights.shape[0] != tokens ||
      expert_weights.shape[1] != top_k) {
    fail("expert_ids / expert_weights must be [tokens, top_k]");
  }
  if (!aligned(x.data, 16) || !aligned(out.data, 16)) fail("x and out must be 16-byte aligned");
  if (tokens * (top_k + 1) > (int64_t(1) << 30)) fail("too many tokens");
  const Layout l = plan(tokens, top_k, experts, hidden, path);
  if (l.items > 65535 * 64 || hidden / 64 > 65535 || l.inter / 32 > 65535) fail("problem too large for the grid");
  char* ws = static_cast<char*>(workspace);
  int32_t* perm = reinterpret_cast<int32_t*>(ws + l.perm);
  int32_t* pos = reinterpret_cast<int32_t*>(ws + l.pos);
  int4* items = reinterpret_cast<int4*>(ws + l.item);
  int* meta = reinterpret_cast<int*>(ws + l.meta);
  float* xs = reinterpret_cast<float*>(ws + l.xs);
  __half* h16 = reinterpret_cast<__half*>(ws + l.h16);
  float* y = reinterpret_cast<float*>(ws + l.y);
  const cudaStream_t stream = current_stream();
  const bool w8 = path == Path::kW8A8, wg = path == Path::kW8A16Wg;
  const GemmPlan gp = gemm_plan(path, tokens, l.inter, hidden);
  const float hscale = intermediate_scale(act);
  const Act a{act.alpha, act.limit, act.beta};

  if ((stages & kRoute) && (stages & kPrep)) {
    const int32_t* ids = expert_ids.as<const int32_t>();
    // Launched while the router's select kernel drains (it waits before reading the ids).
    launch_kernel(w8 ? route_prep_kernel<true> : wg ? route_prep_kernel<false, true> : route_prep_kernel<false>,
                  dim3(unsigned(tokens + 1)),
                  dim3(kRouteThreads), 0, true, ids, int(tokens), int(top_k), experts.num_routed,
                  experts.has_shared ? 1 : 0, l.bt, perm, pos, items, meta, x.as<const float>(), int(hidden),
                  static_cast<void*>(ws + l.xc), xs);
  } else if (stages & kRoute) {
    route(expert_ids.as<const int32_t>(), int(tokens), int(top_k), experts.num_routed, experts.has_shared, l.bt, perm,
          pos, items, meta);
  } else if (stages & kPrep) {
    if (w8) {
      quant_rows_kernel<float, true><<<unsigned(tokens), kQuantThreads, 0, stream>>>(
          x.as<const float>(), hidden, int(hidden), ws + l.xc, hidden, xs);
    } else if (wg) {
      quant_rows_kernel<float, false, true><<<unsigned(tokens), kQuantThreads, 0, stream>>>(
          x.as<const float>(), hidden, int(hidden), ws + l.xc, hidden, xs);
    } else {
      quant_rows_kernel<float, false><<<unsigned(tokens), kQuantThreads, 0, stream>>>(
          x.as<const float>(), hidden, int(hidden), ws + l.xc, hidden, xs);
    }
    M3_CUDA_CHECK_LAUNCH();
  }
  if (stages & kGemms) {
    const Group g_gu = make_group(experts, true, hidden), g_dn = make_group(experts, false, hidden);
    // The persistent kernels' tile counters (gate+up, down): meta[2], meta[3].
    unsigned* tile_ctr = reinterpret_cast<unsigned*>(meta + 2);
    if (wg || w8) M3_CUDA_CHECK(cudaMemsetAsync(tile_ctr, 0, 2 * sizeof(unsigned), stream));
    if (wg) {
      WgArgs gu = grouped_args<WgArgs>(reinterpret_cast<const __half*>(ws + l.xc), perm, hidden, xs, hscale, h16,
                                       l.inter, items, meta, a, g_gu);
      gu.col_tiles = int(gp.gu_col_tiles);
      gu.tile_ctr = tile_ctr;
      launch_wg<true>(gu);
      WgArgs dn = grouped_args<WgArgs>(h16, nullptr, l.inter, nullptr, 1.0f / hscale, y, hidden, items, meta, a, g_dn);
      dn.col_tiles = int(gp.dn_col_tiles);
      dn.tile_ctr = tile_ctr + 1;
      launch_wg<false>(dn);
    } else if (!w8) {
      // The arrival counters (items[i].w) start at 0 from the routing; a call without it (the
      // GEMMs alone, on items routed before) clears them first.
      if (!(stages & kRoute)) M3_CUDA_CHECK(cudaMemset2DAsync(reinterpret_cast<int*>(items) + 3, sizeof(int4), 0, sizeof(int),
                                                             size_t(l.items), stream));
      const W16Args gu = grouped_args<W16Args>(reinterpret_cast<const __half*>(ws + l.xc), perm, hidden, xs, hscale,
                                               h16, l.inter, items, meta, a, g_gu);
      launch_w16<true>(gp.token_tile, dim3(unsigned(l.items), unsigned(gp.gu_col_tiles)), gu);
      W16Args dn = grouped_args<W16Args>(h16, nullptr, l.inter, nullptr, 1.0f / hscale, y, hidden, items, meta, a, g_dn);
      dn.item_tiles = int(gp.gu_col_tiles);
      launch_w16<false>(gp.token_tile, dim3(unsigned(l.items), unsigned(gp.dn_col_tiles)), dn);
    } else {
      uint8_t* hq = reinterpret_cast<uint8_t*>(ws + l.hq);
      float* hs = reinterpret_cast<float*>(ws + l.hs);
      W8Args gu = grouped_args<W8Args>(reinterpret_cast<const uint8_t*>(ws + l.xc), perm, hidden, xs, hscale, h16,
                                       l.inter, items, meta, a, g_gu);
      gu.col_tiles = int(gp.gu_col_tiles);
      gu.tile_ctr = tile_ctr;
      const int n_experts = experts.num_routed + (experts.has_shared ? 1 : 0);
      gu.s_log = scale_words_log(g_gu, n_experts);
      // Row scales come from each row's amax over the widest intermediate: experts narrower than
      // that must leave zeros (not stale bytes) in the columns past their own width.
      bool uniform = true;
      for (int e = 0; e < experts.num_routed + (experts.has_shared ? 1 : 0); ++e) {
        uniform = uniform && experts.gate[e].out_features() == l.inter;
      }
      if (!uniform) M3_CUDA_CHECK(cudaMemsetAsync(h16, 0, size_t(l.rows) * size_t(l.inter) * 2, stream));
      const bool deep = gp.stages == kW8StagesDeep;
      launch_w8<true>(gu, deep);
      // Rows past the routed ones (ids outside [0, routed)) are never written: their quantised
      // copies are never read either.
      if (l.inter % 256 == 0 && l.inter <= 256 * kWarpRowChunks) {
        constexpr int kRowsPerCta = kQuantThreads / 32;
        quant_h_rows_kernel<<<unsigned((l.rows + kRowsPerCta - 1) / kRowsPerCta), kQuantThreads, 0, stream>>>(
            h16, l.inter, int(l.rows), int(l.inter), hq, l.inter, hs);
      } else {
        quant_rows_kernel<__half, true><<<unsigned(l.rows), kQuantThreads, 0, stream>>>(h16, l.inter, int(l.inter), hq,
                                                                                        l.inter, hs);
      }
      M3_CUDA_CHECK_LAUNCH();
      W8Args dn = grouped_args<W8Args>(hq, nullptr, l.inter, hs, 1.0f / hscale, y, hidden, items, meta, a, g_dn);
      dn.col_tiles = int(gp.dn_col_tiles);
      dn.s_log = scale_words_log(g_dn, n_experts);
      dn.tile_ctr = tile_ctr + 1;
      launch_w8<false>(dn, deep);
    }
  }
  if (stages & kCombine) {
    const dim3 grid(unsigned(tokens), unsigned(gp.combine_ctas_per_token));
    // A programmatic dependent of the down projection when the GEMMs ran in this call (the
    // routing finished before they began); alone, a plain launch.
    auto combine = [&](auto* yv) {  // y as written by the down projection: bf16 (W8A8) or float
      using Y = std::remove_cv_t<std::remove_pointer_t<decltype(yv)>>;
      launch_kernel(combine_kernel<Y>, grid, dim3(kCombineThreads), 0, (stages & kGemms) != 0, yv,
                    expert_weights.as<const float>(), expert_ids.as<const int32_t>(), static_cast<const int32_t*>(pos),
                    int(top_k), static_cast<const int*>(meta), experts.has_shared ? 1 : 0, out.as<float>(), int(hidden));
    };
    if (w8) combine(reinterpret_cast<const __nv_bfloat16*>(y));
    else combine(static_cast<const float*>(y));
  }
}

}  // namespace m3::cuda::moe_mxfp8

// ---------------------------------------------------------------------------------------------
// Dispatch entries.
namespace m3::cuda {
namespace {

// Below this hidden size a layer's experts are a few hundred KB: latency, not bandwidth, sets the
// time, and the grouped row-dot (fp32 activations) costs the same.
constexpr int64_t kMinHidden = 1024;

std::string need_mxfp8_moe(const ops::Problem& p) {
  if (p.device != Device::kCuda) return "tensors are not in device memory";
  if (p.dtype != DType::kF8E4M3) {
    return "MXFP8 (F8E4M3 + e8m0 scale) expert weights only, got " + std::string(dtype_name(p.dtype));
  }
  if (p.k % 128 != 0) return "hidden size is not a multiple of 128";
  if (p.k < kMinHidden) {
    return "hidden size < " + std::to_string(kMinHidden) +
           " (experts this small are launch-latency-bound: the exact fp32 row-dot is as fast)";
  }
  if (p.n % 128 != 0) return "intermediate size is not a multiple of 128";
  if (p.extra < 1 || p.extra > 64) return "top_k must be in [1, 64]";
  return "";
}

std::string need_w8a8(const ops::Problem& p) {
  std::string why = need_mxfp8_moe(p);
  if (!why.empty()) return why;
  if (p.batch_invariant) {
    return "batch invariance requested (the path switches with the token count, so a token's result would depend on "
           "its batch)";
  }
  if (p.m < moe_mxfp8::kW8A8MinTokens) {
    return "fewer than " + std::to_string(moe_mxfp8::kW8A8MinTokens) + " tokens (W8A16 streams the weights there)";
  }
  return "";
}

std::string need_w16wg(const ops::Problem& p) {
  std::string why = need_mxfp8_moe(p);
  if (!why.empty()) return why;
  if (p.m < moe_mxfp8::kW8A16WgMinTokens) {
    return "fewer than " + std::to_string(moe_mxfp8::kW8A16WgMinTokens) +
           " tokens (the mma.sync kernel streams the weights faster there)";
  }
  return "";
}

// Workspace of decode-sized calls (M3 at top-4: ~250 KB per token; up to 8 MB), so that no alloc
// node separates the router's select kernel from the routing kernel launched as its programmatic
// dependent. Consecutive MoE calls never overlap on it: the kernels between two layers' experts
// (norms, adds, the router) wait for the kernel before them before they touch anything.
__device__ __align__(256) uint4 g_moe_workspace[(size_t(8) << 20) / 16];

void run_entry(const TensorView& x, const TensorView& ids, const TensorView& wts, const ops::ExpertWeights& experts,
               const ops::SwigluParams& act, const TensorView& out, moe_mxfp8::Path path) {
  if (x.shape.rank() != 2 || ids.shape.rank() != 2 || x.shape[0] == 0) return;
  static FixedScratch ws_of(g_moe_workspace);
  Scratch ws(moe_mxfp8::workspace_bytes(x.shape[0], ids.shape[1], experts, x.shape[1], path), ws_of);
  moe_mxfp8::run(x, ids, wts, experts, act, out, path, ws.as<void>());
}

void w8a8_entry(const TensorView& x, const TensorView& ids, const TensorView& wts, const ops::ExpertWeights& experts,
                const ops::SwigluParams& act, const TensorView& out) {
  run_entry(x, ids, wts, experts, act, out, moe_mxfp8::Path::kW8A8);
}

void w16wg_entry(const TensorView& x, const TensorView& ids, const TensorView& wts, const ops::ExpertWeights& experts,
                 const ops::SwigluParams& act, const TensorView& out) {
  run_entry(x, ids, wts, experts, act, out, moe_mxfp8::Path::kW8A16Wg);
}

void w8a16_entry(const TensorView& x, const TensorView& ids, const TensorView& wts, const ops::ExpertWeights& experts,
                 const ops::SwigluParams& act, const TensorView& out) {
  run_entry(x, ids, wts, experts, act, out, moe_mxfp8::Path::kW8A16);
}

// The trace's account of a call: moe_experts problems carry tokens (m), the first expert's
// intermediate size (n), hidden (k) and top_k (extra).
template <moe_mxfp8::Path kPath>
std::string plan_moe(const ops::Problem& p) {
  return moe_mxfp8::plan_text(moe_mxfp8::gemm_plan(kPath, p.m, p.n, p.k));
}

}  // namespace

void register_moe_mxfp8(ops::KernelTable& table) {
  table.moe.add({"moe_experts.mxfp8_w8a8_wgmma.sm90",
                 "device MXFP8 experts, hidden >= 1024, hidden and intermediate sizes multiples of 128, top_k <= 64, "
                 "<= 256 experts incl. the shared one; tokens >= 256 and batch invariance NOT requested (not batch-invariant: "
                 "the path depends on the token count): activations e4m3 with a power-of-two scale per token, "
                 "wgmma m64nNk32 e4m3 with the weight's e8m0 block scale applied per 32-wide K step in fp32, "
                 "persistent warp-specialised CTAs (6 pipeline stages up to 1024 tokens, 4 above), fused gate+up "
                 "SwiGLU-OAI, device routing, expert outputs in bf16, combine in the CPU's order; no host sync",
                 need_w8a8, w8a8_entry, plan_moe<moe_mxfp8::Path::kW8A8>});
  table.moe.add({"moe_experts.mxfp8_w8a16_wgmma.sm90",
                 "device MXFP8 experts, hidden >= 1024, hidden and intermediate sizes multiples of 128, top_k <= 64, "
                 "<= 256 experts incl. the shared one; tokens >= 384, any batch-invariance setting (batch-invariant: the "
                 "bits of moe_experts.mxfp8_w8a16_mma for every token): the same f16 operands and per-output MMA order "
                 "on wgmma m64nNk16 (A = weights dequantised in registers, B = token tile in shared memory from a "
                 "cp.async producer warpgroup), persistent CTAs, fused gate+up SwiGLU-OAI, device routing, combine "
                 "in the CPU's order; no host sync",
                 need_w16wg, w16wg_entry, plan_moe<moe_mxfp8::Path::kW8A16Wg>});
  table.moe.add({"moe_experts.mxfp8_w8a16_mma.sm90",
                 "device MXFP8 experts, hidden >= 1024, hidden and intermediate sizes multiples of 128, top_k <= 64, "
                 "<= 256 experts incl. the shared one; any token count, any batch-invariance setting (batch-invariant: fixed "
                 "per-output reduction order, per-token activation scale): activations f16 with a power-of-two "
                 "scale per token, e4m3 weights dequantised exactly to f16 in registers, mma.sync m16n8k16 with "
                 "fp32 accumulation, many CTAs per expert over N, fused gate+up SwiGLU-OAI, device routing, "
                 "combine in the CPU's order; no host sync",
                 need_mxfp8_moe, w8a16_entry, plan_moe<moe_mxfp8::Path::kW8A16>});
}

}  // namespace m3::cuda

// ---------------------------------------------------------------------------------------------
// The MoE timeline's host side (moe_timeline.cuh): this file's table and the report over both.
M3_MOE_TL_DEFINE_HOST(experts)

namespace m3::cuda::moe_tl {

bool enabled() {
#ifdef M3_MOE_TIMELINE
  return true;
#else
  return false;
#endif
}

void reset() {
  clear_router();
  clear_experts();
}

std::string report() {
  if (!enabled()) return "moe timeline: not compiled in (cmake -DM3_MOE_TIMELINE=ON)\n";
  std::vector<Rec> router(size_t(kKernels) * kCtas), experts(size_t(kKernels) * kCtas);
  read_router(router.data());
  read_experts(experts.data());
  auto rec = [&](int k, int c) -> const Rec& {
    return (k == kLogits || k == kSelect ? router : experts)[size_t(k) * kCtas + size_t(c)];
  };
  unsigned long long t0 = ~0ull;
  for (int k = 0; k < kKernels; ++k) {
    for (int c = 0; c < kCtas; ++c) {
      if (rec(k, c).t[kEntry] != 0) t0 = std::min(t0, rec(k, c).t[kEntry]);
    }
  }
  if (t0 == ~0ull) return "moe timeline: no marks recorded\n";
  static const char* const names[kKernels] = {"logits", "select", "route", "gate_up", "down", "combine"};
  static const char* const marks[kMarks] = {"entry", "waited", "mid", "exit"};
  auto us = [&](unsigned long long t) { return double(t - t0) * 1e-3; };
  char buf[256];
  std::string out = "moe timeline (us after the first CTA's entry; first / p50 / last over the CTAs)\n";
  // One line per (mark) over a set of CTAs.
  auto line = [&](const std::string& who, const std::vector<const Rec*>& rs) {
    for (int m = 0; m < kMarks; ++m) {
      std::vector<unsigned long long> v;
      for (const Rec* r : rs) {
        if (r->t[m] != 0) v.push_back(r->t[m]);
      }
      if (v.empty()) continue;
      std::sort(v.begin(), v.end());
      std::snprintf(buf, sizeof buf, "  %-16s %-6s %4zu ctas  %8.2f %8.2f %8.2f\n", who.c_str(), marks[m], v.size(),
                    us(v.front()), us(v[v.size() / 2]), us(v.back()));
      out += buf;
    }
  };
  for (int k = 0; k < kKernels; ++k) {
    std::vector<const Rec*> rs;
    std::vector<int> sms;
    for (int c = 0; c < kCtas; ++c) {
      if (rec(k, c).t[kEntry] == 0) continue;
      rs.push_back(&rec(k, c));
      sms.push_back(rec(k, c).sm);
    }
    if (rs.empty()) continue;
    std::sort(sms.begin(), sms.end());
    const size_t distinct = size_t(std::unique(sms.begin(), sms.end()) - sms.begin());
    std::snprintf(buf, sizeof buf, "%s: %zu ctas on %zu SMs%s\n", names[k], rs.size(), distinct,
                  rec(k, kCtas - 1).t[kEntry] != 0 ? " (the grid's first CTAs only)" : "");
    out += buf;
    line("all", rs);
    if (k != kGateUp && k != kDown) continue;
    // Per item (CTAs that got past their wait: items past the routing's count return before).
    for (int item = 0; item < 8; ++item) {
      std::vector<const Rec*> ri;
      for (const Rec* r : rs) {
        if (r->item == item && r->t[kWaited] != 0) ri.push_back(r);
      }
      if (!ri.empty()) line("item " + std::to_string(item), ri);
    }
  }
  return out;
}

}  // namespace m3::cuda::moe_tl
