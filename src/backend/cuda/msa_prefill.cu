// KV-block-major MSA sparse attention for prefill (BF16 KV cache, head_dim 128, block size
// <= 128). The selections {token -> blocks} of a chunk of tokens are inverted into
// {(KV group, sequence, block) -> tokens} by a counting sort; each CTA loads one selected
// block's K and V into shared memory once and attends the tokens of up to 16 128-row tiles that
// chose it (warps each running their own 16-row m-tiles with the next one's Q prefetched per
// warp), writing per (token, head, selected block) a partial (max, sum, P.V); a merge kernel
// folds each row's partials in ascending block order.
//
// The unit partial is the canonical one of msa_decode.cu instruction for instruction (S by
// one MMA chain over the k-steps with Q's bf16 hi then lo half, masked, the unit's row max,
// exp2 of the scaled difference, P split into bf16 hi + lo, P.V and the row sum by one chain
// over the key steps, hi then lo), and the merge is the canonical fold, so a row's result is
// bit-identical to the query-major and decode paths: the entry is batch-invariant.
//
// The block kernel runs on wgmma (bm_block_wg_kernel), with the same fragments and MMA order,
// hence the same bits. The fast variant (not batch-invariant) drops the lo halves, writes bf16
// partials, and stages Q rounded to bf16 (rank-and-count writes the chunk's copy): its CTAs of 8
// warps take half the shared memory, two per SM, so one's item prologue overlaps the other's
// MMAs (the canonical kernel: 16 warps, fp32 Q stages, one CTA per SM).
//
// Launches per chunk of tokens (the partials of a chunk stay under kScratchBytes): a memset
// of the counts, rank-and-count, one-CTA scan (entry offsets and the work list), scatter,
// the block kernel, the merge.
#include <cuda_bf16.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <stdexcept>
#include <string>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_internal.h"
#include "backend/cuda/msa.h"
#include "backend/cuda/msa_common.cuh"
#include "backend/cuda/wgmma.cuh"

namespace m3::cuda {
namespace {

using msa::cp_async16;
using msa::cp_async_commit;
using msa::cp_async_wait;
using msa::kHeadDim;
using msa::kUnitKeys;
using msa::smem_u32;
using msa::tile_off;

constexpr int kWarps = 16;  // of the canonical block kernel: 128 registers per thread, one CTA per SM
constexpr int kThreads = kWarps * 32;
constexpr int kFastWarps = 8;  // of the fast one: two CTAs per SM (bf16 Q stages), same warps per SM
constexpr int kTileRows = 128;  // rows (token x head) of a tile: the unit of the work list
constexpr int kTilesPerCta = 16;  // tiles of one block per CTA (its K/V loaded once)
constexpr int kMaxTopK = 64;
constexpr int kMaxGroup = 128;
constexpr size_t kScratchBytes = size_t(2) << 30;  // partials of one chunk of tokens
constexpr int kScanThreads = 1024;

struct BmArgs {
  const float* q;  // [tokens, q_heads, 128]
  __nv_bfloat16* qb;  // fast variant: the chunk's Q rounded to bf16 [chunk tokens, q_heads, 128] (bm_rank_count)
  float* out;
  const __nv_bfloat16* k;  // [slots, kv_heads, 128]
  const __nv_bfloat16* v;
  const int32_t* sel;  // [kv_heads, tokens, top_k]
  const int32_t* query_start;
  const int32_t* positions;
  const int32_t* seq_lens;
  const int32_t* block_tables;
  // scratch
  int* count;       // [n_keys] selections per (group, seq, block); back to 0 after the scatter
  int* entry_off;   // [n_keys + 1]
  int2* items;      // [max_items] (key, first tile)
  int* item_total;  // [1]
  int* slot_of;     // [chunk tokens, kv, top_k] rank of the block among the token's distinct valid ones, or -1
  int* n_valid;     // [chunk tokens, kv]
  int* entries;     // [chunk tokens * kv * top_k] (token in chunk << 6 | slot), grouped by key
  void* part_o;     // [kv, chunk tokens, top_k, group, 128]: fp32 (canonical) or bf16 (fast variant)
  float2* part_ml;  // [kv, chunk tokens, top_k, group]
  int num_seqs, num_tokens, max_blocks, bs, q_heads, kv_heads, group, top_k, tile_tokens;
  int c0, n_tok;    // the chunk: tokens [c0, c0 + n_tok)
  int tiles_per_item;  // kTilesPerCta for both variants (the fast kernel's token list holds kItemRows;
                       // 8-tile items were 4-5 % slower, docs/msa_kernels.md, twenty-third round)
  int n_keys, max_items;
  float scale_log2;
};

__device__ __forceinline__ int key_of(const BmArgs& a, int g, int s, int b) {
  return (g * a.num_seqs + s) * a.max_blocks + b;
}

__device__ __forceinline__ uint32_t pack_bf16x2(float x, float y) {
  return msa::bf16x2_bits(__floats2bfloat162_rn(x, y));
}

// Per (token, group), one warp (lane l holds selections l and l + 32): the valid distinct
// blocks, their rank (ascending block id) and counts. (A thread per pair, re-reading its ids in
// O(top_k^3) loops, took 76 us per chunk of 4000 tokens in 63 CTAs.)
constexpr int kRankThreads = 256;
__global__ void __launch_bounds__(kRankThreads) bm_rank_count(BmArgs a) {
  const int i = int((blockIdx.x * blockDim.x + threadIdx.x) >> 5), lane = int(threadIdx.x) & 31;
  if (i >= a.n_tok * a.kv_heads) return;  // warp-uniform
  const int tr = i / a.kv_heads, g = i % a.kv_heads, t = a.c0 + tr;
  const int s = msa::seq_of_token(a.query_start, a.num_seqs, t);
  const int local = a.positions[t] / a.bs;
  const int32_t* ids = a.sel + (int64_t(g) * a.num_tokens + t) * a.top_k;
  const int k = a.top_k;
  int b[2];
  bool first[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    b[h] = lane + 32 * h < k ? ids[lane + 32 * h] : -1;
    first[h] = true;
  }
  // First occurrences: no earlier position holds the same id.
  for (int j = 0; j < k; ++j) {
    const int v = __shfl_sync(0xffffffffu, b[j >> 5], j & 31);
#pragma unroll
    for (int h = 0; h < 2; ++h) first[h] = first[h] && !(j < lane + 32 * h && v == b[h]);
  }
  // Rank: the distinct ids in [0, b) (each below b <= local, so valid).
  int rank[2] = {0, 0};
  for (int j = 0; j < k; ++j) {
    const int v = __shfl_sync(0xffffffffu, b[j >> 5], j & 31);
    const bool f = __shfl_sync(0xffffffffu, first[j >> 5], j & 31);
#pragma unroll
    for (int h = 0; h < 2; ++h) rank[h] += (f && v >= 0 && v < b[h]) ? 1 : 0;
  }
  int* slot = a.slot_of + int64_t(i) * k;
  int nvalid = 0;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int j = lane + 32 * h;
    const bool ok = j < k && first[h] && b[h] >= 0 && b[h] <= local;
    if (ok) atomicAdd(&a.count[key_of(a, g, s, b[h])], 1);
    if (j < k) slot[j] = ok ? rank[h] : -1;
    nvalid += __popc(__ballot_sync(0xffffffffu, ok));
  }
  if (lane == 0) a.n_valid[i] = nvalid;
  // The fast variant's Q rows of this (token, group), rounded to bf16 once (the block kernel's hi
  // halves, the same bits): its Q stages take half the shared memory and the gathers half the bytes.
  if (a.qb != nullptr) {
    const int64_t r0 = int64_t(t) * a.q_heads + int64_t(g) * a.group;
    const int64_t w0 = int64_t(tr) * a.q_heads + int64_t(g) * a.group;
    for (int e = lane; e < a.group * (kHeadDim / 4); e += 32) {
      const float4 x = __ldcs(reinterpret_cast<const float4*>(a.q + r0 * kHeadDim) + e);
      reinterpret_cast<uint2*>(a.qb + w0 * kHeadDim)[e] = make_uint2(pack_bf16x2(x.x, x.y), pack_bf16x2(x.z, x.w));
    }
  }
}

// One CTA: entry offsets (exclusive scan of the counts) and the work list (per key,
// ceil(count / (tile_tokens * kTilesPerCta)) items).
__global__ void __launch_bounds__(kScanThreads) bm_scan(BmArgs a) {
  __shared__ int warp_sum[2][kScanThreads / 32];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int n = a.n_keys, per = (n + kScanThreads - 1) / kScanThreads;
  const int lo = min(n, tid * per), hi = min(n, lo + per);
  const int per_item = a.tile_tokens * a.tiles_per_item;
  int se = 0, si = 0;
  for (int k = lo; k < hi; ++k) {
    const int c = a.count[k];
    se += c;
    si += (c + per_item - 1) / per_item;
  }
  const int ie = msa::warp_inclusive_scan(se), ii = msa::warp_inclusive_scan(si);
  if (lane == 31) {
    warp_sum[0][warp] = ie;
    warp_sum[1][warp] = ii;
  }
  __syncthreads();
  int be = 0, bi = 0, te = 0, ti = 0;
  for (int w = 0; w < kScanThreads / 32; ++w) {
    if (w < warp) {
      be += warp_sum[0][w];
      bi += warp_sum[1][w];
    }
    te += warp_sum[0][w];
    ti += warp_sum[1][w];
  }
  int oe = be + ie - se, oi = bi + ii - si;
  for (int k = lo; k < hi; ++k) {
    const int c = a.count[k];
    a.entry_off[k] = oe;
    const int items = (c + per_item - 1) / per_item;
    for (int j = 0; j < items; ++j) a.items[oi + j] = make_int2(k, j * a.tiles_per_item);
    oe += c;
    oi += items;
  }
  if (tid == 0) {
    a.entry_off[n] = te;
    a.item_total[0] = ti;
  }
}

// Each (token, group, selected block) into its key's range of entries, a thread per selection
// (order within a key does not matter: every row's partial is computed the same way wherever
// it lands; a thread per (token, group) ran its top_k atomics in sequence: 31 us per chunk).
__global__ void bm_scatter(BmArgs a) {
  const int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= int64_t(a.n_tok) * a.kv_heads * a.top_k) return;
  const int i = int(e / a.top_k), j = int(e % a.top_k);
  const int slot = a.slot_of[e];
  if (slot < 0) return;
  const int tr = i / a.kv_heads, g = i % a.kv_heads, t = a.c0 + tr;
  const int s = msa::seq_of_token(a.query_start, a.num_seqs, t);
  const int key = key_of(a, g, s, a.sel[(int64_t(g) * a.num_tokens + t) * a.top_k + j]);
  const int idx = a.entry_off[key] + atomicSub(&a.count[key], 1) - 1;
  a.entries[idx] = (tr << 6) | slot;
}

// Shared memory: the block's K and V (swizzled bf16 tiles), the item's token list, and per warp
// one Q stage of 16 rows (canonical: fp32 rows padded to 136 floats, a warp's 8-byte fragment
// reads hit distinct banks per half-warp; fast: bf16, kQStrideB).
// Rows (token x head) of a work item; its token list (ent_s) and, canonical only, positions
// (pos_s) take kItemRows ints each. The fast variant reads positions from global memory.
constexpr int kItemRows = kTilesPerCta * kTileRows;
constexpr int kQStride = kHeadDim + 8;              // floats per staged Q row
constexpr size_t kQStage = size_t(16) * kQStride * 4;

// A work item's coordinates: block b of sequence s for KV group g; its tokens are entries
// [begin + t_lo, + n_tok) of the key, its rows n_tok x G (token in item x G + head); kvis keys of
// the block are in the cache.
struct BmItem {
  int g, s, b, begin, t_lo, n_tok, rows, kvis;
  int64_t page;
};
__device__ __forceinline__ BmItem bm_item(const BmArgs& a, int2 it) {
  BmItem w;
  const int key = it.x;
  w.g = key / (a.num_seqs * a.max_blocks);
  w.s = (key / a.max_blocks) % a.num_seqs;
  w.b = key % a.max_blocks;
  w.begin = a.entry_off[key];
  const int cnt = a.entry_off[key + 1] - w.begin;
  w.t_lo = it.y * a.tile_tokens;
  w.n_tok = min(cnt - w.t_lo, a.tiles_per_item * a.tile_tokens);
  w.rows = w.n_tok * a.group;
  w.kvis = min(a.bs, a.seq_lens[w.s] - w.b * a.bs);
  w.page = a.block_tables[int64_t(w.s) * a.max_blocks + w.b];
  return w;
}
// Element offset of 16-byte chunk ch of key r's K/V row (keys past the cache read key 0: the
// copies of those are zero-filled and the keys masked).
__device__ __forceinline__ int64_t bm_kv_elem(const BmArgs& a, const BmItem& w, int r, int ch) {
  return ((w.page * a.bs + (r < w.kvis ? r : 0)) * a.kv_heads + w.g) * kHeadDim + ch * 8;
}
// The item's token list: token in chunk, slot of the block among its selections, position.
template <bool kPos, int kT>
__device__ __forceinline__ void bm_load_tokens(const BmArgs& a, const BmItem& w, int* ent_s, int* pos_s) {
  for (int i = int(threadIdx.x); i < w.n_tok; i += kT) {
    const int e = a.entries[w.begin + w.t_lo + i];
    ent_s[i] = e;
    if constexpr (kPos) pos_s[i] = a.positions[a.c0 + (e >> 6)];
  }
}
// The 16 rows of m-tile mt into a warp's Q stage: lane r < 16 finds row r's Q (element offset,
// -1 past the item: zero-filled), and every lane copies its 16-byte chunk of each row.
__device__ __forceinline__ void bm_fetch_q(const BmArgs& a, const BmItem& w, const int* ent_s, uint32_t q_stage, int mt,
                                           int lane) {
  const int G = a.group, row = mt * 16 + (lane & 15);
  // The row's index in q's [tokens x q_heads] rows (32-bit, as the launcher checks): one shuffle
  // per row, not two.
  const int mine = row < w.rows ? (a.c0 + (ent_s[row / G] >> 6)) * a.q_heads + w.g * G + row % G : -1;
  const uint32_t dst = q_stage + uint32_t(lane) * 16u;
#pragma unroll
  for (int r = 0; r < 16; ++r) {
    const int qr = __shfl_sync(0xffffffffu, mine, r);
    cp_async16(dst + uint32_t(r * kQStride * 4), a.q + (qr >= 0 ? int64_t(qr) * kHeadDim + lane * 4 : 0), qr >= 0);
  }
  cp_async_commit();
}
// The fast variant's bf16 Q stage: rows of 136 bf16 (272 bytes: the fragment reads of a
// half-warp hit distinct banks); lane l copies 16-byte chunk l % 16 of rows l / 16, + 2, ...
constexpr int kQStrideB = kHeadDim + 8;
constexpr size_t kQStageB = size_t(16) * kQStrideB * 2;
__device__ __forceinline__ void bm_fetch_qb(const BmArgs& a, const BmItem& w, const int* ent_s, uint32_t q_stage,
                                            int mt, int lane) {
  const int G = a.group, row = mt * 16 + (lane & 15), c = lane & 15;
  const int mine = row < w.rows ? (ent_s[row / G] >> 6) * a.q_heads + w.g * G + row % G : -1;  // chunk-local
  const uint32_t dst = q_stage + uint32_t((lane >> 4) * kQStrideB * 2 + c * 16);
  const __nv_bfloat16* const src = a.qb + c * 8;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int qr = __shfl_sync(0xffffffffu, mine, (lane >> 4) + 2 * i);
    cp_async16(dst + uint32_t(i * 4 * kQStrideB), src + (qr >= 0 ? int64_t(qr) * kHeadDim : 0), qr >= 0);
  }
  cp_async_commit();
}
// x through an opaque move (kept in a register, recomputed where used, never hoisted).
__device__ __forceinline__ uint32_t opaque_u32(uint32_t x) {
  uint32_t y;
  asm volatile("mov.b32 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}

// A canonical partial's P.V pair (fp32). The fast variant's partials are bf16 (half the bytes the
// block kernel writes and the merge reads), stored 16 bytes at a time after quad_transpose_pairs.
__device__ __forceinline__ void store_pair(float* p, float x, float y) { *reinterpret_cast<float2*>(p) = make_float2(x, y); }
__device__ __forceinline__ float4 load_quad(const float* p) { return __ldcg(reinterpret_cast<const float4*>(p)); }

// A quad's row of 32 bf16 pairs, lane c holding pairs 4 dt + c (dt = 0..7, the m16n8 fragment's
// order), regathered so that lane c holds pairs 4 c .. 4 c + 3 in v[0..3] and 16 + 4 c .. in
// v[4..7]: a warp's 16-byte store then writes 64 contiguous bytes (two whole sectors) of each of
// its 8 rows, where the fragment's 4-byte stores wrote 16 bytes of each. Two 4 x 4 transposes
// (v[0..3] and v[4..7]), each two rounds of exchanges with the lane 2 and then 1 apart.
__device__ __forceinline__ void quad_transpose_pairs(uint32_t (&v)[8], int cq) {
#pragma unroll
  for (int g = 0; g < 2; ++g) {
#pragma unroll
    for (int bit = 1; bit >= 0; --bit) {
      const int m = 1 << bit;
      const bool b = (cq >> bit) & 1;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int lo = bit ? i : 2 * i;  // the element pair (lo, lo + m) differs in `bit`
        uint32_t& elo = v[4 * g + lo];
        uint32_t& ehi = v[4 * g + lo + m];
        const uint32_t r = __shfl_xor_sync(0xffffffffu, b ? elo : ehi, m);
        if (b) elo = r; else ehi = r;
      }
    }
  }
}

// Row r's partial index: [group, token in chunk, slot, head].
__device__ __forceinline__ int64_t bm_pidx(const BmArgs& a, const BmItem& w, const int* ent_s, int r) {
  const int ti = r / a.group;
  const int e = ent_s[ti];
  return ((int64_t(w.g) * a.n_tok + (e >> 6)) * a.top_k + (e & 63)) * a.group + r % a.group;
}

// The block kernel on wgmma (sm_90a). One work item: the tokens of up to a.tiles_per_item tiles
// that chose one (group, seq, block); the CTA loads the block's K and V once, then each of its 16
// warps owns 16-row m-tiles (row = token-in-item x G + head) with its own Q stage (the next
// m-tile's fp32 Q rows gathered by cp.async while P.V runs), and a warpgroup's four m-tiles run
// as one m64 wgmma per step. kHiLo (canonical): the bits of the decode and query-major kernels'
// mma.sync hi-then-lo chain, since a wgmma m64nNk16 chain with A from registers gives the fp32
// bits of the mma.sync m16n8k16 chain over the same operands in the same order
// (tools/wgmma_probe/wgmma_identity_probe.cu), and Q and P are split into bf16 hi + lo in
// registers exactly as there:
//   S   = per 16-dim step, hi then lo, over all 128 keys (N = 128) from K in shared memory;
//   O   = per 16-key step, hi then lo, over 64 dims at a time (N = 64) from V in shared memory,
//         read transposed by an MN-major descriptor (as the dense prefill kernel);
//   sum = the same steps against a tile of ones (N = 8), as the mma.sync kernel's ones fragment.
// The fast variant (kHiLo false, batch_invariant == false only): the hi halves alone (Q and P
// rounded to bf16, half the MMAs) and partials of type PO = bf16 (half the partial bytes).
// K and V are stored as two 128-byte-swizzled halves of 64 dims each ([half][key][128 B]).
constexpr size_t kWgKOff = 0;                        // K: [dim half][key][128 B]
constexpr size_t kWgVOff = kWgKOff + 2 * 16384;      // V: [dim half][key][128 B] (read MN-major)
constexpr size_t kWgOnesOff = kWgVOff + 2 * 16384;   // 8 rows x 128 B of bf16 ones
constexpr size_t kWgQOff = kWgOnesOff + 1024;        // per warp a Q stage
constexpr size_t kWgTokOff = kWgQOff + size_t(kWarps) * kQStage;
constexpr size_t kWgBlockSmem = kWgTokOff + size_t(2) * kItemRows * 4 + 1024;  // + 1024: base alignment
// The fast variant: 8 bf16 Q stages and the token list alone (positions from global memory), so
// that two CTAs fit an SM and one's item prologue overlaps the other's MMAs.
constexpr size_t kWgTokOffFast = kWgQOff + size_t(kFastWarps) * kQStageB;
constexpr size_t kWgBlockSmemFast = kWgTokOffFast + size_t(kItemRows) * 4 + 1024;
static_assert(2 * (kWgBlockSmemFast + 1024) <= 228 * 1024, "two fast CTAs per SM");

template <bool kHiLo, class PO>
__global__ void __launch_bounds__(kHiLo ? kThreads : kFastWarps * 32, kHiLo ? 1 : 2) bm_block_wg_kernel(BmArgs a) {
  constexpr int W = kHiLo ? kWarps : kFastWarps, T = W * 32;
  extern __shared__ unsigned char smem_raw[];
  // Aligned by pointer arithmetic on the shared array, as wgmma::align_1024 does (so loads are
  // LDS, not generic LD), but written out: through the helper ptxas scheduled this kernel
  // differently and it measured 1-3 % slower (thirty-fifth session).
  unsigned char* const smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  // Per token of the item: (token in chunk << 6 | slot).
  int* const ent_s = reinterpret_cast<int*>(smem + (kHiLo ? kWgTokOff : kWgTokOffFast));
  int* const pos_s = ent_s + kItemRows;
  const uint32_t k_tile0 = smem_u32(smem + kWgKOff), v_tile0 = smem_u32(smem + kWgVOff);
  const uint32_t ones0 = smem_u32(smem + kWgOnesOff);

  if (int(blockIdx.x) >= a.item_total[0]) return;
  const BmItem w = bm_item(a, a.items[blockIdx.x]);
  const int rows = w.rows, kvis = w.kvis;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, cq = lane & 3;
  const int wg = warp >> 2, w4 = warp & 3;
  const float sl2 = a.scale_log2;
  // K and V of the block into their swizzled halves (keys past the sequence's cache are
  // zero-filled and masked). V is read transposed by its descriptor (MN-major), as the dense
  // prefill kernel does: no transpose pass.
  for (int i = tid; i < kUnitKeys * 16; i += T) {
    const int r = i >> 4, ch = i & 15;
    const int64_t elem = bm_kv_elem(a, w, r, ch);
    const uint32_t so = uint32_t((ch >> 3) * 16384 + r * 128 + (((ch & 7) ^ (r & 7)) << 4));
    cp_async16(k_tile0 + so, a.k + elem, r < kvis);
    cp_async16(v_tile0 + so, a.v + elem, r < kvis);
  }
  cp_async_commit();
  bm_load_tokens<kHiLo, T>(a, w, ent_s, pos_s);
  {
    uint32_t* o = reinterpret_cast<uint32_t*>(smem + kWgOnesOff);
    for (int i = tid; i < 256; i += T) o[i] = msa::kBf16OnePair;
  }
  __syncthreads();  // the token list is in

  const size_t q_off = kWgQOff + size_t(warp) * (kHiLo ? kQStage : kQStageB);
  const uint32_t q_stage = smem_u32(smem + q_off);
  const float* const qs = reinterpret_cast<const float*>(smem + q_off);
  const __nv_bfloat16* const qsb = reinterpret_cast<const __nv_bfloat16*>(smem + q_off);
  // Rows past the item are zero-filled: a warpgroup's four warps run every wgmma together.
  auto fetch_q = [&](int mt) {
    if constexpr (kHiLo) bm_fetch_q(a, w, ent_s, q_stage, mt, lane);
    else bm_fetch_qb(a, w, ent_s, q_stage, mt, lane);
  };
  const int n_it = (rows + 63) >> 6;  // m64 tiles of the item
  if (wg < n_it) fetch_q(wg * 4 + w4);  // its copies in flight with K and V
  cp_async_wait<0>();
  wgmma::fence_proxy_async();  // this thread's cp.async and st.shared writes, for the async proxy
  __syncthreads();             // K, V and the ones are in
  const int kb = w.b * a.bs;

#pragma unroll 1
  for (int m64 = wg; m64 < n_it; m64 += W / 4) {
    const int mt = m64 * 4 + w4;
    cp_async_wait<0>();
    __syncwarp();  // every lane's Q copies for this m-tile are visible to the warp
    // The tiles' addresses pass an opaque move in every iteration: with the lo halves gone, ptxas
    // hoisted the 25 descriptors out of the loop and spilled them (184 bytes of stack).
    const uint32_t k_tile = kHiLo ? k_tile0 : opaque_u32(k_tile0), v_tile = kHiLo ? v_tile0 : opaque_u32(v_tile0);
    const uint32_t ones = kHiLo ? ones0 : opaque_u32(ones0);
    // The lane's Q fragment elements: one base and immediates (ptxas hoisted 32 addresses
    // otherwise, and spilled them, 184 bytes of stack, in the fast variant).
    const float* const q_lane = qs + gq * kQStride + 2 * cq;
    const __nv_bfloat16* const qb_lane = kHiLo ? qsb : qsb + int(opaque_u32(uint32_t(gq * kQStrideB + 2 * cq)));

    // The fast variant has no position array in shared memory: the rows' positions come from
    // global memory, requested before S so that S covers their latency.
    int pos_pre0 = 0, pos_pre1 = 0;
    if constexpr (!kHiLo) {
      const int q0 = mt * 16 + gq, q1 = q0 + 8;
      pos_pre0 = q0 < rows ? __ldg(a.positions + a.c0 + (ent_s[q0 / a.group] >> 6)) : -1;
      pos_pre1 = q1 < rows ? __ldg(a.positions + a.c0 + (ent_s[q1 / a.group] >> 6)) : -1;
    }
    // S: 16-dim steps ascending, hi then lo (the canonical chain), issued in batches of kSB
    // steps whose A fragments stay in registers until the batch's wait (one wait per batch, not
    // per step: the order of the chain, hence its bits, is the same). The fast variant in one batch
    // of 8 spilled 88 bytes with the bf16 stages.
    constexpr int kSB = 4;
    float sa[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) sa[i] = 0.0f;
#pragma unroll
    for (int k0 = 0; k0 < 8; k0 += kSB) {
      uint32_t qh[kSB][4], ql[kSB][4];
#pragma unroll
      for (int j = 0; j < kSB; ++j)
#pragma unroll
        for (int f = 0; f < 4; ++f) {
          if constexpr (kHiLo) {
            const float2 x =
                *reinterpret_cast<const float2*>(q_lane + 8 * (f & 1) * kQStride + (k0 + j) * 16 + 8 * (f >> 1));
            msa::split_bf16(x.x, x.y, qh[j][f], ql[j][f]);
          } else {
            qh[j][f] =
                *reinterpret_cast<const uint32_t*>(qb_lane + 8 * (f & 1) * kQStrideB + (k0 + j) * 16 + 8 * (f >> 1));
          }
        }
      wgmma::fence_regs(sa);
      wgmma::fence();
#pragma unroll
      for (int j = 0; j < kSB; ++j) {
        const int ks = k0 + j;
        const uint64_t dk = wgmma::desc_sw128(k_tile + uint32_t((ks >> 2) * 16384 + (ks & 3) * 32));
        wgmma::WgmmaRS<true, 128>::run(sa, qh[j], dk);
        if constexpr (kHiLo) wgmma::WgmmaRS<true, 128>::run(sa, ql[j], dk);
      }
      wgmma::commit();
      wgmma::wait<0>();
      wgmma::fence_regs(sa);
      wgmma::fence_regs(qh);
      if constexpr (kHiLo) wgmma::fence_regs(ql);
    }
    __syncwarp();  // every lane is done reading the stage
    if (m64 + W / 4 < n_it) fetch_q(mt + W);
    const int r0 = mt * 16 + gq, r1 = r0 + 8;
    // The canonical kernel reads its rows' positions here, after S (held across S they spill).
    const int pos0 = kHiLo ? (r0 < rows ? pos_s[r0 / a.group] : -1) : pos_pre0;
    const int pos1 = kHiLo ? (r1 < rows ? pos_s[r1 / a.group] : -1) : pos_pre1;
    float m0, m1;
    uint32_t ph[8][4], pl[8][4];
    auto sv = [&](int nt, int e) -> float& { return sa[4 * nt + e]; };
    // A full block wholly before every row of the warp's m-tile (most of a prefill's selections:
    // all but the token's own block) needs no masks; rows past the item are not stored.
    const bool open0 = r0 >= rows || kb + kUnitKeys - 1 <= pos0, open1 = r1 >= rows || kb + kUnitKeys - 1 <= pos1;
    if (__all_sync(0xffffffffu, kvis >= kUnitKeys && open0 && open1)) {
      msa::unit_probs(sv, kUnitKeys, 0, cq, INT_MAX, INT_MAX, sl2, m0, m1, ph, pl);
    } else {
      msa::unit_probs(sv, kvis, kb, cq, pos0, pos1, sl2, m0, m1, ph, pl);
    }
    // The two rows' partial indices (32-bit: a chunk's partial rows are under kScratchBytes /
    // 256). The fast variant finds them once per m-tile: per store they cost a division by G and
    // two token-list loads, redone after every wgmma fence (a quarter of its stall samples). The
    // canonical kernel, 128 registers with the lo halves, finds them at each use (held, they spill).
    const int pi0 = kHiLo ? 0 : (r0 < rows ? int(bm_pidx(a, w, ent_s, r0)) : -1);
    const int pi1 = kHiLo ? 0 : (r1 < rows ? int(bm_pidx(a, w, ent_s, r1)) : -1);
    auto row_pidx = [&](int h) -> int {
      if constexpr (kHiLo) {
        const int r = h ? r1 : r0;
        return r < rows ? int(bm_pidx(a, w, ent_s, r)) : -1;
      } else {
        return h ? pi1 : pi0;
      }
    };
    float lv[4] = {0, 0, 0, 0};
#pragma unroll
    for (int dh = 0; dh < 2; ++dh) {
      float oa[32];
#pragma unroll
      for (int i = 0; i < 32; ++i) oa[i] = 0.0f;
      wgmma::fence_regs(oa);
      wgmma::fence_regs(lv);
      wgmma::fence();
#pragma unroll
      for (int kk = 0; kk < 8; ++kk) {
        const uint64_t dv = wgmma::desc_sw128_mn(v_tile + uint32_t(dh * 16384 + kk * 2048), 16384);
        wgmma::WgmmaRS64TransB::run(oa, ph[kk], dv);
        if constexpr (kHiLo) wgmma::WgmmaRS64TransB::run(oa, pl[kk], dv);
        if (dh == 0) {
          const uint64_t d1 = wgmma::desc_sw128(ones);
          wgmma::WgmmaRS<true, 8>::run(lv, ph[kk], d1);
          if constexpr (kHiLo) wgmma::WgmmaRS<true, 8>::run(lv, pl[kk], d1);
        }
      }
      wgmma::commit();
      wgmma::wait<0>();
      wgmma::fence_regs(oa);
      wgmma::fence_regs(lv);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int pi = row_pidx(h);
        if constexpr (sizeof(PO) == 2) {
          // bf16: the quad's row regathered so that each 16-byte store writes whole sectors (the
          // fragment's 4-byte stores wrote half sectors: twice the L2 store transactions).
          uint32_t v[8];
#pragma unroll
          for (int dt = 0; dt < 8; ++dt) v[dt] = pack_bf16x2(oa[4 * dt + 2 * h], oa[4 * dt + 2 * h + 1]);
          quad_transpose_pairs(v, cq);  // every lane of the warp, before the row test
          if (pi < 0) continue;
          // Streaming (evict-first) stores: the merge reads each row once, and the Q rows and K/V
          // blocks the next items read stay in L2 (8K attention -1.2 %, 32K -0.9 %; no gain for
          // the canonical kernel's fp32 rows).
          PO* dst = static_cast<PO*>(a.part_o) + int64_t(pi) * kHeadDim + 64 * dh + 8 * cq;
          __stcs(reinterpret_cast<uint4*>(dst), make_uint4(v[0], v[1], v[2], v[3]));
          __stcs(reinterpret_cast<uint4*>(dst + 32), make_uint4(v[4], v[5], v[6], v[7]));
        } else {
          // fp32: a 4-lane group's 8-byte stores already cover one whole sector of the row.
          if (pi < 0) continue;
          PO* dst = static_cast<PO*>(a.part_o) + int64_t(pi) * kHeadDim + 64 * dh;
#pragma unroll
          for (int dt = 0; dt < 8; ++dt) store_pair(dst + dt * 8 + 2 * cq, oa[4 * dt + 2 * h], oa[4 * dt + 2 * h + 1]);
        }
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int pi = row_pidx(h);
      if (pi >= 0 && cq == 0) {
        if constexpr (kHiLo) a.part_ml[pi] = make_float2(h ? m1 : m0, lv[2 * h]);
        else __stcs(&a.part_ml[pi], make_float2(h ? m1 : m0, lv[2 * h]));  // streaming, as the rows
      }
    }
  }
}

// Per (token, head): the canonical fold of its fp32 partials in ascending block order; 32
// threads per row, 4 dims (16 bytes of each partial) per thread.
__global__ void bm_merge(BmArgs a) {
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int G = a.group;
  if (idx >= int64_t(a.n_tok) * a.kv_heads * G * 32) return;
  const int d = int(idx & 31) * 4;
  const int64_t row = idx >> 5;  // (token in chunk, group, head)
  const int hh = int(row % G), g = int((row / G) % a.kv_heads), tr = int(row / (int64_t(G) * a.kv_heads));
  const int n = a.n_valid[tr * a.kv_heads + g];
  const float sl2 = a.scale_log2;
  float M = -INFINITY, L = 0.0f, O[4] = {0, 0, 0, 0};
  for (int k = 0; k < n; ++k) {
    const int64_t pidx = ((int64_t(g) * a.n_tok + tr) * a.top_k + k) * G + hh;
    const float2 ml = __ldcg(&a.part_ml[pidx]);
    const float4 o = load_quad(static_cast<const float*>(a.part_o) + pidx * kHeadDim + d);
    const msa::FoldScale f = msa::fold_scale(M, ml.x, sl2);
    L = msa::fold_val(L, f, ml.y);
    O[0] = msa::fold_val(O[0], f, o.x);
    O[1] = msa::fold_val(O[1], f, o.y);
    O[2] = msa::fold_val(O[2], f, o.z);
    O[3] = msa::fold_val(O[3], f, o.w);
  }
  float* dst = a.out + (int64_t(a.c0 + tr) * a.q_heads + g * G + hh) * kHeadDim + d;
  *reinterpret_cast<float4*>(dst) = make_float4(msa::finish(O[0], L), msa::finish(O[1], L), msa::finish(O[2], L),
                                                msa::finish(O[3], L));
}

// The fast variant's merge (bf16 partials): the same fold, 16 threads per row and 8 dims (16
// bytes of each partial) per thread, kMergeBatch partials' loads in flight before their folds.
// (32 threads of 8 bytes, one partial at a time, read at ~56 % of the DRAM peak: twice the load
// instructions per byte of the fp32 merge.) Batches of 2 (40 registers) beat 4 (56) by 3 % and 8
// (79) sat between (docs/msa_kernels.md, twenty-second and twenty-third rounds). The fp32 merge
// keeps one partial at a time: the same batched form made it 2.4-3.1 % slower.
constexpr int kMergeBatch = 2;
__global__ void bm_merge_bf16(BmArgs a) {
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int G = a.group;
  if (idx >= (int64_t(a.n_tok) * a.kv_heads * G << 4)) return;
  const int d = int(idx & 15) * 8;
  const int64_t row = idx >> 4;  // (token in chunk, group, head)
  const int hh = int(row % G), g = int((row / G) % a.kv_heads), tr = int(row / (int64_t(G) * a.kv_heads));
  const int n = a.n_valid[tr * a.kv_heads + g];
  const float sl2 = a.scale_log2;
  const int64_t pbase = (int64_t(g) * a.n_tok + tr) * a.top_k * G + hh;
  const __nv_bfloat16* po = static_cast<const __nv_bfloat16*>(a.part_o);
  float M = -INFINITY, L = 0.0f, O[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) O[i] = 0.0f;
  for (int k0 = 0; k0 < n; k0 += kMergeBatch) {
    float2 ml[kMergeBatch];
    uint4 o[kMergeBatch];
    // Past n the loads repeat the last partial (predicated by clamping: an early `break` out of
    // the unrolled loop raised the registers, 56 -> 91 in a 32-thread form).
#pragma unroll
    for (int j = 0; j < kMergeBatch; ++j) {
      const int64_t pidx = pbase + int64_t(min(k0 + j, n - 1)) * G;
      ml[j] = __ldcg(&a.part_ml[pidx]);
      o[j] = __ldcg(reinterpret_cast<const uint4*>(po + pidx * kHeadDim + d));
    }
#pragma unroll
    for (int j = 0; j < kMergeBatch; ++j) {
      if (k0 + j >= n) continue;
      const msa::FoldScale f = msa::fold_scale(M, ml[j].x, sl2);
      L = msa::fold_val(L, f, ml[j].y);
      const uint32_t w[4] = {o[j].x, o[j].y, o[j].z, o[j].w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        O[2 * i] = msa::fold_val(O[2 * i], f, __uint_as_float(w[i] << 16));
        O[2 * i + 1] = msa::fold_val(O[2 * i + 1], f, __uint_as_float(w[i] & 0xffff0000u));
      }
    }
  }
  float* dst = a.out + (int64_t(a.c0 + tr) * a.q_heads + g * G + hh) * kHeadDim + d;
#pragma unroll
  for (int i = 0; i < 8; i += 4)
    *reinterpret_cast<float4*>(dst + i) = make_float4(msa::finish(O[i], L), msa::finish(O[i + 1], L),
                                                      msa::finish(O[i + 2], L), msa::finish(O[i + 3], L));
}

}  // namespace

std::string msa_block_major_refusal(const MsaAttnShape& s) {
  if (!s.sparse) return "dense attention";
  if (!s.bf16) return "K/V caches are not BF16";
  if (s.head_dim != kHeadDim) return "head_dim is not 128";
  if (s.kv_heads < 1 || s.q_heads % s.kv_heads != 0) return "query heads are not a multiple of the KV heads";
  if (s.q_heads / s.kv_heads > kMaxGroup) return "more than 128 query heads per KV head";
  if (s.top_k < 1 || s.top_k > kMaxTopK) return "top_k outside 1..64";
  if (s.bs < 1 || s.bs > kUnitKeys) return "pages of more than 128 keys";
  if (!s.has_seq_lens) return "no sequence lengths in the metadata";
  if (s.kv_heads * int64_t(s.num_seqs) * std::max(1, s.max_blocks) >= (int64_t(1) << 24)) {
    return "2^24 or more (KV head, sequence, block) keys";
  }
  if (s.tokens >= (int64_t(1) << 24) || s.tokens * s.q_heads >= (int64_t(1) << 31)) return "too many query tokens";
  return "";
}

// Tokens per chunk: partials (and per-selection bookkeeping) under the scratch budget. The fast
// variant's partials are bf16: half the bytes (the merge is bandwidth-bound on them). Chunks of
// equal size: a short last chunk (8K tokens with bf16 partials were 7930 + 262) pays an item per
// selected block for a few tokens each.
int64_t msa_block_major_chunk(const MsaAttnShape& s, bool hilo) {
  const size_t group = size_t(s.q_heads / s.kv_heads);
  const size_t po_bytes = hilo ? 4 : 2;
  const size_t per_token = size_t(s.kv_heads) * size_t(s.top_k) * (group * (kHeadDim * po_bytes + 8) + 12) +
                           size_t(s.kv_heads) * 4 + (hilo ? 0 : size_t(s.q_heads) * kHeadDim * 2);
  const int64_t max_chunk = std::clamp<int64_t>(int64_t(kScratchBytes / per_token), 1, std::max<int64_t>(1, s.tokens));
  const int64_t n_chunks = (s.tokens + max_chunk - 1) / max_chunk;
  return std::max<int64_t>(1, (s.tokens + n_chunks - 1) / n_chunks);
}

namespace {

void block_major(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                 const ops::AttentionMetadata& meta, const TensorView& selected, int top_k, const TensorView& out,
                 bool hilo) {
  const int64_t tokens = q.shape[0], q_heads = q.shape[1], head_dim = q.shape[2];
  if (tokens == 0) return;
  const int64_t kv_heads = k_cache.shape[1];
  const int bs = meta.block_size;
  const int64_t n_keys = kv_heads * int64_t(meta.num_seqs) * std::max(1, meta.max_blocks_per_seq);
  const MsaAttnShape shape = msa_attn_shape(q, k_cache, v_cache, meta, selected, top_k);
  if (!msa_block_major_refusal(shape).empty()) return launch_msa_attention(q, k_cache, v_cache, meta, selected, top_k, out);

  BmArgs a{};
  a.q = q.as<const float>();
  a.out = out.as<float>();
  a.k = k_cache.as<const __nv_bfloat16>();
  a.v = v_cache.as<const __nv_bfloat16>();
  a.sel = selected.as<const int32_t>();
  a.query_start = meta.query_start;
  a.positions = meta.positions;
  a.seq_lens = meta.seq_lens;
  a.block_tables = meta.block_tables;
  a.num_seqs = meta.num_seqs;
  a.num_tokens = int(tokens);
  a.max_blocks = std::max(1, meta.max_blocks_per_seq);
  a.bs = bs;
  a.q_heads = int(q_heads);
  a.kv_heads = int(kv_heads);
  a.group = int(q_heads / kv_heads);
  a.top_k = top_k;
  a.tile_tokens = std::max(1, kTileRows / a.group);
  a.n_keys = int(n_keys);
  a.scale_log2 = float(1.4426950408889634 / std::sqrt(double(head_dim)));
  const size_t po_bytes = hilo ? 4 : 2;
  const int64_t chunk = msa_block_major_chunk(shape, hilo);
  a.tiles_per_item = kTilesPerCta;
  // Work items of a chunk of n tokens, at most: full items plus one partial item per key.
  auto items_for = [&](int64_t n) {
    return (n * kv_heads * top_k) / (int64_t(a.tile_tokens) * a.tiles_per_item) + n_keys + 1;
  };
  const int64_t max_items = items_for(chunk);
  auto align = [](size_t x) { return (x + 255) & ~size_t(255); };
  const size_t sel_n = size_t(chunk) * kv_heads * top_k;
  const size_t part_rows = sel_n * a.group;
  size_t off = 0;
  const size_t o_count = off;
  off = align(off + size_t(n_keys) * 4);
  const size_t o_entry_off = off;
  off = align(off + size_t(n_keys + 1) * 4);
  const size_t o_items = off;
  off = align(off + size_t(max_items) * 8);
  const size_t o_total = off;
  off = align(off + 4);
  const size_t o_slot = off;
  off = align(off + sel_n * 4);
  const size_t o_nvalid = off;
  off = align(off + size_t(chunk) * kv_heads * 4);
  const size_t o_entries = off;
  off = align(off + sel_n * 4);
  const size_t o_part_ml = off;
  off = align(off + part_rows * 8);
  const size_t o_part_o = off;
  off = align(off + part_rows * kHeadDim * po_bytes);
  const size_t o_qb = off;
  if (!hilo) off = align(off + size_t(chunk) * q_heads * kHeadDim * 2);
  Scratch scratch(off);
  unsigned char* base = scratch.as<unsigned char>();
  a.count = reinterpret_cast<int*>(base + o_count);
  a.entry_off = reinterpret_cast<int*>(base + o_entry_off);
  a.items = reinterpret_cast<int2*>(base + o_items);
  a.item_total = reinterpret_cast<int*>(base + o_total);
  a.slot_of = reinterpret_cast<int*>(base + o_slot);
  a.n_valid = reinterpret_cast<int*>(base + o_nvalid);
  a.entries = reinterpret_cast<int*>(base + o_entries);
  a.part_ml = reinterpret_cast<float2*>(base + o_part_ml);
  a.part_o = base + o_part_o;
  a.qb = hilo ? nullptr : reinterpret_cast<__nv_bfloat16*>(base + o_qb);
  a.max_items = int(max_items);
  const cudaStream_t stream = current_stream();
  const auto block_kernel = hilo ? bm_block_wg_kernel<true, float> : bm_block_wg_kernel<false, __nv_bfloat16>;
  const size_t block_smem = hilo ? kWgBlockSmem : kWgBlockSmemFast;
  const int block_threads = hilo ? kThreads : kFastWarps * 32;
  M3_CUDA_CHECK(cudaFuncSetAttribute(block_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(block_smem)));
  for (int64_t c0 = 0; c0 < tokens; c0 += chunk) {
    a.c0 = int(c0);
    a.n_tok = int(std::min<int64_t>(chunk, tokens - c0));
    const int n_sel = a.n_tok * a.kv_heads;
    M3_CUDA_CHECK(cudaMemsetAsync(a.count, 0, size_t(n_keys) * 4, stream));
    bm_rank_count<<<unsigned((int64_t(n_sel) * 32 + kRankThreads - 1) / kRankThreads), kRankThreads, 0, stream>>>(a);
    bm_scan<<<1, kScanThreads, 0, stream>>>(a);
    bm_scatter<<<unsigned((int64_t(n_sel) * top_k + 255) / 256), 256, 0, stream>>>(a);
    block_kernel<<<unsigned(items_for(a.n_tok)), block_threads, block_smem, stream>>>(a);
    const int64_t merge_threads = int64_t(a.n_tok) * kv_heads * a.group * (hilo ? 32 : 16);
    (hilo ? bm_merge : bm_merge_bf16)<<<unsigned((merge_threads + 255) / 256), 256, 0, stream>>>(a);
  }
  M3_CUDA_CHECK_LAUNCH();
}

}  // namespace

void launch_msa_attention_block_major(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                                      const ops::AttentionMetadata& meta, const TensorView& selected, int top_k,
                                      const TensorView& out) {
  block_major(q, k_cache, v_cache, meta, selected, top_k, out, true);
}

void launch_msa_attention_block_major_fast(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                                           const ops::AttentionMetadata& meta, const TensorView& selected, int top_k,
                                           const TensorView& out) {
  block_major(q, k_cache, v_cache, meta, selected, top_k, out, false);
}

// Block-major pays off when many tokens of a sequence share blocks: a prefill, not a batch of
// short chunks (the canonical variant gives the same bits either way).
void launch_msa_attention_prefill(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                                  const ops::AttentionMetadata& meta, const TensorView& selected, int top_k,
                                  const TensorView& out) {
  if (q.shape[0] >= 64 * int64_t(std::max(1, meta.num_seqs)))
    return block_major(q, k_cache, v_cache, meta, selected, top_k, out, true);
  launch_msa_attention(q, k_cache, v_cache, meta, selected, top_k, out);
}

void launch_msa_attention_prefill_fast(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                                       const ops::AttentionMetadata& meta, const TensorView& selected, int top_k,
                                       const TensorView& out) {
  if (q.shape[0] >= 64 * int64_t(std::max(1, meta.num_seqs)))
    return block_major(q, k_cache, v_cache, meta, selected, top_k, out, false);
  launch_msa_attention(q, k_cache, v_cache, meta, selected, top_k, out);
}

}  // namespace m3::cuda
