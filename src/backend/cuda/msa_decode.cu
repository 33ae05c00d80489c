// Paged GQA attention over a BF16 KV cache for decode and short multi-token queries (MSA
// block-sparse or dense), tuned for Hopper. head_dim 128.
//
// A CTA owns one row group of one (sequence, KV group): up to 64 query rows = the group's
// query heads of up to `tokens_per_group` consecutive tokens, so every K/V tile it loads is
// shared by all of them (the 16 heads of an M3 KV group form the MMA M dimension). Keys come
// in 64-key units through the page table (cp.async, 3 stages, XOR-swizzled shared memory),
// only from the union of the row group's selected blocks; per (row, key) a mask applies that
// token's own selection and the causal cut. Q.K^T and P.V run on bf16 tensor cores
// (mma.sync m16n8k16) with Q and P split into bf16 hi + lo halves (products keep ~16
// mantissa bits: about fp32 against the reference). Each unit's S is computed by the four
// warps over 16 keys each, staged in shared memory, and its P.V by the four warps over 32
// output dims each.
//
// Batch invariance. A row's result is one canonical computation whatever the batch, the row
// group, the split or the chunking: per 64-key unit (fixed by absolute key position) a partial
// (max, sum, P.V) relative to the unit's own max, with a fixed instruction sequence; units
// folded in ascending order within a super-unit (dense: 8 consecutive units by absolute
// position; sparse: each unit alone, so small batches split finely), super-units folded in
// ascending order, then divided. Units a row does not see are exact identities of the fold,
// so the other tokens of a row group change nothing. Splits take whole super-units: with one
// split the CTA folds them itself; with several, each writes its super-unit partials and the
// last CTA to finish (arrival counter) folds them, so small batches still fill the SMs in one
// launch. All arithmetic of the canonical path uses explicit rounding intrinsics (no
// contraction choices left to the compiler).
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_internal.h"
#include "backend/cuda/msa.h"
#include "backend/cuda/msa_common.cuh"

namespace m3::cuda {
namespace {

using msa::cp_async16;
using msa::cp_async_commit;
using msa::cp_async_wait;
using msa::smem_u32;

constexpr int kHeadDim = 128;
constexpr int kUnitKeys = 64;
constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
static_assert(kWarps * 16 == kUnitKeys && kWarps * 32 == kHeadDim, "warp w scores keys [16w, 16w+16) and outputs dims [32w, 32w+32)");
constexpr int kStages = 3;
constexpr int kTileBytes = kUnitKeys * kHeadDim * 2;  // K or V of one unit, 16 KB
constexpr int kStageBytes = 2 * kTileBytes;
constexpr int kMaxRows = 64;
constexpr int kMaxList = 512;      // selected ids of one row group (tokens x top_k), multi-token
constexpr int kMaxListDecode = 64; // one token: top_k <= 64
constexpr int kMaxTopK = 64;
constexpr int kMaxSplits = 64;
constexpr int kDenseSuUnits = 8;   // units per super-unit, dense (sparse: 1)
constexpr int kSStride = kUnitKeys + 4;  // padded rows of the staged scores
constexpr size_t kMaxPartialBytes = size_t(256) << 20;

__device__ unsigned g_attention_counters[msa::kMaxCounters];

template <int MT>
struct Layout {
  static constexpr int kList = MT == 1 ? kMaxListDecode : kMaxList;
  static constexpr size_t kStagesOff = 0;
  static constexpr size_t kQOff = size_t(kStages) * kStageBytes;               // Q hi, Q lo tiles
  static constexpr size_t kSOff = kQOff + size_t(2) * MT * 16 * kHeadDim * 2;  // staged scores
  static constexpr size_t kOuterOff = kSOff + size_t(MT) * 16 * kSStride * 4;  // MT=4: outer fold state
  static constexpr size_t kOuterBytes = MT == 1 ? 0 : size_t(MT) * 16 * kHeadDim * 4;
  static constexpr size_t kIdsOff = kOuterOff + kOuterBytes;
  static constexpr size_t kListOff = kIdsOff + kList * 4;
  static constexpr size_t kMasksOff = kListOff + kList * 4;
  static constexpr size_t kPosOff = kMasksOff + size_t(kList) * 8;
  static constexpr size_t kFirstOff = kPosOff + kMaxRows * 4;
  static constexpr size_t kBytes = kFirstOff + kList;
};

struct AttnArgs {
  const float* q;  // [tokens, q_heads, 128]
  float* out;      // [tokens, q_heads, 128]
  const __nv_bfloat16* k;  // [slots, kv_heads, 128]
  const __nv_bfloat16* v;
  const int32_t* sel;  // [kv_heads, tokens, top_k] or null (dense)
  const int32_t* query_start;
  const int32_t* positions;
  const int32_t* block_tables;
  float* part_o;    // [tokens, kv_heads, su_cap, MT*16, 128] super-unit partials (splits > 1)
  float2* part_ml;  // [tokens, kv_heads, su_cap, MT*16] (max, sum)
  unsigned* counters;
  int top_k, num_seqs, num_tokens, max_blocks, bs, q_heads, kv_heads, group, tokens_per_group, splits, su_cap;
  float scale_log2;  // log2(e) / sqrt(head_dim)
};

__device__ __forceinline__ uint32_t bf16x2_bits(__nv_bfloat162 v) { return *reinterpret_cast<uint32_t*>(&v); }

// (x0, x1) = hi + lo with hi, lo bf16 pairs (element 0 in the low half).
__device__ __forceinline__ void split_bf16(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(x0, x1);
  const float2 hf = __bfloat1622float2(h);
  hi = bf16x2_bits(h);
  lo = bf16x2_bits(__floats2bfloat162_rn(__fsub_rn(x0, hf.x), __fsub_rn(x1, hf.y)));
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

// Byte offset of 16-byte chunk `ch` of row `row` in a swizzled [rows][128] bf16 tile.
__device__ __forceinline__ uint32_t tile_off(int row, int ch) { return uint32_t(row * 256 + ((ch ^ (row & 7)) << 4)); }

// One step of the canonical fold: state (M, L, O) absorbs a partial (m, l, o), each relative
// to its own max. Identities (m = -inf, l = 0, o = 0) leave the state's bits unchanged.
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
__device__ __forceinline__ float finish(float o, float l) { return l > 0.0f ? __fdiv_rn(o, l) : 0.0f; }

// Per warp, for its 2 rows of one m-tile and its 32 output dims (4 d-tiles): fold state.
struct RowState {
  float m[2], l[2], o[4][4];
  __device__ void reset() {
    m[0] = m[1] = -INFINITY;
    l[0] = l[1] = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
  }
  // Absorbs `x` (rows r0: o[*][0..1], r1: o[*][2..3]).
  __device__ void absorb(const RowState& x, float sl2) {
    const FoldScale f0 = fold_scale(m[0], x.m[0], sl2), f1 = fold_scale(m[1], x.m[1], sl2);
    l[0] = fold_val(l[0], f0, x.l[0]);
    l[1] = fold_val(l[1], f1, x.l[1]);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      o[i][0] = fold_val(o[i][0], f0, x.o[i][0]);
      o[i][1] = fold_val(o[i][1], f0, x.o[i][1]);
      o[i][2] = fold_val(o[i][2], f1, x.o[i][2]);
      o[i][3] = fold_val(o[i][3], f1, x.o[i][3]);
    }
  }
};

// MT m-tiles of 16 rows per row group (1: one decode token of a group of <= 16 heads).
template <int MT>
__global__ void __launch_bounds__(kThreads, MT == 1 ? 2 : 1) msa_attention_kernel(AttnArgs a) {
  using L = Layout<MT>;
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned char* const stage_buf = smem + L::kStagesOff;
  const uint32_t q_hi = smem_u32(smem + L::kQOff), q_lo = q_hi + MT * 16 * kHeadDim * 2;
  float* const s_tile = reinterpret_cast<float*>(smem + L::kSOff);
  float* const outer_o = reinterpret_cast<float*>(smem + L::kOuterOff);
  int* const ids = reinterpret_cast<int*>(smem + L::kIdsOff);
  int* const list = reinterpret_cast<int*>(smem + L::kListOff);
  unsigned long long* const masks = reinterpret_cast<unsigned long long*>(smem + L::kMasksOff);
  int* const s_pos = reinterpret_cast<int*>(smem + L::kPosOff);
  unsigned char* const firsts = smem + L::kFirstOff;
  __shared__ int s_count, s_last;

  // Launched with programmatic serialization: the kernel just before (the indexer's
  // selection, or kv_write's new K/V) may still run until here; only the launch and CTA
  // scheduling overlap it.
  msa::wait_previous_kernel();
  const int t0 = blockIdx.x, g = blockIdx.y, split = blockIdx.z;
  const int s = msa::seq_of_token(a.query_start, a.num_seqs, t0);
  const int q_begin = a.query_start[s], q_end = a.query_start[s + 1];
  if ((t0 - q_begin) % a.tokens_per_group != 0) return;  // not the first token of a row group
  const int T = min(a.tokens_per_group, q_end - t0), G = a.group, rows = T * G;
  const int bs = a.bs, top_k = a.top_k;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const float sl2 = a.scale_log2;
  if (tid < T) s_pos[tid] = a.positions[t0 + tid];
  if (tid == 0) s_count = 0;
  // Q rows as bf16 hi / lo tiles (rows past the group are zero).
  for (int i = tid; i < MT * 16 * (kHeadDim / 8); i += kThreads) {
    const int row = i / (kHeadDim / 8), ch = i % (kHeadDim / 8);
    float x[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    if (row < rows) {
      const float* src = a.q + (int64_t(t0 + row / G) * a.q_heads + g * G + row % G) * kHeadDim + ch * 8;
      const float4 u = *reinterpret_cast<const float4*>(src), w = *reinterpret_cast<const float4*>(src + 4);
      x[0] = u.x, x[1] = u.y, x[2] = u.z, x[3] = u.w, x[4] = w.x, x[5] = w.y, x[6] = w.z, x[7] = w.w;
    }
    uint4 hi, lo;
    split_bf16(x[0], x[1], hi.x, lo.x);
    split_bf16(x[2], x[3], hi.y, lo.y);
    split_bf16(x[4], x[5], hi.z, lo.z);
    split_bf16(x[6], x[7], hi.w, lo.w);
    *reinterpret_cast<uint4*>(smem + L::kQOff + tile_off(row, ch)) = hi;
    *reinterpret_cast<uint4*>(smem + L::kQOff + MT * 16 * kHeadDim * 2 + tile_off(row, ch)) = lo;
  }
  __syncthreads();
  int pos_max = 0;
  for (int tt = 0; tt < T; ++tt) pos_max = max(pos_max, s_pos[tt]);
  // Blocks this row group reads: the union of its tokens' valid selections (deduplicated,
  // ascending, with the tokens that chose each), or every block up to the last position.
  const int units_per_block = (bs + kUnitKeys - 1) / kUnitKeys;
  const bool dense = a.sel == nullptr;
  int n_list;
  if (dense) {
    n_list = pos_max / bs + 1;
  } else {
    const int n_ids = T * top_k;
    for (int i = tid; i < n_ids; i += kThreads) {
      const int tt = i / top_k;
      const int b = a.sel[(int64_t(g) * a.num_tokens + t0 + tt) * top_k + i % top_k];
      ids[i] = (b >= 0 && b <= s_pos[tt] / bs) ? b : -1;
    }
    __syncthreads();
    for (int i = tid; i < n_ids; i += kThreads) {  // first occurrence of each valid id
      const int b = ids[i];
      bool first = b >= 0;
      for (int j = 0; j < i && first; ++j) first = ids[j] != b;
      firsts[i] = first;
    }
    __syncthreads();
    for (int i = tid; i < n_ids; i += kThreads) {
      if (!firsts[i]) continue;
      const int b = ids[i];
      int rank = 0;  // distinct smaller ids
      unsigned long long tokens = 0;
      for (int j = 0; j < n_ids; ++j) {
        const int c = ids[j];
        if (c == b) tokens |= 1ull << (j / top_k);
        rank += (firsts[j] && c < b) ? 1 : 0;
      }
      list[rank] = b;
      masks[rank] = tokens;
      atomicAdd(&s_count, 1);
    }
    __syncthreads();
    n_list = s_count;
  }
  // Super-units: kSu consecutive units of the list (dense: unit index = absolute position, so
  // a super-unit is 8 fixed units; sparse: one unit each).
  const int kSu = dense ? kDenseSuUnits : 1;
  const int total_units = n_list * units_per_block;
  const int n_su = (total_units + kSu - 1) / kSu;
  const int su0 = int(int64_t(split) * n_su / a.splits), su1 = int(int64_t(split + 1) * n_su / a.splits);
  const int u_begin = min(su0 * kSu, total_units), u_end = min(su1 * kSu, total_units);
  const int n_units = u_end - u_begin;
  const int32_t* table = a.block_tables + int64_t(s) * a.max_blocks;

  struct Unit {
    int kb, ke, block;  // keys [kb, ke) of `block`
    unsigned long long tokens;
  };
  auto unit_at = [&](int u) {
    const int li = u / units_per_block, sub = u % units_per_block;
    Unit x;
    x.block = dense ? li : list[li];
    x.kb = x.block * bs + sub * kUnitKeys;
    x.ke = min(min(x.block * bs + bs, x.kb + kUnitKeys), pos_max + 1);
    x.tokens = dense ? ~0ull : masks[li];
    return x;
  };
  auto load_unit = [&](int i) {
    const Unit x = unit_at(u_begin + i);
    unsigned char* buf = stage_buf + (i % kStages) * kStageBytes;
    const int64_t page_base = int64_t(table[x.block]) * bs - int64_t(x.block) * bs;
    const int ch = tid & 15;
#pragma unroll
    for (int r = tid >> 4; r < kUnitKeys; r += kThreads / 16) {
      const int j = x.kb + r;
      const bool ok = j < x.ke;
      const int64_t slot = ok ? page_base + j : 0;
      const int64_t elem = (slot * a.kv_heads + g) * kHeadDim + ch * 8;
      cp_async16(smem_u32(buf + tile_off(r, ch)), a.k + elem, ok);
      cp_async16(smem_u32(buf + kTileBytes + tile_off(r, ch)), a.v + elem, ok);
    }
  };
  // Token (bit) and position of this thread's two rows in m-tile mt; rows past the group see nothing.
  auto row_info = [&](int row, int& pos, unsigned long long& bit) {
    pos = -1;
    bit = 0;
    if (row < rows) {
      pos = s_pos[row / G];
      bit = 1ull << (row / G);
    }
  };

  RowState inner[MT], outer[MT > 1 ? 1 : MT];  // MT > 1 keeps the outer state in shared memory
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) inner[mt].reset();
  float outer_m[MT][2], outer_l[MT][2];  // MT > 1: the outer max / sum (per thread, like the state)
  if constexpr (MT == 1) {
    outer[0].reset();
  } else {
    for (int i = tid; i < MT * 16 * kHeadDim; i += kThreads) outer_o[i] = 0.0f;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) outer_m[mt][0] = outer_m[mt][1] = -INFINITY, outer_l[mt][0] = outer_l[mt][1] = 0.0f;
    __syncthreads();  // outer_o is zeroed by other threads than its owners
  }
  const int64_t part_base = (int64_t(t0) * a.kv_heads + g) * a.su_cap;  // this row group's super-unit partials
  const int d0 = warp * 32;  // this warp's output dims in P.V
  int su = su0;              // super-unit of the unit being processed

  // Ends super-unit `k`: fold it into the outer state (one split) or write its partial.
  auto end_super_unit = [&](int k) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      if (mt * 16 >= rows) break;
      const int r0 = mt * 16 + (lane >> 2), r1 = r0 + 8;
      if (a.splits == 1) {
        if constexpr (MT == 1) {
          outer[0].absorb(inner[0], sl2);
        } else {
          const FoldScale f0 = fold_scale(outer_m[mt][0], inner[mt].m[0], sl2);
          const FoldScale f1 = fold_scale(outer_m[mt][1], inner[mt].m[1], sl2);
          outer_l[mt][0] = fold_val(outer_l[mt][0], f0, inner[mt].l[0]);
          outer_l[mt][1] = fold_val(outer_l[mt][1], f1, inner[mt].l[1]);
#pragma unroll
          for (int dt = 0; dt < 4; ++dt) {
            float* o0 = outer_o + r0 * kHeadDim + d0 + dt * 8 + 2 * (lane & 3);
            float* o1 = outer_o + r1 * kHeadDim + d0 + dt * 8 + 2 * (lane & 3);
            o0[0] = fold_val(o0[0], f0, inner[mt].o[dt][0]);
            o0[1] = fold_val(o0[1], f0, inner[mt].o[dt][1]);
            o1[0] = fold_val(o1[0], f1, inner[mt].o[dt][2]);
            o1[1] = fold_val(o1[1], f1, inner[mt].o[dt][3]);
          }
        }
      } else {
        const int64_t base = (part_base + k) * (MT * 16);
#pragma unroll
        for (int dt = 0; dt < 4; ++dt) {
          const int d = d0 + dt * 8 + 2 * (lane & 3);
          *reinterpret_cast<float2*>(a.part_o + (base + r0) * kHeadDim + d) = make_float2(inner[mt].o[dt][0], inner[mt].o[dt][1]);
          *reinterpret_cast<float2*>(a.part_o + (base + r1) * kHeadDim + d) = make_float2(inner[mt].o[dt][2], inner[mt].o[dt][3]);
        }
        if (warp == 0 && (lane & 3) == 0) {
          a.part_ml[base + r0] = make_float2(inner[mt].m[0], inner[mt].l[0]);
          a.part_ml[base + r1] = make_float2(inner[mt].m[1], inner[mt].l[1]);
        }
      }
      inner[mt].reset();
    }
  };

#pragma unroll 1
  for (int i = 0; i < kStages - 1; ++i) {
    if (i < n_units) load_unit(i);
    cp_async_commit();
  }
#pragma unroll 1
  for (int i = 0; i < n_units; ++i) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    if (i + kStages - 1 < n_units) load_unit(i + kStages - 1);
    cp_async_commit();
    const int u = u_begin + i;
    const Unit x = unit_at(u);
    const uint32_t k_tile = smem_u32(stage_buf + (i % kStages) * kStageBytes);
    const uint32_t v_tile = k_tile + kTileBytes;

    // S = Q.K^T: warp w scores keys [16w, 16w + 16) for every m-tile; k-steps in order, hi then lo.
    uint32_t kf[2][4][4];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int ks2 = 0; ks2 < 4; ++ks2) ldmatrix_x4(kf[nt][ks2], k_tile + tile_off(warp * 16 + nt * 8 + (lane & 7), ks2 * 4 + (lane >> 3)));
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      if (mt * 16 >= rows) break;
      float sc[2][4] = {{0, 0, 0, 0}, {0, 0, 0, 0}};
#pragma unroll
      for (int ks = 0; ks < 8; ++ks) {
        uint32_t qh[4], ql[4];
        ldmatrix_x4(qh, q_hi + tile_off(mt * 16 + (lane & 15), ks * 2 + (lane >> 4)));
        ldmatrix_x4(ql, q_lo + tile_off(mt * 16 + (lane & 15), ks * 2 + (lane >> 4)));
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const uint32_t b0 = kf[nt][ks / 2][(ks & 1) * 2], b1 = kf[nt][ks / 2][(ks & 1) * 2 + 1];
          mma_bf16(sc[nt], qh, b0, b1);
          mma_bf16(sc[nt], ql, b0, b1);
        }
      }
      int pos0, pos1;
      unsigned long long bit0, bit1;
      const int r0 = mt * 16 + (lane >> 2), r1 = r0 + 8;
      row_info(r0, pos0, bit0);
      row_info(r1, pos1, bit1);
      const bool see0 = (x.tokens & bit0) != 0, see1 = (x.tokens & bit1) != 0;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const int kk = warp * 16 + nt * 8 + 2 * (lane & 3);
        float v[4];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int j = x.kb + kk + e;
          const bool in = j < x.ke;
          v[e] = (in && see0 && j <= pos0) ? sc[nt][e] : -INFINITY;
          v[2 + e] = (in && see1 && j <= pos1) ? sc[nt][2 + e] : -INFINITY;
        }
        *reinterpret_cast<float2*>(s_tile + (mt * 16 + (lane >> 2)) * kSStride + kk) = make_float2(v[0], v[1]);
        *reinterpret_cast<float2*>(s_tile + (mt * 16 + (lane >> 2) + 8) * kSStride + kk) = make_float2(v[2], v[3]);
      }
    }
    __syncthreads();

    // P.V: warp w computes output dims [32w, 32w + 32) over all 64 keys of the unit.
    uint32_t vf[4][2][4];
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
      for (int dp = 0; dp < 2; ++dp) {
        ldmatrix_x4_trans(vf[kk][dp], v_tile + tile_off(kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7),
                                                       warp * 4 + dp * 2 + (lane >> 4)));
      }
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      if (mt * 16 >= rows) break;
      const float* srow0 = s_tile + (mt * 16 + (lane >> 2)) * kSStride + 2 * (lane & 3);
      const float* srow1 = srow0 + 8 * kSStride;
      float p[8][4];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float2 x0 = *reinterpret_cast<const float2*>(srow0 + j * 8);
        const float2 x1 = *reinterpret_cast<const float2*>(srow1 + j * 8);
        p[j][0] = x0.x, p[j][1] = x0.y, p[j][2] = x1.x, p[j][3] = x1.y;
      }
      float m0 = -INFINITY, m1 = -INFINITY;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        m0 = fmaxf(m0, fmaxf(p[j][0], p[j][1]));
        m1 = fmaxf(m1, fmaxf(p[j][2], p[j][3]));
      }
      m0 = fmaxf(m0, __shfl_xor_sync(0xffffffffu, m0, 1));
      m0 = fmaxf(m0, __shfl_xor_sync(0xffffffffu, m0, 2));
      m1 = fmaxf(m1, __shfl_xor_sync(0xffffffffu, m1, 1));
      m1 = fmaxf(m1, __shfl_xor_sync(0xffffffffu, m1, 2));
      const float mb0 = m0 == -INFINITY ? 0.0f : __fmul_rn(m0, sl2), mb1 = m1 == -INFINITY ? 0.0f : __fmul_rn(m1, sl2);
      float l0 = 0.0f, l1 = 0.0f;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        p[j][0] = exp2f(__fmaf_rn(p[j][0], sl2, -mb0));
        p[j][1] = exp2f(__fmaf_rn(p[j][1], sl2, -mb0));
        p[j][2] = exp2f(__fmaf_rn(p[j][2], sl2, -mb1));
        p[j][3] = exp2f(__fmaf_rn(p[j][3], sl2, -mb1));
        l0 = __fadd_rn(__fadd_rn(l0, p[j][0]), p[j][1]);
        l1 = __fadd_rn(__fadd_rn(l1, p[j][2]), p[j][3]);
      }
      l0 = __fadd_rn(l0, __shfl_xor_sync(0xffffffffu, l0, 1));
      l0 = __fadd_rn(l0, __shfl_xor_sync(0xffffffffu, l0, 2));
      l1 = __fadd_rn(l1, __shfl_xor_sync(0xffffffffu, l1, 1));
      l1 = __fadd_rn(l1, __shfl_xor_sync(0xffffffffu, l1, 2));
      RowState part;
      part.m[0] = m0;
      part.m[1] = m1;
      part.l[0] = l0;
      part.l[1] = l1;
#pragma unroll
      for (int dt = 0; dt < 4; ++dt) part.o[dt][0] = part.o[dt][1] = part.o[dt][2] = part.o[dt][3] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        uint32_t ph[4], pl[4];
        split_bf16(p[2 * kk][0], p[2 * kk][1], ph[0], pl[0]);
        split_bf16(p[2 * kk][2], p[2 * kk][3], ph[1], pl[1]);
        split_bf16(p[2 * kk + 1][0], p[2 * kk + 1][1], ph[2], pl[2]);
        split_bf16(p[2 * kk + 1][2], p[2 * kk + 1][3], ph[3], pl[3]);
#pragma unroll
        for (int dt = 0; dt < 4; ++dt) {
          const uint32_t b0 = vf[kk][dt / 2][(dt & 1) * 2], b1 = vf[kk][dt / 2][(dt & 1) * 2 + 1];
          mma_bf16(part.o[dt], ph, b0, b1);
          mma_bf16(part.o[dt], pl, b0, b1);
        }
      }
      inner[mt].absorb(part, sl2);
    }
    // Super-unit boundary (ranges are whole super-units).
    if (i + 1 == n_units || (u + 1) % kSu == 0) {
      end_super_unit(su);
      ++su;
    }
  }
  cp_async_wait<0>();

  if (a.splits == 1) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      if (mt * 16 >= rows) break;
      const int r0 = mt * 16 + (lane >> 2), r1 = r0 + 8;
#pragma unroll
      for (int dt = 0; dt < 4; ++dt) {
        const int d = d0 + dt * 8 + 2 * (lane & 3);
        float o00, o01, o10, o11, l0, l1;
        if constexpr (MT == 1) {
          o00 = outer[0].o[dt][0], o01 = outer[0].o[dt][1], o10 = outer[0].o[dt][2], o11 = outer[0].o[dt][3];
          l0 = outer[0].l[0], l1 = outer[0].l[1];
        } else {
          o00 = outer_o[r0 * kHeadDim + d], o01 = outer_o[r0 * kHeadDim + d + 1];
          o10 = outer_o[r1 * kHeadDim + d], o11 = outer_o[r1 * kHeadDim + d + 1];
          l0 = outer_l[mt][0], l1 = outer_l[mt][1];
        }
        if (r0 < rows) {
          float* o = a.out + (int64_t(t0 + r0 / G) * a.q_heads + g * G + r0 % G) * kHeadDim + d;
          *reinterpret_cast<float2*>(o) = make_float2(finish(o00, l0), finish(o01, l0));
        }
        if (r1 < rows) {
          float* o = a.out + (int64_t(t0 + r1 / G) * a.q_heads + g * G + r1 % G) * kHeadDim + d;
          *reinterpret_cast<float2*>(o) = make_float2(finish(o10, l1), finish(o11, l1));
        }
      }
    }
    return;
  }

  // Splits: the last CTA of the row group folds every super-unit partial in order.
  if (!msa::arrive_last(&a.counters[int64_t(t0) * a.kv_heads + g], unsigned(a.splits), &s_last)) return;
  for (int idx = tid; idx < rows * kHeadDim; idx += kThreads) {
    const int row = idx / kHeadDim, d = idx % kHeadDim;
    float M = -INFINITY, Lsum = 0.0f, O = 0.0f;
    for (int k = 0; k < n_su; ++k) {
      const int64_t prow = (part_base + k) * (MT * 16) + row;
      const float2 ml = __ldcg(&a.part_ml[prow]);
      const FoldScale f = fold_scale(M, ml.x, sl2);
      Lsum = fold_val(Lsum, f, ml.y);
      O = fold_val(O, f, __ldcg(&a.part_o[prow * kHeadDim + d]));
    }
    a.out[(int64_t(t0 + row / G) * a.q_heads + g * G + row % G) * kHeadDim + d] = finish(O, Lsum);
  }
}

}  // namespace

// Shapes outside the tuned kernel (not BF16, head_dim != 128, query heads per KV head not
// dividing or above 64, top_k > 64) run the generic kernel.
void launch_msa_attention(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                          const ops::AttentionMetadata& meta, const TensorView& selected, int top_k,
                          const TensorView& out) {
  const int64_t tokens = q.shape[0], q_heads = q.shape[1], head_dim = q.shape[2];
  if (tokens == 0) return;
  const int64_t kv_heads = k_cache.shape[1];
  const bool sparse = selected.data != nullptr;
  const int bs = meta.block_size;
  const bool tuned = k_cache.dtype == DType::kBF16 && v_cache.dtype == DType::kBF16 && head_dim == kHeadDim &&
                     kv_heads >= 1 && q_heads % kv_heads == 0 && q_heads / kv_heads <= kMaxRows &&
                     (!sparse || (top_k >= 1 && top_k <= kMaxTopK)) && bs >= 1;
  if (!tuned) return launch_generic_attention(q, k_cache, v_cache, meta, selected, top_k, out);

  AttnArgs a{};
  a.q = q.as<const float>();
  a.out = out.as<float>();
  a.k = k_cache.as<const __nv_bfloat16>();
  a.v = v_cache.as<const __nv_bfloat16>();
  a.sel = sparse ? selected.as<const int32_t>() : nullptr;
  a.top_k = sparse ? top_k : 0;
  a.query_start = meta.query_start;
  a.positions = meta.positions;
  a.block_tables = meta.block_tables;
  a.num_seqs = meta.num_seqs;
  a.num_tokens = int(tokens);
  a.max_blocks = meta.max_blocks_per_seq;
  a.bs = bs;
  a.q_heads = int(q_heads);
  a.kv_heads = int(kv_heads);
  a.group = int(q_heads / kv_heads);
  a.scale_log2 = float(1.4426950408889634 / std::sqrt(double(head_dim)));
  // Row groups: one token per group for pure decode (one query per sequence); otherwise as
  // many tokens as fit 64 rows (and the selected-id buffer). Numerics do not depend on it.
  const bool pure_decode = tokens == meta.num_seqs;
  int tr = pure_decode ? 1 : std::max(1, kMaxRows / a.group);
  if (sparse) tr = std::max(1, std::min(tr, kMaxList / top_k));
  const int mt = (tr * a.group + 15) / 16 <= 1 ? 1 : 4;  // 1 only for one token of <= 16 heads
  a.tokens_per_group = tr;
  // Splits: enough CTAs for two per SM; each split takes whole super-units.
  const int64_t groups = (pure_decode ? tokens : (tokens + tr - 1) / tr + meta.num_seqs) * kv_heads;
  const int64_t units_per_block = (bs + kUnitKeys - 1) / kUnitKeys;
  const int64_t max_blocks = std::max(1, meta.max_blocks_per_seq);
  // Super-units per row group at most (sparse: one per unit of the union of selections).
  const int64_t su_cap = sparse ? std::min<int64_t>(int64_t(tr) * top_k, max_blocks) * units_per_block
                                : (max_blocks * units_per_block + kDenseSuUnits - 1) / kDenseSuUnits;
  const int64_t target = 2 * int64_t(current_sm_count());
  int64_t splits = std::clamp<int64_t>(target / groups, 1, std::min<int64_t>(kMaxSplits, su_cap));
  const size_t part_bytes = size_t(tokens) * size_t(kv_heads) * size_t(su_cap) * size_t(mt * 16) * (kHeadDim + 2) * 4;
  if (tokens * kv_heads > msa::kMaxCounters || part_bytes > kMaxPartialBytes) splits = 1;
  a.splits = int(splits);
  a.su_cap = int(su_cap);

  Scratch part(splits > 1 ? part_bytes : 0);
  if (splits > 1) {
    a.part_o = part.as<float>();
    a.part_ml = reinterpret_cast<float2*>(a.part_o + size_t(tokens) * kv_heads * su_cap * (mt * 16) * kHeadDim);
    static unsigned* counters[64] = {};
    int dev = 0;
    M3_CUDA_CHECK(cudaGetDevice(&dev));
    if (!counters[dev & 63]) {
      M3_CUDA_CHECK(cudaGetSymbolAddress(reinterpret_cast<void**>(&counters[dev & 63]), g_attention_counters));
    }
    a.counters = counters[dev & 63];
  }
  const dim3 grid{unsigned(tokens), unsigned(kv_heads), unsigned(splits)};
  auto run = [&](auto kernel, size_t smem) {
    M3_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    // Programmatic dependent launch: the launch overlaps the tail of the previous kernel (the
    // kernel waits for it before reading anything).
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = grid;
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = current_stream();
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = cfg.stream ? 1 : 0;  // created streams only (the legacy stream keeps plain ordering)
    M3_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, a));
  };
  if (mt == 1) run(msa_attention_kernel<1>, Layout<1>::kBytes);
  else run(msa_attention_kernel<4>, Layout<4>::kBytes);
  M3_CUDA_CHECK_LAUNCH();
}

}  // namespace m3::cuda
