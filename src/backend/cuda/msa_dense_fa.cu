// Dense causal attention for prefill without batch invariance (sm_90a): M3's dense layers (0-2),
// BF16 KV cache, head_dim 128, Q and P rounded to bf16, fp32 accumulation and softmax.
//
// The canonical kernel (msa_dense_prefill.cu) keeps the query-major kernel's numerics: units
// folded in super-units of 8, row sums by MMA against ones, every warp copying K/V and waiting on
// __syncthreads per unit. Without batch invariance none of that is needed, and the time goes to
// what runs between the MMAs (thirty-fifth round). This kernel is laid out as FlashAttention-3
// lays out a forward pass on Hopper:
//   WG0 (producer, few registers): cp.async of each 128-key unit's K and V (through the page
//       table) into a ring of stages, arriving on the stage's full barrier; waits for the
//       consumers to release a stage (K after S, V after P.V) before refilling it.
//   WG1, WG2 (consumers): 64 rows each of the CTA's 128 (the KV group's query heads of 128 / G
//       consecutive tokens). Per unit u: issue S_u = Q K_u^T, then P_{u-1} V_{u-1}, wait for S_u
//       alone and run unit u's softmax while the tensor cores do P_{u-1} V_{u-1}; then rescale O.
// The row max and the scaled exponent are fp32 (exp2 of s * log2(e) / sqrt(d) - m); the row sums
// add the fp32 probabilities (the bf16 rounding of P is unbiased; the parity bound is the fast
// variants' 1e-2 of max|ref|).
#include <cuda_bf16.h>

#include <algorithm>
#include <climits>
#include <cmath>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_internal.h"
#include "backend/cuda/mma_operands.cuh"
#include "backend/cuda/msa.h"
#include "backend/cuda/msa_common.cuh"
#include "backend/cuda/wgmma.cuh"

namespace m3::cuda {
namespace {

using mma_ops::cp_async_arrive_noinc;
using mma_ops::mbar_arrive;
using mma_ops::mbar_init;
using mma_ops::mbar_wait;
using msa::cp_async16;
using msa::kHeadDim;
using msa::kUnitKeys;
using msa::smem_u32;

constexpr int kThreads = 384;  // producer + two consumer warpgroups
constexpr int kRows = 128;     // (token, head) rows of a CTA
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

__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

struct FaArgs {
  const float* q;  // [tokens, q_heads, 128]
  float* out;      // [tokens, q_heads, 128]
  const __nv_bfloat16* k;  // [slots, kv_heads, 128]
  const __nv_bfloat16* v;
  const int32_t* query_start;
  const int32_t* positions;
  const int32_t* block_tables;
  int num_seqs, max_blocks, bs_shift, kv_heads, q_heads, group, tile_tokens;
  float scale_log2;
};

// The CTA's tile x (tiles are the sequences' runs of tile_tokens tokens numbered from the end, so
// the longest causal prefixes start first): info = (sequence, first token, tokens); warp 0.
__device__ __forceinline__ bool find_tile(const FaArgs& a, int x, int* info) {
  const int lane = threadIdx.x & 31;
  int total = 0;
  for (int s0 = 0; s0 < a.num_seqs; s0 += 32) {
    const int s = s0 + lane;
    const int n = s < a.num_seqs ? (a.query_start[s + 1] - a.query_start[s] + a.tile_tokens - 1) / a.tile_tokens : 0;
    total += __reduce_add_sync(0xffffffffu, n);
  }
  if (x >= total) return false;
  const int want = total - 1 - x;
  int before = 0;
  for (int s0 = 0; s0 < a.num_seqs; s0 += 32) {
    const int s = s0 + lane;
    const int n = s < a.num_seqs ? (a.query_start[s + 1] - a.query_start[s] + a.tile_tokens - 1) / a.tile_tokens : 0;
    const int incl = msa::warp_inclusive_scan(n);
    const bool mine = s < a.num_seqs && before + incl - n <= want && want < before + incl;
    if (__ballot_sync(0xffffffffu, mine) != 0) {
      if (mine) {
        const int q0 = a.query_start[s] + (want - (before + incl - n)) * a.tile_tokens;
        info[0] = s;
        info[1] = q0;
        info[2] = min(a.tile_tokens, a.query_start[s + 1] - q0);
      }
      return true;
    }
    before += __shfl_sync(0xffffffffu, incl, 31);
  }
  return false;
}

// d (64 x 128 fp32) += A (registers, the m16n8k16 A layout per warp) x B (MN-major descriptor over
// both 64-wide halves of the dims, `lbo` bytes apart), bf16.
__device__ __forceinline__ void wgmma_rs128_tb(float (&d)[64], const uint32_t (&a)[4], uint64_t db) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\nwgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, "
               "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, "
               "%43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
               "{%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                 "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                 "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                 "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
                 "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
                 "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
                 "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
                 "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}

template <int kStages>
struct Bars {
  uint32_t base;
  __device__ __forceinline__ uint32_t full_k(int s) const { return base + 8u * uint32_t(s); }
  __device__ __forceinline__ uint32_t full_v(int s) const { return base + 8u * uint32_t(kStages + s); }
  __device__ __forceinline__ uint32_t empty_k(int s) const { return base + 8u * uint32_t(2 * kStages + s); }
  __device__ __forceinline__ uint32_t empty_v(int s) const { return base + 8u * uint32_t(3 * kStages + s); }
};

// WG0: unit u's K, then its V, into stage u % kStages once the consumers released it. Thread
// (row r0 = tid / 16 in 0..7, 16-byte column ch) copies rows r0 + 8 it; keys past pos_max are
// zero-filled (masked anyway). Pages of >= 128 keys hold whole units: one page lookup per unit.
template <int kStages>
__device__ __forceinline__ void produce(const FaArgs& a, unsigned char* smem, const Bars<kStages>& bars, int g, int s,
                                        int n_units, int pos_max, int tid) {
  using L = Layout<kStages>;
  const int ch = tid & 15, r0 = tid >> 4;
  const uint32_t so = sw_off(r0, ch);  // + 1 KB per 8 rows (the swizzle repeats every 8)
  const int32_t* table = a.block_tables + int64_t(s) * a.max_blocks;
  const int bs = 1 << a.bs_shift;
  const int64_t row_step = int64_t(8) * a.kv_heads * kHeadDim;  // elements between a thread's rows
  for (int u = 0; u < n_units; ++u) {
    const int st = u % kStages;
    const uint32_t par = uint32_t((u / kStages) & 1) ^ 1u;
    const int kb = u * kUnitKeys;
    int64_t e0 = 0;
    if (bs >= kUnitKeys) {
      const int64_t slot0 = int64_t(__ldg(table + (kb >> a.bs_shift))) * bs + (kb & (bs - 1)) + r0;
      e0 = (slot0 * a.kv_heads + g) * kHeadDim + ch * 8;
    }
    for (int kv = 0; kv < 2; ++kv) {
      if (u >= kStages) mbar_wait(kv ? bars.empty_v(st) : bars.empty_k(st), par);
      const __nv_bfloat16* src = kv ? a.v : a.k;
      const uint32_t dst = smem_u32(smem + (kv ? L::kVOff : L::kKOff) + size_t(st) * kTile) + so;
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
        cp_async16(dst + uint32_t(it * 1024), src + e, ok);
      }
      cp_async_arrive_noinc(kv ? bars.full_v(st) : bars.full_k(st));
    }
  }
  msa::cp_async_wait<0>();
}

template <int kStages>
__global__ void __launch_bounds__(kThreads, 1) msa_dense_fa_kernel(const __grid_constant__ FaArgs a) {
  using L = Layout<kStages>;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* const smem = wgmma::align_1024(smem_raw);
  int* const pos_s = reinterpret_cast<int*>(smem + L::kPosOff);
  int* const info = reinterpret_cast<int*>(smem + L::kInfoOff);
  const Bars<kStages> bars{smem_u32(smem + L::kBarOff)};
  const int tid = int(threadIdx.x), warp = tid >> 5, lane = tid & 31, wg = tid >> 7;
  const int g = int(blockIdx.x % unsigned(a.kv_heads));
  if (warp == 0) {
    const bool ok = find_tile(a, int(blockIdx.x / unsigned(a.kv_heads)), info);
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
    produce(a, smem, bars, g, s, n_units, pos_max, tid);
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
    for (int kk = 0; kk < 8; ++kk) wgmma_rs128_tb(o, p[kk], wgmma::desc_sw128_mn(v_tile + uint32_t(kk * 2048), 16384));
    wgmma::commit();
  };

#pragma unroll 1
  for (int u = 0; u < n_units; ++u) {
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
    if (u > 0) {
      issue_pv(u - 1);
      wgmma::wait<1>();
    } else {
      wgmma::wait<0>();
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
      sc[i] = ex2(fmaf(sc[i], sl2, -b0));
      sc[i + 1] = ex2(fmaf(sc[i + 1], sl2, -b0));
      sc[i + 2] = ex2(fmaf(sc[i + 2], sl2, -b1));
      sc[i + 3] = ex2(fmaf(sc[i + 3], sl2, -b1));
      s0 += sc[i] + sc[i + 1];
      s1 += sc[i + 2] + sc[i + 3];
    }
    l0 = fmaf(l0, al0, s0);
    l1 = fmaf(l1, al1, s1);
    if (u > 0) {
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
  }
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
  const int64_t tokens = q.shape[0];
  if (tokens == 0) return;
  if (!msa_dense_prefill_refusal(msa_attn_shape(q, k_cache, v_cache, meta, {}, 0)).empty()) {
    return launch_msa_attention(q, k_cache, v_cache, meta, {}, 0, out);
  }
  FaArgs a{};
  a.q = q.as<const float>();
  a.out = out.as<float>();
  a.k = k_cache.as<const __nv_bfloat16>();
  a.v = v_cache.as<const __nv_bfloat16>();
  a.query_start = meta.query_start;
  a.positions = meta.positions;
  a.block_tables = meta.block_tables;
  a.num_seqs = meta.num_seqs;
  a.max_blocks = std::max(1, meta.max_blocks_per_seq);
  a.bs_shift = 0;
  while ((1 << a.bs_shift) < meta.block_size) ++a.bs_shift;
  a.q_heads = int(q.shape[1]);
  a.kv_heads = int(k_cache.shape[1]);
  a.group = a.q_heads / a.kv_heads;
  a.tile_tokens = kRows / a.group;
  a.scale_log2 = float(1.4426950408889634 / std::sqrt(double(kHeadDim)));
  // Tiles at most: every sequence's last run may be partial.
  const int64_t tiles = (tokens + a.tile_tokens - 1) / a.tile_tokens + meta.num_seqs;
  const auto kernel = msa_dense_fa_kernel<kDenseFaStages>;
  constexpr size_t smem = Layout<kDenseFaStages>::kSmem;
  M3_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  launch_kernel(kernel, dim3(unsigned(tiles * a.kv_heads)), dim3(kThreads), smem, true, a);
}

}  // namespace m3::cuda
