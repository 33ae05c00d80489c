// Dense causal attention for prefill without batch invariance (sm_90a): M3's dense layers (0-2),
// BF16 KV cache, head_dim 128, Q and P rounded to bf16, fp32 accumulation and softmax.
//
// The canonical kernel (msa_dense_prefill.cu) keeps the query-major kernel's numerics: units
// folded in super-units of 8, row sums by MMA against ones, every warp copying K/V and waiting on
// __syncthreads per unit. Without batch invariance none of that is needed, and the time goes to
// what runs between the MMAs (thirty-fifth round). This kernel is laid out as FlashAttention-3
// lays out a forward pass on Hopper:
//   WG0 (producer, few registers): each 128-key unit's K and V (through the page table) into a
//       ring of stages: whole units of pages of >= 128 keys by TMA (one thread, two boxes),
//       others by cp.async; arriving on the stage's full barrier; waits for the consumers to
//       release a stage (K after S, V after P.V) before refilling it.
//   WG1, WG2 (consumers): 64 rows each of the CTA's 128 (the KV group's query heads of 128 / G
//       consecutive tokens). Per unit u: issue S_u = Q K_u^T, then P_{u-1} V_{u-1}, wait for S_u
//       alone and run unit u's softmax while the tensor cores do P_{u-1} V_{u-1}; then rescale O.
// The row max and the scaled exponent are fp32 (exp2 of s * log2(e) / sqrt(d) - m); the row sums
// add the fp32 probabilities (the bf16 rounding of P is unbiased; the parity bound is the fast
// variants' 1e-2 of max|ref|).
#include <cuda.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <type_traits>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_internal.h"
#include "backend/cuda/mma_operands.cuh"
#include "backend/cuda/msa.h"
#include "backend/cuda/msa_common.cuh"
#include "backend/cuda/msa_dense_tiles.cuh"
#include "backend/cuda/tma.cuh"
#include "backend/cuda/wgmma.cuh"

namespace m3::cuda {
namespace {

using mma_ops::cp_async_arrive_noinc;
using mma_ops::mbar_arrive;
using mma_ops::mbar_init;
using mma_ops::mbar_wait;
using msa::cp_async16;
using msa::DenseArgs;
using msa::kHeadDim;
using msa::kUnitKeys;
using msa::smem_u32;

constexpr int kThreads = 384;  // producer + two consumer warpgroups
constexpr int kRows = msa::kDenseRows;
constexpr int kProducerRegs = 56, kConsumerRegs = 224;  // 128 * 56 + 256 * 224 <= 65536

// Shared memory from a 1024-byte aligned base. Q, K and V tiles are [dim half][row][128 B] with the
// 128-byte swizzle (16-byte chunk c of row r at c ^ (r & 7)): K-major for Q (S's A) and K (S's B),
// MN-major for V (P.V's B, transposed by its descriptor).
constexpr size_t kTile = 32768;  // 128 rows x 128 dims of bf16
template <int kStages>
struct Layout {
  static constexpr size_t kQOff = 0;
  static constexpr size_t kKOff = kQOff + kTile;
  static constexpr size_t kVOff = kKOff + kStages * kTile;
  static constexpr size_t kBarOff = kVOff + kStages * kTile;  // full K, full V, empty K, empty V: kStages each
  static constexpr size_t kPosOff = kBarOff + 4 * 8 * kStages;
  static constexpr size_t kInfoOff = kPosOff + size_t(kRows) * 4;  // sequence, first token, tokens, pos max, pos min
  static constexpr size_t kSmem = kInfoOff + 32 + 1024;            // + 1024: base alignment
  static_assert(kSmem <= 232448, "shared memory");
};

__device__ __forceinline__ uint32_t sw_off(int r, int ch) {
  return uint32_t((ch >> 3) * kRows * 128 + r * 128 + (((ch & 7) ^ (r & 7)) << 4));
}

// 2^x by the MUFU approximation (O's rescale; the probabilities take msa::unit_prob, the same
// instruction after the fma).
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

using FaArgs = msa::DenseTmaArgs;

template <int kStages>
struct Bars {
  uint32_t base;
  __device__ __forceinline__ uint32_t full_k(int s) const { return base + 8u * uint32_t(s); }
  __device__ __forceinline__ uint32_t full_v(int s) const { return base + 8u * uint32_t(kStages + s); }
  __device__ __forceinline__ uint32_t empty_k(int s) const { return base + 8u * uint32_t(2 * kStages + s); }
  __device__ __forceinline__ uint32_t empty_v(int s) const { return base + 8u * uint32_t(3 * kStages + s); }
};

// TMA (cp.async.bulk.tensor) for whole units in pages of >= 128 keys: one thread issues a unit's
// K or V as two 64-dim boxes of 128 keys, which land 128-byte swizzled as the consumers read them
// (thirty-seventh round: 8K 2774 -> 1925 us on an H100 with the peeled loop below).

// WG0: unit u's K, then its V, into stage u % kStages once the consumers released it (every
// producer thread waits, so each full barrier gets 128 arrivals per unit whichever way it is filled).
// Whole units in pages of >= 128 keys: thread 0 issues the two TMA boxes (its arrival carries the
// bytes), the others just arrive. Otherwise (the last unit of the CTA's prefix, smaller pages) thread
// (row r0 = tid / 16 in 0..7, 16-byte column ch) copies rows r0 + 8 it by cp.async, keys past
// pos_max zero-filled: masked anyway, and zeros keep stale V rows (which may hold anything) out of
// P.V, where 0 x NaN would not vanish.
template <int kStages>
__device__ __forceinline__ void produce(const FaArgs& fa, unsigned char* smem, const Bars<kStages>& bars, int g, int s,
                                        int n_units, int pos_max, int tid) {
  using L = Layout<kStages>;
  const DenseArgs& a = fa.d;
  const int ch = tid & 15, r0 = tid >> 4;
  const uint32_t so = sw_off(r0, ch);  // + 1 KB per 8 rows (the swizzle repeats every 8)
  const int32_t* table = a.block_tables + int64_t(s) * a.max_blocks;
  const int bs = 1 << a.bs_shift;
  const int64_t row_step = int64_t(8) * a.kv_heads * kHeadDim;  // elements between a thread's rows
  for (int u = 0; u < n_units; ++u) {
    const int st = u % kStages;
    const uint32_t par = uint32_t((u / kStages) & 1) ^ 1u;
    const int kb = u * kUnitKeys;
    const bool by_tma = bs >= kUnitKeys && kb + kUnitKeys - 1 <= pos_max;
    int64_t slot0 = 0;
    if (bs >= kUnitKeys && (!by_tma || tid == 0)) slot0 = int64_t(__ldg(table + (kb >> a.bs_shift))) * bs + (kb & (bs - 1));
    const int64_t e0 = ((slot0 + r0) * a.kv_heads + g) * kHeadDim + ch * 8;
    for (int kv = 0; kv < 2; ++kv) {
      if (u >= kStages) mbar_wait(kv ? bars.empty_v(st) : bars.empty_k(st), par);
      const uint32_t bar = kv ? bars.full_v(st) : bars.full_k(st);
      const uint32_t tile = smem_u32(smem + (kv ? L::kVOff : L::kKOff) + size_t(st) * kTile);
      if (by_tma) {
        if (tid == 0) {
          const CUtensorMap* map = kv ? &fa.map_v : &fa.map_k;
          tma::arrive_expect_tx(bar, uint32_t(kTile));
          tma::load_3d(tile, map, 0, g, int(slot0), bar);
          tma::load_3d(tile + uint32_t(kTile / 2), map, 64, g, int(slot0), bar);
        } else {
          mbar_arrive(bar);
        }
        continue;
      }
      const __nv_bfloat16* src = kv ? a.v : a.k;
#pragma unroll 4
      for (int it = 0; it < kUnitKeys / 8; ++it) {
        const int j = kb + r0 + 8 * it;
        const bool ok = j <= pos_max;
        int64_t e;
        if (bs >= kUnitKeys) {
          e = ok ? e0 + it * row_step : 0;
        } else {
          const int64_t slot = ok ? int64_t(__ldg(table + (j >> a.bs_shift))) * bs + (j & (bs - 1)) : 0;
          e = ok ? (slot * a.kv_heads + g) * kHeadDim + ch * 8 : 0;
        }
        cp_async16(tile + so + uint32_t(it * 1024), src + e, ok);
      }
      cp_async_arrive_noinc(bar);
    }
  }
  msa::cp_async_wait<0>();
}

template <int kStages>
__global__ void __launch_bounds__(kThreads, 1) msa_dense_fa_kernel(const __grid_constant__ FaArgs fa) {
  const DenseArgs& a = fa.d;
  using L = Layout<kStages>;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* const smem = wgmma::align_1024(smem_raw);
  int* const pos_s = reinterpret_cast<int*>(smem + L::kPosOff);
  int* const info = reinterpret_cast<int*>(smem + L::kInfoOff);
  const Bars<kStages> bars{smem_u32(smem + L::kBarOff)};
  const int tid = int(threadIdx.x), warp = tid >> 5, lane = tid & 31, wg = tid >> 7;
  const int g = int(blockIdx.x % unsigned(a.kv_heads));
  if (warp == 0) {
    const bool ok = msa::find_dense_tile(a, int(blockIdx.x / unsigned(a.kv_heads)), info);
    if (lane == 0 && !ok) info[2] = 0;
  }
  if (tid == 32) {
    for (int st = 0; st < kStages; ++st) {
      mbar_init(bars.full_k(st), 128);
      mbar_init(bars.full_v(st), 128);
      mbar_init(bars.empty_k(st), 8);
      mbar_init(bars.empty_v(st), 8);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  const int T = info[2];
  if (T == 0) return;
  const int s = info[0], t0 = info[1];
  // The previous kernel (the attention prologue) writes Q and the new K/V rows: wait first.
  pdl_wait();
  if (warp == 0) {
    int mx = -1, mn = INT_MAX;
    for (int t = lane; t < T; t += 32) {
      const int p = a.positions[t0 + t];
      pos_s[t] = p;
      mx = max(mx, p);
      mn = min(mn, p);
    }
    mx = __reduce_max_sync(0xffffffffu, mx);
    mn = __reduce_min_sync(0xffffffffu, mn);
    if (lane == 0) info[3] = mx, info[4] = mn;
  }
  __syncthreads();
  const int pos_max = info[3], pos_min = info[4];
  const int n_units = pos_max / kUnitKeys + 1;

  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegs));
    produce(fa, smem, bars, g, s, n_units, pos_max, tid);
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegs));
  const int G = a.group, rows = T * G, cw = wg - 1, ct = tid - 128;
  const int gq = lane >> 2, cq = lane & 3;
  const float sl2 = a.scale_log2;

  // Q rows as bf16 (rows past the tile are zero), by both consumer warpgroups.
  for (int i = ct; i < kRows * (kHeadDim / 8); i += 256) {
    const int row = i >> 4, ch = i & 15;
    float x[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    if (row < rows) {
      const float* src = a.q + (int64_t(t0 + row / G) * a.q_heads + g * G + row % G) * kHeadDim + ch * 8;
      const float4 u = __ldg(reinterpret_cast<const float4*>(src)), w = __ldg(reinterpret_cast<const float4*>(src) + 1);
      x[0] = u.x, x[1] = u.y, x[2] = u.z, x[3] = u.w, x[4] = w.x, x[5] = w.y, x[6] = w.z, x[7] = w.w;
    }
    uint4 h;
    h.x = msa::bf16x2_bits(__floats2bfloat162_rn(x[0], x[1]));
    h.y = msa::bf16x2_bits(__floats2bfloat162_rn(x[2], x[3]));
    h.z = msa::bf16x2_bits(__floats2bfloat162_rn(x[4], x[5]));
    h.w = msa::bf16x2_bits(__floats2bfloat162_rn(x[6], x[7]));
    *reinterpret_cast<uint4*>(smem + L::kQOff + sw_off(row, ch)) = h;
  }
  wgmma::fence_proxy_async();
  asm volatile("bar.sync 1, 256;\n" ::: "memory");

  const int r0 = 64 * cw + 16 * (warp & 3) + gq, r1 = r0 + 8;
  const int pos0 = r0 < rows ? pos_s[r0 / G] : -1, pos1 = r1 < rows ? pos_s[r1 / G] : -1;
  const uint32_t q_tile = smem_u32(smem + L::kQOff) + uint32_t(64 * cw * 128);

  float o[64], sc[64];
  uint32_t p[8][4];
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = 0.0f;
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) p[kk][0] = p[kk][1] = p[kk][2] = p[kk][3] = 0u;

  // P_{u-1} V_{u-1}: issued after S_u (so S_u, which the softmax waits for, finishes first).
  auto issue_pv = [&](int u) {
    const int st = u % kStages;
    mbar_wait(bars.full_v(st), uint32_t((u / kStages) & 1));
    wgmma::fence_proxy_async();  // the copies were generic-proxy writes; wgmma reads through the async proxy
    const uint32_t v_tile = smem_u32(smem + L::kVOff + size_t(st) * kTile);
    wgmma::fence_regs(o);
    wgmma::fence_regs(p);
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) wgmma::WgmmaRS128TransB::run(o, p[kk], wgmma::desc_sw128_mn(v_tile + uint32_t(kk * 2048), 16384));
    wgmma::commit();
  };

  // One unit's step. The first unit is peeled (kFirst: no P.V before it) so that the loop body waits
  // on the same wgmma groups every time: with the branch inside the loop ptxas could not prove which
  // group `wgmma.wait_group 1` retires and serialised every wgmma (C7513; a wait after each HGMMA).
  auto step = [&](int u, auto first) {
    constexpr bool kFirst = decltype(first)::value;
    const int st = u % kStages;
    const int kb = u * kUnitKeys;
    mbar_wait(bars.full_k(st), uint32_t((u / kStages) & 1));
    wgmma::fence_proxy_async();
    const uint32_t k_tile = smem_u32(smem + L::kKOff + size_t(st) * kTile);
#pragma unroll
    for (int i = 0; i < 64; ++i) sc[i] = 0.0f;
    wgmma::fence_regs(sc);
    wgmma::fence();
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) {
      const uint32_t off = uint32_t((ks >> 2) * kTile / 2 + (ks & 3) * 32);
      wgmma::WgmmaSS<128>::run(sc, wgmma::desc_sw128(q_tile + off), wgmma::desc_sw128(k_tile + off));
    }
    wgmma::commit();
    if constexpr (kFirst) {
      wgmma::wait<0>();
    } else {
      issue_pv(u - 1);
      wgmma::wait<1>();
    }
    wgmma::fence_regs(sc);
    if (lane == 0) mbar_arrive(bars.empty_k(st));

    // Softmax of unit u (log2 domain): mask, row max over the quad, probabilities in place.
    if (kb + kUnitKeys - 1 > pos_min) {
#pragma unroll
      for (int i = 0; i < 64; ++i) {
        const int key = kb + 8 * (i >> 2) + 2 * cq + (i & 1);
        if (key > ((i & 2) ? pos1 : pos0)) sc[i] = -INFINITY;
      }
    }
    float x0 = -INFINITY, x1 = -INFINITY;
#pragma unroll
    for (int i = 0; i < 64; i += 4) {
      x0 = fmaxf(x0, fmaxf(sc[i], sc[i + 1]));
      x1 = fmaxf(x1, fmaxf(sc[i + 2], sc[i + 3]));
    }
    x0 = fmaxf(x0, __shfl_xor_sync(0xffffffffu, x0, 1));
    x1 = fmaxf(x1, __shfl_xor_sync(0xffffffffu, x1, 1));
    x0 = fmaxf(x0, __shfl_xor_sync(0xffffffffu, x0, 2));
    x1 = fmaxf(x1, __shfl_xor_sync(0xffffffffu, x1, 2));
    const float n0 = fmaxf(m0, x0 * sl2), n1 = fmaxf(m1, x1 * sl2);
    const float al0 = m0 == -INFINITY ? 0.0f : ex2(m0 - n0), al1 = m1 == -INFINITY ? 0.0f : ex2(m1 - n1);
    const float b0 = n0 == -INFINITY ? 0.0f : n0, b1 = n1 == -INFINITY ? 0.0f : n1;
    m0 = n0;
    m1 = n1;
    float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
    for (int i = 0; i < 64; i += 4) {
      sc[i] = msa::unit_prob(sc[i], b0, sl2);
      sc[i + 1] = msa::unit_prob(sc[i + 1], b0, sl2);
      sc[i + 2] = msa::unit_prob(sc[i + 2], b1, sl2);
      sc[i + 3] = msa::unit_prob(sc[i + 3], b1, sl2);
      s0 += sc[i] + sc[i + 1];
      s1 += sc[i + 2] + sc[i + 3];
    }
    l0 = fmaf(l0, al0, s0);
    l1 = fmaf(l1, al1, s1);
    if constexpr (!kFirst) {
      wgmma::wait<0>();
      wgmma::fence_regs(o);
      wgmma::fence_regs(p);
      if (lane == 0) mbar_arrive(bars.empty_v((u - 1) % kStages));
    }
#pragma unroll
    for (int i = 0; i < 64; ++i) o[i] *= (i & 2) ? al1 : al0;
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {
      p[kk][0] = msa::bf16x2_bits(__floats2bfloat162_rn(sc[8 * kk + 0], sc[8 * kk + 1]));
      p[kk][1] = msa::bf16x2_bits(__floats2bfloat162_rn(sc[8 * kk + 2], sc[8 * kk + 3]));
      p[kk][2] = msa::bf16x2_bits(__floats2bfloat162_rn(sc[8 * kk + 4], sc[8 * kk + 5]));
      p[kk][3] = msa::bf16x2_bits(__floats2bfloat162_rn(sc[8 * kk + 6], sc[8 * kk + 7]));
    }
    };
  step(0, std::true_type{});
#pragma unroll 1
  for (int u = 1; u < n_units; ++u) step(u, std::false_type{});
  issue_pv(n_units - 1);
  wgmma::wait<0>();
  wgmma::fence_regs(o);

  l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
  l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = h ? r1 : r0;
    if (r >= rows) continue;
    const float inv = 1.0f / (h ? l1 : l0);
    float* row = a.out + (int64_t(t0 + r / G) * a.q_heads + g * G + r % G) * kHeadDim;
#pragma unroll
    for (int nt = 0; nt < 16; ++nt) {
      const int i = 4 * nt + 2 * h;
      *reinterpret_cast<float2*>(row + 8 * nt + 2 * cq) = make_float2(o[i] * inv, o[i + 1] * inv);
    }
  }
}

}  // namespace

void launch_msa_attention_dense_prefill_fast(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                                             const ops::AttentionMetadata& meta, const TensorView& out) {
  if (!msa::dense_prefill_takes(q, k_cache, v_cache, meta, out)) return;
  const FaArgs fa = msa::dense_tma_args(q, k_cache, v_cache, meta, out);
  const auto kernel = msa_dense_fa_kernel<kDenseFaStages>;
  constexpr size_t smem = Layout<kDenseFaStages>::kSmem;
  M3_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  launch_kernel(kernel, dim3(msa::dense_ctas(fa.d, q.shape[0])), dim3(kThreads), smem, true, fa);
}

}  // namespace m3::cuda
