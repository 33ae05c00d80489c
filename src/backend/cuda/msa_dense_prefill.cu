// Dense causal attention for prefill on wgmma (sm_90a): M3's dense layers (0-2), BF16 KV
// cache, head_dim 128, query heads per KV head <= 64.
//
// A CTA (two warpgroups, 256 threads) owns 128 rows of one (sequence, KV group): the group's
// query heads of up to 128 / G consecutive tokens (8 for M3's 16 heads per group), so each
// 128-key unit of K and V is read from L2 once for all of them (the query-major kernel shares
// a unit among 4 tokens on mma.sync). K and V arrive two units in flight: by TMA where the unit
// lies whole in the causal prefix of pages of >= 128 keys (-2.7 to -2.9 % at 8K / 32K on an H200,
// thirty-ninth round), else by cp.async; per unit, each warpgroup runs its 64 rows:
//   S   = per 16-dim step, Q's bf16 hi then lo half (from shared memory), m64n128k16 over the
//         unit's keys;
//   P   = the canonical masked probabilities, split into bf16 hi + lo in registers;
//   O   = per 16-key step, hi then lo, m64n64k16 over one half of the dims at a time, V read
//         transposed by its descriptor (MN-major);
//   sum = the same steps against a tile of ones.
// Units are folded in registers within a super-unit of 8 (by absolute position), super-units
// into the outer state, which waits in the output rows (fp32, L2) between super-units.
//
// Numerics: the canonical computation of docs/msa_kernels.md ("Batch invariance"), the same
// fragments and MMA order as the query-major kernel (msa_decode.cu), so the result equals it
// bit for bit: a wgmma m64nNk16 chain with A from registers gives the fp32 bits of the mma.sync
// m16n8k16 chain over the same operands (tools/wgmma_probe), units a row does not see are
// exact identities of the fold, and the super-units are the same 8-unit ranges.
// Without batch invariance the dense prefill runs msa_dense_fa.cu instead.
#include <cuda_bf16.h>

#include <algorithm>
#include <climits>
#include <cmath>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_internal.h"
#include "backend/cuda/msa.h"
#include "backend/cuda/msa_common.cuh"
#include "backend/cuda/mma_operands.cuh"
#include "backend/cuda/msa_dense_tiles.cuh"
#include "backend/cuda/tma.cuh"
#include "backend/cuda/wgmma.cuh"

namespace m3::cuda {
namespace {

using msa::cp_async16;
using msa::DenseArgs;
using msa::cp_async_commit;
using msa::cp_async_wait;
using msa::FoldScale;
using msa::kHeadDim;
using msa::kUnitKeys;
using msa::smem_u32;

constexpr int kThreads = 256;  // two warpgroups
constexpr int kRows = msa::kDenseRows;
constexpr int kMaxGroup = 64;  // the query-major kernel's limit (same numerics for decode)
constexpr int kSuUnits = 8;    // units per super-unit (msa_decode.cu's kDenseSuUnits)

// Shared memory (from a 1024-byte aligned base). K, V and Q are all [dim half][row][128 B] with
// the 128-byte swizzle (16-byte chunk c of row r at c ^ (r & 7)): K-major for K (S's B) and Q
// (S's A), MN-major for V (P.V's B, transposed by the descriptor).
constexpr size_t kStage = 32768;                          // K or V of one unit
constexpr size_t kKOff = 0;                               // 2 stages of K
constexpr size_t kVOff = kKOff + 2 * kStage;              // 2 stages of V
constexpr size_t kQhOff = kVOff + 2 * kStage;             // Q hi
constexpr size_t kQlOff = kQhOff + size_t(kRows) * 256;   // Q lo
constexpr size_t kOnesOff = kQlOff + size_t(kRows) * 256; // 8 rows x 128 B of bf16 ones
constexpr size_t kPosOff = kOnesOff + 1024;               // positions of the CTA's tokens
constexpr size_t kTileOff = kPosOff + size_t(kRows) * 4;  // (sequence, first token, tokens)
constexpr size_t kBarOff = kTileOff + 16;                 // 2 mbarriers: a stage's K and V by TMA
constexpr size_t kSmem = kBarOff + 16 + 1024;             // + 1024: base alignment
static_assert(kSmem <= 232448, "shared memory");

__global__ void __launch_bounds__(kThreads, 1) msa_dense_prefill_kernel(const __grid_constant__ msa::DenseTmaArgs ta) {
  const DenseArgs& a = ta.d;
  extern __shared__ unsigned char smem_raw[];
  // Aligned through an integer, so the compiler accesses this buffer by generic LD / ST: the
  // LDS form (wgmma::align_1024) measured 2-3 % slower for this kernel (thirty-fifth session).
  unsigned char* const smem =
      reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  int* const pos_s = reinterpret_cast<int*>(smem + kPosOff);
  int* const tile_s = reinterpret_cast<int*>(smem + kTileOff);
  const uint32_t bar0 = smem_u32(smem + kBarOff);  // + 8 for stage 1
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, cq = lane & 3;
  const int g = int(blockIdx.x % unsigned(a.kv_heads));
  if (warp == 0) {
    const bool ok = msa::find_dense_tile(a, int(blockIdx.x / unsigned(a.kv_heads)), tile_s);
    if (lane == 0 && !ok) tile_s[2] = 0;
  }
  if (tid == 32) {
    mma_ops::mbar_init(bar0, 1);
    mma_ops::mbar_init(bar0 + 8, 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  const int T = tile_s[2];
  if (T == 0) return;
  const int s = tile_s[0], t0 = tile_s[1], G = a.group, rows = T * G;
  const float sl2 = a.scale_log2;

  // Q rows as bf16 hi / lo tiles (rows past the tile are zero), the positions, the ones tile.
  // The previous kernel (the attention prologue) writes Q and the new K/V rows: wait first.
  pdl_wait();
  for (int i = tid; i < kRows * (kHeadDim / 8); i += kThreads) {
    const int row = i / (kHeadDim / 8), ch = i % (kHeadDim / 8);
    uint4 hi, lo;
    msa::q_chunk_hilo(a.q, a.q_heads, t0, g, G, row, rows, ch, hi, lo);
    *reinterpret_cast<uint4*>(smem + kQhOff + msa::sw128_off(row, ch, kRows)) = hi;
    *reinterpret_cast<uint4*>(smem + kQlOff + msa::sw128_off(row, ch, kRows)) = lo;
  }
  if (tid < T) pos_s[tid] = a.positions[t0 + tid];
  for (int i = tid; i < 256; i += kThreads) reinterpret_cast<uint32_t*>(smem + kOnesOff)[i] = msa::kBf16OnePair;
  __syncthreads();
  int pos_max = 0, pos_min = INT_MAX;
  for (int t = 0; t < T; ++t) pos_max = max(pos_max, pos_s[t]), pos_min = min(pos_min, pos_s[t]);
  const int n_units = pos_max / kUnitKeys + 1;
  const int32_t* table = a.block_tables + int64_t(s) * a.max_blocks;
  const int bs = 1 << a.bs_shift;

  // Unit u's K and V into stage u % 2. Units that lie whole in the causal prefix of pages of >= 128
  // keys (a prefix of the units: all but the CTA's last, mostly) by TMA: thread 0 issues K and V as
  // two 64-dim boxes each, on the stage's mbarrier (phase u / 2: every earlier unit of the stage
  // came the same way). Others by cp.async: thread (row r0 = tid / 16, 16-byte column ch) copies
  // rows r0 + 16 it, keys past pos_max zero-filled (masked anyway, and zeros keep stale V rows, which
  // may hold NaN, out of P.V); pages of >= 128 keys hold whole units: one page lookup, the rows a
  // fixed stride apart.
  const int n_tma = bs >= kUnitKeys ? (pos_max + 1) / kUnitKeys : 0;
  const int ld_ch = tid & 15, ld_r0 = tid >> 4;
  const uint32_t ld_so = msa::sw128_off(ld_r0, ld_ch, kUnitKeys);  // + 2 KB per 16 rows (the swizzle repeats every 8)
  const uint32_t ld_step = uint32_t(16 * a.kv_heads * kHeadDim);  // elements between a thread's rows
  auto load_unit = [&](int u) {
    const int kb = u * kUnitKeys;
    if (u < n_tma) {
      if (tid == 0) {
        const uint32_t bar = bar0 + 8u * uint32_t(u & 1);
        const uint32_t kt = smem_u32(smem + kKOff + size_t(u & 1) * kStage);
        const uint32_t vt = smem_u32(smem + kVOff + size_t(u & 1) * kStage);
        const int slot0 = int(__ldg(table + (kb >> a.bs_shift))) * bs + (kb & (bs - 1));
        tma::arrive_expect_tx(bar, uint32_t(2 * kStage));
        tma::load_3d(kt, &ta.map_k, 0, g, slot0, bar);
        tma::load_3d(kt + uint32_t(kStage / 2), &ta.map_k, 64, g, slot0, bar);
        tma::load_3d(vt, &ta.map_v, 0, g, slot0, bar);
        tma::load_3d(vt + uint32_t(kStage / 2), &ta.map_v, 64, g, slot0, bar);
      }
      return;
    }
    const uint32_t kd = smem_u32(smem + kKOff + size_t(u & 1) * kStage) + ld_so;
    const uint32_t vd = smem_u32(smem + kVOff + size_t(u & 1) * kStage) + ld_so;
    if (bs >= kUnitKeys) {
      const int64_t slot0 = int64_t(__ldg(table + (kb >> a.bs_shift))) * bs + (kb & (bs - 1)) + ld_r0;
      const int64_t e0 = (slot0 * a.kv_heads + g) * kHeadDim + ld_ch * 8;
      const __nv_bfloat16 *k0 = a.k + e0, *v0 = a.v + e0;
#pragma unroll
      for (int it = 0; it < kUnitKeys / 16; ++it) {
        const bool ok = kb + ld_r0 + 16 * it <= pos_max;
        const uint32_t e = ok ? uint32_t(it) * ld_step : 0u;  // (a copy of 0 bytes reads nothing)
        cp_async16(kd + uint32_t(it * 2048), k0 + e, ok);
        cp_async16(vd + uint32_t(it * 2048), v0 + e, ok);
      }
    } else {
#pragma unroll
      for (int it = 0; it < kUnitKeys / 16; ++it) {
        const int j = kb + ld_r0 + 16 * it;
        const bool ok = j <= pos_max;
        const int64_t slot = ok ? int64_t(__ldg(table + (j >> a.bs_shift))) * bs + (j & (bs - 1)) : 0;
        const int64_t e = ok ? (slot * a.kv_heads + g) * kHeadDim + ld_ch * 8 : 0;
        cp_async16(kd + uint32_t(it * 2048), a.k + e, ok);
        cp_async16(vd + uint32_t(it * 2048), a.v + e, ok);
      }
    }
    cp_async_commit();
  };
  load_unit(0);

  const uint32_t q_hi = smem_u32(smem + kQhOff), q_lo = smem_u32(smem + kQlOff), ones = smem_u32(smem + kOnesOff);
  const int wg = warp >> 2, wg_row0 = 64 * wg;  // the warpgroup and its first row
  const int r0 = 16 * warp + gq, r1 = r0 + 8;
  const int pos0 = r0 < rows ? pos_s[r0 / G] : -1, pos1 = r1 < rows ? pos_s[r1 / G] : -1;
  auto out_row = [&](int r) { return a.out + (int64_t(t0 + r / G) * a.q_heads + g * G + r % G) * kHeadDim; };

  float io[64];  // the super-unit's state: rows r0 / r1, dims 64 dh + 8 dt + 2 cq (+1) at 32 dh + 4 dt + (0..3)
  float im0 = -INFINITY, im1 = -INFINITY, il0 = 0.0f, il1 = 0.0f;
  float om0 = -INFINITY, om1 = -INFINITY, ol0 = 0.0f, ol1 = 0.0f;  // the outer state (O in the output rows)
  bool outer_empty = true;
#pragma unroll
  for (int i = 0; i < 64; ++i) io[i] = 0.0f;

#pragma unroll 1
  for (int u = 0; u < n_units; ++u) {
    if (u < n_tma) {
      mma_ops::mbar_wait(bar0 + 8u * uint32_t(u & 1), uint32_t((u >> 1) & 1));
    } else {
      cp_async_wait<0>();
      wgmma::fence_proxy_async();
    }
    __syncthreads();  // unit u's K and V are in; every warpgroup is done with unit u - 1 (its stage)
    const int kb = u * kUnitKeys;
    const uint32_t k_tile = smem_u32(smem + kKOff + size_t(u & 1) * kStage);
    const uint32_t v_tile = smem_u32(smem + kVOff + size_t(u & 1) * kStage);
    // S: 16-dim steps ascending, hi then lo (the canonical chain). Warpgroup 1 issues its S after
    // warpgroup 0 (named barrier 1), so the tensor cores finish warpgroup 0's first and its
    // softmax runs under warpgroup 1's S. The next unit's copies are issued while S runs.
    float sa[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) sa[i] = 0.0f;
    if (wg == 1) asm volatile("bar.sync 1, 256;\n" ::: "memory");
    wgmma::fence_regs(sa);
    wgmma::fence();
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) {
      const uint32_t kq = uint32_t((ks >> 2) * kRows * 128 + wg_row0 * 128 + (ks & 3) * 32);
      const uint64_t dk = wgmma::desc_sw128(k_tile + uint32_t((ks >> 2) * 16384 + (ks & 3) * 32));
      wgmma::WgmmaSS<128>::run(sa, wgmma::desc_sw128(q_hi + kq), dk);
      wgmma::WgmmaSS<128>::run(sa, wgmma::desc_sw128(q_lo + kq), dk);
    }
    wgmma::commit();
    if (wg == 0) asm volatile("bar.arrive 1, 256;\n" ::: "memory");
    if (u + 1 < n_units) load_unit(u + 1);
    wgmma::wait<0>();
    wgmma::fence_regs(sa);
    {
      float m0, m1;
      uint32_t ph[8][4], pl[8][4];
      auto sv = [&](int nt, int e) -> float& { return sa[4 * nt + e]; };
      if (kb + kUnitKeys - 1 <= pos_min) {  // every key visible to every row (CTA-uniform): no masks
        msa::unit_probs(sv, kUnitKeys, 0, cq, INT_MAX, INT_MAX, sl2, m0, m1, ph, pl);
      } else {
        msa::unit_probs(sv, min(kUnitKeys, pos_max + 1 - kb), kb, cq, pos0, pos1, sl2, m0, m1, ph, pl);
      }
      const FoldScale f0 = msa::fold_scale(im0, m0, sl2), f1 = msa::fold_scale(im1, m1, sl2);
      // P.V per half of the dims (both halves in flight; the first folded while the second runs)
      // and the row sums, key steps ascending, hi then lo.
      float oa[2][32], lv[4] = {0, 0, 0, 0};
#pragma unroll
      for (int i = 0; i < 32; ++i) oa[0][i] = oa[1][i] = 0.0f;
      wgmma::fence_regs(oa[0]);
      wgmma::fence_regs(oa[1]);
      wgmma::fence_regs(lv);
      wgmma::fence();
#pragma unroll
      for (int dh = 0; dh < 2; ++dh) {
#pragma unroll
        for (int kk = 0; kk < 8; ++kk) {
          const uint64_t dv = wgmma::desc_sw128_mn(v_tile + uint32_t(dh * 16384 + kk * 2048), 16384);
          wgmma::WgmmaRS64TransB::run(oa[dh], ph[kk], dv);
          wgmma::WgmmaRS64TransB::run(oa[dh], pl[kk], dv);
          if (dh == 0) {
            const uint64_t d1 = wgmma::desc_sw128(ones);
            wgmma::WgmmaRS<true, 8>::run(lv, ph[kk], d1);
            wgmma::WgmmaRS<true, 8>::run(lv, pl[kk], d1);
          }
        }
        wgmma::commit();
      }
      wgmma::wait<1>();
      wgmma::fence_regs(oa[0]);
      wgmma::fence_regs(lv);
      il0 = msa::fold_val(il0, f0, lv[0]);
      il1 = msa::fold_val(il1, f1, lv[2]);
#pragma unroll
      for (int i = 0; i < 32; ++i) io[i] = msa::fold_val(io[i], (i & 2) ? f1 : f0, oa[0][i]);
      wgmma::wait<0>();
      wgmma::fence_regs(oa[1]);
#pragma unroll
      for (int i = 0; i < 32; ++i) io[32 + i] = msa::fold_val(io[32 + i], (i & 2) ? f1 : f0, oa[1][i]);
    }
    // Super-unit boundary: fold it into the outer state (O in the output rows between super-units).
    if (u + 1 == n_units || (u + 1) % kSuUnits == 0) {
      const bool last = u + 1 == n_units;
      const FoldScale f0 = msa::fold_scale(om0, im0, sl2), f1 = msa::fold_scale(om1, im1, sl2);
      ol0 = msa::fold_val(ol0, f0, il0);
      ol1 = msa::fold_val(ol1, f1, il1);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = h ? r1 : r0;
        if (r >= rows) continue;
        const FoldScale& f = h ? f1 : f0;
        const float l = h ? ol1 : ol0;
        float* row = out_row(r);
#pragma unroll
        for (int dh = 0; dh < 2; ++dh) {
#pragma unroll
          for (int dt = 0; dt < 8; ++dt) {
            float2* p = reinterpret_cast<float2*>(row + 64 * dh + 8 * dt + 2 * cq);
            const float2 prev = outer_empty ? make_float2(0.0f, 0.0f) : __ldcg(p);
            const int i = 32 * dh + 4 * dt + 2 * h;
            float2 o = make_float2(msa::fold_val(prev.x, f, io[i]), msa::fold_val(prev.y, f, io[i + 1]));
            if (last) o = make_float2(msa::finish(o.x, l), msa::finish(o.y, l));
            __stcg(p, o);
          }
        }
      }
      outer_empty = false;
      im0 = im1 = -INFINITY;
      il0 = il1 = 0.0f;
#pragma unroll
      for (int i = 0; i < 64; ++i) io[i] = 0.0f;
    }
  }
}

}  // namespace

std::string msa_dense_prefill_refusal(const MsaAttnShape& s) {
  if (!s.bf16) return "K/V caches are not BF16";
  if (s.head_dim != kHeadDim) return "head_dim is not 128";
  if (s.kv_heads < 1 || s.q_heads % s.kv_heads != 0) return "query heads are not a multiple of the KV heads";
  if (s.q_heads / s.kv_heads > kMaxGroup) return "more than 64 query heads per KV head";
  if (s.bs < 1 || (s.bs & (s.bs - 1)) != 0) return "page size is not a power of two";
  if (s.tokens >= (int64_t(1) << 24)) return "2^24 or more query tokens";
  return "";
}

int64_t msa_dense_prefill_tile_tokens(const MsaAttnShape& s) { return kRows / (s.q_heads / s.kv_heads); }

namespace {

void dense_prefill(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                   const ops::AttentionMetadata& meta, const TensorView& out) {
  if (!msa::dense_prefill_takes(q, k_cache, v_cache, meta, out)) return;
  const msa::DenseTmaArgs ta = msa::dense_tma_args(q, k_cache, v_cache, meta, out);
  const auto kernel = msa_dense_prefill_kernel;
  M3_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmem)));
  launch_kernel(kernel, dim3(msa::dense_ctas(ta.d, q.shape[0])), dim3(kThreads), kSmem, true, ta);
}

}  // namespace

void launch_msa_attention_dense_prefill(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                                        const ops::AttentionMetadata& meta, const TensorView& out) {
  dense_prefill(q, k_cache, v_cache, meta, out);
}

namespace {

// Dense prefills (a batch averaging >= 64 tokens per sequence) take the wgmma kernel (canonical or
// fast); decode, speculative verification and short chunks the query-major one.
void dense_entry(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                 const ops::AttentionMetadata& meta, const TensorView& selected, int top_k, const TensorView& out,
                 bool hilo) {
  // (dense_prefill hands the shapes it does not take to query-major itself.)
  if (selected.data == nullptr && q.shape[0] >= 64 * int64_t(std::max(1, meta.num_seqs)))
    return hilo ? dense_prefill(q, k_cache, v_cache, meta, out)
                : launch_msa_attention_dense_prefill_fast(q, k_cache, v_cache, meta, out);
  launch_msa_attention(q, k_cache, v_cache, meta, selected, top_k, out);
}

}  // namespace

void launch_msa_attention_dense(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                                const ops::AttentionMetadata& meta, const TensorView& selected, int top_k,
                                const TensorView& out) {
  dense_entry(q, k_cache, v_cache, meta, selected, top_k, out, true);
}

void launch_msa_attention_dense_fast(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                                     const ops::AttentionMetadata& meta, const TensorView& selected, int top_k,
                                     const TensorView& out) {
  dense_entry(q, k_cache, v_cache, meta, selected, top_k, out, false);
}

}  // namespace m3::cuda
