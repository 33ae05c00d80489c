// Batch-invariant tensor-core linear for BF16 and MXFP8 weights (contract: linear_mma.h).
//
// Data flow of one call (current_stream(), no host synchronisation):
//   split   one CTA per x row: hi and lo pieces (bf16, or f16 of x * 2^k with the row's 2^-k);
//           several GEMMs over one x (a layer's projections) share it and, with narrow tiles, one
//           launch (GroupArgs);
//   gemm    CTAs of 128 weight rows x 8, 16 or 32 tokens (narrow: 8 warps of 16 rows; M <= 128) or
//           x 128 tokens (wide: 2 x 4 warps of 64 rows x 32 tokens), a cp.async ring of 64-wide K
//           stages (weights, e8m0 scales, both x pieces) in shared memory; weights are the MMA's
//           A operand (so one token costs one n8 tile, not an m16 one); the weights' first stages
//           stream while the split finishes (programmatic dependent launch);
//   reduce  when the output tiles alone cannot fill the GPU (decode), the K segments run in
//           separate CTAs that write fp32 partials, and the last CTA of a tile (ticket) adds
//           them in segment order: the same additions a single CTA makes in registers.
//
// K order inside a 64-wide stage (as the MoE W8A16 kernel): lane (g, t) reads elements
// [16t, 16t + 16) of its weight rows and token rows; MMA step s (0..3) takes elements
// 16t + 4s .. 16t + 4s + 3 as the fragment's k = 2t, 2t + 1, 2t + 8, 2t + 9. A fixed
// permutation of k inside a stage, identical for every tile, so no shuffles are needed.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_internal.h"
#include "backend/cuda/linear_mma.h"
#include "backend/cuda/linear_wgmma.h"
#include "backend/cuda/mma_operands.cuh"
#include "backend/cuda/msa_timeline.cuh"
#include "backend/cuda/pdl.cuh"

namespace m3::cuda {
namespace {

using namespace mma_ops;

constexpr int kKc = 64;            // K per pipeline stage
constexpr int kRowsCta = 128;      // weight rows per CTA: 4 row-warps x 32
constexpr int kCtaTarget = 264;    // CTAs the fixed K split aims for (a constant: the bits never depend on the GPU)
constexpr int kMinK = 1024;        // smaller K (tiny test models) keeps the exact fp32 row-dot
constexpr int kPieceRow = 144;     // shared-memory bytes of a 64-wide f16/bf16 row: 128 + 16, conflict-free 16-byte reads
constexpr int kSplitMaxRows = 256; // K segments in separate CTAs only up to this many rows (bounded partials)
// Fewest 64-wide K stages per segment (part of the bits). Narrow outputs (k/v/index projections,
// N = 128-512) would otherwise split K into 4-stage segments, 96 CTAs per projection that each
// pay a CTA's setup, a full row of scales and a partial for 32 KB of weights: a layer's grouped
// projections then took 568 CTAs, a wave and a half at three per SM. With 12: 360 CTAs, one wave;
// one token 38.2 -> 32.8 us, 32 rows 84.7 -> 76.1 (H200).
constexpr int kMinSegStages = 12;

enum class WKind { kBF16, kFP8 };

template <WKind W>
constexpr int w_row_bytes() {  // shared-memory bytes of one weight row per stage (FP8: 64, conflict-free unpadded)
  return W == WKind::kBF16 ? kPieceRow : kKc;
}
template <WKind W, int kCT, int kStages>
constexpr size_t smem_bytes() {
  return size_t(kStages) * (size_t(kRowsCta) * w_row_bytes<W>() + (W == WKind::kFP8 ? kRowsCta * 4 : 0) +
                            size_t(2) * kCT * kPieceRow);
}

struct Args {
  const uint16_t* xhi;    // [m][k] pieces (bf16 or f16 bits)
  const uint16_t* xlo;
  const float* xscale;    // [m] powers of two (f16 pieces) or null
  const uint8_t* w;       // [n][k] bf16 or e4m3
  const uint8_t* ws;      // [n][k / 32] e8m0 (MXFP8) or null
  const uint8_t* wref;    // [n] each scale row's largest byte (LinearWeight::scale_max) or null
  float* y;
  int64_t ldy;
  float* partial;         // [nseg][m][n] when split
  int* tickets;           // [tiles] when split (zeroed by the split kernel)
  int m, n, k;
  int seg_stages, nseg, split;
  int gx, gy;             // this GEMM's tiles: gx along n, gy along m (and nseg along K when split)
};

// Several GEMMs over the same x pieces in one launch (the layer's q/k/v/index projections, the
// dense MLP's gate and up): a 1-D grid, GEMM i's CTAs at [first_cta[i], first_cta[i + 1]) in the
// order a launch of its own would have (n tile fastest, then m tile, then K segment), so each CTA
// computes exactly what it would alone. One launch streams the group's weights back to back
// instead of one short launch (and its ramp and tail) per matrix.
constexpr int kMaxGroup = 6;
struct GroupArgs {
  Args sub[kMaxGroup];
  int first_cta[kMaxGroup + 1];
  int count;
};


template <WKind W>
__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (W == WKind::kBF16) {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// One x row per CTA: the hi and lo pieces (and, for f16, the row's power of two). kVec: x rows
// 16-byte aligned, four elements per access (k is a multiple of 64).
// kWg: columns c..c + 3 (c % 4 == 0) stored in wg_col order (pairs stay adjacent), for the wgmma kernel.
template <bool kF16, bool kWg = false>
__device__ __forceinline__ void split4(const float4 v, float mul, uint16_t* hr, uint16_t* lr, int c) {
  const float e[4] = {v.x * mul, v.y * mul, v.z * mul, v.w * mul};
  uint32_t h[4], l[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    if constexpr (kF16) {
      const __half hh = __float2half_rn(e[q]);
      h[q] = __half_as_ushort(hh);
      l[q] = __half_as_ushort(__float2half_rn(e[q] - __half2float(hh)));
    } else {
      const __nv_bfloat16 hh = __float2bfloat16_rn(e[q]);
      h[q] = __bfloat16_as_ushort(hh);
      l[q] = __bfloat16_as_ushort(__float2bfloat16_rn(e[q] - __bfloat162float(hh)));
    }
  }
  if constexpr (kWg) {
    *reinterpret_cast<uint32_t*>(hr + wg_col(c)) = h[0] | (h[1] << 16);
    *reinterpret_cast<uint32_t*>(hr + wg_col(c + 2)) = h[2] | (h[3] << 16);
    *reinterpret_cast<uint32_t*>(lr + wg_col(c)) = l[0] | (l[1] << 16);
    *reinterpret_cast<uint32_t*>(lr + wg_col(c + 2)) = l[2] | (l[3] << 16);
  } else {
    *reinterpret_cast<uint2*>(hr + c) = make_uint2(h[0] | (h[1] << 16), h[2] | (h[3] << 16));
    *reinterpret_cast<uint2*>(lr + c) = make_uint2(l[0] | (l[1] << 16), l[2] | (l[3] << 16));
  }
}

// One CTA of kSplitThreads per x row. A row of up to kSplitHold float4s per thread (12288
// elements) is read once, into registers, for both its maximum and its pieces; longer rows are
// read twice. CTA 0 also zeroes the GEMMs' split-K tickets (they count only after the GEMMs'
// pdl_wait, which waits for this grid): one graph node fewer than a memset.
constexpr int kSplitThreads = 512, kSplitHold = 6;
template <bool kF16, bool kVec, bool kWg = false>
__global__ void __launch_bounds__(kSplitThreads) split_rows_kernel(const float* x, int64_t ldx, int k, uint16_t* hi,
                                                                   uint16_t* lo, float* xscale, int* tickets,
                                                                   int ntickets) {
  M3_TL_MARK(linear_split, int(blockIdx.x), 0);
  pdl_launch_dependents();  // the GEMM's CTAs may start streaming weights
  pdl_wait();               // x (and, through the chain, the last call's tickets) are final
  M3_TL_MARK(linear_split, int(blockIdx.x), 1);
  constexpr int kStride = 4 * kSplitThreads;
  const int tid = int(threadIdx.x);
  if (blockIdx.x == 0)
    for (int i = tid; i < ntickets; i += kSplitThreads) tickets[i] = 0;
  const float* xr = x + int64_t(blockIdx.x) * ldx;
  uint16_t* hr = hi + int64_t(blockIdx.x) * k;
  uint16_t* lr = lo + int64_t(blockIdx.x) * k;
  auto load4 = [&](int c) {
    if constexpr (kVec) return *reinterpret_cast<const float4*>(xr + c);
    else return make_float4(xr[c], xr[c + 1], xr[c + 2], xr[c + 3]);
  };
  auto max4 = [](float4 v) { return fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))); };
  const bool hold = k <= kSplitHold * kStride;
  float4 v[kSplitHold];
  if (hold) {
#pragma unroll
    for (int j = 0; j < kSplitHold; ++j) {
      const int c = 4 * tid + j * kStride;
      v[j] = c < k ? load4(c) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);  // zeros leave the maximum as it is
    }
  }
  float mul = 1.0f;
  if constexpr (kF16) {
    float amax = 0.0f;
    if (hold) {
#pragma unroll
      for (int j = 0; j < kSplitHold; ++j) amax = fmaxf(amax, max4(v[j]));
    } else {
      for (int c = 4 * tid; c < k; c += kStride) amax = fmaxf(amax, max4(load4(c)));
    }
    amax = cta_amax(amax, kSplitThreads / 32);
    int e = 0;
    if (amax > 0.0f && amax <= 3.0e38f) {  // zero, inf or NaN rows keep scale 1 (and propagate)
      int ex = 0;
      frexpf(amax, &ex);  // amax in [2^(ex-1), 2^ex): |x * 2^(15-ex)| < 2^15
      e = max(-126, min(126, 15 - ex));
    }
    mul = ldexpf(1.0f, e);
    if (tid == 0) xscale[blockIdx.x] = ldexpf(1.0f, -e);
  }
  M3_TL_MARK(linear_split, int(blockIdx.x), 2);
  if (hold) {
#pragma unroll
    for (int j = 0; j < kSplitHold; ++j) {
      const int c = 4 * tid + j * kStride;
      if (c < k) split4<kF16, kWg>(v[j], mul, hr, lr, c);
    }
  } else {
    for (int c = 4 * tid; c < k; c += kStride) split4<kF16, kWg>(load4(c), mul, hr, lr, c);
  }
  M3_TL_MARK(linear_split, int(blockIdx.x), 3);
  M3_TL_FINISH(linear_split, int(blockIdx.x), int(gridDim.x));
}

// A CTA: 128 weight rows x kCT tokens; warps kWR (along rows) x kTW (along tokens); a warp owns
// 16 kMI weight rows x 8 kNT tokens. Narrow tiles (small M): 8 x 1 warps of 16 x 8, 16 or 32; wide tile:
// 2 x 4 warps of 64 x 32 (fewer shared-memory bytes per MMA).
// The 8- and 16-token tiles are capped at 80 registers so that three CTAs fit an SM (84 had taken
// the 16-token tile to two on every launch); the launch then chooses two or three. The 32-token
// tile is held to two (at most 128; it uses 112-116), which its rules assume (kNarrowWave).
template <WKind W, int kMI, int kNT, int kTW, int kStages>
__global__ void __launch_bounds__(32 * (128 / (16 * kMI)) * kTW, kTW == 1 && kNT <= 2 ? 3 : kTW == 1 ? 2 : 1)
    mma_linear_kernel(const __grid_constant__ GroupArgs ga) {
  constexpr int kWR = kRowsCta / (16 * kMI);
  constexpr int kThreads = 32 * kWR * kTW;
  constexpr int kCT = 8 * kNT * kTW;  // tokens per CTA
  constexpr int kWRow = w_row_bytes<W>();
  constexpr int kWBytes = kRowsCta * kWRow;
  constexpr int kSBytes = W == WKind::kFP8 ? kRowsCta * 4 : 0;
  constexpr int kXBytes = 2 * kCT * kPieceRow;
  constexpr int kStageBytes = kWBytes + kSBytes + kXBytes;
  constexpr int kEb = W == WKind::kBF16 ? 2 : 1;  // weight bytes per element
  constexpr int kWChunks = kKc * kEb / 16;        // 16-byte chunks per weight row per stage
  extern __shared__ __align__(16) unsigned char smem[];

  const int tid = int(threadIdx.x), warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  M3_TL_MARK(linear_gemm, int(blockIdx.x), 0);
  const int rb = (warp % kWR) * 16 * kMI;  // this warp's first weight row in the CTA
  const int tok0 = (warp / kWR) * 8 * kNT; // and first token row
  // This CTA's GEMM. The wide tile (prefill sizes) always runs alone: a constant index keeps its
  // parameters constant-bank operands (a dynamic one cost it 48 bytes of spills at 255 registers).
  int gi = 0;
  if constexpr (kTW == 1)
    while (gi + 1 < ga.count && int(blockIdx.x) >= ga.first_cta[gi + 1]) ++gi;
  const Args& a = ga.sub[gi];
  const int local = int(blockIdx.x) - ga.first_cta[gi];
  const int bx = local % a.gx, by = (local / a.gx) % a.gy, bz = local / (a.gx * a.gy);
  const int n0 = bx * kRowsCta, m0 = by * kCT;
  const int kst = a.k / kKc;
  const int seg0 = a.split ? bz : 0;
  const int st_begin = seg0 * a.seg_stages;
  const int st_end = a.split ? min(kst, st_begin + a.seg_stages) : kst;
  const int live_rows = min(kCT, a.m - m0);          // token rows of this CTA
  const int load_rows = (live_rows + 7) & ~7;         // whole n8 tiles (zero-filled past m)
  const int64_t wrow_bytes = int64_t(a.k) * kEb;

  // Copies per thread and stage: the chunk -> (row, 16-byte column) map is fixed at compile time.
  constexpr int kWPer = kRowsCta * kWChunks / kThreads;  // weight chunks
  constexpr int kXChunks = 2 * kCT * 8;                   // x chunks (both pieces)
  constexpr int kXPer = kXChunks >= kThreads ? kXChunks / kThreads : 1;
  static_assert(kWPer * kThreads == kRowsCta * kWChunks && (kXPer * kThreads == kXChunks || kXChunks < kThreads),
                "copy map");
  // The narrow tile (instruction-bound, few copies per thread) computes each copy's source and
  // destination once, a stage adding only its K offset; the wide tile recomputes them per stage
  // (holding its eight x sources per thread measured slower).
  constexpr bool kHoist = kTW == 1;
  const uint8_t* wsrc[kHoist ? kWPer : 1];
  uint32_t wdst[kHoist ? kWPer : 1];
  if constexpr (kHoist) {
#pragma unroll
    for (int q = 0; q < kWPer; ++q) {
      const int c = tid + q * kThreads, r = c / kWChunks, ch = c % kWChunks;
      const int n = min(n0 + r, a.n - 1);  // rows past n load row n - 1: their outputs are never stored
      wsrc[q] = a.w + int64_t(n) * wrow_bytes + ch * 16;
      wdst[q] = uint32_t(r * kWRow + ch * 16);
    }
  }
  const uint8_t* ssrc = nullptr;  // FP8: this thread's scale row (threads < 128)
  if constexpr (W == WKind::kFP8) {
    if (tid < kRowsCta) ssrc = a.ws + int64_t(min(n0 + tid, a.n - 1)) * (a.k / 32);
  }
  const uint16_t* xsrc[kHoist ? kXPer : 1];
  uint32_t xdst[kHoist ? kXPer : 1], xbytes[kHoist ? kXPer : 1];
  uint32_t xmask = 0;  // bit q: chunk q is in a loaded n8 tile
  if constexpr (kHoist) {
#pragma unroll
    for (int q = 0; q < kXPer; ++q) {
      const int c = tid + q * kThreads, part = c / (kCT * 8), r = (c / 8) % kCT, ch = c % 8;
      const bool live = r < live_rows;
      xsrc[q] = (part ? a.xlo : a.xhi) + int64_t(live ? m0 + r : 0) * a.k + ch * 8;
      xdst[q] = uint32_t(kWBytes + kSBytes + (part * kCT + r) * kPieceRow + ch * 16);
      xbytes[q] = live ? 16u : 0u;  // zero-filled past m
      if (c < kXChunks && r < load_rows) xmask |= 1u << q;
    }
  }
  const uint32_t smem0 = smem_u32(smem);
  auto load_w = [&](int st, int buf) {
    const uint32_t base = smem0 + uint32_t(buf * kStageBytes);
    const int64_t kb = int64_t(st) * kKc * kEb;
#pragma unroll
    for (int q = 0; q < kWPer; ++q) {
      if constexpr (kHoist) {
        cp_async16_w(base + wdst[q], wsrc[q] + kb);
      } else {
        const int c = tid + q * kThreads, r = c / kWChunks, ch = c % kWChunks;
        const int n = min(n0 + r, a.n - 1);
        cp_async16_w(base + uint32_t(r * kWRow + ch * 16), a.w + int64_t(n) * wrow_bytes + ch * 16 + kb);
      }
    }
    if constexpr (W == WKind::kFP8) {
      // The 4 scale bytes of the 128-wide K window holding this stage (two stages share them).
      if (tid < kRowsCta) cp_async4(base + kWBytes + tid * 4, ssrc + (st / 2) * 4);
    }
  };
  auto load_x = [&](int st, int buf) {
    const uint32_t base = smem0 + uint32_t(buf * kStageBytes);
    const int k0 = st * kKc;
#pragma unroll
    for (int q = 0; q < kXPer; ++q) {
      if constexpr (kHoist) {
        if (xmask >> q & 1u) cp_async16(base + xdst[q], xsrc[q] + k0, xbytes[q]);
      } else {
        const int c = tid + q * kThreads, part = c / (kCT * 8), r = (c / 8) % kCT, ch = c % 8;
        if (r < load_rows) {  // whole n8 tiles; zero-filled past m
          const bool live = r < live_rows;
          const uint16_t* src = (part ? a.xlo : a.xhi) + int64_t(live ? m0 + r : 0) * a.k + k0 + ch * 8;
          cp_async16(base + uint32_t(kWBytes + kSBytes + (part * kCT + r) * kPieceRow + ch * 16), src, live ? 16u : 0u);
        }
      }
    }
  };

  // Weights do not depend on the previous kernel (the x split): their first stages stream while it
  // finishes (programmatic dependent launch), then x follows.
  for (int d = 0; d < kStages - 1; ++d)
    if (st_begin + d < st_end) load_w(st_begin + d, d);

  // Each FP8 row's largest scale byte: the block scales enter the f16 weights relative to it.
  uint32_t ref[2] = {0, 0};  // byte i: m16 tile i's row g (ref[0]) or g + 8 (ref[1])
  if constexpr (W == WKind::kFP8) {
    int r[2 * kMI];  // q = 2 i + h: row rb + 16 i + 8 h + g
    if (a.wref != nullptr) {  // the load-time reference (LinearWeight::scale_max)
#pragma unroll
      for (int q = 0; q < 2 * kMI; ++q) r[q] = __ldg(a.wref + min(n0 + rb + 8 * q + g, a.n - 1));
    } else {
      const uint32_t* s32 = reinterpret_cast<const uint32_t*>(a.ws);
      const uint32_t* rows[2 * kMI];
#pragma unroll
      for (int q = 0; q < 2 * kMI; ++q) rows[q] = s32 + int64_t(min(n0 + rb + 8 * q + g, a.n - 1)) * (a.k / 128);
      rows_max_byte<2 * kMI, 16 / kMI>(rows, a.k / 128, t, r);
    }
#pragma unroll
    for (int q = 0; q < 2 * kMI; ++q) ref[q & 1] |= uint32_t(r[q]) << (8 * (q >> 1));
  }

  M3_TL_MARK(linear_gemm, int(blockIdx.x), 1);
  pdl_wait();
  M3_TL_MARK(linear_gemm, int(blockIdx.x), 2);
  for (int d = 0; d < kStages - 1; ++d) {
    if (st_begin + d < st_end) load_x(st_begin + d, d);
    cp_async_commit();  // group d: stage d's x (group 0 also holds every prologue weight stage)
  }

  // acc: the current K segment; tot: the segments so far, added in order.
  float acc[kMI][kNT][4], tot[kMI][kNT][4];
  // each_frag calls f(i, j, e) for every accumulator element of this thread.
  auto each_frag = [&](auto&& f) {
#pragma unroll
    for (int i = 0; i < kMI; ++i)
#pragma unroll
      for (int j = 0; j < kNT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) f(i, j, e);
  };
  each_frag([&](int i, int j, int e) { acc[i][j][e] = tot[i][j][e] = 0.0f; });
  bool first = true;
  // The final value of an output: the weight row's and the x row's powers of two.
  auto scaled = [&](float v, int i, int h, int tok) {
    if constexpr (W == WKind::kFP8) v = v * ldexpf(1.0f, int((ref[h] >> (8 * i)) & 0xffu) - 127);
    if (a.xscale) v = v * __ldcg(a.xscale + tok);  // the split's, written after this launch: no ld.global.nc
    return v;
  };

  int buf = 0, nbuf = kStages - 1;  // the buffer of stage st and of stage st + kStages - 1
  int seg_left = a.seg_stages;      // stages left in the current K segment (st_begin starts one)
  for (int st = st_begin; st < st_end; ++st) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // stage st visible to all; all warps are done with the buffer refilled below
    if (st == st_begin) M3_TL_MARK(linear_gemm, int(blockIdx.x), 3);
    const int nx = st + kStages - 1;
    if (nx < st_end) {
      load_w(nx, nbuf);
      load_x(nx, nbuf);
    }
    cp_async_commit();
    const unsigned char* base = smem + size_t(buf) * kStageBytes;
    buf = buf + 1 == kStages ? 0 : buf + 1;
    nbuf = nbuf + 1 == kStages ? 0 : nbuf + 1;
    const unsigned char* xs = base + kWBytes + kSBytes;

    __half2 ml[kMI], mh[kMI];
    if constexpr (W == WKind::kFP8) {
      const int sh = 8 * (2 * (st & 1) + (t >> 1));  // this lane's 32-wide block in the 128-wide window
      const uint32_t* sc = reinterpret_cast<const uint32_t*>(base + kWBytes);
#pragma unroll
      for (int i = 0; i < kMI; ++i) {
        const int rlo = rb + 16 * i + g;
        ml[i] = pow2_h2(int((sc[rlo] >> sh) & 0xffu) - int((ref[0] >> (8 * i)) & 0xffu));
        mh[i] = pow2_h2(int((sc[rlo + 8] >> sh) & 0xffu) - int((ref[1] >> (8 * i)) & 0xffu));
      }
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {  // MMA steps 2 half, 2 half + 1
      uint32_t af[kMI][2][4];
#pragma unroll
      for (int i = 0; i < kMI; ++i) {
        const int rlo = rb + 16 * i + g;
        if constexpr (W == WKind::kBF16) {
          const uint4 l = *reinterpret_cast<const uint4*>(base + rlo * kWRow + 32 * t + 16 * half);
          const uint4 h = *reinterpret_cast<const uint4*>(base + (rlo + 8) * kWRow + 32 * t + 16 * half);
#pragma unroll
          for (int s2 = 0; s2 < 2; ++s2) {
            af[i][s2][0] = word_of(l, 2 * s2);
            af[i][s2][1] = word_of(h, 2 * s2);
            af[i][s2][2] = word_of(l, 2 * s2 + 1);
            af[i][s2][3] = word_of(h, 2 * s2 + 1);
          }
        } else {
          const uint2 l = *reinterpret_cast<const uint2*>(base + rlo * kWRow + 16 * t + 8 * half);
          const uint2 h = *reinterpret_cast<const uint2*>(base + (rlo + 8) * kWRow + 16 * t + 8 * half);
#pragma unroll
          for (int s2 = 0; s2 < 2; ++s2) {
            const uint32_t wl = s2 ? l.y : l.x, wh = s2 ? h.y : h.x;
            af[i][s2][0] = e4m3x2_scaled(wl, ml[i]);
            af[i][s2][1] = e4m3x2_scaled(wh, mh[i]);
            af[i][s2][2] = e4m3x2_scaled<true>(wl, ml[i]);
            af[i][s2][3] = e4m3x2_scaled<true>(wh, mh[i]);
          }
        }
      }
      // Per live n8 tile: both pieces, then the MMAs; for one accumulator the hi MMA precedes the lo
      // MMA of the same step, with the other m16 tiles' MMAs between them.
#pragma unroll
      for (int j = 0; j < kNT; ++j) {
        if (tok0 + 8 * j < live_rows) {  // warp-uniform: n8 tiles without tokens are skipped
          const unsigned char* xh = xs + (tok0 + 8 * j + g) * kPieceRow + 32 * t + 16 * half;
          const uint4 bh = *reinterpret_cast<const uint4*>(xh);
          const uint4 bl = *reinterpret_cast<const uint4*>(xh + kCT * kPieceRow);
#pragma unroll
          for (int s2 = 0; s2 < 2; ++s2) {
#pragma unroll
            for (int i = 0; i < kMI; ++i) mma<W>(acc[i][j], af[i][s2], word_of(bh, 2 * s2), word_of(bh, 2 * s2 + 1));
#pragma unroll
            for (int i = 0; i < kMI; ++i) mma<W>(acc[i][j], af[i][s2], word_of(bl, 2 * s2), word_of(bl, 2 * s2 + 1));
          }
        }
      }
    }
    if (--seg_left == 0 || st + 1 == st_end) {  // end of a K segment: fold in order
      seg_left = a.seg_stages;
      each_frag([&](int i, int j, int e) {
        tot[i][j][e] = first ? acc[i][j][e] : tot[i][j][e] + acc[i][j][e];
        acc[i][j][e] = 0.0f;
      });
      first = false;
    }
  }
  cp_async_wait<0>();
  M3_TL_MARK(linear_gemm, int(blockIdx.x), 4);

  // Epilogue. Fragment (i, j): e = 0, 1: weight row rlo, tokens 2t, 2t + 1; e = 2, 3: row rlo + 8.
  // each_out calls f(i, j, e, tok, n) for this thread's outputs that exist.
  auto each_out = [&](auto&& f) {
    each_frag([&](int i, int j, int e) {
      const int tok = m0 + tok0 + 8 * j + 2 * t + (e & 1);
      const int n = n0 + rb + 16 * i + 8 * (e >> 1) + g;
      if (tok < a.m && n < a.n) f(i, j, e, tok, n);
    });
  };
  auto finish = [&](float v, int i, int h, int tok, int n) { a.y[int64_t(tok) * a.ldy + n] = scaled(v, i, h, tok); };
  if (!a.split) {
    each_out([&](int i, int j, int e, int tok, int n) { finish(tot[i][j][e], i, e >> 1, tok, n); });
    M3_TL_MARK(linear_gemm, int(blockIdx.x), 6);
    M3_TL_FINISH(linear_gemm, int(blockIdx.x), int(gridDim.x));
    return;
  }
  // Split: this segment's partial, then the tile's last CTA adds all of them in segment order.
  each_out([&](int i, int j, int e, int tok, int n) {
    a.partial[(int64_t(seg0) * a.m + tok) * a.n + n] = tot[i][j][e];
  });
  __threadfence();
  __syncthreads();
  __shared__ int last;
  int* ticket = a.tickets + bx + int64_t(a.gx) * by;
  if (tid == 0) last = atomicAdd(ticket, 1) == a.nseg - 1;
  __syncthreads();
  M3_TL_MARK(linear_gemm, int(blockIdx.x), 5);
  if (!last) {
    M3_TL_FINISH(linear_gemm, int(blockIdx.x), int(gridDim.x));
    return;
  }
  __threadfence();
  each_out([&](int i, int, int e, int tok, int n) {
    // The partials' loads go out 8 at a time (one L2 round trip per 8; k/v projections, 24
    // segments: 192 -> 120 us at 128 rows), added in segment order. The 32-token BF16 tile keeps
    // an unrolled loop (7 trailing loads serial): the batched form costs its main loop ~60 register
    // moves per stage in SASS (LM head at 32 rows 4 % slower), and it rarely splits.
    const float* p = a.partial + int64_t(tok) * a.n + n;
    const int64_t stride = int64_t(a.m) * a.n;
    float v = __ldcg(p);
    if constexpr (W == WKind::kBF16 && kNT == 4) {
#pragma unroll 8
      for (int s = 1; s < a.nseg; ++s) v = v + __ldcg(p + s * stride);
    } else {
      for (int s0 = 1; s0 < a.nseg; s0 += 8) {
        float part[8];
#pragma unroll
        for (int b = 0; b < 8; ++b) part[b] = s0 + b < a.nseg ? __ldcg(p + (s0 + b) * stride) : 0.0f;
#pragma unroll
        for (int b = 0; b < 8; ++b)
          if (s0 + b < a.nseg) v = v + part[b];
      }
    }
    finish(v, i, e >> 1, tok, n);
  });
  M3_TL_MARK(linear_gemm, int(blockIdx.x), 6);
  M3_TL_FINISH(linear_gemm, int(blockIdx.x), int(gridDim.x));
}

// The fixed K split: a function of N and K only.
struct Plan {
  int seg_stages, nseg;
};
Plan k_plan(int64_t n, int64_t k) {
  const int64_t kst = k / kKc, nt = (n + kRowsCta - 1) / kRowsCta;
  // Segments per output tile rounded down: a GEMM's CTAs stay within two per SM. Rounding up
  // (q_proj 320 CTAs, o_proj 288: a third CTA on some SMs) measured 6-15 % slower at one token.
  // Narrow outputs keep segments of at least kMinSegStages stages (docs/linear_kernels.md).
  int64_t s = std::min<int64_t>(std::max<int64_t>(1, kCtaTarget / nt), std::max<int64_t>(1, kst / kMinSegStages));
  s = std::max<int64_t>(1, s);
  const int64_t ss = (kst + s - 1) / s;
  return Plan{int(ss), int((kst + ss - 1) / ss)};
}

// The pieces of x [m, k] and their per-row scales.
struct SplitX {
  uint16_t* hi;
  uint16_t* lo;
  float* scale;
};
void split_x(const float* x, int64_t ldx, int64_t m, int64_t k, bool f16, bool wg, const SplitX& s, int* tickets,
             int ntickets) {
  const bool vec = ldx % 4 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0;  // k % 64 == 0 always
  auto kernel = wg ? (f16 ? (vec ? split_rows_kernel<true, true, true> : split_rows_kernel<true, false, true>)
                         : (vec ? split_rows_kernel<false, true, true> : split_rows_kernel<false, false, true>))
                : f16 ? (vec ? split_rows_kernel<true, true> : split_rows_kernel<true, false>)
                      : (vec ? split_rows_kernel<false, true> : split_rows_kernel<false, false>);
  // A programmatic dependent of whatever wrote x: its launch overlaps that kernel's tail.
  launch_kernel(kernel, dim3(unsigned(m)), dim3(kSplitThreads), 0, true, x, ldx, int(k), s.hi, s.lo,
                f16 ? s.scale : nullptr, tickets, ntickets);
}

// Dynamic shared memory that leaves room for at most two CTAs per SM (three need less than a
// third of the SM's shared memory each): the launch's way to choose two.
size_t two_per_sm_bytes() {
  return size_t(current_device_attribute(cudaDevAttrMaxSharedMemoryPerMultiprocessor) / 3 -
                current_device_attribute(cudaDevAttrReservedSharedMemoryPerBlock) + 1024);
}

template <WKind W, int kMI, int kNT, int kTW, int kStages>
size_t launch_smem(int per_sm) {
  constexpr size_t bytes = smem_bytes<W, 8 * kNT * kTW, kStages>();
  auto kernel = mma_linear_kernel<W, kMI, kNT, kTW, kStages>;
  if constexpr (kTW == 1 && kNT <= 2) {
    const size_t two = std::max(bytes, two_per_sm_bytes());
    allow_dynamic_smem(reinterpret_cast<const void*>(kernel), two);  // the larger size, once
    return per_sm == 2 ? two : bytes;
  } else {
    allow_dynamic_smem(reinterpret_cast<const void*>(kernel), bytes);
    return bytes;
  }
}

// per_sm: 2 pads the 8- or 16-token tile's shared memory so that two CTAs run per SM (0 or 3: as
// many as fit).
template <WKind W, int kMI, int kNT, int kTW, int kStages>
void launch(const GroupArgs& ga, int per_sm) {
  auto kernel = mma_linear_kernel<W, kMI, kNT, kTW, kStages>;
  const size_t bytes = launch_smem<W, kMI, kNT, kTW, kStages>(per_sm);
  // A programmatic dependent of the x split (or of the GEMM launch before it over the same split).
  launch_kernel(kernel, dim3(unsigned(ga.first_cta[ga.count])), dim3(32 * (kRowsCta / (16 * kMI)) * kTW), bytes, true,
                ga);
}

// Tokens per CTA of the mma.sync tiles (the bits do not depend on it). Narrow tiles (8 warps of
// 16 weight rows) for decode batches: 8 tokens up to 8 rows, 16 up to 16; from 17 to 32 rows one
// 32-token tile when the weights are far larger than L2 (an LM head: one weight read instead of
// two, 1400 -> 834 us at 32 rows), else two 16-token tiles (L2-resident second read, twice the
// CTAs: faster for the layer's own linears); 32-token tiles up to rule.narrow_max_rows. The wide
// tile (2 x 4 warps of 64 rows x 32 tokens) beyond.
constexpr int64_t kSms = 132, kNarrowWave = 2 * kSms;  // H100 / H200 SMs; 32-token tiles run two per SM
int tokens_per_cta(int64_t m, int64_t wbytes, const MmaLinearRule& rule) {
  const bool big = wbytes > (int64_t(128) << 20);
  if (m > (big ? 32 : rule.narrow_max_rows)) return 128;
  if (m > 32) return 32;
  if (m <= 8) return 8;
  if (m <= 16 || !big) return 16;
  return 32;
}

// One GEMM of a call, its scratch allocated before the x split (which zeroes its tickets) is
// launched, so that the split and the GEMM launches stay adjacent kernels in the stream.
struct Gemm {
  Args a{};
  int64_t ctas = 0;
  bool fp8 = false;
  int ct = 0;  // tokens per CTA
  bool wg = false, wg_overlap = false;  // the wgmma kernel, and its form
  Gemm(int64_t m, const ops::LinearWeight& w, float* y, int64_t ldy, bool wgmma, const MmaLinearRule& rule) {
    const int64_t n = w.out_features(), k = w.in_features();
    fp8 = w.data.dtype == DType::kF8E4M3;
    const MmaLinearPlan plan = mma_linear_plan(m, n, k, w.data.dtype, wgmma, rule);
    wg = plan.kernel == MmaLinearKernel::kWgmma;
    wg_overlap = wg && plan.overlap;
    // The grid is 1-D (fire() bounds its CTA count); rows and tiles are ints in the kernel.
    if (m > INT32_MAX) throw std::runtime_error("linear.mma_hilo_invariant.sm90: too many rows (" + std::to_string(m) + ")");
    ct = plan.tokens_per_cta;
    per_sm_rule = rule.narrow_ctas_per_sm;
    a.w = static_cast<const uint8_t*>(w.data.data);
    a.ws = fp8 ? static_cast<const uint8_t*>(w.scale.data) : nullptr;
    a.wref = fp8 ? static_cast<const uint8_t*>(w.scale_max.data) : nullptr;
    a.y = y;
    a.ldy = ldy;
    a.m = int(m);
    a.n = int(n);
    a.k = int(k);
    a.seg_stages = plan.seg_stages;
    a.nseg = plan.nseg;
    a.split = plan.split;
    a.gx = int(plan.grid_x);
    a.gy = int(plan.grid_y);
    ctas = plan.grid_x * plan.grid_y * plan.grid_z;
    if (a.split) {
      partial_bytes = size_t(plan.nseg) * size_t(m) * size_t(n) * 4;
      ticket_count = size_t(plan.grid_x * plan.grid_y);
    }
  }
  size_t partial_bytes = 0, ticket_count = 0;
  int per_sm_rule = 0;  // MmaLinearRule::narrow_ctas_per_sm
};

// One launch for GEMMs [0, count) of the same weight type and token tile.
void fire(Gemm* const* gs, int count, const SplitX& xs) {
  GroupArgs ga{};
  ga.count = count;
  int64_t ctas = 0;
  for (int i = 0; i < count; ++i) {
    Args& a = ga.sub[i] = gs[i]->a;
    a.xhi = xs.hi;
    a.xlo = xs.lo;
    a.xscale = gs[i]->fp8 ? xs.scale : nullptr;
    ga.first_cta[i] = int(ctas);
    ctas += gs[i]->ctas;
  }
  if (ctas > INT32_MAX) throw std::runtime_error("linear.mma_hilo_invariant.sm90: problem too large");
  ga.first_cta[count] = int(ctas);
  // Token tile (the bits do not depend on it): see tokens_per_cta().
  const int ct = gs[0]->ct;
  const int per_sm = ct <= 16 ? narrow_ctas_per_sm(ctas, gs[0]->per_sm_rule) : 0;
  if (gs[0]->fp8) {
    if (ct == 128) launch<WKind::kFP8, 4, 4, 4, 4>(ga, 0);
    else if (ct == 8) launch<WKind::kFP8, 1, 1, 1, 4>(ga, per_sm);
    else if (ct == 16) launch<WKind::kFP8, 1, 2, 1, 4>(ga, per_sm);
    else launch<WKind::kFP8, 1, 4, 1, 4>(ga, 0);
  } else {
    if (ct == 128) launch<WKind::kBF16, 4, 4, 4, 3>(ga, 0);
    else if (ct == 8) launch<WKind::kBF16, 1, 1, 1, 4>(ga, per_sm);
    else if (ct == 16) launch<WKind::kBF16, 1, 2, 1, 4>(ga, per_sm);
    else launch<WKind::kBF16, 1, 4, 1, 4>(ga, 0);
  }
}

void check_weight(const ops::LinearWeight& w) {
  const std::string why = mma_linear_eligible(w.data.dtype, w.out_features(), w.in_features());
  if (!why.empty()) throw std::runtime_error("linear.mma_hilo_invariant.sm90: " + why);
}

}  // namespace

const char* mma_linear_kernel_name(MmaLinearKernel k) {
  switch (k) {
    case MmaLinearKernel::kNarrow: return "narrow";
    case MmaLinearKernel::kWide: return "wide";
    case MmaLinearKernel::kWgmma: return "wgmma";
  }
  return "?";
}

std::string mma_linear_tile_text(const MmaLinearPlan& p) {
  return std::string(mma_linear_kernel_name(p.kernel)) + (p.overlap ? " overlapped " : " ") +
         (p.kernel == MmaLinearKernel::kWgmma ? "128 x 128" : std::to_string(p.tokens_per_cta) + "-token") + " tiles";
}

std::string mma_linear_plan_text(const MmaLinearPlan& p) {
  std::string s = mma_linear_tile_text(p) + " x " + std::to_string(p.grid_x) + " x " + std::to_string(p.grid_y) + ", K in " +
                  std::to_string(p.nseg) + " segment" + (p.nseg == 1 ? "" : "s") + " of " + std::to_string(p.seg_stages) +
                  " x 64";
  if (p.split) s += p.kernel == MmaLinearKernel::kWgmma ? " as separate work items" : " on separate CTAs";
  if (p.ctas_per_sm > 0) s += ", " + std::to_string(p.ctas_per_sm) + " CTAs per SM";
  return s;
}

MmaLinearPlan mma_linear_plan(int64_t m, int64_t n, int64_t k, DType dtype, bool wgmma, const MmaLinearRule& rule) {
  MmaLinearPlan p;
  const Plan kp = k_plan(n, k);
  p.seg_stages = kp.seg_stages;
  p.nseg = kp.nseg;
  static_assert(kRowsCta == kWgLinearTileRows, "grid_x counts the weight tiles of both kernels");
  p.grid_x = (n + kRowsCta - 1) / kRowsCta;
  const bool wide_weight =
      n >= rule.wgmma_wide_n && m >= (dtype == DType::kBF16 ? rule.wgmma_bf16_wide_min_rows : rule.wgmma_wide_min_rows);
  // BF16 weights (the LM head) in the overlapped form only (their kernel has no other).
  const bool wg_type = dtype == DType::kF8E4M3 || (dtype == DType::kBF16 && rule.wgmma_bf16 && rule.wgmma_overlap);
  if (wgmma && wg_type && (m >= rule.wgmma_min_rows || wide_weight)) {
    // 128 x 128 tiles walked by persistent CTAs; K segments as work items of their own (the
    // overlapped form with wgmma_split only) when the tiles alone leave SMs idle.
    p.kernel = MmaLinearKernel::kWgmma;
    p.tokens_per_cta = kWgLinearTileTokens;
    p.grid_y = (m + kWgLinearTileTokens - 1) / kWgLinearTileTokens;
    p.overlap = rule.wgmma_overlap;
    p.split = p.overlap && rule.wgmma_split && p.nseg > 1 && p.grid_x * p.grid_y < kSms && m <= kSplitMaxRows;
    p.grid_z = p.split ? p.nseg : 1;
    return p;
  }
  p.tokens_per_cta = tokens_per_cta(m, n * k * (dtype == DType::kF8E4M3 ? 1 : 2), rule);
  p.kernel = p.tokens_per_cta == 128 ? MmaLinearKernel::kWide : MmaLinearKernel::kNarrow;
  p.grid_y = (m + p.tokens_per_cta - 1) / p.tokens_per_cta;
  // K segments in separate CTAs when the tiles alone leave SMs idle: fewer tiles than SMs, or (32-token
  // tiles past 128 rows, two CTAs per SM) a last wave under rule.split_fill percent full.
  const int64_t tiles = p.grid_x * p.grid_y, slots = (tiles + kNarrowWave - 1) / kNarrowWave * kNarrowWave;
  const bool ragged = p.tokens_per_cta == 32 && m > 128 && tiles * 100 < slots * rule.split_fill;
  p.split = p.nseg > 1 && (tiles < kSms || ragged) && m <= kSplitMaxRows;
  p.grid_z = p.split ? p.nseg : 1;
  // (BF16 weights: their rings fit two per SM whatever the rule says.)
  if (p.tokens_per_cta <= 16 && dtype == DType::kF8E4M3) p.ctas_per_sm = narrow_ctas_per_sm(p.grid_x * p.grid_y * p.grid_z, rule.narrow_ctas_per_sm);
  return p;
}

int narrow_ctas_per_sm(int64_t ctas, int rule) {
  if (rule == 2 || rule == 3) return rule;
  // Up to one wave of two per SM, two: allowed three, the launch packed them onto fewer SMs.
  if (ctas <= 2 * kSms) return 2;
  // The fill of the last wave at o per SM, compared as ctas / (waves(o) * o): the larger wins.
  auto slots = [&](int64_t o) { return (ctas + o * kSms - 1) / (o * kSms) * o * kSms; };
  return slots(2) < slots(3) ? 2 : 3;
}

int narrow_occupancy_check(int tokens_per_cta, bool fp8, int per_sm) {
  auto check = [&](auto kernel, size_t bytes) {
    int n = 0;
    M3_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, 256, bytes));
    return n;
  };
  if (tokens_per_cta == 32) {
    if (fp8) return check(mma_linear_kernel<WKind::kFP8, 1, 4, 1, 4>, launch_smem<WKind::kFP8, 1, 4, 1, 4>(0));
    return check(mma_linear_kernel<WKind::kBF16, 1, 4, 1, 4>, launch_smem<WKind::kBF16, 1, 4, 1, 4>(0));
  }
  if (tokens_per_cta == 8) {
    if (fp8) return check(mma_linear_kernel<WKind::kFP8, 1, 1, 1, 4>, launch_smem<WKind::kFP8, 1, 1, 1, 4>(per_sm));
    return check(mma_linear_kernel<WKind::kBF16, 1, 1, 1, 4>, launch_smem<WKind::kBF16, 1, 1, 1, 4>(per_sm));
  }
  if (fp8) return check(mma_linear_kernel<WKind::kFP8, 1, 2, 1, 4>, launch_smem<WKind::kFP8, 1, 2, 1, 4>(per_sm));
  return check(mma_linear_kernel<WKind::kBF16, 1, 2, 1, 4>, launch_smem<WKind::kBF16, 1, 2, 1, 4>(per_sm));
}

MmaLinearRule mma_group_rule() {
  MmaLinearRule r;
  r.wgmma_wide_min_rows = r.wgmma_bf16_wide_min_rows = int64_t(1) << 62;
  return r;
}

std::string mma_linear_eligible(DType dtype, int64_t n, int64_t k) {
  if (dtype != DType::kBF16 && dtype != DType::kF8E4M3) return "BF16 or MXFP8 weights only";
  if (k < kMinK) return "in_features < 1024 (small layers keep the exact fp32 row-dot)";
  if (k % (dtype == DType::kF8E4M3 ? 128 : kKc) != 0) {
    return dtype == DType::kF8E4M3 ? "MXFP8 in_features must be a multiple of 128" : "BF16 in_features must be a multiple of 64";
  }
  if (n < 1 || n > (int64_t(1) << 30) || k > (int64_t(1) << 30)) return "out/in features out of range";
  return "";
}

namespace {

// Workspace of decode-sized calls (64 MB: M3's linears up to 256 rows, split partials included),
// so that a captured step has no alloc and free nodes around every linear. Two calls never
// overlap on it: the split touches it only after its pdl_wait (every earlier kernel, the previous
// call's GEMMs included, has completed: each kernel of the chain waits for the one before it) and
// the GEMMs are dependents of the split (the wgmma kernel a plain successor).
__device__ __align__(256) uint4 g_linear_workspace[(size_t(64) << 20) / 16];

// One workspace per call (x pieces, scales, the GEMMs' partials and tickets), the split (zeroing
// the tickets), then one launch per run of GEMMs with the same weight type and narrow token tile
// (at most kMaxGroup each; wide tiles one per GEMM), back to back, each a programmatic dependent
// of the kernel before.
void run(const float* x, int64_t ldx, int64_t m, int64_t k, bool f16, Gemm* const* gemms, int count) {
  // The wgmma kernel takes the x pieces in wg_col order, so one call's GEMMs share one kernel
  // (groups of weights plan without the wide-weight path: mma_group_rule).
  const bool wg = gemms[0]->wg;
  for (int i = 1; i < count; ++i) {
    if (gemms[i]->wg != wg) throw std::runtime_error("linear.mma_hilo_invariant.sm90: a group mixes wgmma and mma.sync GEMMs");
  }
  auto up = [](size_t b) { return (b + 255) / 256 * 256; };
  const size_t piece = up(size_t(m * k) * 2), scale = up(size_t(m) * 4);
  size_t bytes = 2 * piece + scale, tickets = 0;
  for (int i = 0; i < count; ++i) {
    bytes += up(gemms[i]->partial_bytes);
    tickets += gemms[i]->ticket_count;
  }
  static FixedScratch buf_of(g_linear_workspace);
  Scratch buf(bytes + tickets * 4, buf_of);
  unsigned char* p = buf.as<unsigned char>();
  const SplitX xs{reinterpret_cast<uint16_t*>(p), reinterpret_cast<uint16_t*>(p + piece),
                  reinterpret_cast<float*>(p + 2 * piece)};
  size_t off = 2 * piece + scale;
  int* tk = reinterpret_cast<int*>(p + bytes);
  for (int i = 0; i < count; ++i) {
    if (gemms[i]->a.split) {
      gemms[i]->a.partial = reinterpret_cast<float*>(p + off);
      gemms[i]->a.tickets = tk;
      tk += gemms[i]->ticket_count;
    }
    off += up(gemms[i]->partial_bytes);
  }
  split_x(x, ldx, m, k, f16, wg, xs, reinterpret_cast<int*>(p + bytes), int(tickets));
  if (wg) {
    for (int i = 0; i < count; ++i) {
      const Args& a = gemms[i]->a;
      WgLinearArgs wa{xs.hi, xs.lo, f16 ? xs.scale : nullptr, a.w, a.ws, a.wref, a.y, a.ldy, a.m, a.n, a.k, a.seg_stages,
                      gemms[i]->wg_overlap, a.split ? a.nseg : 1, a.partial, a.tickets};
      wa.bf16 = !f16;
      launch_linear_wgmma(wa);
    }
    return;
  }
  for (int i = 0; i < count;) {
    int j = i + 1;
    while (j < count && j - i < kMaxGroup && gemms[i]->ct != 128 && gemms[j]->fp8 == gemms[i]->fp8 &&
           gemms[j]->ct == gemms[i]->ct)
      ++j;
    fire(gemms + i, j - i, xs);
    i = j;
  }
}

}  // namespace

void mma_linear(const float* x, int64_t ldx, int64_t m, const ops::LinearWeight& w, float* y, int64_t ldy, bool wgmma,
                const MmaLinearRule& rule) {
  check_weight(w);
  if (m == 0 || w.out_features() == 0) return;
  Gemm g(m, w, y, ldy, wgmma, rule);
  Gemm* gs[1] = {&g};
  run(x, ldx, m, w.in_features(), w.data.dtype == DType::kF8E4M3, gs, 1);
}

void mma_linear_group(const float* x, int64_t ldx, int64_t m, const ops::LinearWeight* const* w, float* const* y,
                      const int64_t* ldy, int count, bool wgmma, const MmaLinearRule& rule) {
  if (count < 1) return;
  for (int i = 0; i < count; ++i) {
    check_weight(*w[i]);
    if (w[i]->data.dtype != w[0]->data.dtype || w[i]->in_features() != w[0]->in_features()) {
      throw std::runtime_error("linear.mma_hilo_invariant.sm90: grouped weights differ in type or in_features");
    }
  }
  if (m == 0) return;
  std::vector<Gemm> gemms;
  gemms.reserve(size_t(count));
  for (int i = 0; i < count; ++i)
    if (w[i]->out_features() > 0) gemms.emplace_back(m, *w[i], y[i], ldy[i], wgmma, rule);
  std::vector<Gemm*> gs;
  for (Gemm& g : gemms) gs.push_back(&g);
  if (gs.empty()) return;
  run(x, ldx, m, w[0]->in_features(), w[0]->data.dtype == DType::kF8E4M3, gs.data(), int(gs.size()));
}

}  // namespace m3::cuda
