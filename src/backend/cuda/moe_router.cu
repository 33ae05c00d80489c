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
//   - wide batches: router_tile_kernel, register-tiled SIMT (a thread holds 8 tokens x 8
//     experts, k-contiguous operand rows staged by cp.async), a CTA per (64 tokens, 128 experts,
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
#include "backend/cuda/moe_timeline.cuh"
#include "backend/cuda/mma_operands.cuh"
#include "backend/cuda/pdl.cuh"

namespace m3::cuda {
namespace {

constexpr int kSeg = 192;         // segment width (part of the reduction order; a multiple of 32)
constexpr int kGroups = 8;        // at most this many groups of segments (part of the order)
constexpr int kMaxExperts = 256;  // 8 per lane in the select kernel
constexpr int kWideMin = 256;     // above this many tokens, the tiled kernel
// Up to this many tokens the tiled kernel stores per-segment partials (H200, M3 router, T = 512:
// 51 -> 45 us; at 1024 the group partials are faster, 81 vs 89 us). With the 8 x 8 tiles, per
// segment up to 2048 tokens measured 600: 62.6 -> 59.0 us, 1024: 63.2 -> 65.3, 1536: 101 -> 93,
// 2048: 101.5 -> 120.6: no single rule wins, so 512 stays.
constexpr int kSegPartialsMax = 512;
constexpr int kTileE = 128;       // experts per tiled CTA (16 threads x 8)

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
constexpr int kSelThreads = 256, kFoldBatch = 32, kWideTPC = 8;
template <int kTPC>
__global__ void __launch_bounds__(kSelThreads) router_select_kernel(SelectArgs a) {
  constexpr int kPer = kMaxExperts / 32;
  static_assert(kTPC <= kSelThreads / 32, "a warp per token");
  M3_MOE_TL_SCOPE(moe_tl::kSelect);
  __shared__ float logit_s[kTPC][kMaxExperts];
  const int lane = int(threadIdx.x) & 31, tt = int(threadIdx.x) >> 5;
  // The correction bias is a weight: loaded before the wait, off the selection's critical path.
  float bias[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) bias[i] = a.bias && lane + 32 * i < a.experts ? __ldg(a.bias + lane + 32 * i) : 0.0f;
  // Dependents (the experts' routing, which waits before reading the ids) are released at once,
  // and the logits kernel releases this one only after its own wait: the router alone 12.9 ->
  // 11.6 us at one token on the H100 against the reverse (logits releasing at its start, this
  // kernel after its wait; docs/moe_kernels.md, sixty-third session).
  pdl_launch_dependents();
  pdl_wait();  // the partials
  M3_MOE_TL_WAITED(moe_tl::kSelect);
  const int t0 = int(blockIdx.x) * kTPC, nt = min(kTPC, a.tokens - t0);
  const int experts = a.experts, top_k = a.top_k;
  const int64_t stride = int64_t(a.tokens) * experts;
  if constexpr (kTPC == kWideTPC) {
    // Group partials (at most kGroups; the host passes spg 1 with them): all of a thread's
    // pairs' partials in flight at once, then each pair folded in order (a batch per pair, 4 at
    // M3, was 4 round trips and 32 predicated slots per pair: 31 us at 4096 tokens).
    constexpr int kQ = kWideTPC * kMaxExperts / kSelThreads;
    float v[kQ][kGroups];
#pragma unroll
    for (int q = 0; q < kQ; ++q) {
      const int i = int(threadIdx.x) + kSelThreads * q;
      const bool ok = i < nt * experts;
      const float* src = a.partial + (int64_t(t0) * experts + i);  // (t0 + i / experts) * experts + i % experts
#pragma unroll
      for (int g = 0; g < kGroups; ++g) v[q][g] = ok && g < a.nstored ? __ldcg(src + g * stride) : 0.0f;
    }
#pragma unroll
    for (int q = 0; q < kQ; ++q) {
      const int i = int(threadIdx.x) + kSelThreads * q;
      if (i >= nt * experts) break;
      float lg = v[q][0];
#pragma unroll
      for (int g = 1; g < kGroups; ++g) {
        if (g < a.nstored) lg = lg + v[q][g];
      }
      logit_s[i / experts][i % experts] = lg;
    }
  } else {
    for (int i = int(threadIdx.x); i < nt * experts; i += kSelThreads) {
      const int tt = i / experts, e = i % experts;
      const float* src = a.partial + int64_t(t0 + tt) * experts + e;
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
  }
  __syncthreads();
  M3_MOE_TL_MID(moe_tl::kSelect);  // the logits folded
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
// kConst: src is never written while the kernel runs (weights), so the non-coherent read-only
// path may serve it; x is written by the kernel this one is a programmatic dependent of, after
// this kernel started, and is read coherently (ld.global.nc after griddepcontrol.wait returned
// stale rows here: other routing on the H200).
template <int kPer, bool kConst>
__device__ __forceinline__ void stage_rows(float (*dst)[kSegRow], const float* src, int64_t ld, int rows, int q4, int tid) {
  float4 v[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int f = tid + kSegThreads * i, r = f / q4, c = 4 * (f % q4);
    const float4* p = reinterpret_cast<const float4*>(src + int64_t(r) * ld + c);
    if (r < rows) v[i] = kConst ? __ldg(p) : __ldcg(p);
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
  M3_MOE_TL_SCOPE(moe_tl::kLogits);
  __shared__ __align__(16) float ws[kSegExperts][kSegRow];
  __shared__ __align__(16) float xs[kTok][kSegRow];
  const int tid = int(threadIdx.x);
  const int e0 = int(blockIdx.x) * kSegExperts, s = int(blockIdx.y), t0 = int(blockIdx.z) * kTok;
  const int k_begin = s * kSeg, len = min(a.k - k_begin, kSeg);  // a multiple of 4
  const int ne = min(kSegExperts, a.experts - e0), nt = min(kTok, a.tokens - t0);
  const int q4 = len / 4;
  stage_rows<kSegExperts * (kSeg / 4) / kSegThreads, true>(ws, a.w + int64_t(e0) * a.k + k_begin, a.k, ne, q4, tid);
  pdl_wait();  // x comes from the kernel before (launched as its dependent: the weights' round trip overlaps it)
  M3_MOE_TL_WAITED(moe_tl::kLogits);
  // The select kernel is released only now (see router_select_kernel): its CTAs no longer wait
  // beside this kernel's from its start.
  pdl_launch_dependents();
  stage_rows<kTok * (kSeg / 4) / kSegThreads, false>(xs, a.x + int64_t(t0) * a.ldx + k_begin, a.ldx, nt, q4, tid);
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

// The tiled kernel (T > kWideMin): a CTA of 128 threads owns 64 tokens x 128 experts over one
// group of segments (or one segment); thread (ty, tx) holds tokens ty + 8 i and experts
// tx + 16 j (i, j < 8): 64 chains, each fed by 16 float4 shared-memory reads per 4 k (256 FMAs),
// so the FMAs, not the reads, set the pace. x and W rows stay k-contiguous (no transposing
// stores): 16-k stages of both come in by cp.async (kTileStages deep, zero-filled past the
// group's end and the last token / expert: fma(0, 0, acc) == acc, as a chain from +0 never
// holds -0), rows padded to 20 floats so that a warp's 4 token rows and 8 expert rows hit
// distinct banks. (The previous kernel, 256 threads of 4 x 4 chains with register-staged,
// transposed k-major stages, ran at ~40 % of the FMA rate: 31 us at 512 tokens.)
constexpr int kTileThreads = 128;
constexpr int kTileT = 64;     // tokens per CTA (8 per thread)
constexpr int kTileK = 16;     // k per stage (a divisor of kSeg)
constexpr int kTileRow = kTileK + 4;
constexpr int kTileStages = 4;
constexpr int kTileStageFloats = (kTileT + kTileE) * kTileRow;
static_assert(kSeg % kTileK == 0, "stages never straddle a segment");
// Stages, then the group's running sum of segment chains ([64 chains][128 threads]): 92 KB, two
// CTAs per SM. (8-k stages in 68 KB, three CTAs per SM, measured slower: 1.29 waves of CTAs at
// 4096 tokens instead of 1.94, and 0.65 at 512.)
constexpr size_t kTileSmemBytes = size_t(kTileStages) * kTileStageFloats * 4 + size_t(64) * kTileThreads * 4;

__global__ void __launch_bounds__(kTileThreads, 2) router_tile_kernel(LogitsArgs a) {
  using mma_ops::cp_async16;
  pdl_launch_dependents();
  extern __shared__ __align__(16) float tile_smem[];
  float* const totals = tile_smem + kTileStages * kTileStageFloats;
  const int tid = int(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  // A warp: 4 token rows x 8 expert rows per read.
  const int ty = 4 * (warp >> 1) + (lane >> 3), tx = 8 * (warp & 1) + (lane & 7);
  const int t0 = int(blockIdx.x) * kTileT, e0 = int(blockIdx.y) * kTileE, grp = int(blockIdx.z);
  const int k_begin = grp * a.spg * kSeg, k_end = min(a.k, k_begin + a.spg * kSeg);
  const int nst = (k_end - k_begin + kTileK - 1) / kTileK;
  // A stage: 64 x rows and 128 W rows of kTileK / 4 16-byte chunks; a thread copies chunk c of
  // rows r0 + (kTileThreads / kChunks) i, the same every stage (sources found once).
  constexpr int kChunks = kTileK / 4, kRowStep = kTileThreads / kChunks;
  constexpr int kXCopies = kTileT / kRowStep, kWCopies = kTileE / kRowStep;
  const int c = tid % kChunks, r0 = tid / kChunks;
  const float* xsrc[kXCopies];
  const float* wsrc[kWCopies];
  bool xok[kXCopies], wok[kWCopies];
#pragma unroll
  for (int i = 0; i < kXCopies; ++i) {
    xok[i] = t0 + r0 + kRowStep * i < a.tokens;
    xsrc[i] = a.x + (xok[i] ? int64_t(t0 + r0 + kRowStep * i) * a.ldx + k_begin + 4 * c : 0);
  }
#pragma unroll
  for (int i = 0; i < kWCopies; ++i) {
    wok[i] = e0 + r0 + kRowStep * i < a.experts;
    wsrc[i] = a.w + (wok[i] ? int64_t(e0 + r0 + kRowStep * i) * a.k + k_begin + 4 * c : 0);
  }
  const uint32_t dst0 = mma_ops::smem_u32(tile_smem + r0 * kTileRow + 4 * c);
  auto load = [&](int st) {
    if (st < nst) {
      const uint32_t dst = dst0 + uint32_t((st % kTileStages) * kTileStageFloats * 4);
      const int dk = st * kTileK;
      const bool kok = k_begin + dk + 4 * c < k_end;
#pragma unroll
      for (int i = 0; i < kXCopies; ++i) {
        const bool ok = xok[i] && kok;
        cp_async16(dst + uint32_t(kRowStep * i * kTileRow * 4), ok ? xsrc[i] + dk : a.x, ok ? 16u : 0u);
      }
#pragma unroll
      for (int i = 0; i < kWCopies; ++i) {
        const bool ok = wok[i] && kok;
        cp_async16(dst + uint32_t((kTileT + kRowStep * i) * kTileRow * 4), ok ? wsrc[i] + dk : a.w, ok ? 16u : 0u);
      }
    }
    mma_ops::cp_async_commit();  // empty groups keep the wait count uniform
  };
  float acc[8][8];
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[i][j] = 0.0f;
#pragma unroll
  for (int s = 0; s < kTileStages - 1; ++s) load(s);
  bool first = true;
  for (int st = 0; st < nst; ++st) {
    mma_ops::cp_async_wait<kTileStages - 2>();
    __syncthreads();  // stage st landed for all; everyone is past stage st - 1, whose slot refills now
    load(st + kTileStages - 1);
    const float* const xs = tile_smem + (st % kTileStages) * kTileStageFloats;
    const float* const ws = xs + kTileT * kTileRow;
#pragma unroll
    for (int kq = 0; kq < kTileK / 4; ++kq) {
      float4 xv[8], wv[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) xv[i] = *reinterpret_cast<const float4*>(xs + (ty + 8 * i) * kTileRow + 4 * kq);
#pragma unroll
      for (int j = 0; j < 8; ++j) wv[j] = *reinterpret_cast<const float4*>(ws + (tx + 16 * j) * kTileRow + 4 * kq);
      // k = 4 kq + 0 .. 3 in turn. Written out: the same loop over a component index made ptxas
      // schedule it in 168 registers instead of 254, and the router 9-15 % slower (H200).
#pragma unroll
      for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = fmaf(wv[j].x, xv[i].x, acc[i][j]);
#pragma unroll
      for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = fmaf(wv[j].y, xv[i].y, acc[i][j]);
#pragma unroll
      for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = fmaf(wv[j].z, xv[i].z, acc[i][j]);
#pragma unroll
      for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = fmaf(wv[j].w, xv[i].w, acc[i][j]);
    }
    // Segment boundary (or the group's end): fold the segment's chains into the group's sums
    // (one segment per CTA: the chains are the partials).
    const int done = (st + 1) * kTileK;
    if (a.spg > 1 && (done % kSeg == 0 || k_begin + done >= k_end)) {
#pragma unroll
      for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          float& t = totals[(8 * i + j) * kTileThreads + tid];
          t = first ? acc[i][j] : t + acc[i][j];
          acc[i][j] = 0.0f;
        }
      first = false;
    }
  }
  mma_ops::cp_async_wait<0>();
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int t = t0 + ty + 8 * i;
    if (t >= a.tokens) break;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int e = e0 + tx + 16 * j;
      if (e < a.experts) {
        a.partial[(int64_t(grp) * a.tokens + t) * a.experts + e] = a.spg > 1 ? totals[(8 * i + j) * kTileThreads + tid] : acc[i][j];
      }
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

// Partials of decode-sized calls (M3: 16 KB per token; up to 2 MB). The logits kernel writes
// them only after its pdl_wait (all earlier work on the stream has completed by then: each
// kernel of the chain waits for the one before it), so consecutive calls never overlap on it;
// the select kernel, the logits kernel's programmatic dependent, then has no free node between
// it and the experts' first kernel.
__device__ __align__(256) uint4 g_router_partials[(size_t(2) << 20) / 16];

RouterPlan fused_router_plan(int64_t tokens, int64_t experts, int64_t hidden) {
  RouterPlan p;
  const Order o = order_of(hidden);
  p.nseg = o.nseg;
  p.spg = o.spg;
  p.ngroups = o.ngroups;
  p.wide = tokens > kWideMin;
  // The tiled kernel writes every segment's partial (a CTA per segment: spg times the CTAs) up to
  // kSegPartialsMax tokens, where its group-per-CTA grid leaves SMs idle.
  p.per_seg = !p.wide || tokens <= kSegPartialsMax;
  p.nstored = p.per_seg ? o.nseg : o.ngroups;
  if (!p.wide) {
    p.tokens_per_cta = tokens <= 32 ? 8 : 32;
    p.experts_per_cta = kSegExperts;
    p.grid[0] = (experts + kSegExperts - 1) / kSegExperts;
    p.grid[1] = o.nseg;
    p.grid[2] = (tokens + p.tokens_per_cta - 1) / p.tokens_per_cta;
  } else {
    p.tokens_per_cta = kTileT;
    p.experts_per_cta = kTileE;
    p.grid[0] = (tokens + kTileT - 1) / kTileT;
    p.grid[1] = (experts + kTileE - 1) / kTileE;
    p.grid[2] = p.nstored;
  }
  p.select_tokens_per_cta = p.per_seg ? 2 : kWideTPC;
  return p;
}

std::string fused_router_plan_text(const RouterPlan& p) {
  const std::string grid = std::to_string(p.grid[0]) + " x " + std::to_string(p.grid[1]) + " x " + std::to_string(p.grid[2]);
  std::string s = "logits: " + grid + " CTAs of " + std::to_string(p.experts_per_cta) + " experts x " +
                  std::to_string(p.tokens_per_cta) + " tokens x ";
  if (!p.wide) {
    s += "one " + std::to_string(kSeg) + "-wide segment (rows staged in shared memory)";
  } else if (p.per_seg) {
    s += "one " + std::to_string(kSeg) + "-wide segment (register-tiled)";
  } else {
    s += "one group of " + std::to_string(p.spg) + " segments (register-tiled)";
  }
  s += ", " + std::to_string(p.nstored) + (p.per_seg ? " segment" : " group") + " partials; select: " +
       std::to_string(p.select_tokens_per_cta) + " tokens per CTA";
  return s;
}

void launch_fused_router(const float* x, int64_t ldx, int64_t tokens, const float* w, int64_t experts, int64_t hidden,
                         const float* bias, int top_k, float scale, int32_t* ids, float* weights) {
  if (tokens == 0) return;
  if (tokens > INT32_MAX / 2) throw std::runtime_error("moe_router: too many tokens");
  const RouterPlan p = fused_router_plan(tokens, experts, hidden);
  static FixedScratch partials_of(g_router_partials);
  Scratch partial(size_t(p.nstored) * size_t(tokens) * size_t(experts) * 4, partials_of);
  const SelectArgs sel{partial.as<const float>(), p.nstored, p.per_seg ? p.spg : 1, bias, int(tokens), int(experts), top_k,
                       scale, ids, weights};
  const LogitsArgs a{x, w, partial.as<float>(), ldx, int(tokens), int(experts), int(hidden), p.per_seg ? 1 : p.spg};
  const dim3 grid(unsigned(p.grid[0]), unsigned(p.grid[1]), unsigned(p.grid[2]));
  if (!p.wide) {
    launch_kernel(p.tokens_per_cta == 8 ? router_seg_kernel<8> : router_seg_kernel<32>, grid, dim3(kSegThreads), 0, true,
                  a);
  } else {
    allow_dynamic_smem(reinterpret_cast<const void*>(router_tile_kernel), kTileSmemBytes);
    router_tile_kernel<<<grid, kTileThreads, kTileSmemBytes, current_stream()>>>(a);
  }
  M3_CUDA_CHECK_LAUNCH();
  // The selection is launched while the logits drain (it waits before reading them).
  const unsigned sel_ctas = unsigned((tokens + p.select_tokens_per_cta - 1) / p.select_tokens_per_cta);
  if (p.select_tokens_per_cta == kWideTPC) {
    launch_kernel(router_select_kernel<kWideTPC>, dim3(sel_ctas), dim3(kSelThreads), 0, true, sel);
  } else {
    launch_kernel(router_select_kernel<2>, dim3(sel_ctas), dim3(kSelThreads), 0, true, sel);
  }
}

}  // namespace m3::cuda

M3_MOE_TL_DEFINE_HOST(router)
