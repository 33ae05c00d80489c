#pragma once
// Device helpers shared by the tuned MSA kernels (msa_indexer.cu, msa_decode.cu,
// msa_prefill.cu): batch bookkeeping, order-preserving score keys, cp.async, tensor-core
// fragments, the canonical softmax fold, cluster barriers, and the arrival counters that let
// the last CTA of a group finish the work (selection) without a second launch.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/pdl.cuh"

namespace m3::cuda::msa {

// The sequence owning batch token t: the last s with query_start[s] <= t (empty sequences
// share their start with the next one, so the last is the right one).
__device__ __forceinline__ int seq_of_token(const int32_t* query_start, int num_seqs, int t) {
  int lo = 0, hi = num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (query_start[mid] <= t) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// fp32 -> uint32 with the same order. -0 and +0 get one key: the CPU reference compares
// floats, for which they are equal (a tie, broken by block id). 0 is below every float's key.
__device__ __forceinline__ uint32_t order_key(float f) {
  uint32_t u = __float_as_uint(f);
  if (u == 0x80000000u) u = 0;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
constexpr uint32_t kKeyMinusInf = 0x007fffffu;  // order_key(-inf)

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

// 16-byte global -> shared copy, bypassing L1 (streamed once). pred false: zero-filled.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool pred) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(pred ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// A cluster barrier in two halves, for work between them (every thread of every CTA of the
// cluster calls both, in order); release/acquire at cluster scope (the global writes before the
// arrival, fenced, are visible to the cluster's CTAs after the wait).
__device__ __forceinline__ void cluster_arrive() {
  __threadfence();
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void cluster_sync() {
  cluster_arrive();
  cluster_wait();
}
// The first half without the fence or release (after an mbarrier-init fence: the barriers a
// peer will signal are initialised before the peers' wait returns).
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }

// Distributed shared memory: the address in CTA `rank` of the cluster of a local shared address,
// and an 8-byte store there that completes as transaction bytes on that CTA's mbarrier `bar`
// (the peer's address of it, also from cluster_map).
__device__ __forceinline__ uint32_t cluster_map(uint32_t local, int rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(local), "r"(rank));
  return r;
}
__device__ __forceinline__ void st_async_f2(uint32_t remote, float x, float y, uint32_t remote_bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [%0], {%1, %2}, [%3];\n" ::"r"(remote),
               "f"(x), "f"(y), "r"(remote_bar)
               : "memory");
}

// A 4-byte store into CTA `rank`'s shared memory (the address from cluster_map); visible to that
// CTA after a cluster barrier.
__device__ __forceinline__ void st_cluster_u32(uint32_t remote, uint32_t v) {
  asm volatile("st.shared::cluster.u32 [%0], %1;\n" ::"r"(remote), "r"(v) : "memory");
}

// Arrival of one CTA of a group of `expected`; true for the last one, which also re-arms the
// counter for the next launch. Every CTA's global writes before this call are visible to the
// last one (fence before arriving, fence after learning it is last).
__device__ __forceinline__ bool arrive_last(unsigned* counter, unsigned expected, int* flag_smem) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned prev = atomicAdd(counter, 1u);
    const bool last = prev == expected - 1;
    if (last) *counter = 0;
    *flag_smem = last;
  }
  __syncthreads();
  const bool last = *flag_smem != 0;
  if (last) __threadfence();
  return last;
}

// Counters live in a static device array (zero at module load, re-armed by each group's last
// CTA), so no memset node is needed per launch. Consequence: launches of the kernels sharing an
// array must not overlap in time on one device (the engine drives one stream per device).
constexpr int kMaxCounters = 1 << 16;

// ---- tensor-core fragments (mma.sync m16n8k16, fp32 accumulation) ----

__device__ __forceinline__ uint32_t bf16x2_bits(__nv_bfloat162 v) { return *reinterpret_cast<uint32_t*>(&v); }

// (x0, x1) = hi + lo with hi, lo bf16 pairs (element 0 in the low half).
// (The halves go back to fp32 by bit placement: __bfloat1622float2 made ptxas unpack and repack
// the pair with byte permutes, two extra instructions per pair.)
__device__ __forceinline__ void split_bf16(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  hi = bf16x2_bits(__floats2bfloat162_rn(x0, x1));
  const float h0 = __uint_as_float(hi << 16), h1 = __uint_as_float(hi & 0xffff0000u);
  lo = bf16x2_bits(__floats2bfloat162_rn(__fsub_rn(x0, h0), __fsub_rn(x1, h1)));
}

constexpr uint32_t kBf16OnePair = 0x3f803f80u;  // (1.0, 1.0) as bf16x2

constexpr int kHeadDim = 128;   // query / key / value head dim the attention kernels take
constexpr int kUnitKeys = 128;  // keys of an attention unit (one KV block of M3)

// Dims [8 ch, 8 ch + 8) of row `row` of a query group (row = token (row / G) of the group from t0,
// head g * G + row % G of q [tokens, q_heads, kHeadDim]) as bf16 hi / lo halves; zeros for rows past
// `rows`. The decode and the dense prefill kernels stage their Q tiles with it.
__device__ __forceinline__ void q_chunk_hilo(const float* q, int q_heads, int t0, int g, int G, int row, int rows,
                                             int ch, uint4& hi, uint4& lo) {
  float x[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  if (row < rows) {
    const float* src = q + (int64_t(t0 + row / G) * q_heads + g * G + row % G) * kHeadDim + ch * 8;
    const float4 u = *reinterpret_cast<const float4*>(src), w = *reinterpret_cast<const float4*>(src + 4);
    x[0] = u.x, x[1] = u.y, x[2] = u.z, x[3] = u.w, x[4] = w.x, x[5] = w.y, x[6] = w.z, x[7] = w.w;
  }
  split_bf16(x[0], x[1], hi.x, lo.x);
  split_bf16(x[2], x[3], hi.y, lo.y);
  split_bf16(x[4], x[5], hi.z, lo.z);
  split_bf16(x[6], x[7], hi.w, lo.w);
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma_f16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Byte offset of 16-byte chunk `ch` of row `row` in a swizzled [rows][128] bf16 tile (256 B rows).
__device__ __forceinline__ uint32_t tile_off(int row, int ch) { return uint32_t(row * 256 + ((ch ^ (row & 7)) << 4)); }

// ---- the canonical softmax fold (batch invariance) ----
// One step: state (M, L, O) absorbs a partial (m, l, o), each relative to its own max.
// Identities (m = -inf, l = 0, o = 0) leave the state's bits unchanged, and the identity
// state absorbing x gives x exactly, so units a row does not see change nothing.
struct FoldScale {
  float a, b;
};
__device__ __forceinline__ FoldScale fold_scale(float& M, float m, float sl2) {
  const float mn = fmaxf(M, m);
  const float a = M == mn ? 1.0f : exp2f(__fmul_rn(__fsub_rn(M, mn), sl2));
  const float b = m == -INFINITY ? 0.0f : exp2f(__fmul_rn(__fsub_rn(m, mn), sl2));
  M = mn;
  return FoldScale{a, b};
}
__device__ __forceinline__ float fold_val(float acc, const FoldScale& f, float x) {
  return __fmaf_rn(acc, f.a, __fmul_rn(x, f.b));
}
// A row's step that keeps the factors for its elements' chains (the folds that run the row chain
// first, then each element's from the stored factors).
__device__ __forceinline__ float2 fold_row(float& M, float& L, float2 ml, float sl2) {
  const FoldScale f = fold_scale(M, ml.x, sl2);
  L = fold_val(L, f, ml.y);
  return make_float2(f.a, f.b);
}
__device__ __forceinline__ float finish(float o, float l) { return l > 0.0f ? __fdiv_rn(o, l) : 0.0f; }

// Probability of a score relative to the unit's max (scaled), the canonical expression: 2^x by
// the MUFU approximation with results below 2^-126 flushed to 0. (exp2f is the same instruction
// plus a subnormal fix-up, three more per score; the terms it kept lie ~2^-126 below the unit's
// largest, which is 1.) ex2(-inf) = +0 for masked keys.
__device__ __forceinline__ float unit_prob(float s, float mb, float sl2) {
  float p;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(p) : "f"(__fmaf_rn(s, sl2, -mb)));
  return p;
}
__device__ __forceinline__ float unit_mb(float m, float sl2) { return m == -INFINITY ? 0.0f : __fmul_rn(m, sl2); }

// A unit's canonical probabilities (the prefill kernels of msa_prefill.cu and msa_dense_prefill.cu)
// for rows r0 = 16 mt + gq and r1 = r0 + 8 over its 128 keys: S (sv(nt, e): element e of the
// thread's fragment of n8 key tile nt) masked to the visible keys at or before each row's
// position, the rows' maxima, and P as the bf16 hi / lo A fragments of the 8 key steps.
template <class Frag>
__device__ __forceinline__ void unit_probs(Frag&& sv, int kvis, int kb, int cq, int pos0, int pos1, float sl2, float& m0,
                                          float& m1, uint32_t (&ph)[8][4], uint32_t (&pl)[8][4]) {
  m0 = -INFINITY;
  m1 = -INFINITY;
#pragma unroll
  for (int nt = 0; nt < 16; ++nt) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int kk = nt * 8 + 2 * cq + e;
      const bool in = kk < kvis;
      sv(nt, e) = (in && kb + kk <= pos0) ? sv(nt, e) : -INFINITY;
      sv(nt, 2 + e) = (in && kb + kk <= pos1) ? sv(nt, 2 + e) : -INFINITY;
      m0 = fmaxf(m0, sv(nt, e));
      m1 = fmaxf(m1, sv(nt, 2 + e));
    }
  }
  m0 = fmaxf(m0, __shfl_xor_sync(0xffffffffu, m0, 1));
  m0 = fmaxf(m0, __shfl_xor_sync(0xffffffffu, m0, 2));
  m1 = fmaxf(m1, __shfl_xor_sync(0xffffffffu, m1, 1));
  m1 = fmaxf(m1, __shfl_xor_sync(0xffffffffu, m1, 2));
  const float mb0 = unit_mb(m0, sl2), mb1 = unit_mb(m1, sl2);
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) {
#pragma unroll
    for (int f = 0; f < 4; ++f) {
      const int nt = 2 * kk + (f >> 1), o = 2 * (f & 1);
      const float mb = f & 1 ? mb1 : mb0;
      split_bf16(unit_prob(sv(nt, o), mb, sl2), unit_prob(sv(nt, o + 1), mb, sl2), ph[kk][f], pl[kk][f]);
    }
  }
}

// ---- warp scans ----
__device__ __forceinline__ int warp_inclusive_scan(int v) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int n = __shfl_up_sync(0xffffffffu, v, off);
    if (lane >= off) v += n;
  }
  return v;
}

}  // namespace m3::cuda::msa
