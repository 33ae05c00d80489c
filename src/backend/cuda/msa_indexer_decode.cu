// MSA lightning indexer, warp-streamed: decode (one token per sequence), speculative
// verification and prefill (query groups of up to 16 (token, head) rows), BF16 or FP8 (e4m3)
// index-K, dim 128, the same exact selections as the 128-row tiles of msa_indexer.cu (shared
// pieces in msa_indexer_common.cuh).
//
// The scan is a stream: every cached index key of a group's range is read once and dotted with
// the group's rows (a prefill's groups re-read their sequence's keys, mostly from L2). The tile kernel, with four CTA barriers per 128-key
// stage, stayed latency bound at ~55 % of the copy bandwidth however its stage was trimmed.
// Here a warp owns whole 128-key units of its CTA's chunk and streams them through its own
// cp.async ring (16-key tiles), so nothing in the scan waits for another warp:
//   - the keys are the MMA's A operand (16 keys x 16 dims per m16n8k16) and the group's rows
//     its N (8 or 16), so one MMA serves 16 keys instead of 8;
//   - the error bound of the approximate dot a is e = c * U with U >= sum_i |q_i sigma| |k_i|,
//     from a second MMA of |K| (sign bits cleared) with u_i >= |q_i sigma| (rounded up, and
//     floored so that the elements zeroed below the operand's normal range stay covered):
//     tighter than c |q sigma| |k| (Cauchy-Schwarz), and no key norms are needed;
//   - lo = max(a - e) per (row, block) is reduced in registers and shuffles; the keys with
//     a + e >= lo (typically one or two per block) are listed, and once 32 are listed (across
//     units) their exact dots (the reference's sequential chain) run one per lane and raise the
//     block scores with atomicMax: the block score is their maximum.
// The last CTA of a query group selects, as in the tile kernel. A CTA whose chunk holds few (row,
// block) pairs (small batches, short contexts) skips the stream and scans its blocks with exact
// dots on all its threads (msa_indexer_exact.cuh).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <climits>
#include <type_traits>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_internal.h"
#include "backend/cuda/msa_indexer_common.cuh"
#include "backend/cuda/msa_indexer_exact.cuh"
#include "backend/cuda/msa_timeline.cuh"

namespace m3::cuda::msa_index {
namespace {

constexpr int kWarpsD = 8, kThreadsD = kWarpsD * 32;
constexpr int kTileKeys = 16, kUnitTiles = 8, kUnitKeys = kTileKeys * kUnitTiles;
constexpr int kMaxRows = 16;     // (token, head) rows of a decode query group
constexpr int kUnitBlocks = 8;   // blocks of a unit at most (block size >= 16)

// The upper operand u (|q sigma| rounded up, floored) and the bound's factor for U.
template <class IK> struct UpperTraits;
template <> struct UpperTraits<__nv_bfloat16> {
  // Zeroed elements (|q sigma| < 2^-126) err by < 2^-126 |k_i| <= 2^-8 * 2^-118 |k_i|.
  static constexpr float kFloor = 3.00926553e-36f;  // 2^-118
  static constexpr float kErrU = 0.0078201294f;      // 2^-7 + 2^-17 (U's own accumulation error)
  static __device__ __forceinline__ uint32_t pack(float x, float y) {
    const __nv_bfloat16 a = __float2bfloat16_ru(fmaxf(fabsf(x), kFloor));
    const __nv_bfloat16 b = __float2bfloat16_ru(fmaxf(fabsf(y), kFloor));
    return uint32_t(__bfloat16_as_ushort(a)) | (uint32_t(__bfloat16_as_ushort(b)) << 16);
  }
};
template <> struct UpperTraits<__nv_fp8_e4m3> {
  // Zeroed elements (|q sigma| < 2^-14) err by < 2^-14 |k_i| <= 2^-11 * 2^-3 |k_i|.
  static constexpr float kFloor = 0.125f;
  static constexpr float kErrU = 0.00097751617f;  // 2^-10 + 2^-20
  static __device__ __forceinline__ uint32_t pack(float x, float y) {
    const __half a = __float2half_ru(fmaxf(fabsf(x), kFloor));
    const __half b = __float2half_ru(fmaxf(fabsf(y), kFloor));
    return uint32_t(__half_as_ushort(a)) | (uint32_t(__half_as_ushort(b)) << 16);
  }
};

// x through an opaque move: ptxas keeps the value in a register instead of recomputing it from
// the thread index where registers are tight.
__device__ __forceinline__ uint32_t opaque(uint32_t x) {
  uint32_t y;
  asm volatile("mov.b32 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}

template <class IK, int kNN>
struct DecCfg {
  static constexpr int kRowBytes = IkTraits<IK>::kRowBytes;
  static constexpr int kTileBytes = kTileKeys * kRowBytes;
  // FP8 decode groups (one n-tile) run two CTAs per SM: twice the warps to hide a tile's
  // dependent chain (ldmatrix, two conversions per key pair, MMAs, bounds), with half-depth
  // rings; at 128 registers it does not spill. BF16 (memory-bound at one CTA) measured 1-3 %
  // slower at two (rings of 2-3 tiles).
  static constexpr int kCtasPerSm = sizeof(IK) == 1 && kNN == 1 ? 2 : 1;
  static constexpr int kSlots = sizeof(IK) == 2 ? (kNN == 1 ? 6 : 5) : kCtasPerSm == 2 ? 5 : 10;  // ring tiles per warp
  static constexpr int kRingBytes = kSlots * kTileBytes;
  // Listed candidates: every (key, row) of a unit plus a partial round; at two CTAs per SM a
  // round's worth plus a unit's usual few, and a unit listing more (ties: equal keys make every
  // key a candidate) has its dots run in place. (The small list for every layout made the
  // 16-row prefill groups 1.5-2 % slower.)
  static constexpr int kCandCap = kCtasPerSm == 2 ? 256 + 32 : kUnitKeys * 8 * kNN + 32;
  static constexpr size_t kCandOff = size_t(kWarpsD) * kRingBytes;
  static constexpr size_t kSigOff = kCandOff + size_t(kWarpsD) * kCandCap * 4;
  static constexpr size_t kPosOff = kSigOff + kMaxRows * 4;
  // Pruning lists (BF16 decode groups of one n-tile): per row, the CTA's kListLen largest block
  // lower bounds, one per lane.
  static constexpr bool kPrune = sizeof(IK) == 2 && kNN == 1;
  static constexpr int kListRows = 8, kListLen = 32;
  static constexpr size_t kListOff = kPosOff + kMaxRows * 4;  // [kListRows][kListLen]
  static constexpr size_t kBytes = kListOff + (kPrune ? kListRows * kListLen * 4 : 0);
  static_assert(kCandCap >= 256, "a warp's candidate list doubles as its selection histogram");
  static_assert(size_t(kWarpsD) * kRingBytes >= ExactLayout<IK>::kBytes, "the exact scan fits the rings");
};
static_assert(kThreadsD == kExactThreads, "the exact scan runs on the decode kernel's threads");

// kKeysFirst: launched as the previous kernel's programmatic dependent (MsaIndexerPlan::
// keys_before_wait), with the group scan, page ids and first key tiles before its wait; else a
// plain launch (no wait), the rows' q requested first.
template <class IK, int kNN, bool kKeysFirst>
__global__ void __launch_bounds__(kThreadsD, DecCfg<IK, kNN>::kCtasPerSm) msa_indexer_decode_kernel(IndexerArgs a) {
  using Cf = DecCfg<IK, kNN>;
  using Tr = IkTraits<IK>;
  using Up = UpperTraits<IK>;
  constexpr int kRowBytes = Cf::kRowBytes, kTileBytes = Cf::kTileBytes, kSlots = Cf::kSlots;
  constexpr bool kBf16 = sizeof(IK) == 2;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ int s_last;
  __shared__ int s_lock;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, cq = lane & 3;
  unsigned char* const ring = smem + warp * Cf::kRingBytes;
  uint32_t* const cand = reinterpret_cast<uint32_t*>(smem + Cf::kCandOff) + warp * Cf::kCandCap;
  float* const sig_s = reinterpret_cast<float*>(smem + Cf::kSigOff);
  int* const s_pos = reinterpret_cast<int*>(smem + Cf::kPosOff);
  float* const s_list = reinterpret_cast<float*>(smem + Cf::kListOff);

  [[maybe_unused]] const int tl_lin = int(blockIdx.x * gridDim.y + blockIdx.y);
  [[maybe_unused]] const int tl_cta = tl_lin < 1024 ? tl_lin : -1;
  [[maybe_unused]] const int tl_ctas = int(min(gridDim.x * gridDim.y, 1024u));
  M3_TL_MARK(indexer, tl_cta, 0);
  const int t0 = a.tok_end - 1 - int(blockIdx.x);  // longest causal prefixes first
  const int s = msa::seq_of_token(a.query_start, a.num_seqs, t0);
  const int q_begin = a.query_start[s], q_end = a.query_start[s + 1];
  if ((t0 - q_begin) % a.group_tokens != 0) return;  // not the first token of a query group
  const int T = min(a.group_tokens, q_end - t0), H = a.heads, P = T * H;  // P <= 8 kNN (host)
  const int bs = a.bs, bs_shift = a.bs_shift;
  for (int i = tid; i < T; i += kThreadsD) s_pos[i] = a.positions[t0 + i];
  __syncthreads();
  const GroupScan gs = group_scan(a, T, s_pos);
  M3_TL_MARK(indexer, tl_cta, 1);
  if (gs.nb == 0) {  // every row takes all its blocks
    if constexpr (kKeysFirst) pdl_wait();  // its dependents are released only once its wait is met
    if (a.early_dependents) pdl_launch_dependents();  // the attention computes them meanwhile (early units)
    if (blockIdx.y == 0) select_group(a, t0, P, s_pos, nullptr, 0, nullptr);
    return;
  }
  auto q_row = [&](int r) { return group_q_row(a, t0, r); };
  const int64_t score_row0 = int64_t(t0 - a.tok_begin) * H;
  // Units taken from the group's counter (all of its CTAs share its blocks: the SMs' shares of
  // the bandwidth differ, and a fixed split leaves the fast ones idle at the end), unless the
  // group's chunks would scan exactly (small chunks: group-uniform, the smallest chunk decides).
  const int group_units = ((gs.nb << bs_shift) + kUnitKeys - 1) / kUnitKeys;
  const bool dyn = a.unit_counters != nullptr && gs.nb >= a.chunks && P * (gs.nb / a.chunks) > a.exact_max &&
                   group_units / (a.chunks * kWarpsD) >= a.dyn_min_units;
  const int b0 = dyn ? 0 : gs.b0, b1 = dyn ? gs.nb : gs.b1;
  // A chunk of few (row, block) pairs: every dot exact, all warps on each block (CTA-uniform).
  const bool exact = !dyn && b0 < b1 && b1 - b0 <= kExactMaxChunkBlocks && P * (b1 - b0) <= a.exact_max;
  if (exact) exact_scan<IK, kKeysFirst>(a, t0, s, P, s_pos, b0, b1 - b0, smem);
  if (b0 < b1 && !exact) {
    const int key_begin = b0 << bs_shift, key_end = b1 << bs_shift;
    const int units = (key_end - key_begin + kUnitKeys - 1) / kUnitKeys;
    // The warp's units in order: unit warp + 8k of the chunk, or (dyn) the next of the group's
    // counter; -1 past the end. uw[d] is the unit ui + d of the loop below (d <= 3: the ring
    // loads up to kSlots - 1 <= 9 tiles ahead, and pages are requested a unit before that).
    unsigned* const unit_ctr = dyn ? a.unit_counters + t0 : nullptr;
    if (kKeysFirst && dyn) pdl_wait();  // the counter was re-armed by the last call's CTAs
    int claims = 0;
    auto claim = [&]() -> int {
      int u = warp + claims++ * kWarpsD;
      if (dyn) {
        unsigned v = 0;
        if (lane == 0) v = atomicAdd(unit_ctr, 1u);
        u = int(__shfl_sync(0xffffffffu, v, 0));
      }
      return u < units ? u : -1;
    };
    int uw[4] = {claim(), claim(), -1, -1};
    const int32_t* table = a.block_tables + int64_t(s) * a.max_blocks;
    const unsigned char* keys = static_cast<const unsigned char*>(a.keys);
    auto unit_key = [&](int u) { return key_begin + u * kUnitKeys; };
    // Page ids of a unit's blocks: lane i < 128 / bs holds block i's (0 past the chunk). The
    // tile loads take theirs by shuffle; the next unit's are requested a unit ahead, so no
    // load waits on a page-table read.
    auto unit_pages = [&](int u) {
      const int blk = (unit_key(u) >> bs_shift) + lane;
      return u >= 0 && lane < (kUnitKeys >> bs_shift) && blk < b1 ? __ldg(table + blk) : 0;
    };
    int pg_cur = unit_pages(uw[0]), pg_next = unit_pages(uw[1]);  // the units of the tiles being loaded
    // The rows' q for sigma (rows warp, warp + 8): a plain launch requests them before the tile
    // loads queue up.
    float4 qv[kMaxRows / kWarpsD];
    auto load_q = [&] {
#pragma unroll
      for (int i = 0; i < kMaxRows / kWarpsD; ++i) {
        const int r = warp + i * kWarpsD;
        qv[i] = r < P ? *reinterpret_cast<const float4*>(q_row(r) + lane * 4) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
    };
    if constexpr (!kKeysFirst) load_q();
    // Tile loads: lane = (16-byte column, key); pass i copies keys i * kPerPass + lane / kChunks.
    // The swizzled destinations repeat every 8 keys: pass i's offset is pass 0's with the key
    // bits i kPerPass and the chunk bits (i kPerPass) & 7 flipped (lkey < kPerPass, so the sums
    // are disjoint bit fields), an XOR with a constant; so one register holds a lane's offsets
    // (the 128-register FP8 kernel recomputed four from the thread index at every tile), and
    // the source is one 64-bit base plus immediates.
    constexpr int kChunks = kRowBytes / 16, kPerPass = 32 / kChunks, kPasses = kTileKeys / kPerPass;
    constexpr int kSwz = 8 / kPerPass;  // distinct swizzles over a lane's passes
    const int lcol = lane % kChunks, lkey = lane / kChunks;
    const uint32_t swz0 = opaque(uint32_t(lkey * kRowBytes + ((lcol ^ lkey) << 4)));
    const uint32_t lane_src = opaque(uint32_t(lkey * kRowBytes + lcol * 16));  // = 16 lane
    auto swz = [&](int i) { return swz0 ^ uint32_t((i * kPerPass * kRowBytes) | ((i * kPerPass) << 4)); };
    const uint32_t ring_u32 = smem_u32(ring);
    uint32_t wr_off = 0;  // ring offset of the next tile to load
    // Tile t of unit u (16 keys of one page, pg_cur's unit) into the slot at wr_off.
    auto load_tile = [&](int u, int t) {
      const int kt = unit_key(u) + t * kTileKeys;
      if (u >= 0 && kt < key_end) {  // warp-uniform
        const int page = __shfl_sync(0xffffffffu, pg_cur, (t * kTileKeys) >> bs_shift);
        const unsigned char* src = keys + (uint64_t(uint32_t(page) * uint32_t(bs) + uint32_t(kt & (bs - 1))) * kRowBytes +
                                          lane_src);
        const uint32_t dst = ring_u32 + wr_off;
        const int rem = key_end - kt - lkey;  // keys of this lane's column left in the chunk
#pragma unroll
        for (int i = 0; i < kPasses; ++i) {
          cp_async16(dst + swz(i % kSwz) + (i / kSwz) * 8 * kRowBytes, src + i * kPerPass * kRowBytes,
                     i * kPerPass < rem);
        }
      }
      wr_off = wr_off + kTileBytes == uint32_t(Cf::kRingBytes) ? 0u : wr_off + kTileBytes;
    };
#pragma unroll
    for (int g = 0; g < kSlots - 1; ++g) {  // the first tiles' loads overlap the setup
      if (g > 0 && g % kUnitTiles == 0) {
        pg_cur = pg_next;
        uw[g / kUnitTiles + 1] = claim();
        pg_next = unit_pages(uw[g / kUnitTiles + 1]);
      }
      load_tile(uw[g / kUnitTiles], g % kUnitTiles);
      cp_async_commit();
    }
    // kKeysFirst (the attention prologue's programmatic dependent, pure decode): the page ids and
    // first tiles are in flight before the prologue has ended. Those keys are earlier steps' (a
    // decode row scores the blocks before its own, which the prologue writes into); the rows' q
    // (for sigma) is the prologue's, read after the wait.
    if constexpr (kKeysFirst) {
      pdl_wait();
      load_q();
    }
    // sigma per row (a power of two putting max |q| in the operand's range).
#pragma unroll
    for (int i = 0; i < kMaxRows / kWarpsD; ++i) {
      const int r = warp + i * kWarpsD;
      const float sg = r < P ? warp_row_sigma(qv[i], Tr::kSigmaExp) : 0.0f;  // warp-uniform
      if (lane == 0) sig_s[r] = sg;
    }
    if constexpr (Cf::kPrune) {
      for (int i = tid; i < Cf::kListRows * Cf::kListLen; i += kThreadsD) s_list[i] = -INFINITY;
    }
    if (tid == 0) s_lock = 0;
    __syncthreads();
    // B fragments of the rows (column gq of n-tile nt): Q sigma and its upper operand u, in
    // the key layout's k order (bf16: dims 16ks + 2c, +1 and +8, +9; f16 from FP8 keys:
    // dims 16ks + 4c + 0..3). Keys valid for lane's rows (8nt + 2cq + j): < lim.
    uint32_t bq[kNN][8][2], bu[kNN][8][2];
    int lim[kNN][2];
#pragma unroll
    for (int nt = 0; nt < kNN; ++nt) {
      const int n = 8 * nt + gq;
      const bool live = n < P;
      const float sg = sig_s[n];
      const float* qp = q_row(live ? n : 0);
#pragma unroll
      for (int ks = 0; ks < 8; ++ks) {
        const int d0 = kBf16 ? 16 * ks + 2 * cq : 16 * ks + 4 * cq;
        const int d1 = kBf16 ? d0 + 8 : d0 + 2;
        const float2 x0 = *reinterpret_cast<const float2*>(qp + d0), x1 = *reinterpret_cast<const float2*>(qp + d1);
        bq[nt][ks][0] = live ? Tr::pack(x0.x * sg, x0.y * sg) : 0u;
        bq[nt][ks][1] = live ? Tr::pack(x1.x * sg, x1.y * sg) : 0u;
        bu[nt][ks][0] = live ? Up::pack(x0.x * sg, x0.y * sg) : 0u;
        bu[nt][ks][1] = live ? Up::pack(x1.x * sg, x1.y * sg) : 0u;
      }
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int r = 8 * nt + 2 * cq + j;
        lim[nt][j] = r < P ? min(key_end, (s_pos[r / H] >> bs_shift) << bs_shift) : INT_MIN;
      }
    }
    M3_TL_MARK(indexer, tl_cta, 2);
    const int mt_per_blk = bs >> 4;  // m-tiles per block: 1..8
    // One listed candidate per lane: the reference's exact dot (the key again from the cache,
    // mostly L2) raises its block score. Candidates wait in the list until 32 are there, so a
    // round's chain latency is paid for a full warp.
    auto exact_round = [&](uint32_t e) {
      const int r = int(e >> 24), key = key_begin + int(e & 0xffffffu);
      const uint32_t slot = uint32_t(__ldg(table + (key >> bs_shift))) * uint32_t(bs) + uint32_t(key & (bs - 1));
      const float x = exact_dot<IK, true>(q_row(r), keys + uint64_t(slot) * kRowBytes, 0);
      if (x == x) {  // the reference skips NaN
        atomicMax(a.scores + (score_row0 + r) * a.max_blocks + (key >> bs_shift), order_key(x));
      }
    };
    int cnt = 0;  // listed candidates (warp-uniform)
    // ldmatrix sources: lane gives row arow, 16-byte chunk 2x + ahalf of a tile (x = ks for
    // bf16, the 32-dim step j for FP8); bf16 chunks 2ks + 8 lie 128 bytes after 2ks's. Chunk
    // (2x + ahalf) ^ (arow & 7) = (ahalf ^ (arow & 7)) ^ 2x: x's offset is x = 0's with bits 5-6
    // flipped (one register, as for the loads).
    const int arow = (lane & 7) + ((lane >> 3) & 1) * 8, ahalf = lane >> 4;
    const uint32_t aoff0 = opaque(uint32_t(arow * kRowBytes + ((ahalf ^ (arow & 7)) << 4)));
    auto aoff = [&](int x) { return aoff0 ^ uint32_t(x << 5); };
    uint32_t rd_off = 0;  // ring offset of the next tile to compute
    // Pruning (BF16 decode groups): per row, the CTA keeps the 32 largest block lower bounds its
    // warps have seen (scaled by the row's sigma), sorted, in shared memory. At least k = top_k - 1
    // blocks score at least the k-th of them, so the row's selection threshold does too, and a key
    // whose upper bound is below it cannot be a selected block's maximum: it is not listed. (A
    // block whose maximum is skipped keeps a score below the threshold, so the selection is the
    // same.) One list for the CTA, not one per warp: it sees eight times the blocks, so its k-th
    // nears the row's threshold early. A warp inserts its unit's blocks under a try-lock and
    // skips them when another warp holds it (a list missing some blocks is still a valid bound;
    // spinning on the lock made 128K, B = 64 30 % slower). Only where the CTA's blocks are at
    // least 16k: with fewer the threshold rises too late to pay for its updates (32K, B = 64: +1-3 %
    // at 8k); FP8's two-CTA kernel lost 3-7 % with it at 128K (docs/msa_kernels.md).
    const int kth = a.top_k - 1;  // pruning needs 1 <= kth <= kListLen
    const int cta_units = dyn ? units / a.chunks : units;  // the CTA's units, about
    const bool prune = Cf::kPrune && kth >= 1 && kth <= Cf::kListLen && cta_units * (kUnitKeys >> bs_shift) >= 16 * kth;
    float lim_lo[kNN][2];  // the lane's rows' current threshold (-inf: none yet)
#pragma unroll
    for (int nt = 0; nt < kNN; ++nt) lim_lo[nt][0] = lim_lo[nt][1] = -INFINITY;

#pragma unroll 1
    for (int ui = 0; uw[0] >= 0; ++ui, uw[0] = uw[1], uw[1] = uw[2], uw[2] = uw[3], uw[3] = -1) {
      const int unit_key0 = unit_key(uw[0]);
      float hi[kUnitTiles][kNN][4], lo[kUnitTiles][kNN][2];
#pragma unroll
      for (int mt = 0; mt < kUnitTiles; ++mt) {
        cp_async_wait<kSlots - 2>();
        __syncwarp();  // tile g visible to the warp; tile g - 1's slot free
        if ((mt + kSlots - 1) % kUnitTiles == 0) {  // the load below starts a unit (mt is unrolled)
          pg_cur = pg_next;
          uw[(mt + kSlots - 1) / kUnitTiles + 1] = claim();
          pg_next = unit_pages(uw[(mt + kSlots - 1) / kUnitTiles + 1]);
        }
        load_tile(uw[(mt + kSlots - 1) / kUnitTiles], (mt + kSlots - 1) % kUnitTiles);
        cp_async_commit();
        const int kt = unit_key0 + mt * kTileKeys;
        float c[kNN][4], u[kNN][4];
#pragma unroll
        for (int nt = 0; nt < kNN; ++nt) {
#pragma unroll
          for (int v = 0; v < 4; ++v) c[nt][v] = u[nt][v] = 0.0f;
        }
        // Step ks of the 16 keys: the approximate dots (A = the keys) and their bound's U (A = the
        // keys' magnitudes, sign bits cleared) for every n-tile of rows.
        auto mma_pair = [&](const uint32_t (&af)[4], int ks) {
          const uint32_t aa[4] = {af[0] & 0x7fff7fffu, af[1] & 0x7fff7fffu, af[2] & 0x7fff7fffu, af[3] & 0x7fff7fffu};
#pragma unroll
          for (int nt = 0; nt < kNN; ++nt) {
            Tr::mma(c[nt], af, bq[nt][ks][0], bq[nt][ks][1]);
            Tr::mma(u[nt], aa, bu[nt][ks][0], bu[nt][ks][1]);
          }
        };
        if (kt < key_end) {  // warp-uniform
          const uint32_t base = ring_u32 + rd_off;
          if constexpr (kBf16) {
#pragma unroll
            for (int ks = 0; ks < 8; ++ks) {
              uint32_t af[4];
              msa::ldmatrix_x4(af, base + aoff(ks & 3) + (ks >> 2) * 128);
              mma_pair(af, ks);
            }
          } else {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              uint32_t r4[4];  // rows gq / gq + 8, dims 32j + 4cq + 0..3 (r4[0], r4[1]) and + 16 (r4[2], r4[3])
              msa::ldmatrix_x4(r4, base + aoff(j));
#pragma unroll
              for (int h = 0; h < 2; ++h) {
                const int ks = 2 * j + h;
                const uint32_t af[4] = {e4m3x2_lo_f16x2(r4[2 * h]), e4m3x2_lo_f16x2(r4[2 * h + 1]),
                                        e4m3x2_hi_f16x2(r4[2 * h]), e4m3x2_hi_f16x2(r4[2 * h + 1])};
                mma_pair(af, ks);
              }
            }
          }
        }
        // (key gq + 8 (v >> 1), row 8nt + 2cq + (v & 1)): upper bound (NaN: not scored; +inf:
        // always recomputed), and the lane's lower bounds per row.
#pragma unroll
        for (int nt = 0; nt < kNN; ++nt) {
          lo[mt][nt][0] = lo[mt][nt][1] = -INFINITY;
#pragma unroll
          for (int v = 0; v < 4; ++v) {
            const int key = kt + gq + 8 * (v >> 1), j = v & 1;
            const float av = c[nt][v], ev = __fmaf_ru(Up::kErrU, u[nt][v], 5.96046448e-08f);
            // a + e finite implies both are (one test instead of two); where only the sum
            // overflows, the key is recomputed as before and lo just skips it (still a bound).
            const float hr = __fadd_ru(av, ev);
            const bool valid = key < lim[nt][j], fin = isfinite(hr);
            hi[mt][nt][v] = !valid ? __int_as_float(0x7fffffff) : fin ? hr : INFINITY;
            if (valid && fin) lo[mt][nt][j] = fmaxf(lo[mt][nt][j], __fsub_rd(av, ev));
          }
        }
        rd_off = rd_off + kTileBytes == uint32_t(Cf::kRingBytes) ? 0u : rd_off + kTileBytes;
      }
      if (ui == 0) M3_TL_MARK(indexer, tl_cta, 6);
      // Block lower bounds: the lane's maximum over the m-tiles of a block (aligned groups of
      // mt_per_blk: a butterfly leaves it in each), then over the 8 key rows of a tile (lanes'
      // gq bits) for the block's first m-tile only, and the butterfly again spreads it.
      auto blocks_max = [&] {
#pragma unroll
        for (int step = 1; step < kUnitTiles; step <<= 1) {
          if (step < mt_per_blk) {
#pragma unroll
            for (int mt = 0; mt < kUnitTiles; ++mt) {
#pragma unroll
              for (int nt = 0; nt < kNN; ++nt) {
                lo[mt][nt][0] = fmaxf(lo[mt][nt][0], lo[mt ^ step][nt][0]);
                lo[mt][nt][1] = fmaxf(lo[mt][nt][1], lo[mt ^ step][nt][1]);
              }
            }
          }
        }
      };
      if (mt_per_blk == kUnitTiles) {  // warp-uniform: one block per unit (M3's 128), a plain reduction
#pragma unroll
        for (int nt = 0; nt < kNN; ++nt) {
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            float x = lo[0][nt][j];
#pragma unroll
            for (int mt = 1; mt < kUnitTiles; ++mt) x = fmaxf(x, lo[mt][nt][j]);
#pragma unroll
            for (int off = 4; off < 32; off <<= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
#pragma unroll
            for (int mt = 0; mt < kUnitTiles; ++mt) lo[mt][nt][j] = x;
          }
        }
      } else {
        blocks_max();
#pragma unroll
        for (int mt = 0; mt < kUnitTiles; ++mt) {
          if ((mt & (mt_per_blk - 1)) != 0) continue;  // warp-uniform
#pragma unroll
          for (int nt = 0; nt < kNN; ++nt) {
#pragma unroll
            for (int j = 0; j < 2; ++j) {
#pragma unroll
              for (int off = 4; off < 32; off <<= 1) {
                lo[mt][nt][j] = fmaxf(lo[mt][nt][j], __shfl_xor_sync(0xffffffffu, lo[mt][nt][j], off));
              }
            }
          }
        }
        blocks_max();
      }
      if (prune) {  // warp-uniform: the unit's blocks into the CTA's lists if the lock is free
        int got = 0;
        if (lane == 0) got = atomicCAS(&s_lock, 0, 1) == 0;
        const bool held = __shfl_sync(0xffffffffu, got, 0) != 0;
        if (held) __threadfence_block();
#pragma unroll
        for (int r = 0; r < Cf::kListRows; ++r) {
          if (r >= P) break;  // warp-uniform
          float l;
          if (held) {
            float t = s_list[r * Cf::kListLen + lane];
#pragma unroll
            for (int mt = 0; mt < kUnitTiles; ++mt) {
              if ((mt & (mt_per_blk - 1)) != 0) continue;  // warp-uniform: a block's first m-tile
              // Row r's block lower bound (on lanes gq = 0, cq = r / 2); -inf for blocks outside
              // the row's range, which change nothing.
              const float v = __shfl_sync(0xffffffffu, lo[mt][0][r & 1], r >> 1);
              const float above = __shfl_up_sync(0xffffffffu, t, 1);
              t = fmaxf(t, lane == 0 ? v : fminf(above, v));  // sorted insert, descending
            }
            s_list[r * Cf::kListLen + lane] = t;
            l = __shfl_sync(0xffffffffu, t, kth - 1);
          } else {
            l = s_list[r * Cf::kListLen + kth - 1];  // one word: the k-th before or after the holder's update
          }
          if ((r >> 1) == cq) lim_lo[0][r & 1] = fmaxf(lim_lo[0][r & 1], l);
        }
        if (held) {
          __threadfence_block();
          __syncwarp();
          if (lane == 0) atomicExch(&s_lock, 0);
        }
      }
      // The unit's block scores start at -inf (what they stay when no candidate has a number):
      // lane (gq, cq) writes block gq of its rows 8nt + 2cq + j, those before the row's limit
      // (lim: the chunk's end and the row's local block; none for rows past P).
      const int ublk0 = unit_key0 >> bs_shift, nbu = kUnitKeys >> bs_shift;
      static_assert(kUnitBlocks == 8, "a unit's blocks are the lanes' gq");
#pragma unroll
      for (int nt = 0; nt < kNN; ++nt) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          if (gq < nbu && ((ublk0 + gq) << bs_shift) < lim[nt][j]) {
            a.scores[(score_row0 + 8 * nt + 2 * cq + j) * a.max_blocks + ublk0 + gq] = kKeyMinusInf;
          }
        }
      }
      // Keys that can be their block's maximum (bit (mt kNN + nt) 4 + v of the lane's mask),
      // listed as (row << 24 | key - key_begin) at the lane's offset in the warp's list.
      using Mask = std::conditional_t<kNN == 1, uint32_t, unsigned long long>;
      Mask m = 0;
#pragma unroll
      for (int mt = 0; mt < kUnitTiles; ++mt) {
#pragma unroll
        for (int nt = 0; nt < kNN; ++nt) {
#pragma unroll
          for (int v = 0; v < 4; ++v) {
            if (hi[mt][nt][v] >= fmaxf(lo[mt][nt][v & 1], lim_lo[nt][v & 1])) m |= Mask(1) << ((mt * kNN + nt) * 4 + v);
          }
        }
      }
      auto entry = [&](int i) {  // mask bit i as (row << 24 | key - key_begin)
        const int mt = i / (4 * kNN), nt = (i / 4) % kNN, v = i & 3;
        return (uint32_t(8 * nt + 2 * cq + (v & 1)) << 24) |
               uint32_t(unit_key0 - key_begin + mt * kTileKeys + gq + 8 * (v >> 1));
      };
      auto lowest = [&] { return kNN == 1 ? __ffs(uint32_t(m)) - 1 : __ffsll(m) - 1; };
      const int mine = kNN == 1 ? __popc(uint32_t(m)) : __popcll(m);
      const int incl = msa::warp_inclusive_scan(mine);
      if (cnt + __shfl_sync(0xffffffffu, incl, 31) > Cf::kCandCap) {  // warp-uniform
        __syncwarp();  // the -inf scores are visible to the warp
        if (lane < cnt) exact_round(cand[lane]);  // the listed ones (fewer than 32), then this unit's in place
        cnt = 0;
        while (__any_sync(0xffffffffu, m != 0)) {
          if (m != 0) {
            exact_round(entry(lowest()));
            m &= m - 1;
          }
        }
        __syncwarp();  // the list may be rewritten
        continue;
      }
      for (int pos = cnt + incl - mine; m != 0; m &= m - 1) cand[pos++] = entry(lowest());
      cnt += __shfl_sync(0xffffffffu, incl, 31);
      __syncwarp();  // the list and the -inf scores are visible to the warp
      // Whole rounds of 32 now; the rest waits for later units' candidates.
      const int full = cnt & ~31;
      for (int b = 0; b < full; b += 32) exact_round(cand[b + lane]);
      if (full > 0) {
        const uint32_t rest = lane < cnt - full ? cand[full + lane] : 0u;
        __syncwarp();
        if (lane < cnt - full) cand[lane] = rest;
        cnt -= full;
        __syncwarp();
      }
    }
    M3_TL_MARK(indexer, tl_cta, 7);
    if (lane < cnt) exact_round(cand[lane]);
    cp_async_wait<0>();
  }
  // The selection reads each row's block scores [0, local) from L2 in 32-byte sectors; the
  // sector holding a row's last score would be only partly written (one 4-byte score per block,
  // from many CTAs), and L2 completes such a sector from DRAM on the read. The last chunk fills
  // the rest of that sector (blocks no CTA scores for the row) with -inf keys.
  if (b0 < b1 && int(blockIdx.y) == a.chunks - 1 && tid < P * 8) {
    const int r = tid >> 3, j = tid & 7, local = s_pos[r / H] >> bs_shift;
    const int64_t first = (score_row0 + r) * a.max_blocks + local;  // the row's first unscored entry
    const int fill = int((8 - (first & 7)) & 7);                       // entries to its sector's end
    if (j < fill && local + j < a.max_blocks) a.scores[first + j] = kKeyMinusInf;
  }
  M3_TL_MARK(indexer, tl_cta, 3);

  // Released only past its own wait (met by now): the attention's early units read Q and K/V
  // before theirs, because everything before this kernel has completed by then.
  if constexpr (kKeysFirst) pdl_wait();
  pdl_launch_dependents();  // the attention kernel may start its setup while the selection runs
  if (a.chunks > 1) {
    if (!msa::arrive_last(&a.counters[t0], unsigned(a.chunks), &s_last)) {
      M3_TL_FINISH(indexer, tl_cta, tl_ctas);
      return;
    }
  } else {
    __syncthreads();  // every warp's score writes and ring reads are done
  }
  if (dyn && tid == 0) a.unit_counters[t0] = 0;  // every CTA of the group is done taking units: re-armed
  M3_TL_MARK(indexer, tl_cta, 4);
  // A row's selection caches its block scores in shared memory. Every warp's ring is free now,
  // so the selecting warps share all of them (at two CTAs per SM a warp's own ring holds 2048
  // scores, a 512K context 4096 blocks).
  const int sharers = min(P, kWarpsD);
  const int cap = (kWarpsD * Cf::kRingBytes / 4 / max(1, sharers)) & ~3;  // words
  select_group(a, t0, P, s_pos, reinterpret_cast<uint32_t*>(smem) + (warp < sharers ? warp * cap : 0), cap,
               reinterpret_cast<unsigned*>(cand));
#ifdef M3_MSA_TIMELINE
  __syncthreads();
  M3_TL_MARK(indexer, tl_cta, 5);
  M3_TL_FINISH(indexer, tl_cta, tl_ctas);
#endif
}

template <class IK, int kNN>
void launch_one(const IndexerArgs& a, bool dependent) {
  auto kernel = dependent ? msa_indexer_decode_kernel<IK, kNN, true> : msa_indexer_decode_kernel<IK, kNN, false>;
  constexpr size_t smem = DecCfg<IK, kNN>::kBytes;
  M3_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  const dim3 grid{unsigned(a.tok_end - a.tok_begin), unsigned(a.chunks)};
  launch_kernel(kernel, grid, dim3(kThreadsD), smem, dependent, a);
}

}  // namespace

bool decode_kernel_takes(int bs, int max_blocks) {
  return bs >= kTileKeys && bs <= kUnitKeys && int64_t(max_blocks) * bs <= (int64_t(1) << 24);
}

int decode_ctas_per_sm(bool fp8, int rows_max) {
  const bool wide = rows_max > 8;
  return fp8 ? (wide ? DecCfg<__nv_fp8_e4m3, 2>::kCtasPerSm : DecCfg<__nv_fp8_e4m3, 1>::kCtasPerSm)
             : (wide ? DecCfg<__nv_bfloat16, 2>::kCtasPerSm : DecCfg<__nv_bfloat16, 1>::kCtasPerSm);
}

void launch_indexer_decode(const IndexerArgs& a, bool fp8, int rows_max, bool dependent) {
  const bool wide = rows_max > 8;
  if (fp8) {
    if (wide) launch_one<__nv_fp8_e4m3, 2>(a, dependent);
    else launch_one<__nv_fp8_e4m3, 1>(a, dependent);
  } else {
    if (wide) launch_one<__nv_bfloat16, 2>(a, dependent);
    else launch_one<__nv_bfloat16, 1>(a, dependent);
  }
}

}  // namespace m3::cuda::msa_index
