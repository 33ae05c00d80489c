// The MoE router on the device: logits = x · W_router^T in fp32, sigmoid, selection by
// probability + correction bias (descending, ties to the lower id), the chosen experts'
// unbiased probabilities renormalised and scaled (the CPU reference's order of operations).
//
// Two launches, no scratch beyond the partial logits:
//   1. router_logits: hidden split into kSplits fixed segments (enough CTAs for the SMs at one
//      token: M3 reads 3 MB of F32 router weight). One warp per expert (or four); a lane sums its
//      float4 chunks of the segment in ascending order with FMA, the warp folds lanes with one
//      xor tree, and the segment's partial goes to [split, token, expert]. The arithmetic of a
//      (token, expert) never depends on the token count or on how CTAs group experts, so the
//      choice is batch-invariant and the wide-tile variant (large batches) gives the same bits.
//   2. router_select: one warp per token; lane l holds experts l, l + 32, ...: logit = the
//      partials summed in split order, sigmoid computed once per expert, top_k rounds of a warp
//      argmax; weights p / sum * scale with the sum in pick order.
#include <cstdint>
#include <stdexcept>
#include <string>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_internal.h"
#include "backend/cuda/moe_router.h"

namespace m3::cuda {
namespace {

constexpr int kSplits = 8;        // fixed K segments (part of the reduction order)
constexpr int kWarps = 8;         // warps per logits CTA
constexpr int kTileTokens = 8;    // tokens per logits CTA
constexpr int kMaxExperts = 256;  // 8 per lane in the select kernel

struct LogitsArgs {
  const float* x;
  const float* w;
  float* partial;  // [kSplits, tokens, experts]
  int64_t ldx;
  int tokens, experts, k, seg;  // seg: elements per split, a multiple of 4
};

// kEPW experts per warp (1 for decode: more CTAs; 4 for wide batches: x read 4x less).
template <int kEPW>
__global__ void __launch_bounds__(kWarps * 32) router_logits_kernel(LogitsArgs a) {
  const int warp = int(threadIdx.x) >> 5, lane = int(threadIdx.x) & 31;
  const int e0 = (int(blockIdx.x) * kWarps + warp) * kEPW;
  const int t0 = int(blockIdx.y) * kTileTokens, s = int(blockIdx.z);
  if (e0 >= a.experts) return;
  const int nt = min(kTileTokens, a.tokens - t0);
  const int k_begin = s * a.seg, k_end = min(a.k, k_begin + a.seg);
  float acc[kTileTokens][kEPW];
#pragma unroll
  for (int t = 0; t < kTileTokens; ++t)
#pragma unroll
    for (int j = 0; j < kEPW; ++j) acc[t][j] = 0.0f;
  for (int c = k_begin + 4 * lane; c < k_end; c += 128) {
    float4 wv[kEPW];
#pragma unroll
    for (int j = 0; j < kEPW; ++j) {
      const int e = min(e0 + j, a.experts - 1);
      wv[j] = __ldg(reinterpret_cast<const float4*>(a.w + int64_t(e) * a.k + c));
    }
#pragma unroll
    for (int t = 0; t < kTileTokens; ++t) {
      if (t >= nt) break;
      const float4 xv = __ldg(reinterpret_cast<const float4*>(a.x + int64_t(t0 + t) * a.ldx + c));
#pragma unroll
      for (int j = 0; j < kEPW; ++j) {
        float v = acc[t][j];
        v = fmaf(wv[j].x, xv.x, v);
        v = fmaf(wv[j].y, xv.y, v);
        v = fmaf(wv[j].z, xv.z, v);
        v = fmaf(wv[j].w, xv.w, v);
        acc[t][j] = v;
      }
    }
  }
#pragma unroll
  for (int t = 0; t < kTileTokens; ++t) {
    if (t >= nt) break;
#pragma unroll
    for (int j = 0; j < kEPW; ++j) {
      float v = acc[t][j];
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
      if (lane == 0 && e0 + j < a.experts) {
        a.partial[(int64_t(s) * a.tokens + t0 + t) * a.experts + e0 + j] = v;
      }
    }
  }
}

// (choice desc, id asc): is (c, i) before (bc, bi)? bi < 0 is "none yet".
__device__ __forceinline__ bool before(float c, int i, float bc, int bi) {
  return bi < 0 || c > bc || (c == bc && i < bi);
}

__global__ void __launch_bounds__(256) router_select_kernel(const float* partial, const float* bias, int tokens,
                                                            int experts, int top_k, float scale, int32_t* ids,
                                                            float* weights) {
  constexpr int kPer = kMaxExperts / 32;
  const int lane = int(threadIdx.x) & 31;
  const int t = int(blockIdx.x) * (int(blockDim.x) >> 5) + (int(threadIdx.x) >> 5);
  if (t >= tokens) return;
  float prob[kPer], choice[kPer];
  unsigned taken = 0;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int e = lane + 32 * i;
    prob[i] = choice[i] = 0.0f;
    if (e >= experts) continue;
    float lg = partial[int64_t(t) * experts + e];
    for (int s = 1; s < kSplits; ++s) lg += partial[(int64_t(s) * tokens + t) * experts + e];
    prob[i] = 1.0f / (1.0f + expf(-lg));
    choice[i] = prob[i] + (bias ? bias[e] : 0.0f);
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
    ids[int64_t(t) * top_k + lane] = picked_id;
    weights[int64_t(t) * top_k + lane] = picked_p / sum * scale;
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
  Scratch partial(size_t(kSplits) * size_t(tokens) * size_t(experts) * 4);
  LogitsArgs a{x, w, partial.as<float>(), ldx, int(tokens), int(experts), int(hidden), 0};
  a.seg = int(((hidden + kSplits - 1) / kSplits + 3) / 4 * 4);
  const unsigned ty = unsigned((tokens + kTileTokens - 1) / kTileTokens);
  if (ty > 65535) throw std::runtime_error("moe_router: too many tokens for one launch");
  // Decode: a warp per expert (M3: 16 x 8 = 128 CTAs at one token). Wide batches: 4 per warp.
  if (tokens <= 4 * kTileTokens) {
    const dim3 grid(unsigned((experts + kWarps - 1) / kWarps), ty, kSplits);
    router_logits_kernel<1><<<grid, kWarps * 32, 0, current_stream()>>>(a);
  } else {
    const dim3 grid(unsigned((experts + 4 * kWarps - 1) / (4 * kWarps)), ty, kSplits);
    router_logits_kernel<4><<<grid, kWarps * 32, 0, current_stream()>>>(a);
  }
  M3_CUDA_CHECK_LAUNCH();
  router_select_kernel<<<unsigned((tokens + 7) / 8), 256, 0, current_stream()>>>(
      partial.as<const float>(), bias, int(tokens), int(experts), top_k, scale, ids, weights);
  M3_CUDA_CHECK_LAUNCH();
}

}  // namespace m3::cuda
