// Paged GQA attention over a BF16 KV cache for decode, short multi-token queries (speculative
// verification) and query-major prefill (MSA block-sparse or dense), tuned for Hopper.
// head_dim 128.
//
// A CTA (8 warps) owns one row group of one (sequence, KV group): up to 64 query rows = the
// group's query heads of up to `tokens_per_group` consecutive tokens, so every K/V tile it
// loads is shared by all of them (the 16 heads of an M3 KV group form the MMA M dimension).
// Keys come in 128-key units (one block of 128 for M3) through the page table (cp.async,
// XOR-swizzled shared memory, 3 stages for one m-tile, 2 for four), only from the union of
// the row group's selected blocks; per (row, key) a mask applies that token's own selection
// and the causal cut, and m-tiles none of whose tokens chose a unit skip it (query-major
// prefill pays no MMAs for other tokens' blocks). Per unit: warp w computes S = Q.K^T for
// keys [16w, 16w + 16) (bf16 hi + lo halves of Q: ~fp32 scores), the row max is exchanged
// through shared memory, every warp writes its probabilities as bf16 hi + lo tiles, and warp
// w computes P.V for output dims [16w, 16w + 16) (warp 0 also the row sums, as P times a
// ones column). The unit partial is the canonical one of docs/msa_kernels.md, shared bit for
// bit with the KV-block-major prefill (msa_prefill.cu).
//
// Batch invariance. A row's result is one canonical computation whatever the batch, row
// group, split or kernel: per unit a partial (max, sum, P.V) relative to the unit's own max,
// with a fixed MMA order; units folded in ascending order within a super-unit (dense: 8
// consecutive units by absolute position; sparse: each unit alone), super-units folded in
// ascending order, then divided. Units a row does not see are exact identities of the fold.
// Small batches split a row group's super-units over the CTAs of a thread-block cluster
// (up to 16): each writes its super-unit partials, the cluster synchronizes, and each CTA
// folds a slice of the rows x dims over all partials in order (no serial last-CTA merge); where
// each CTA has at most one unit (B <= 2 at M3), or the grid runs one CTA per SM with all its
// clusters resident (B = 16 on an H100), the partials go straight into the folding CTAs' shared
// memory (st.async on an mbarrier) instead of through global memory and a cluster barrier.
// Early units: a decode token of a small batch whose context is at most top_k blocks (all
// selected) computes its units (one or several blocks per CTA) before waiting for the indexer,
// which lets it start early, and folds them after.
#include <cuda_bf16.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <string>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_internal.h"
#include "backend/cuda/msa.h"
#include "backend/cuda/pdl.cuh"
#include "backend/cuda/mma_operands.cuh"
#include "backend/cuda/msa_common.cuh"
#include "backend/cuda/msa_timeline.cuh"
#include "backend/cuda/tma.cuh"

namespace m3::cuda {
namespace {

using msa::cp_async16;
using msa::cp_async_commit;
using msa::cp_async_wait;
using msa::FoldScale;
using msa::kHeadDim;
using msa::kUnitKeys;
using msa::smem_u32;
using msa::tile_off;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
static_assert(kWarps * 16 == kUnitKeys && kWarps * 16 == kHeadDim, "warp w: keys [16w, 16w+16) in S, dims [16w, 16w+16) in P.V");
constexpr int kTileBytes = kUnitKeys * kHeadDim * 2;  // K or V of one unit, 32 KB
constexpr int kStageBytes = 2 * kTileBytes;
constexpr int kMaxRows = 64;
constexpr int kMaxList = 512;       // selected ids of one row group (tokens x top_k), multi-token
constexpr int kMaxListDecode = 16;  // one m-tile: tokens x top_k <= 16 (M3 decode), so two CTAs fit an SM
constexpr int kMaxTopK = 64;
constexpr int kMaxCluster = 16;
constexpr int kDenseSuUnits = 8;    // units per super-unit, dense (sparse: 1)
constexpr size_t kMaxPartialBytes = size_t(256) << 20;
constexpr size_t kDecodePartialBytes = size_t(8) << 20;  // the fixed buffer of decode batches' split partials

// kSplit (MT == 1, the decode layout when the grid exceeds one CTA per SM): K and V tiles are
// separate pipeline steps through a ring of 3 tile slots (K(u), V(u), K(u+1), ...: two tiles in
// flight while one is read), which leaves room for two CTAs per SM (16 warps to hide the S /
// softmax / P.V latencies). Otherwise whole-unit stages: 3 for MT == 1 (two units in flight per
// CTA: a few CTAs streaming a long dense context), 2 for MT == 4.
template <int MT, bool kSplit>
struct Layout {
  static_assert(!kSplit || MT == 1, "the split ring is a one-m-tile layout");
  static constexpr int kRows = MT * 16;
  static constexpr bool kSplitKV = kSplit;
  static constexpr int kStages = MT == 1 ? 3 : 2;  // tile slots (split) or unit stages
  static constexpr int kList = MT == 1 ? kMaxListDecode : kMaxList;
  static constexpr size_t kQOff = size_t(kStages) * (kSplitKV ? kTileBytes : kStageBytes);  // Q hi, Q lo: [kRows][128] bf16
  static constexpr size_t kPOff = kQOff + size_t(2) * kRows * 256;  // P hi, P lo: [kRows][128 keys] bf16
  static constexpr size_t kMaxOff = kPOff + size_t(2) * kRows * 256;  // [kWarps][kRows] partial row maxima
  // The split layout keeps the final sums, and the setup's selected ids and first flags, inside
  // the P region (P is written only in the unit loop; a barrier separates the uses).
  static constexpr size_t kAfterMax = kMaxOff + size_t(kWarps) * kRows * 4;
  static constexpr size_t kLOff = kSplitKV ? kPOff : kAfterMax;  // [kRows] final sums
  static constexpr size_t kIdsOff = kSplitKV ? kPOff + size_t(kRows) * 4 : kLOff + size_t(kRows) * 4;
  static constexpr size_t kListOff = kSplitKV ? kAfterMax : kIdsOff + size_t(kList) * 4;
  static constexpr size_t kPagesOff = kListOff + size_t(kList) * 4;
  static constexpr size_t kMasksOff = kPagesOff + size_t(kList) * 4;  // 8-byte aligned
  static constexpr size_t kPosOff = kMasksOff + size_t(kList) * 8;
  static constexpr size_t kFirstOff = kSplitKV ? kIdsOff + size_t(kList) * 4 : kPosOff + size_t(kRows) * 4;
  static constexpr size_t kBytes = kSplitKV ? kPosOff + size_t(kRows) * 4 : kFirstOff + kList;
  static_assert(!kSplitKV || kFirstOff + kList <= kMaxOff, "overlays inside the P region");
  static_assert(kMasksOff % 8 == 0, "masks alignment");
  static_assert(kBytes <= 227 * 1024, "shared memory");
  static_assert(!kSplitKV || 2 * (kBytes + 1024 + 128) <= 233472, "two decode CTAs per SM (1 KB driver + static per CTA)");
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
  float* part_o;    // [row groups, su_cap, MT*16, 128] super-unit partials (splits > 1)
  float2* part_ml;  // [row groups, su_cap, MT*16] (max, sum)
  int top_k, num_seqs, num_tokens, max_blocks, bs, q_heads, kv_heads, group, tokens_per_group, splits, su_cap;
  float scale_log2;  // log2(e) / sqrt(head_dim)
  bool early_reads;  // Q, K, V complete before the previous kernel began (AttentionMetadata)
  int early_max_blocks;  // early units: contexts of at most this many blocks (<= top_k, splits * kMaxListDecode)
  int recv_off;  // pushed partials: their buffer's offset in dynamic shared memory (0: the ring's third slot)
  int stripes;   // clusters per row group (MsaAttnPlan::stripes; the kStripes variant only)
};

// Stripes' arrival counters, one per row group: zero at module load, re-armed by each row group's
// last cluster, so no memset node per launch (launches never overlap: see g_decode_partials).
__device__ unsigned g_stripe_arrivals[kMaxStripeGroups];

// Fold state of one thread: rows (g, g+8) of each m-tile, its warp's 16 output dims (2 d-tiles).
template <int MT>
struct Fold {
  float m[MT][2], l[MT][2], o[MT][2][4];
  __device__ __forceinline__ void reset() {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      m[mt][0] = m[mt][1] = -INFINITY;
      l[mt][0] = l[mt][1] = 0.0f;
#pragma unroll
      for (int dt = 0; dt < 2; ++dt) o[mt][dt][0] = o[mt][dt][1] = o[mt][dt][2] = o[mt][dt][3] = 0.0f;
    }
  }
  __device__ __forceinline__ void absorb(int mt, float pm0, float pm1, float pl0, float pl1, const float (&po)[2][4],
                                         float sl2) {
    const FoldScale f0 = msa::fold_scale(m[mt][0], pm0, sl2), f1 = msa::fold_scale(m[mt][1], pm1, sl2);
    l[mt][0] = msa::fold_val(l[mt][0], f0, pl0);
    l[mt][1] = msa::fold_val(l[mt][1], f1, pl1);
#pragma unroll
    for (int dt = 0; dt < 2; ++dt) {
      o[mt][dt][0] = msa::fold_val(o[mt][dt][0], f0, po[dt][0]);
      o[mt][dt][1] = msa::fold_val(o[mt][dt][1], f0, po[dt][1]);
      o[mt][dt][2] = msa::fold_val(o[mt][dt][2], f1, po[dt][2]);
      o[mt][dt][3] = msa::fold_val(o[mt][dt][3], f1, po[dt][3]);
    }
  }
};

template <int MT, bool kSplit, bool kEarly = false, bool kPush = false, bool kStripes = false>
__global__ void __launch_bounds__(kThreads, kSplit ? 2 : 1) msa_attention_kernel(AttnArgs a) {
  using L = Layout<MT, kSplit>;
  constexpr int kRows = L::kRows;
  constexpr int kStages = L::kStages;
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned char* const stage_buf = smem;
  const uint32_t q_hi = smem_u32(smem + L::kQOff), q_lo = q_hi + kRows * 256;
  unsigned char* const p_hi_ptr = smem + L::kPOff;
  unsigned char* const p_lo_ptr = p_hi_ptr + kRows * 256;
  const uint32_t p_hi = smem_u32(p_hi_ptr), p_lo = p_hi + kRows * 256;
  float* const rowmax = reinterpret_cast<float*>(smem + L::kMaxOff);
  float* const lsum = reinterpret_cast<float*>(smem + L::kLOff);
  int* const ids = reinterpret_cast<int*>(smem + L::kIdsOff);
  int* const list = reinterpret_cast<int*>(smem + L::kListOff);
  int* const pages = reinterpret_cast<int*>(smem + L::kPagesOff);
  unsigned long long* const masks = reinterpret_cast<unsigned long long*>(smem + L::kMasksOff);
  int* const s_pos = reinterpret_cast<int*>(smem + L::kPosOff);
  unsigned char* const firsts = smem + L::kFirstOff;
  __shared__ int s_count;
  __shared__ __align__(8) unsigned long long s_push_bar;  // partials pushed into this CTA (see `push`)

  [[maybe_unused]] const int tl_cta = blockIdx.x < 1024u ? int(blockIdx.x) : -1;
  [[maybe_unused]] const int tl_ctas = int(min(gridDim.x, 1024u));
  M3_TL_MARK(attention, tl_cta, 0);
  const int C = a.splits;
  const int split = int(blockIdx.x % unsigned(C));  // rank in the cluster (cluster dims (C, 1, 1))
  // Stripes: a row group's clusters are consecutive, and its super-units are split over all their
  // CTAs (S of them) as over one cluster's.
  static_assert(!kStripes || (kSplit && MT == 1 && !kEarly && !kPush), "stripes: the split ring, dense");
  const int S = kStripes ? C * a.stripes : C;
  const int rank = kStripes ? int(blockIdx.x % unsigned(S)) : split;
  const int rg = int(blockIdx.x / unsigned(S));
  const int t0 = rg / a.kv_heads, g = rg % a.kv_heads;
  const int s = msa::seq_of_token(a.query_start, a.num_seqs, t0);
  const int q_begin = a.query_start[s], q_end = a.query_start[s + 1];
  if ((t0 - q_begin) % a.tokens_per_group != 0) return;  // not the first token of a row group (whole cluster)
  const int T = min(a.tokens_per_group, q_end - t0), G = a.group, rows = T * G;
  const int bs = a.bs, top_k = a.top_k;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, cq = lane & 3;
  const float sl2 = a.scale_log2;
  if (tid < T) s_pos[tid] = a.positions[t0 + tid];
  if (tid == 0) s_count = 0;
  // Q rows as bf16 hi / lo tiles (rows past the group are zero). Right after the layer's own
  // indexer (a.early_reads) Q was complete before that kernel let this one start (it releases
  // its dependents past its own wait on the prologue), so this overlaps its tail; otherwise the
  // kernel before is the prologue writing Q: wait for it first.
  if (!a.early_reads) pdl_wait();
  for (int i = tid; i < kRows * (kHeadDim / 8); i += kThreads) {
    const int row = i / (kHeadDim / 8), ch = i % (kHeadDim / 8);
    uint4 hi, lo;
    msa::q_chunk_hilo(a.q, a.q_heads, t0, g, G, row, rows, ch, hi, lo);
    *reinterpret_cast<uint4*>(smem + L::kQOff + tile_off(row, ch)) = hi;
    *reinterpret_cast<uint4*>(smem + L::kQOff + kRows * 256 + tile_off(row, ch)) = lo;
  }
  // The selection (indexer) or the new K/V (kv_write) come from the previous kernel.
  M3_TL_MARK(attention, tl_cta, 1);
  // Early units: one token (T == 1: every selected block is seen by all rows) with at most
  // a.early_max_blocks <= top_k blocks, which the indexer selects all of, split over the cluster
  // (several per CTA where it has fewer CTAs than blocks). Their keys and values were written
  // before the previous kernel (the indexer) started, like Q, so the units run before the wait;
  // only the fold reads the selection (the same partials in the same order: the same bits).
  bool early_units = false;
  int n_blocks = 0;
  if constexpr (kEarly) {
    static_assert(MT == 1 && kSplit, "early units: the split ring");
    if (a.sel != nullptr && T == 1 && C > 1 && bs <= kUnitKeys) {
      __syncthreads();  // s_pos
      n_blocks = s_pos[0] / bs + 1;
      early_units = n_blocks <= a.early_max_blocks;  // the same for every CTA of the cluster
    }
  }
  if (!early_units) pdl_wait();
  __syncthreads();
  M3_TL_MARK(attention, tl_cta, 2);
  int pos_max = 0;
  for (int tt = 0; tt < T; ++tt) pos_max = max(pos_max, s_pos[tt]);
  const bool dense = a.sel == nullptr;
  const int32_t* table = a.block_tables + int64_t(s) * a.max_blocks;
  int n_units;
  const int units_per_block = (bs + kUnitKeys - 1) / kUnitKeys;
  // The union of the selections for one m-tile (T * top_k <= 16 ids): warp 0 alone, one id per
  // lane, one barrier (the CTA-wide version put three barriers and a serial scan per id on the
  // setup path); the pages requested before the union's shuffles, not after.
  auto union_one_tile = [&](bool with_pages) {
    const int n_ids = T * top_k;
    if (warp == 0) {
      int b = -1, page = 0;
      if (lane < n_ids) {
        const int tt = lane / top_k;
        b = a.sel[(int64_t(g) * a.num_tokens + t0 + tt) * top_k + lane % top_k];
        if (b < 0 || b > s_pos[tt] / bs) b = -1;
      }
      if (with_pages && b >= 0) page = __ldg(table + b);
      const unsigned peers = __match_any_sync(0xffffffffu, b);
      const bool first = b >= 0 && (peers & ((1u << lane) - 1u)) == 0;
      const unsigned firsts_mask = __ballot_sync(0xffffffffu, first);
      int rank = 0;
      unsigned long long tokens = 0;
      for (int j = 0; j < n_ids; ++j) {
        const int c = __shfl_sync(0xffffffffu, b, j);
        if (c == b) tokens |= 1ull << (j / top_k);
        rank += (((firsts_mask >> j) & 1u) && c < b) ? 1 : 0;
      }
      if (first) {
        list[rank] = b;
        if (with_pages) {
          masks[rank] = tokens;
          pages[rank] = page;
        }
      }
      if (lane == 0) s_count = __popc(firsts_mask);
    }
    __syncthreads();
  };
  if (dense) {
    n_units = pos_max / kUnitKeys + 1;
  } else if (early_units) {
    n_units = n_blocks;
  } else if (MT == 1) {
    union_one_tile(true);
    n_units = s_count * units_per_block;
  } else {
    // The union of the row group's valid selections: deduplicated, ascending, with the tokens
    // that chose each block and its page.
    const int n_ids = T * top_k;
    for (int i = tid; i < n_ids; i += kThreads) {
      const int tt = i / top_k;
      const int b = a.sel[(int64_t(g) * a.num_tokens + t0 + tt) * top_k + i % top_k];
      ids[i] = (b >= 0 && b <= s_pos[tt] / bs) ? b : -1;
    }
    __syncthreads();
    for (int i = tid; i < n_ids; i += kThreads) {
      const int b = ids[i];
      bool first = b >= 0;
      for (int j = 0; j < i && first; ++j) first = ids[j] != b;
      firsts[i] = first;
    }
    __syncthreads();
    for (int i = tid; i < n_ids; i += kThreads) {
      if (!firsts[i]) continue;
      const int b = ids[i];
      int rank = 0;
      unsigned long long tokens = 0;
      for (int j = 0; j < n_ids; ++j) {
        const int c = ids[j];
        if (c == b) tokens |= 1ull << (j / top_k);
        rank += (firsts[j] && c < b) ? 1 : 0;
      }
      list[rank] = b;
      masks[rank] = tokens;
      pages[rank] = table[b];
      atomicAdd(&s_count, 1);
    }
    __syncthreads();
    n_units = s_count * units_per_block;
  }
  M3_TL_MARK(attention, tl_cta, 3);
  // Super-units (dense: 8 units by absolute position; sparse: one each), split over the cluster.
  const int kSu = dense ? kDenseSuUnits : 1;
  const int n_su = (n_units + kSu - 1) / kSu;
  const int su0 = int(int64_t(rank) * n_su / S), su1 = int(int64_t(rank + 1) * n_su / S);
  const int u_begin = min(su0 * kSu, n_units), u_end = min(su1 * kSu, n_units);
  const int my_units = u_end - u_begin;
  // Pushed partials (MsaAttnPlan::push: the split ring, sparse, whole rows per CTA): each CTA
  // stores each unit partial with st.async straight into the shared memory of the CTAs that fold
  // its rows, counted on their mbarriers, instead of to global memory behind a fence and a
  // cluster barrier and read back from L2 (same partials, same fold order: the same bits). The
  // buffer is the ring's third slot where every CTA has at most one unit (which never fills it:
  // M3 decode at B <= 2), else a region beside the ring (a.recv_off; one CTA per SM). The cluster
  // barrier here only publishes the mbarriers' init.
  static_assert(!kPush || (kSplit && MT == 1), "pushed partials: the split ring");
  constexpr bool push = kPush;
  if constexpr (push) {
    if (tid == 0) {
      mma_ops::mbar_init(smem_u32(&s_push_bar), 1);
      msa::mbar_init_fence();
    }
    msa::cluster_arrive_relaxed();
  }
  // Early units: this CTA's block (u_begin, if any) in the list.
  const int list_base = early_units ? u_begin : 0;
  if (early_units) {
    if (tid < my_units) {
      list[tid] = u_begin + tid;
      pages[tid] = __ldg(table + u_begin + tid);
      masks[tid] = 1ull;
    }
    __syncthreads();
  }

  // Tokens whose rows lie in each m-tile (an m-tile none of whose tokens sees a unit skips it).
  unsigned long long mt_tokens[MT];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    mt_tokens[mt] = 0;
    if (mt * 16 < rows) {
      const int lo = (mt * 16) / G, hi = (min(rows, mt * 16 + 16) - 1) / G, n = hi - lo + 1;
      mt_tokens[mt] = (n >= 64 ? ~0ull : ((1ull << n) - 1)) << lo;
    }
  }

  // Token (within the row group) of each row, -1 past the rows: the one-m-tile unit loop reads it
  // instead of dividing by the group size.
  __shared__ int s_row_tok[kRows];
  if constexpr (MT == 1) {
    for (int r = tid; r < kRows; r += kThreads) s_row_tok[r] = r < rows ? r / G : -1;
    __syncthreads();
  }

  struct Unit {
    int kb, ke, block, page;  // keys [kb, ke) of `block` (sparse: its page)
    unsigned long long tokens;
  };
  auto unit_at = [&](int u) {
    Unit x;
    if (dense) {
      x.block = -1;
      x.page = -1;
      x.kb = u * kUnitKeys;
      x.ke = min(x.kb + kUnitKeys, pos_max + 1);
      x.tokens = ~0ull;
    } else {
      const int li = units_per_block == 1 ? u - list_base : u / units_per_block, sub = units_per_block == 1 ? 0 : u % units_per_block;
      x.block = list[li];
      x.page = pages[li];
      x.kb = x.block * bs + sub * kUnitKeys;
      x.ke = min(min(x.block * bs + bs, x.kb + kUnitKeys), pos_max + 1);
      x.tokens = masks[li];
    }
    return x;
  };
  // Dense contexts whose pages hold whole units (bs a multiple of 128, as M3's): one page per
  // unit, its id loaded a unit ahead. A lookup per row put dependent L2 round trips in front of
  // every tile's copies (dense decode ran at 20-30 % of the copy bandwidth).
  const bool unit_pages = dense && bs % kUnitKeys == 0;
  int pg_idx = -1, pg_val = 0, pf_idx = -1, pf_val = 0;
  auto unit_page = [&](int i) {  // page of this CTA's unit i; i never decreases between calls
    if (i != pg_idx) {
      pg_val = i == pf_idx ? pf_val : __ldg(table + (u_begin + i) * kUnitKeys / bs);
      pg_idx = i;
      if (i + 1 < my_units) {
        pf_idx = i + 1;
        pf_val = __ldg(table + (u_begin + i + 1) * kUnitKeys / bs);
      }
    }
    return pg_val;
  };
  // Unit i's K and/or V tiles into k_buf / v_buf (null: skipped). Thread (row r0 = tid / 16,
  // 16-byte column ch) copies rows r0 + 16 it: when the unit's keys share a page, their cache
  // rows are a fixed stride apart and their tile offsets 4 KB apart (the swizzle depends on
  // row & 7 only), so a copy is one add; otherwise each row looks its page up.
  const int ld_ch = tid & 15, ld_r0 = tid >> 4;
  const uint32_t ld_so = tile_off(ld_r0, ld_ch);
  const int64_t ld_step = int64_t(kThreads / 16) * a.kv_heads * kHeadDim;
  auto load_tiles = [&](int i, unsigned char* k_buf, unsigned char* v_buf) {
    const Unit x = unit_at(u_begin + i);
    const int nkeys = x.ke - x.kb;
    if (MT == 1 && (unit_pages || !dense)) {  // (the 4-m-tile kernel has no registers to spare for it)
      const int64_t slot0 = unit_pages ? int64_t(unit_page(i)) * bs + x.kb % bs : int64_t(x.page) * bs + (x.kb - x.block * bs);
      const int64_t e0 = ((slot0 + ld_r0) * a.kv_heads + g) * kHeadDim + ld_ch * 8;
      const uint32_t kd = k_buf ? smem_u32(k_buf) + ld_so : 0u, vd = v_buf ? smem_u32(v_buf) + ld_so : 0u;
#pragma unroll
      for (int it = 0; it < kUnitKeys / (kThreads / 16); ++it) {
        const bool ok = ld_r0 + it * (kThreads / 16) < nkeys;
        const int64_t e = ok ? e0 + it * ld_step : 0;
        if (k_buf) cp_async16(kd + it * (kThreads / 16) * 256, a.k + e, ok);
        if (v_buf) cp_async16(vd + it * (kThreads / 16) * 256, a.v + e, ok);
      }
      return;
    }
#pragma unroll 2
    for (int r = ld_r0; r < kUnitKeys; r += kThreads / 16) {
      const int j = x.kb + r;
      const bool ok = j < x.ke;
      int64_t slot = 0;
      if (ok) slot = dense ? int64_t(table[j / bs]) * bs + j % bs : int64_t(x.page) * bs + (j - x.block * bs);
      const int64_t elem = (slot * a.kv_heads + g) * kHeadDim + ld_ch * 8;
      if (k_buf) cp_async16(smem_u32(k_buf + tile_off(r, ld_ch)), a.k + elem, ok);
      if (v_buf) cp_async16(smem_u32(v_buf + tile_off(r, ld_ch)), a.v + elem, ok);
    }
  };
  // Split ring: tile t (K(u) = 2u, V(u) = 2u + 1) lives in slot t % kStages.
  auto tile_slot = [&](int t) { return stage_buf + (t % kStages) * kTileBytes; };
  // Pushed partials: the buffer of the ro rows each CTA folds, [su_cap][ro][128] values, then
  // [su_cap][ro] (max, sum).
  auto recv_values = [&]() { return reinterpret_cast<float*>(a.recv_off ? smem + a.recv_off : tile_slot(2)); };
  auto recv_max_sum = [&](int ro) { return reinterpret_cast<float2*>(recv_values() + a.su_cap * ro * kHeadDim); };
  auto load_unit = [&](int i) {
    unsigned char* buf = stage_buf + (i % kStages) * kStageBytes;
    load_tiles(i, buf, buf + kTileBytes);
  };

  // Fragment addresses in the swizzled tiles: the swizzle depends on row & 7 only, so a lane's
  // offsets are a few constants plus immediates (the one-m-tile kernel keeps them in registers;
  // the 4-m-tile kernel, with none to spare, computes them in place).
  //   K (B operand of S): rows 16w + 8nt + (lane & 7), chunk 4q4 + (lane >> 3);
  //   Q and P (A operands): rows 16mt + (lane & 15), chunk 2ks + (lane >> 4) (ks + 4: 128 B on);
  //   V (B of P.V, transposed): rows 16kk + 8((lane >> 3) & 1) + (lane & 7), chunk 2w + (lane >> 4);
  //   P stores: row 16mt + gq, chunk 2w + nt, element 2cq (row + 8: 2 KB on).
  uint32_t kof[4] = {}, aof[4] = {}, pof[2] = {}, vof = 0;
  if constexpr (MT == 1) {
#pragma unroll
    for (int x = 0; x < 4; ++x) {
      kof[x] = tile_off(warp * 16 + (lane & 7), x * 4 + (lane >> 3));
      aof[x] = tile_off(lane & 15, x * 2 + (lane >> 4));
    }
    vof = tile_off(((lane >> 3) & 1) * 8 + (lane & 7), warp * 2 + (lane >> 4));
    pof[0] = tile_off(gq, warp * 2) + 4 * cq;
    pof[1] = tile_off(gq, warp * 2 + 1) + 4 * cq;
  }
  auto k_off = [&](int nt, int q4) -> uint32_t {
    if constexpr (MT == 1) return kof[q4] + nt * 8 * 256;
    else return tile_off(warp * 16 + nt * 8 + (lane & 7), q4 * 4 + (lane >> 3));
  };
  auto a_off = [&](int mt, int ks) -> uint32_t {
    if constexpr (MT == 1) return aof[ks & 3] + (ks >> 2) * 128;
    else return tile_off(mt * 16 + (lane & 15), ks * 2 + (lane >> 4));
  };
  auto v_off = [&](int kk) -> uint32_t {
    if constexpr (MT == 1) return vof + kk * 16 * 256;
    else return tile_off(kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7), warp * 2 + (lane >> 4));
  };
  auto p_off = [&](int mt, int nt) -> uint32_t {
    if constexpr (MT == 1) return pof[nt];
    else return tile_off(mt * 16 + gq, warp * 2 + nt) + 4 * cq;
  };

  Fold<MT> outer, inner;
  outer.reset();
  inner.reset();
  int su = su0;
  // Ends super-unit k: fold it into the outer state (one CTA) or write its partial.
  auto end_super_unit = [&](int k) {
    if constexpr (push) {  // (sparse: a super-unit is one unit; MT == 1)
      const int ro = rows / C;  // rows each CTA folds
      float* const recv_o = recv_values();
      float2* const recv_ml = recv_max_sum(ro);
      const uint32_t bar = smem_u32(&s_push_bar);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = gq + 8 * h;
        if (r >= rows) continue;
        const int owner = r / ro, slot = k * ro + r % ro;
        const uint32_t rbar = msa::cluster_map(bar, owner);
#pragma unroll
        for (int dt = 0; dt < 2; ++dt) {
          const int d = warp * 16 + dt * 8 + 2 * cq;
          msa::st_async_f2(msa::cluster_map(smem_u32(recv_o + slot * kHeadDim + d), owner), inner.o[0][dt][2 * h],
                           inner.o[0][dt][2 * h + 1], rbar);
        }
        if (warp == 0 && cq == 0) {
          msa::st_async_f2(msa::cluster_map(smem_u32(recv_ml + slot), owner), inner.m[0][h], inner.l[0][h], rbar);
        }
      }
      inner.reset();
    } else {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if (mt * 16 >= rows) break;
        if (C == 1) {
          outer.absorb(mt, inner.m[mt][0], inner.m[mt][1], inner.l[mt][0], inner.l[mt][1], inner.o[mt], sl2);
        } else {
          const int r0 = mt * 16 + gq, r1 = r0 + 8;
          const int64_t base = (int64_t(rg) * a.su_cap + k) * kRows;
#pragma unroll
          for (int dt = 0; dt < 2; ++dt) {
            const int d = warp * 16 + dt * 8 + 2 * cq;
            *reinterpret_cast<float2*>(a.part_o + (base + r0) * kHeadDim + d) = make_float2(inner.o[mt][dt][0], inner.o[mt][dt][1]);
            *reinterpret_cast<float2*>(a.part_o + (base + r1) * kHeadDim + d) = make_float2(inner.o[mt][dt][2], inner.o[mt][dt][3]);
          }
          if (warp == 0 && cq == 0) {
            a.part_ml[base + r0] = make_float2(inner.m[mt][0], inner.l[mt][0]);
            a.part_ml[base + r1] = make_float2(inner.m[mt][1], inner.l[mt][1]);
          }
        }
      }
      inner.reset();
    }
  };

  if constexpr (L::kSplitKV) {
    // One commit group per tile: K(0), V(0).
    if (my_units > 0) load_tiles(0, tile_slot(0), nullptr);
    cp_async_commit();
    if (my_units > 0) load_tiles(0, nullptr, tile_slot(1));
    cp_async_commit();
  } else {
#pragma unroll 1
    for (int i = 0; i < kStages - 1; ++i) {
      if (i < my_units) load_unit(i);
      cp_async_commit();
    }
  }
  if constexpr (push) msa::cluster_wait();  // every CTA's mbarrier is initialised (the first tiles are on their way)
#pragma unroll 1
  for (int i = 0; i < my_units; ++i) {
    uint32_t k_tile, v_tile;
    if constexpr (L::kSplitKV) {
      cp_async_wait<1>();  // K(i) landed (V(i) may still be in flight)
      __syncthreads();     // ... for every thread; all are done with unit i - 1 (V(i-1)'s slot is reused)
      if (i + 1 < my_units) load_tiles(i + 1, tile_slot(2 * i + 2), nullptr);
      cp_async_commit();
      k_tile = smem_u32(tile_slot(2 * i));
      v_tile = smem_u32(tile_slot(2 * i + 1));
    } else {
      cp_async_wait<kStages - 2>();
      __syncthreads();
      if (i + kStages - 1 < my_units) load_unit(i + kStages - 1);
      cp_async_commit();
      k_tile = smem_u32(stage_buf + (i % kStages) * kStageBytes);
      v_tile = k_tile + kTileBytes;
    }
    const int u = u_begin + i;
    const Unit x = unit_at(u);
    bool act[MT];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) act[mt] = (x.tokens & mt_tokens[mt]) != 0;

    // S = Q.K^T for keys [16w, 16w + 16): per k-step the hi then the lo half of Q (one chain).
    uint32_t kf[2][4][4];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int q4 = 0; q4 < 4; ++q4)
        msa::ldmatrix_x4(kf[nt][q4], k_tile + k_off(nt, q4));
    }
    float sv[MT][2][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      if (!act[mt]) continue;
      float sc[2][4] = {{0, 0, 0, 0}, {0, 0, 0, 0}};
#pragma unroll
      for (int ks = 0; ks < 8; ++ks) {
        uint32_t qh[4], ql[4];
        msa::ldmatrix_x4(qh, q_hi + a_off(mt, ks));
        msa::ldmatrix_x4(ql, q_lo + a_off(mt, ks));
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const uint32_t b0 = kf[nt][ks / 2][(ks & 1) * 2], b1 = kf[nt][ks / 2][(ks & 1) * 2 + 1];
          msa::mma_bf16(sc[nt], qh, b0, b1);
          msa::mma_bf16(sc[nt], ql, b0, b1);
        }
      }
      const int r0 = mt * 16 + gq, r1 = r0 + 8;
      // (the 4-m-tile kernel divides: holding 8 row tokens would spill its registers)
      const int tk0 = MT == 1 ? s_row_tok[r0] : r0 < rows ? r0 / G : -1;
      const int tk1 = MT == 1 ? s_row_tok[r1] : r1 < rows ? r1 / G : -1;
      const int pos0 = tk0 >= 0 ? s_pos[tk0] : -1, pos1 = tk1 >= 0 ? s_pos[tk1] : -1;
      const bool see0 = tk0 >= 0 && ((x.tokens >> tk0) & 1ull), see1 = tk1 >= 0 && ((x.tokens >> tk1) & 1ull);
      float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int j = x.kb + warp * 16 + nt * 8 + 2 * cq + e;
          const bool in = j < x.ke;
          sv[mt][nt][e] = (in && see0 && j <= pos0) ? sc[nt][e] : -INFINITY;
          sv[mt][nt][2 + e] = (in && see1 && j <= pos1) ? sc[nt][2 + e] : -INFINITY;
          mx0 = fmaxf(mx0, sv[mt][nt][e]);
          mx1 = fmaxf(mx1, sv[mt][nt][2 + e]);
        }
      }
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
      if (cq == 0) {
        rowmax[warp * kRows + r0] = mx0;
        rowmax[warp * kRows + r1] = mx1;
      }
    }
    __syncthreads();
    // Unit max per row, probabilities as bf16 hi / lo tiles (rows x 128 keys).
    float um[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      if (!act[mt]) continue;
      const int r0 = mt * 16 + gq, r1 = r0 + 8;
      float m0 = -INFINITY, m1 = -INFINITY;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        m0 = fmaxf(m0, rowmax[w * kRows + r0]);
        m1 = fmaxf(m1, rowmax[w * kRows + r1]);
      }
      um[mt][0] = m0;
      um[mt][1] = m1;
      const float mb0 = msa::unit_mb(m0, sl2), mb1 = msa::unit_mb(m1, sl2);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        uint32_t h0, l0, h1, l1;
        msa::split_bf16(msa::unit_prob(sv[mt][nt][0], mb0, sl2), msa::unit_prob(sv[mt][nt][1], mb0, sl2), h0, l0);
        msa::split_bf16(msa::unit_prob(sv[mt][nt][2], mb1, sl2), msa::unit_prob(sv[mt][nt][3], mb1, sl2), h1, l1);
        const uint32_t off0 = p_off(mt, nt), off1 = off0 + 8 * 256;  // rows r0 and r0 + 8
        *reinterpret_cast<uint32_t*>(p_hi_ptr + off0) = h0;
        *reinterpret_cast<uint32_t*>(p_lo_ptr + off0) = l0;
        *reinterpret_cast<uint32_t*>(p_hi_ptr + off1) = h1;
        *reinterpret_cast<uint32_t*>(p_lo_ptr + off1) = l1;
      }
    }
    if constexpr (L::kSplitKV) cp_async_wait<1>();  // V(i) landed (K(i+1) may still be in flight)
    __syncthreads();  // P (and the split ring's V(i)) visible; every warp is done reading K(i)
    if constexpr (L::kSplitKV) {
      if (i + 1 < my_units) load_tiles(i + 1, nullptr, tile_slot(2 * i + 3));  // into K(i)'s slot
      cp_async_commit();
    }

    // P.V for dims [16w, 16w + 16): per key step the hi then the lo half of P (one chain);
    // warp 0 also the row sums (P times ones).
    uint32_t vf[8][4];
#pragma unroll
    for (int kk = 0; kk < 8; ++kk)
      msa::ldmatrix_x4_trans(vf[kk], v_tile + v_off(kk));
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      if (!act[mt]) continue;
      float po[2][4] = {{0, 0, 0, 0}, {0, 0, 0, 0}}, pl[4] = {0, 0, 0, 0};
#pragma unroll
      for (int kk = 0; kk < 8; ++kk) {
        uint32_t ph[4], plo[4];
        msa::ldmatrix_x4(ph, p_hi + a_off(mt, kk));
        msa::ldmatrix_x4(plo, p_lo + a_off(mt, kk));
#pragma unroll
        for (int dt = 0; dt < 2; ++dt) {
          msa::mma_bf16(po[dt], ph, vf[kk][2 * dt], vf[kk][2 * dt + 1]);
          msa::mma_bf16(po[dt], plo, vf[kk][2 * dt], vf[kk][2 * dt + 1]);
        }
        if (warp == 0) {
          msa::mma_bf16(pl, ph, msa::kBf16OnePair, msa::kBf16OnePair);
          msa::mma_bf16(pl, plo, msa::kBf16OnePair, msa::kBf16OnePair);
        }
      }
      inner.absorb(mt, um[mt][0], um[mt][1], pl[0], pl[2], po, sl2);
    }
    // Super-unit boundary (split ranges are whole super-units).
    if (i + 1 == my_units || (u + 1) % kSu == 0) {
      end_super_unit(su);
      ++su;
    }
  }
  cp_async_wait<0>();
  M3_TL_MARK(attention, tl_cta, 4);

  if (C == 1) {
    if constexpr (L::kSplitKV) __syncthreads();  // lsum overlays P: every warp is done with P.V
    if (warp == 0 && cq == 0) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        lsum[mt * 16 + gq] = outer.l[mt][0];
        lsum[mt * 16 + gq + 8] = outer.l[mt][1];
      }
    }
    __syncthreads();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      if (mt * 16 >= rows) break;
      const int r0 = mt * 16 + gq, r1 = r0 + 8;
      const float l0 = lsum[r0], l1 = lsum[r1];
#pragma unroll
      for (int dt = 0; dt < 2; ++dt) {
        const int d = warp * 16 + dt * 8 + 2 * cq;
        if (r0 < rows) {
          float* o = a.out + (int64_t(t0 + r0 / G) * a.q_heads + g * G + r0 % G) * kHeadDim + d;
          *reinterpret_cast<float2*>(o) = make_float2(msa::finish(outer.o[mt][dt][0], l0), msa::finish(outer.o[mt][dt][1], l0));
        }
        if (r1 < rows) {
          float* o = a.out + (int64_t(t0 + r1 / G) * a.q_heads + g * G + r1 % G) * kHeadDim + d;
          *reinterpret_cast<float2*>(o) = make_float2(msa::finish(outer.o[mt][dt][2], l1), msa::finish(outer.o[mt][dt][3], l1));
        }
      }
    }
    M3_TL_MARK(attention, tl_cta, 6);
    M3_TL_FINISH(attention, tl_cta, tl_ctas);
    return;
  }

  if constexpr (push) {
    const int ro = rows / C;  // rows this CTA folds: [split * ro, split * ro + ro)
    const float* const recv_o = recv_values();
    const float2* const recv_ml = recv_max_sum(ro);
    const uint32_t bar = smem_u32(&s_push_bar);
    if (tid == 0) tma::arrive_expect_tx(bar, uint32_t(n_su * ro) * uint32_t(kHeadDim * 4 + 8));
    int n_fold = n_su;
    if (early_units) {  // the fold order: the selected blocks, ascending
      pdl_wait();
      __syncthreads();  // every warp is done with this CTA's list
      union_one_tile(false);
      n_fold = s_count;
    }
    mma_ops::mbar_wait<true>(bar, 0);
    M3_TL_MARK(attention, tl_cta, 5);
    for (int e = tid; e < ro * kHeadDim; e += kThreads) {
      const int lr = e / kHeadDim, d = e % kHeadDim, r = split * ro + lr;
      float M = -INFINITY, Ls = 0.0f, O = 0.0f;
      for (int k = 0; k < n_fold; ++k) {
        const int slot = (early_units ? list[k] : k) * ro + lr;
        const float2 ml = recv_ml[slot];
        const FoldScale f = msa::fold_scale(M, ml.x, sl2);
        Ls = msa::fold_val(Ls, f, ml.y);
        O = msa::fold_val(O, f, recv_o[slot * kHeadDim + d]);
      }
      a.out[(int64_t(t0 + r / G) * a.q_heads + g * G + r % G) * kHeadDim + d] = msa::finish(O, Ls);
    }
    M3_TL_MARK(attention, tl_cta, 6);
    M3_TL_FINISH(attention, tl_cta, tl_ctas);
    return;
  }

  // Split over the cluster: every super-unit partial is written; each CTA folds a slice of the
  // rows x dims over all of them, in order. Early units: the selected blocks' partials, in
  // ascending order.
  int n_fold = n_su;
  if (early_units) {
    msa::cluster_arrive();
    pdl_wait();
    __syncthreads();  // every warp is done with this CTA's list
    union_one_tile(false);
    n_fold = s_count;
    msa::cluster_wait();
  } else {
    msa::cluster_sync();
  }
  if constexpr (kStripes) {
    // The cluster counts in once its partials are written (the barrier above: every thread's
    // fence, then release / acquire at cluster scope, so this thread's fence is cumulative over
    // them). The last cluster in re-arms the counter for the next launch, tells its CTAs, and
    // folds every stripe's partials as one cluster does (the same partials in the same order);
    // the others are done. Nothing waits on another cluster, so residency does not matter.
    __shared__ unsigned s_last;
    if (split == 0 && tid == 0) {
      __threadfence();
      const unsigned last = atomicAdd(&g_stripe_arrivals[rg], 1u) + 1u == unsigned(a.stripes) ? 1u : 0u;
      if (last != 0u) {
        atomicExch(&g_stripe_arrivals[rg], 0u);
        __threadfence();  // the other clusters' partials are read after this
      }
      for (int r = 0; r < C; ++r) msa::st_cluster_u32(msa::cluster_map(smem_u32(&s_last), r), last);
    }
    msa::cluster_sync();
    if (s_last == 0u) {
      M3_TL_FINISH(attention, tl_cta, tl_ctas);
      return;
    }
  }
  auto part_idx = [&](int k) { return early_units ? list[k] : k; };
  M3_TL_MARK(attention, tl_cta, 5);
  const int E = rows * kHeadDim, per = (E + C - 1) / C;
  const int e0 = split * per, e1 = min(E, e0 + per);
  const int64_t base = int64_t(rg) * a.su_cap * kRows;
  // A row's fold factors depend on its (max, sum) sequence only: one thread per row runs that
  // chain (the exponentials) into shared memory, the slice's elements are then FMA chains over
  // their partials, loaded all at once. The same operations as the per-element fold below.
  // (With at most one element per thread the per-element fold is as short and skips a barrier.)
  constexpr int kFoldBatch = 16;
  const size_t fold_bytes = size_t(n_fold) * kRows * sizeof(float2) + kRows * sizeof(float);
  const size_t ring_bytes = size_t(kStages) * (L::kSplitKV ? kTileBytes : kStageBytes);
  if constexpr ((!kSplit || kStripes) && MT == 1) {
    // The deep stages (a dense context over few CTAs: up to 128 super-unit partials per row group
    // at 128K), and the stripes' folding cluster, which has as many, stage the slice's partials in
    // the drained ring first, every copy in flight at once, where the loops below load them 8 or 16
    // at a time, a dependent L2 round trip per batch. Then the same row chains and element chains
    // as below, from shared memory.
    const int span = e1 - e0, r_lo = e0 / kHeadDim, nr = span > 0 ? (e1 - 1) / kHeadDim - r_lo + 1 : 0;
    const size_t o_bytes = size_t(n_fold) * size_t(span) * 4;
    if (n_fold > 8 && e0 % 4 == 0 && span % 4 == 0 && o_bytes + size_t(n_fold) * nr * 8 + size_t(nr) * 4 <= ring_bytes) {
      float* const so = reinterpret_cast<float*>(stage_buf);                // [n_fold][span]
      float2* const fab = reinterpret_cast<float2*>(stage_buf + o_bytes);   // [n_fold][nr]: (max, sum), then factors
      float* const lrow = reinterpret_cast<float*>(fab + size_t(n_fold) * nr);
      const int q = span / 4;
      for (int i = tid; i < n_fold * q; i += kThreads) {
        const int k = i / q, e = e0 + 4 * (i % q);
        cp_async16(smem_u32(so + size_t(k) * span + (e - e0)),
                   a.part_o + (base + int64_t(part_idx(k)) * kRows + e / kHeadDim) * kHeadDim + e % kHeadDim, true);
      }
      cp_async_commit();
      for (int i = tid; i < n_fold * nr; i += kThreads) {
        const int k = i / nr;
        fab[i] = __ldcg(&a.part_ml[base + int64_t(part_idx(k)) * kRows + r_lo + i % nr]);
      }
      cp_async_wait<0>();
      __syncthreads();
      if (tid < nr) {
        float M = -INFINITY, Ls = 0.0f;
        for (int k = 0; k < n_fold; ++k) {
          fab[k * nr + tid] = msa::fold_row(M, Ls, fab[k * nr + tid], sl2);
        }
        lrow[tid] = Ls;
      }
      __syncthreads();
      for (int e = e0 + tid; e < e1; e += kThreads) {
        const int r = e / kHeadDim, d = e % kHeadDim, rr = r - r_lo;
        float O = 0.0f;
        for (int k = 0; k < n_fold; ++k) {
          const float2 f = fab[k * nr + rr];
          O = msa::fold_val(O, FoldScale{f.x, f.y}, so[size_t(k) * span + (e - e0)]);
        }
        a.out[(int64_t(t0 + r / G) * a.q_heads + g * G + r % G) * kHeadDim + d] = msa::finish(O, lrow[rr]);
      }
      M3_TL_MARK(attention, tl_cta, 6);
      M3_TL_FINISH(attention, tl_cta, tl_ctas);
      return;
    }
  }
  if (e1 - e0 > kThreads && fold_bytes <= ring_bytes) {  // (so every thread has an element)
    float2* const fab = reinterpret_cast<float2*>(stage_buf);  // [n_fold][kRows] (the tiles are drained)
    float* const lrow = reinterpret_cast<float*>(stage_buf + size_t(n_fold) * kRows * sizeof(float2));
    const int r_lo = e0 / kHeadDim, r_hi = (e1 - 1) / kHeadDim;  // rows of this slice
    // The first element's first partials are requested before the row chains run.
    const int e_first = e0 + tid, r_first = e_first / kHeadDim, d_first = e_first % kHeadDim;
    float ov0[kFoldBatch];
#pragma unroll
    for (int j = 0; j < kFoldBatch; ++j) {
      ov0[j] = j < n_fold ? __ldcg(&a.part_o[(base + int64_t(part_idx(j)) * kRows + r_first) * kHeadDim + d_first]) : 0.0f;
    }
    const int row = r_lo + tid;
    if (row <= r_hi) {
      float M = -INFINITY, Ls = 0.0f;
      for (int k0 = 0; k0 < n_fold; k0 += kFoldBatch) {
        float2 ml[kFoldBatch];
#pragma unroll
        for (int j = 0; j < kFoldBatch; ++j) {
          if (k0 + j < n_fold) ml[j] = __ldcg(&a.part_ml[base + int64_t(part_idx(k0 + j)) * kRows + row]);
        }
#pragma unroll
        for (int j = 0; j < kFoldBatch; ++j) {
          if (k0 + j < n_fold) {
            fab[(k0 + j) * kRows + row] = msa::fold_row(M, Ls, ml[j], sl2);
          }
        }
      }
      lrow[row] = Ls;
    }
    __syncthreads();
    for (int e = e_first; e < e1; e += kThreads) {
      const int r = e / kHeadDim, d = e % kHeadDim;
      float O = 0.0f;
      for (int k0 = 0; k0 < n_fold; k0 += kFoldBatch) {
        float ov[kFoldBatch];
#pragma unroll
        for (int j = 0; j < kFoldBatch; ++j) {
          if (e == e_first && k0 == 0) ov[j] = ov0[j];
          else ov[j] = k0 + j < n_fold ? __ldcg(&a.part_o[(base + int64_t(part_idx(k0 + j)) * kRows + r) * kHeadDim + d]) : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < kFoldBatch; ++j) {
          if (k0 + j < n_fold) {
            const float2 f = fab[(k0 + j) * kRows + r];
            O = msa::fold_val(O, FoldScale{f.x, f.y}, ov[j]);
          }
        }
      }
      a.out[(int64_t(t0 + r / G) * a.q_heads + g * G + r % G) * kHeadDim + d] = msa::finish(O, lrow[r]);
    }
    M3_TL_MARK(attention, tl_cta, 6);
    M3_TL_FINISH(attention, tl_cta, tl_ctas);
    return;
  }
  for (int e = e0 + tid; e < e1; e += kThreads) {
    const int row = e / kHeadDim, d = e % kHeadDim;
    float M = -INFINITY, Ls = 0.0f, O = 0.0f;
    for (int k0 = 0; k0 < n_fold; k0 += 8) {
      float2 ml[8];
      float ov[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        if (k0 + j < n_fold) {
          const int64_t prow = base + int64_t(part_idx(k0 + j)) * kRows + row;
          ml[j] = __ldcg(&a.part_ml[prow]);
          ov[j] = __ldcg(&a.part_o[prow * kHeadDim + d]);
        }
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        if (k0 + j < n_fold) {
          const FoldScale f = msa::fold_scale(M, ml[j].x, sl2);
          Ls = msa::fold_val(Ls, f, ml[j].y);
          O = msa::fold_val(O, f, ov[j]);
        }
      }
    }
    a.out[(int64_t(t0 + row / G) * a.q_heads + g * G + row % G) * kHeadDim + d] = msa::finish(O, Ls);
  }
  M3_TL_MARK(attention, tl_cta, 6);
  M3_TL_FINISH(attention, tl_cta, tl_ctas);
}

// Partials of decode batches (M3 top-16: 532 KB per token; up to 8 MB: B <= 15). Not larger:
// with 32 MB (B <= 60) B = 16 steps measured 3-7 % slower, B = 24 1-5 % and B = 32 0-3 % faster
// (H200, 2K-128K), whether the indexer let the attention start before or after its selection
// (docs/msa_kernels.md, thirty-first round; not understood). Two launches of the attention never
// overlap on it: partials are written after the kernel's wait (every earlier kernel has then
// completed) or, for early units, before it, once the indexer has let the kernel start (it
// releases its dependents only past its own wait: all earlier work has then completed).
__device__ __align__(256) uint4 g_decode_partials[kDecodePartialBytes / 16];

}  // namespace

std::vector<MsaFixedBuffer> msa_attention_fixed_buffers() {
  static FixedScratch part_of(g_decode_partials);
  return {{part_of.address(), part_of.bytes()}};
}

namespace {

// How many clusters of `cluster` CTAs of `kernel` with `smem` bytes of dynamic shared memory can
// be resident at once on this device (0 where it cannot launch them).
int resident_clusters(const void* kernel, size_t smem, unsigned cluster) {
  int clusters = 0;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)) == cudaSuccess &&
      cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) == cudaSuccess) {
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(cluster);
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = smem;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = cluster;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) != cudaSuccess) clusters = 0;
  }
  cudaGetLastError();
  return clusters;
}

// Largest cluster the kernel can be launched with on this device (16 where a GPC can hold it).
// Called once per device (msa_attention_limits).
template <int MT, bool kSplit>
int max_cluster() {
  const void* kernel = reinterpret_cast<const void*>(msa_attention_kernel<MT, kSplit>);
  return resident_clusters(kernel, Layout<MT, kSplit>::kBytes, kMaxCluster) > 0 ? kMaxCluster : 8;
}

// Pushed partials beside the ring: every launch of that form asks for more shared memory than two
// CTAs per SM leave, so one CTA per SM; how many clusters of 2, 4, 8, 16 fit at once.
constexpr size_t kPushRecvMax = size_t(72) << 10;  // B = 16 at M3: 16 partials x 8 rows x 520 bytes = 65 KB
void push_wide_clusters(int (&out)[4]) {
  const void* kernel = reinterpret_cast<const void*>(msa_attention_kernel<1, true, false, true>);
  for (int i = 0; i < 4; ++i) out[i] = resident_clusters(kernel, Layout<1, true>::kBytes + kPushRecvMax, 2u << i);
}

}  // namespace

namespace {
MsaAttnShape attn_shape(int64_t tokens, int64_t q_heads, int64_t head_dim, int64_t kv_heads,
                        const ops::AttentionMetadata& meta, bool sparse, int top_k, bool bf16) {
  MsaAttnShape s;
  s.tokens = tokens;
  s.q_heads = q_heads;
  s.head_dim = head_dim;
  s.kv_heads = kv_heads;
  s.num_seqs = meta.num_seqs;
  s.max_blocks = meta.max_blocks_per_seq;
  s.bs = meta.block_size;
  s.sparse = sparse;
  s.top_k = top_k;
  s.bf16 = bf16;
  s.has_seq_lens = meta.seq_lens != nullptr;
  s.early_reads = meta.qkv_before_previous_kernel;
  return s;
}
}  // namespace

MsaAttnShape msa_attn_shape(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                            const ops::AttentionMetadata& meta, const TensorView& selected, int top_k) {
  return attn_shape(q.shape[0], q.shape[1], q.shape[2], k_cache.shape[1], meta, selected.data != nullptr, top_k,
                    k_cache.dtype == DType::kBF16 && v_cache.dtype == DType::kBF16);
}

// ops::attention's problem: m tokens, n query heads, k head dim, extra top_k (0: dense), the K
// cache's dtype (V is the K cache's type in the engine), kv_heads and the batch's metadata.
MsaAttnShape msa_attn_shape(const ops::Problem& p) {
  return attn_shape(p.m, p.n, p.k, p.kv_heads, *p.attention, p.extra >= 1, int(p.extra), p.dtype == DType::kBF16);
}

// Shapes outside the tuned kernel run the generic kernel.
std::string msa_attention_refusal(const MsaAttnShape& s) {
  if (!s.bf16) return "K/V caches are not BF16";
  if (s.head_dim != kHeadDim) return "head_dim is not 128";
  if (s.kv_heads < 1 || s.q_heads % s.kv_heads != 0) return "query heads are not a multiple of the KV heads";
  if (s.q_heads / s.kv_heads > kMaxRows) return "more than 64 query heads per KV head";
  if (s.sparse && (s.top_k < 1 || s.top_k > kMaxTopK)) return "top_k outside 1..64";
  if (s.bs < 1) return "no page size";
  if (s.tokens * s.kv_heads >= (int64_t(1) << 27)) return "2^27 or more (token, KV head) row groups";
  return "";
}

// Asked of the runtime once per device (every eager launch plans with them).
MsaAttnLimits msa_attention_limits() {
  static std::array<std::once_flag, 64> once;
  static std::array<MsaAttnLimits, 64> cached;
  int dev = 0;
  M3_CUDA_CHECK(cudaGetDevice(&dev));
  dev &= 63;
  std::call_once(once[size_t(dev)], [&] {
    MsaAttnLimits& l = cached[size_t(dev)];
    l.sms = current_sm_count();
    l.cluster_deep = max_cluster<1, false>();
    l.cluster_ring = max_cluster<1, true>();
    l.cluster_four = max_cluster<4, false>();
    push_wide_clusters(l.push_wide_clusters);
    // Two CTAs per SM (the split ring's residency). Measured (H100, attention alone, 128K): B = 1
    // 185.6 -> 143.9 us, B = 2 290.8 -> 259.1 us. M3_MSA_STRIPE_CTAS=N overrides it (0: none).
    l.stripe_ctas = default_stripe_ctas(l.sms);
    if (const char* env = std::getenv("M3_MSA_STRIPE_CTAS"); env != nullptr && *env != '\0') {
      l.stripe_ctas = std::max<int64_t>(0, std::atoll(env));
    }
  });
  return cached[size_t(dev)];
}

MsaAttnPlan msa_attention_plan(const MsaAttnShape& s, const MsaAttnLimits& lim) {
  MsaAttnPlan p;
  p.tuned = msa_attention_refusal(s).empty();
  if (!p.tuned || s.tokens == 0) return p;
  const bool sparse = s.sparse;
  const int top_k = sparse ? s.top_k : 0;
  const int64_t tokens = s.tokens, kv_heads = s.kv_heads;
  const int group = int(s.q_heads / kv_heads);
  // Row groups: one token per group for pure decode (one query per sequence); otherwise as
  // many tokens as fit 64 rows (and the selected-id buffer). Numerics do not depend on it.
  p.pure_decode = tokens == s.num_seqs;
  int tr = p.pure_decode ? 1 : std::max(1, kMaxRows / group);
  if (sparse) tr = std::max(1, std::min(tr, kMaxList / top_k));
  // One m-tile only when the row group fits it and its selected ids fit the decode list.
  p.m_tiles = (tr * group <= 16 && tr * top_k <= kMaxListDecode) ? 1 : 4;
  p.tokens_per_group = tr;
  // Super-units per row group at most (sparse: one per unit of the union of selections).
  const int64_t units_per_block = (s.bs + kUnitKeys - 1) / kUnitKeys;
  const int64_t max_blocks = std::max(1, s.max_blocks);
  p.su_cap = sparse ? std::min<int64_t>(int64_t(tr) * top_k, max_blocks) * units_per_block
                    : ((max_blocks * s.bs + kUnitKeys - 1) / kUnitKeys + kDenseSuUnits - 1) / kDenseSuUnits;
  // Cluster split: grow (powers of two, <= 16) while the row groups times the split still fit
  // about the resident CTAs. One m-tile: a dense context over at most half the SMs keeps the
  // deep whole-unit stages (each of a few CTAs streams many units); everything else takes the
  // split ring and two CTAs per SM.
  p.groups = (p.pure_decode ? tokens : (tokens + tr - 1) / tr + s.num_seqs) * kv_heads;
  const int64_t groups = p.groups, sms = lim.sms, su_cap = p.su_cap;
  auto grow = [&](int cap, int64_t target) {
    int sp = 1;
    while (sp < cap && groups * sp * 2 <= target + target / 4 && sp * 2 <= su_cap) sp *= 2;
    return sp;
  };
  int splits = 1;
  if (p.m_tiles == 1) {
    splits = grow(lim.cluster_deep, sms);
    p.split_ring = sparse || groups * splits > sms / 2;  // measured: 1 x 128K dense deep, 32 x 128K split
    // Split ring. Sparse (a few units per row group): about one CTA per SM in all (measured, H200,
    // top-16 decode, attention alone: B = 4 8 splits 25.8 us vs 16 splits 33.6; B = 8 4 splits
    // 40.4 vs 44.2; B = 16 2 splits 59.4 vs 69.0), but two splits rather than one up to one row
    // group per SM (B = 32: 73.6 vs 88.9). Dense contexts keep the previous rule (grow against
    // the resident CTAs, two per SM): end to end the halved split measured mixed there (dense
    // layer at 8 x 128K 2.99 vs 2.67 ms, at 16 x 128K 4.71 vs 5.04 ms).
    if (p.split_ring) {
      splits = grow(lim.cluster_ring, sparse ? sms : 2 * sms);
      if (sparse && splits == 1 && groups <= sms && su_cap >= 2) splits = 2;
    }
  } else {
    splits = grow(lim.cluster_four, sms);
  }
  // Stripes: a dense pure-decode row group that already has the largest cluster, in a grid that
  // would leave SMs idle (B = 1-2 at M3 TP1: 64 and 128 CTAs), takes several clusters of the split
  // ring: up to lim.stripe_ctas CTAs in all, at least one super-unit per CTA, and two where the
  // grid passes one CTA per SM. (Measured, H100, seventy-fourth session: the second CTA per SM
  // gains where each CTA keeps 2 super-units, 6-10 % of the attention at 64K-128K, and loses 1-1.5 %
  // where it keeps one: TP1 B = 2 at 32K, TP4 B = 8 at 32K and B = 2 at 128K.) The fold needs a
  // cluster barrier, so one cluster alone cannot grow past the cluster limit.
  int stripes = 1;
  if (!sparse && p.pure_decode && p.m_tiles == 1 && groups <= kMaxStripeGroups && lim.cluster_ring > 1 &&
      splits >= lim.cluster_ring) {
    const int64_t c = lim.cluster_ring;
    auto fits = [&](int64_t per_group) {
      return groups * per_group <= lim.stripe_ctas && per_group <= su_cap &&
             (groups * per_group <= sms || 2 * per_group <= su_cap);
    };
    while (fits(c * stripes * 2)) stripes *= 2;
    if (stripes > 1) {
      splits = lim.cluster_ring;
      p.split_ring = true;
    }
  }
  // Early units (a variant of the split-ring kernel, so that the others keep their registers: 118
  // against 128; it checks the context; partial index = block id < top_k, within su_cap).
  // Only where Q and K/V were complete before the previous kernel (the layer's own indexer) began.
  // A CTA takes several blocks where the cluster has fewer CTAs than top_k (B = 3-4 at M3's
  // shapes: 8-CTA clusters). Contexts of more than top_k blocks do not run early: computing every
  // block's unit meanwhile (the selected ones folded after) measured slower, 8K at B = 1 27.5 ->
  // 34.6 us on an H100 (docs/msa_kernels.md, thirty-third round).
  p.early = sparse && s.early_reads && p.pure_decode && tokens <= kEarlyUnitsMaxSeqs && p.split_ring &&
            units_per_block == 1 && splits > 1;
  if (p.early) p.early_max_blocks = std::min(top_k, splits * kMaxListDecode);
  const size_t rows_pad = size_t(p.m_tiles) * 16;
  p.part_bytes = size_t(tokens) * size_t(kv_heads) * size_t(p.su_cap) * rows_pad * (kHeadDim + 2) * 4;
  if (p.part_bytes > kMaxPartialBytes) splits = 1;
  if (splits == 1) p.early = false, p.early_max_blocks = 0, stripes = 1;
  p.splits = splits;
  p.stripes = stripes;
  // Decode batches take the fixed buffer where the partials fit (B <= 15 at M3 TP1): no memory
  // nodes around the launch, so the programmatic edge from the indexer holds in a graph (with
  // the indexer's fixed scores, H200: B = 8 steps 2-6 % faster; the 2-5 % loss at B = 8 and 16
  // measured with the early units inside the shared kernel was that kernel's, not the buffers').
  p.fixed_partials = splits > 1 && p.pure_decode && p.part_bytes <= kDecodePartialBytes;
  // Pushed partials where each CTA folds whole rows: into the ring's third slot where every CTA of
  // a cluster has at most one unit (a row group's union of selections, and so its partials, never
  // exceeds su_cap; the slot holds a CTA's share: at most 16 rows x 520 bytes), else beside the
  // ring where the grid fits one CTA per SM and all its clusters fit at once. H100, attention alone
  // at B = 1 / 2: 15.8-16.1 -> 14.6-14.7 us / 18.2-18.8 -> 17.1-17.3 us (docs/msa_kernels.md,
  // forty-first round).
  p.ctas = tokens * kv_heads * splits * stripes;
  const int64_t rows = int64_t(p.tokens_per_group) * group;
  if (splits > 1 && p.split_ring && sparse && p.pure_decode && p.m_tiles == 1 && rows % splits == 0) {
    const size_t recv = size_t(p.su_cap) * size_t(rows / splits) * (kHeadDim * 4 + 8);
    int lg = 0;
    while ((2 << lg) < splits) ++lg;
    if (p.su_cap <= splits) {
      p.push = true;
    } else if (lg < 4 && p.ctas <= lim.sms && recv <= kPushRecvMax && groups <= lim.push_wide_clusters[lg]) {
      p.push = true;
      p.push_recv_bytes = recv;
    }
  }
  return p;
}

std::string msa_attention_plan_text(const MsaAttnPlan& p) {
  if (!p.tuned) return "the generic kernel (shape outside the tuned one)";
  std::string s = std::to_string(p.groups) + (p.groups == 1 ? " row group of " : " row groups of ") + std::to_string(p.tokens_per_group) + " token" +
                  (p.tokens_per_group == 1 ? "" : "s") + " (" + std::to_string(p.m_tiles) + " m-tile" +
                  (p.m_tiles == 1 ? "" : "s") + "), ";
  s += p.m_tiles == 4 ? "2 whole-unit stages" : p.split_ring ? "K/V split ring, two CTAs per SM" : "3 whole-unit stages";
  if (p.early) s += ", early units (contexts of <= " + std::to_string(p.early_max_blocks) + " blocks)";
  if (p.push) {
    s += ", partials pushed into the folding CTAs' shared memory";
    if (p.push_recv_bytes > 0) s += " (" + std::to_string((p.push_recv_bytes + 1023) / 1024) + " KB beside the ring, one CTA per SM)";
  }
  s += ", " + std::to_string(p.ctas) + " CTAs";
  if (p.splits > 1) {
    s += " in clusters of " + std::to_string(p.splits);
    if (p.stripes > 1) s += " (" + std::to_string(p.stripes) + " per row group, the last one in folds)";
    s += ", up to " + std::to_string(p.su_cap) + " super-unit partials per row group (" +
         (p.fixed_partials ? "fixed buffer" : "pool") + ")";
  }
  return s;
}

void launch_msa_attention(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                          const ops::AttentionMetadata& meta, const TensorView& selected, int top_k,
                          const TensorView& out) {
  const int64_t tokens = q.shape[0], q_heads = q.shape[1], head_dim = q.shape[2];
  if (tokens == 0) return;
  const int64_t kv_heads = k_cache.shape[1];
  const bool sparse = selected.data != nullptr;
  const int bs = meta.block_size;
  const MsaAttnShape shape = msa_attn_shape(q, k_cache, v_cache, meta, selected, top_k);
  if (!msa_attention_refusal(shape).empty()) return launch_generic_attention(q, k_cache, v_cache, meta, selected, top_k, out);
  const MsaAttnPlan plan = msa_attention_plan(shape, msa_attention_limits());

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
  a.tokens_per_group = plan.tokens_per_group;
  a.early_reads = shape.early_reads;
  a.early_max_blocks = plan.early_max_blocks;
  a.stripes = plan.stripes;
  const int mt = plan.m_tiles, splits = plan.splits;
  const bool split_ring = plan.split_ring, early = plan.early;
  size_t smem = mt == 4 ? Layout<4, false>::kBytes : split_ring ? Layout<1, true>::kBytes : Layout<1, false>::kBytes;
  if (plan.push_recv_bytes > 0) {
    a.recv_off = int((smem + 15) / 16 * 16);
    smem = size_t(a.recv_off) + plan.push_recv_bytes;
  }
  a.splits = splits;
  a.su_cap = int(plan.su_cap);
  static FixedScratch part_of(g_decode_partials);
  const size_t scratch_bytes = splits > 1 ? plan.part_bytes : 0;
  Scratch part = plan.pure_decode ? Scratch(scratch_bytes, part_of) : Scratch(scratch_bytes);
  if (splits > 1) {
    a.part_o = part.as<float>();
    a.part_ml = reinterpret_cast<float2*>(a.part_o + size_t(tokens) * kv_heads * plan.su_cap * size_t(mt) * 16 * kHeadDim);
  }
  const unsigned grid = unsigned(plan.ctas);
  auto run = [&](auto kernel) {
    M3_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    if (splits > 8) M3_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(grid);
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = current_stream();
    cudaLaunchAttribute attr[2];
    unsigned n = 0;
    if (cfg.stream && pdl_enabled()) {  // created streams only (the legacy stream keeps plain ordering)
      // Programmatic dependent launch: the launch and the Q staging overlap the tail of the
      // previous kernel (the kernel waits for it before reading selections or K/V).
      attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
      attr[n].val.programmaticStreamSerializationAllowed = 1;
      ++n;
    }
    if (splits > 1) {
      attr[n].id = cudaLaunchAttributeClusterDimension;
      attr[n].val.clusterDim.x = unsigned(splits);
      attr[n].val.clusterDim.y = 1;
      attr[n].val.clusterDim.z = 1;
      ++n;
    }
    cfg.attrs = attr;
    cfg.numAttrs = n;
    M3_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, a));
  };
  if (mt == 4) run(msa_attention_kernel<4, false>);
  else if (early) plan.push ? run(msa_attention_kernel<1, true, true, true>) : run(msa_attention_kernel<1, true, true>);
  else if (plan.stripes > 1) run(msa_attention_kernel<1, true, false, false, true>);
  else if (split_ring) plan.push ? run(msa_attention_kernel<1, true, false, true>) : run(msa_attention_kernel<1, true>);
  else run(msa_attention_kernel<1, false>);
  M3_CUDA_CHECK_LAUNCH();
}

}  // namespace m3::cuda
