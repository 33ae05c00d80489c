// The MoE router on the device: logits = x · W_router^T in fp32, sigmoid, selection by
// probability + correction bias (descending, ties to the lower id), the chosen experts'
// unbiased probabilities renormalised and scaled (the CPU reference's order of operations).
//
// The canonical logit of a (token, expert), the same bits for every token count and kernel:
// hidden is cut into 192-wide segments; a segment's partial is one fp32 FMA chain over its
// elements in ascending order, from +0; segments fold in order within groups of `spg`
// consecutive segments (at most kGroups groups), and the groups fold in order.
//   - decode (T <= kWideMin): router_seg_kernel, a CTA per (32 experts, segment, 8 or 32
//     tokens) stages its rows in shared memory and writes every segment's partial (M3: 128 CTAs
//     at one token);
//   - wide batches: router_tile_kernel, register-tiled SIMT (a thread holds 4 tokens x 4
//     experts, operands staged k-major in shared memory), a CTA per (token tile, 128 experts,
//     group) folds its group's segments itself and writes the group's partial (up to
//     kSegPartialsMax tokens a CTA per segment, writing the segment's partial). It replaced a
//     warp-per-expert kernel that re-read the router weight per 8 tokens (1.2 ms at 4096 tokens).
// router_select (launched as the logits kernel's programmatic dependent) folds the partials, then
// a warp per token: lane l holds experts l, l + 32, ..., sigmoid once per expert, top_k rounds of
// a warp argmax; weights p / sum * scale with the sum in pick order. (Selecting in the last logits
// CTA instead, to save the launch, measured slower: one CTA folding 8 tokens' partials.)
#include <cstdint>
#include <stdexcept>
#include <string>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_internal.h"
#include "backend/cuda/moe_router.h"
#include "backend/cuda/pdl.cuh"

namespace m3::cuda {
namespace {

constexpr int kSeg = 192;         // segment width (part of the reduction order; a multiple of 32)
constexpr int kGroups = 8;        // at most this many groups of segments (part of the order)
constexpr int kMaxExperts = 256;  // 8 per lane in the select kernel
constexpr int kWideMin = 256;     // above this many tokens, the tiled kernel
// Up to this many tokens the tiled kernel stores per-segment partials (H200, M3 router, T = 512:
// 51 -> 45 us; at 1024 the group partials are faster, 81 vs 89 us).
constexpr int kSegPartialsMax = 512;
constexpr int kTileK = 32;        // k per shared-memory stage of the tiled kernel
constexpr int kTileE = 128;       // experts per tiled CTA (32 threads x 4)

struct Order {
  int nseg, spg, ngroups;  // segments, segments per group, groups
};
Order order_of(int64_t hidden) {
  Order o;
  o.nseg = int((hidden + kSeg - 1) / kSeg);
  o.spg = (o.nseg + kGroups - 1) / kGroups;
  o.ngroups = (o.nseg + o.spg - 1) / o.spg;
  return o;
}

// What the selection reads and writes. partial: [nstored, tokens, experts], folded in order
// within groups of spg, then the groups.
struct SelectArgs {
  const float* partial;
  int nstored, spg;
  const float* bias;
  int tokens, experts, top_k;
  float scale;
  int32_t* ids;
  float* weights;
};

// (choice desc, id asc): is (c, i) before (bc, bi)? bi < 0 is "none yet".
__device__ __forceinline__ bool before(float c, int i, float bc, int bi) {
  return bi < 0 || c > bc || (c == bc && i < bi);
}

struct LogitsArgs {
  const float* x;
  const float* w;
  float* partial;  // seg: [nseg, tokens, experts]; tile: [ngroups, tokens, experts]
  int64_t ldx;
  int tokens, experts, k, spg;
};

// A CTA of 256 threads takes kTPC tokens: first every thread folds (token, expert) logits into
// shared memory, a pair's partials loaded 32 at a time ahead of the adds (M3 decode: one L2 round
// trip per pair, and at most one pair per thread with 2 tokens per CTA: 8 tokens in one CTA took
// 8 dependent round trips); then warp tt < kTPC selects for token tt. Wide batches (<= 8 group
// partials per pair) take 8 tokens per CTA.
constexpr int kSelThreads = 256, kFoldBatch = 32;
template <int kTPC>
__global__ void __launch_bounds__(kSelThreads) router_select_kernel(SelectArgs a) {
  constexpr int kPer = kMaxExperts / 32;
  static_assert(kTPC <= kSelThreads / 32, "a warp per token");
  __shared__ float logit_s[kTPC][kMaxExperts];
  const int lane = int(threadIdx.x) & 31, tt = int(threadIdx.x) >> 5;
  // The correction bias is a weight: loaded before the wait, off the selection's critical path.
  float bias[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) bias[i] = a.bias && lane + 32 * i < a.experts ? __ldg(a.bias + lane + 32 * i) : 0.0f;
  pdl_wait();  // the partials
  pdl_launch_dependents();
  const int t0 = int(blockIdx.x) * kTPC, nt = min(kTPC, a.tokens - t0);
  const int experts = a.experts, top_k = a.top_k;
  for (int i = int(threadIdx.x); i < nt * experts; i += kSelThreads) {
    const int tt = i / experts, e = i % experts;
    const float* src = a.partial + int64_t(t0 + tt) * experts + e;
    const int64_t stride = int64_t(a.tokens) * experts;
    // Partials fold in order within groups of spg (position `in_group`), then the groups (a
    // counter, not idx % spg: 32 unrolled integer divisions made this the block's slowest launch).
    float lg = 0.0f, gs = 0.0f;
    int in_group = 0;
    bool first_group = true;
    for (int c0 = 0; c0 < a.nstored; c0 += kFoldBatch) {
      float v[kFoldBatch];
#pragma unroll
      for (int j = 0; j < kFoldBatch; ++j) v[j] = c0 + j < a.nstored ? __ldcg(src + int64_t(c0 + j) * stride) : 0.0f;
#pragma unroll
      for (int j = 0; j < kFoldBatch; ++j) {
        const int idx = c0 + j;
        if (idx >= a.nstored) break;
        gs = in_group == 0 ? v[j] : gs + v[j];
        if (++in_group == a.spg || idx == a.nstored - 1) {
          lg = first_group ? gs : lg + gs;
          first_group = false;
          in_group = 0;
        }
      }
    }
    logit_s[tt][e] = lg;
  }
  __syncthreads();
  const int t = t0 + tt;
  if (tt >= nt) return;
  float prob[kPer], choice[kPer];
  unsigned taken = 0;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int e = lane + 32 * i;
    prob[i] = choice[i] = 0.0f;
    if (e >= experts) continue;
    prob[i] = 1.0f / (1.0f + expf(-logit_s[tt][e]));
    choice[i] = prob[i] + bias[i];
  }
  float sum = 0.0f, picked_p = 0.0f;
  int picked_id = -1;
  for (int r = 0; r < top_k; ++r) {
    float bc = 0.0f, bp = 0.0f;
    int bi = -1;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int e = lane + 32 * i;
      if (e < experts && !((taken >> i) & 1u) && before(choice[i], e, bc, bi)) {
        bc = choice[i];
        bi = e;
        bp = prob[i];
      }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      const float oc = __shfl_xor_sync(0xffffffffu, bc, off), op = __shfl_xor_sync(0xffffffffu, bp, off);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, off);
      if (oi >= 0 && before(oc, oi, bc, bi)) {
        bc = oc;
        bi = oi;
        bp = op;
      }
    }
    if (bi >= 0 && (bi & 31) == lane) taken |= 1u << (bi >> 5);
    sum += bp;  // pick order, as the reference
    if (lane == r) {
      picked_id = bi;
      picked_p = bp;
    }
  }
  if (lane < top_k) {
    a.ids[int64_t(t) * top_k + lane] = picked_id;
    a.weights[int64_t(t) * top_k + lane] = picked_p / sum * a.scale;
  }
}

// CTA (32 experts from 32 blockIdx.x, segment blockIdx.y, kTok tokens from kTok blockIdx.z): the
// experts' segment rows and the tokens' segment of x are staged in shared memory with coalesced
// loads (M3 at one token: 4 x 32 CTAs of 24 KB), then thread (token group tid / 32, expert
// tid % 32) runs the chains of its kTok / 4 tokens from there (rows padded to 196 floats:
// conflict-free float4 reads). kTok 8 at decode, 32 past 32 tokens (a quarter of the weight
// re-reads).
constexpr int kSegExperts = 32, kSegThreads = 128, kSegRow = kSeg + 4;
// rows x (4 q4) floats of src (row stride ld) into dst's rows, every load issued before the first
// store: one memory round trip per CTA (a strided loop unrolled by 4 made it three to four).
template <int kPer>
__device__ __forceinline__ void stage_rows(float (*dst)[kSegRow], const float* src, int64_t ld, int rows, int q4, int tid) {
  float4 v[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int f = tid + kSegThreads * i, r = f / q4, c = 4 * (f % q4);
    if (r < rows) v[i] = __ldg(reinterpret_cast<const float4*>(src + int64_t(r) * ld + c));
  }
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int f = tid + kSegThreads * i, r = f / q4, c = 4 * (f % q4);
    if (r < rows) *reinterpret_cast<float4*>(&dst[r][c]) = v[i];
  }
}
template <int kTok>
__global__ void __launch_bounds__(kSegThreads) router_seg_kernel(LogitsArgs a) {
  constexpr int kPer = kTok / (kSegThreads / kSegExperts);  // tokens per thread
  __shared__ __align__(16) float ws[kSegExperts][kSegRow];
  __shared__ __align__(16) float xs[kTok][kSegRow];
  pdl_launch_dependents();
  const int tid = int(threadIdx.x);
  const int e0 = int(blockIdx.x) * kSegExperts, s = int(blockIdx.y), t0 = int(blockIdx.z) * kTok;
  const int k_begin = s * kSeg, len = min(a.k - k_begin, kSeg);  // a multiple of 4
  const int ne = min(kSegExperts, a.experts - e0), nt = min(kTok, a.tokens - t0);
  const int q4 = len / 4;
  stage_rows<kSegExperts * (kSeg / 4) / kSegThreads>(ws, a.w + int64_t(e0) * a.k + k_begin, a.k, ne, q4, tid);
  stage_rows<kTok * (kSeg / 4) / kSegThreads>(xs, a.x + int64_t(t0) * a.ldx + k_begin, a.ldx, nt, q4, tid);
  __syncthreads();
  const int e = tid % kSegExperts, tb = kPer * (tid / kSegExperts);
  if (e >= ne || tb >= nt) return;
  const int mine = min(kPer, nt - tb);
  float acc[kPer];
#pragma unroll
  for (int j = 0; j < kPer; ++j) acc[j] = 0.0f;
#pragma unroll 2
  for (int c = 0; c < len; c += 4) {
    const float4 wv = *reinterpret_cast<const float4*>(&ws[e][c]);
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      if (j < mine) {
        const float4 xv = *reinterpret_cast<const float4*>(&xs[tb + j][c]);
        float v = acc[j];
        v = fmaf(wv.x, xv.x, v);
        v = fmaf(wv.y, xv.y, v);
        v = fmaf(wv.z, xv.z, v);
        v = fmaf(wv.w, xv.w, v);
        acc[j] = v;
      }
    }
  }
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    if (j < mine) a.partial[(int64_t(s) * a.tokens + t0 + tb + j) * a.experts + e0 + e] = acc[j];
  }
}

// CTA (token tile blockIdx.x of 8 TT tokens, experts 128 blockIdx.y .., group blockIdx.z); thread
// (ty, tx) holds tokens ty TT .. + TT - 1 and experts 4 tx .. + 3. Elements past
// hidden are zero-filled: fma(0, 0, acc) == acc, as a chain from +0 never holds -0.
__device__ __forceinline__ float4 ld4_or_zero(bool ok, const float* p) {
  return ok ? __ldg(reinterpret_cast<const float4*>(p)) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
}
// The k-major tiles hold 4-column (16-byte) groups; row k stores group g at g ^ ((k / 4) % 8), so
// that the transposing stores of a warp (4 rows x 8 consecutive k-quads) hit 32 banks.
__device__ __forceinline__ int swz(int k, int g) { return (g ^ ((k >> 2) & 7)) * 4; }
// Four consecutive k (k-quad kq) of column `col` into rows 4 kq .. 4 kq + 3 of a k-major tile.
template <int kCols>
__device__ __forceinline__ void put_kmajor(float (*tile)[kCols], int kq, int col, const float4& v) {
  const int c = swz(4 * kq, col >> 2) + (col & 3);
  tile[4 * kq][c] = v.x;
  tile[4 * kq + 1][c] = v.y;
  tile[4 * kq + 2][c] = v.z;
  tile[4 * kq + 3][c] = v.w;
}

constexpr int TT = 4;  // 8 tokens per thread measured slower: 195 registers, one CTA per SM
__global__ void __launch_bounds__(256, 2) router_tile_kernel(LogitsArgs a) {
  constexpr int kBT = 8 * TT;
  pdl_launch_dependents();
  __shared__ __align__(16) float xs[kTileK][kBT];
  __shared__ __align__(16) float ws[kTileK][kTileE];
  // The group's running sum of segment chains, one column per thread (conflict-free): in
  // registers it took 16 of the 128, which ptxas now spends on loading the next k's operands
  // two k ahead.
  __shared__ float totals[TT * 4][256];
  // Thread (ty, tx): tokens ty TT .., experts 4 tx ..; a warp is 4 token groups x 8 expert
  // groups, so each k's operand reads are 4 and 8 distinct 16-byte words, one shared-memory
  // wavefront each (a warp of 32 expert groups needed four for its 512 bytes of weights).
  const int tid = int(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  const int ty = 4 * (warp >> 2) + (lane >> 3), tx = 8 * (warp & 3) + (lane & 7);
  const int t0 = int(blockIdx.x) * kBT, e0 = int(blockIdx.y) * kTileE, grp = int(blockIdx.z);
  const int k_begin = grp * a.spg * kSeg, k_end = min(a.k, k_begin + a.spg * kSeg);
  constexpr int kXv = kBT * kTileK / 4 / 256;  // float4 of x per thread per stage (TT / 4)
  constexpr int kWv = kTileE * kTileK / 4 / 256;
  float4 xr[kXv], wr[kWv];
  // Stage loads: 8 threads per row, 128 contiguous bytes. (One 16-byte word from each of 32 rows
  // per warp put a line per lane into every request; those loads, not the FMAs, set the kernel's
  // pace: 349 -> 238 us at 4096 tokens.)
  auto load = [&](int kt) {
#pragma unroll
    for (int r = 0; r < kXv; ++r) {
      const int f = tid + 256 * r, tok = f / 8, k = kt + 4 * (f % 8);
      xr[r] = ld4_or_zero(t0 + tok < a.tokens && k < k_end, a.x + int64_t(t0 + tok) * a.ldx + k);
    }
#pragma unroll
    for (int r = 0; r < kWv; ++r) {
      const int f = tid + 256 * r, e = f / 8, k = kt + 4 * (f % 8);
      wr[r] = ld4_or_zero(e0 + e < a.experts && k < k_end, a.w + int64_t(e0 + e) * a.k + k);
    }
  };
  float acc[TT][4];
#pragma unroll
  for (int i = 0; i < TT; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;
  bool first = true;
  load(k_begin);
  for (int kt = k_begin; kt < k_end; kt += kTileK) {
    __syncthreads();  // everyone is done reading the previous stage
#pragma unroll
    for (int r = 0; r < kXv; ++r) put_kmajor(xs, (tid + 256 * r) % 8, (tid + 256 * r) / 8, xr[r]);
#pragma unroll
    for (int r = 0; r < kWv; ++r) put_kmajor(ws, (tid + 256 * r) % 8, (tid + 256 * r) / 8, wr[r]);
    __syncthreads();
    if (kt + kTileK < k_end) load(kt + kTileK);  // in flight during this stage's FMAs
#pragma unroll
    for (int kk = 0; kk < kTileK; ++kk) {
      float xv[TT];
#pragma unroll
      for (int q = 0; q < TT / 4; ++q) {
        const float4 v = *reinterpret_cast<const float4*>(&xs[kk][swz(kk, ty * (TT / 4) + q)]);
        xv[4 * q] = v.x;
        xv[4 * q + 1] = v.y;
        xv[4 * q + 2] = v.z;
        xv[4 * q + 3] = v.w;
      }
      const float4 wv4 = *reinterpret_cast<const float4*>(&ws[kk][swz(kk, tx)]);
      const float wv[4] = {wv4.x, wv4.y, wv4.z, wv4.w};
#pragma unroll
      for (int i = 0; i < TT; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(wv[j], xv[i], acc[i][j]);
    }
    // Segment boundary (or the group's end): fold the segment's chain into the group's sum.
    if ((kt + kTileK - k_begin) % kSeg == 0 || kt + kTileK >= k_end) {
#pragma unroll
      for (int i = 0; i < TT; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          float& t = totals[4 * i + j][tid];
          t = first ? acc[i][j] : t + acc[i][j];
          acc[i][j] = 0.0f;
        }
      first = false;
    }
  }
#pragma unroll
  for (int i = 0; i < TT; ++i) {
    const int t = t0 + ty * TT + i;
    if (t >= a.tokens) break;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int e = e0 + 4 * tx + j;
      if (e < a.experts) a.partial[(int64_t(grp) * a.tokens + t) * a.experts + e] = totals[4 * i + j][tid];
    }
  }
}


}  // namespace

std::string fused_router_problem(int64_t experts, int64_t hidden, int top_k, const float* x, int64_t ldx,
                                 const float* w) {
  if (experts > kMaxExperts) return "more than 256 experts";
  if (top_k < 1 || top_k > 32 || top_k > experts) return "top_k must be in [1, min(32, experts)]";
  if (hidden % 4 != 0 || ldx % 4 != 0) return "hidden size and x row stride must be multiples of 4";
  if ((reinterpret_cast<uintptr_t>(x) & 15u) || (reinterpret_cast<uintptr_t>(w) & 15u)) {
    return "x and the router weight must be 16-byte aligned";
  }
  if (hidden > INT32_MAX / 2) return "hidden size too large";
  return "";
}

void launch_fused_router(const float* x, int64_t ldx, int64_t tokens, const float* w, int64_t experts, int64_t hidden,
                         const float* bias, int top_k, float scale, int32_t* ids, float* weights) {
  if (tokens == 0) return;
  if (tokens > INT32_MAX / 2) throw std::runtime_error("moe_router: too many tokens");
  const Order o = order_of(hidden);
  const bool wide = tokens > kWideMin;
  // The tiled kernel writes every segment's partial (a CTA per segment: spg times the CTAs) up to
  // kSegPartialsMax tokens, where its group-per-CTA grid leaves SMs idle.
  const bool per_seg = !wide || tokens <= kSegPartialsMax;
  const int nstored = per_seg ? o.nseg : o.ngroups;
  Scratch partial(size_t(nstored) * size_t(tokens) * size_t(experts) * 4);
  const SelectArgs sel{partial.as<const float>(), nstored, per_seg ? o.spg : 1, bias, int(tokens), int(experts), top_k,
                       scale, ids, weights};
  const LogitsArgs a{x, w, partial.as<float>(), ldx, int(tokens), int(experts), int(hidden), per_seg ? 1 : o.spg};
  if (!wide) {
    const int tok = tokens <= 32 ? 8 : 32;
    const dim3 grid(unsigned((experts + kSegExperts - 1) / kSegExperts), unsigned(o.nseg), unsigned((tokens + tok - 1) / tok));
    if (tok == 8) {
      router_seg_kernel<8><<<grid, kSegThreads, 0, current_stream()>>>(a);
    } else {
      router_seg_kernel<32><<<grid, kSegThreads, 0, current_stream()>>>(a);
    }
  } else {
    const dim3 grid(unsigned((tokens + 8 * TT - 1) / (8 * TT)), unsigned((experts + kTileE - 1) / kTileE),
                    unsigned(nstored));
    router_tile_kernel<<<grid, 256, 0, current_stream()>>>(a);
  }
  M3_CUDA_CHECK_LAUNCH();
  // The selection is launched while the logits drain (it waits before reading them).
  if (!per_seg) {
    launch_kernel(router_select_kernel<8>, dim3(unsigned((tokens + 7) / 8)), dim3(kSelThreads), 0, true, sel);
  } else {
    launch_kernel(router_select_kernel<2>, dim3(unsigned((tokens + 1) / 2)), dim3(kSelThreads), 0, true, sel);
  }
}

}  // namespace m3::cuda
