// MSA lightning indexer for prefills with blocks of 128 keys: a warp owns 16 (token, head) rows
// and every key of the stage's block, so the per-(row, block) work needs no other warp.
//
// The other two layouts spend most of their instructions per (row, key) element: the tiles of
// msa_indexer.cu split a block's keys over two warps (shared-memory atomics and four barriers
// per stage, ~72 instructions per element, 255 registers: 2 warps per scheduler), and the
// warp-streamed kernel re-reads a prefill's keys per 4 tokens (~34 GB of L2 reads at 32K).
// Here, per element: one max (the row's block maximum of the approximate dots) and one compare.
//
// Exactness. a = approximate dot (Q sigma rounded to bf16 / f16, fp32 tensor-core accumulation)
// is within e_k = c |q sigma| |k| of sigma x (x = the reference's exact dot; c and the zeroed-
// element term as in msa_indexer_common.cuh). With E >= every e_k of the block (the block's
// largest |k|), the exact block maximum is >= max_k a_k - E, and a key can reach it only if
// a_k + E >= max a - E: so the keys with a_k >= max a - 2E (rounded down) are a superset of the
// block's possible maxima, and the block score is the maximum of their exact dots (bit-identical
// to the reference's). Rows or blocks whose bound could overflow or is not finite (non-finite
// or huge Q or keys) list every key of the block. Long rows also drop the keys that cannot reach
// the row's k-th best block lower bound so far (pruning, below).
//
// CTA: 16 warps, 256 rows (64 tokens at 4 index heads), one CTA per SM; keys through a 2-stage
// ring of whole blocks in XOR-swizzled shared memory, the rows' fp32
// q in shared memory for the exact dots (through L1 they stalled the scan: 28 M dots of 512-byte
// rows at 32K, one row per lane); the blocks'
// |k| from a Gram MMA (each warp one 8-key n-tile). Each warpgroup's 64 rows take
// the approximate dots as 8 wgmma m64n128k16 with Q in registers (the stage's B read once per
// warpgroup, not once per warp: 8 instructions where mma.sync took 128 MMAs and 64 ldmatrix; the
// same fp32 bits). FP8 keys are copied raw into the upper half of their stage and converted
// there to f16 (exact) in the BF16 keys' layout by the threads that copied them, so both key
// types run the same f16 / bf16 wgmma path (on mma.sync over per-fragment conversions, FP8 took
// 5 % (8K) to 32 % (64K) longer than BF16). Candidates are listed per warp (a bitmask
// per thread and row, compacted with a warp scan) and their exact dots run one per lane from the
// stage still in shared memory. Groups are enumerated on the device (no host sync); long
// contexts with few groups split their blocks over chunks, and the last chunk's CTA selects
// (arrival counter), as in the other layouts.
//
// BF16 keys arrive by TMA: thread 0 issues a stage as two 64-dim boxes of the block's 128 keys,
// which land 128-byte swizzled as the wgmma reads them, on the stage's mbarrier; each warp counts
// itself done with a stage, and the warp that does so last issues the stage that refills it. So a
// stage takes one CTA barrier (the blocks' |k|), where the cp.async ring took two and every
// thread's copies (thirty-eighth round: 4.5-6.5 % off the indexer at 8K-128K on an H100). FP8
// keys keep the cp.async ring: their stage is converted in place by the threads that copied it.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <type_traits>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_internal.h"
#include "backend/cuda/msa_indexer_common.cuh"
#include "backend/cuda/mma_operands.cuh"
#include "backend/cuda/msa_timeline.cuh"
#include "backend/cuda/tensor_map.h"
#include "backend/cuda/tma.cuh"
#include "backend/cuda/wgmma.cuh"

namespace m3::cuda::msa_index {
namespace {

using mma_ops::mbar_init;
using mma_ops::mbar_wait;

constexpr int kPThreads = 512, kPWarps = kPThreads / 32, kPRows = 16 * kPWarps;
constexpr int kPBlockKeys = 128;        // the only block size this kernel takes
constexpr int kPBufBytes = 64 * 1024;   // the key ring; reused by the selection
constexpr int kPQStride = 132;          // floats per shared q row: rows 16 B apart in the banks
constexpr int kPCandCap = 128;          // listed exact dots per warp and stage (more run in place)
// Pruning (BF16 keys): per row, the kPListLen largest block lower bounds the CTA has seen, in
// shared memory, bound the row's selection threshold from below when k = top_k - 1 <= kPListLen.
// Only in CTAs of more than kPPruneMinStages blocks: with fewer the bound rises too late to pay
// for its upkeep (8K prefill: +2 % with every CTA pruning, 32K -12 %, 64K -17 %).
constexpr int kPListLen = 16;
constexpr int kPPruneMinStages = 64;
// Bound inputs below these cannot overflow the approximate dots, the bound or max a - 2E.
constexpr float kMaxRowFactor = 17179869184.0f;  // 2^34 >= c |q sigma| + zero term (|q sigma| < 2^37)
constexpr float kMaxKeyNorm = 1.2089258e24f;     // 2^80

// Shared q row of the CTA's row r. A warp's candidate list interleaves its rows g and g + 8 (one
// lane lists both), and eight lanes of an exact-dot load read eight rows at once: rows 16 B apart
// in the banks repeat every 8 rows, so rows g and g + 8 are stored next to each other
// (physical row 2 g + 1 for g + 8), not 8 apart. (Stored in order, the exact dots' q loads took
// twice their ideal shared-memory wavefronts.)
__device__ __forceinline__ int q_slot(int r) { return (r & ~15) | ((r & 7) << 1) | ((r >> 3) & 1); }

// IK: the stage's element type (bf16 keys, or __half for FP8 keys converted in shared memory).
template <class IK>
struct PCfg {
  static_assert(sizeof(IK) == 2, "stages of 2-byte elements");
  static constexpr int kStageBytes = kPBlockKeys * kDim * 2;
  // A stage holds the block as two 128-byte halves of every key (dims 0-63, then 64-127), each a
  // 128-byte-swizzled K-major tile: the B operand of the warpgroups' wgmma.
  static constexpr int kHalfStride = kPBlockKeys * 128;
  static constexpr int kRowPitch = 128;  // bytes from one key's row to the next
  static constexpr int kStages = kPBufBytes / kStageBytes;  // 2
  static constexpr size_t kQOff = kPBufBytes;                                       // [rows][kPQStride] f32
  static constexpr size_t kCandOff = kQOff + size_t(kPRows) * kPQStride * 4;        // [warps][cap] u32
  static constexpr size_t kBestOff = kCandOff + size_t(kPWarps) * kPCandCap * 4;    // [rows] order keys
  static constexpr size_t kNkOff = kBestOff + size_t(kPRows) * 4;                   // [2][warps] f32
  static constexpr size_t kSigOff = kNkOff + size_t(2 * kPWarps) * 4;               // [rows]
  static constexpr size_t kAOff = kSigOff + size_t(kPRows) * 4;                     // [rows]
  static constexpr size_t kPosOff = kAOff + size_t(kPRows) * 4;                     // [tokens <= rows]
  static constexpr size_t kLstOff = kPosOff + size_t(kPRows) * 4;                   // [rows][kPListLen] f32
  static constexpr size_t kBarOff = kLstOff + size_t(kPRows) * kPListLen * 4;       // [stages] mbarriers (TMA)
  static constexpr size_t kRelOff = kBarOff + size_t(kStages) * 8;                 // [stages] u32 releases
  static constexpr size_t kBytes = kRelOff + size_t(kStages) * 4 + 1024;          // + the 1024-byte alignment
  static constexpr int kSelectCap = kPBufBytes / 4 / kPWarps - 256;  // words per warp: cache, then hist
  static_assert(kStages >= 2, "a ring of at least two blocks");
  static_assert(kBytes <= 227 * 1024, "one CTA's shared memory");
};

// Block-wide exclusive scan step: returns this thread's exclusive prefix of v and the total.
__device__ __forceinline__ int block_excl_scan(int v, int* warp_tot, int& total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int incl = msa::warp_inclusive_scan(v);
  if (lane == 31) warp_tot[warp] = incl;
  __syncthreads();
  int before = 0;
  total = 0;
#pragma unroll
  for (int w = 0; w < kPWarps; ++w) {
    const int t = warp_tot[w];
    before += w < warp ? t : 0;
    total += t;
  }
  __syncthreads();
  return before + incl - v;
}

// The query groups of the slice, in token order: sequence s contributes the groups whose first
// token q_begin + m G lies in [tok_begin, tok_end). CTA x takes group (total - 1 - x): longest
// causal prefixes first. Returns false when x is past the last group.
__device__ bool find_group(const IndexerArgs& a, int* warp_tot, int* found, int& seq, int& t0) {
  const int G = a.group_tokens;
  auto count = [&](int s, int& first) {
    const int qb = a.query_start[s], qe = a.query_start[s + 1];
    const int lo = max(qb, a.tok_begin), hi = min(qe, a.tok_end);
    first = 0;
    if (lo >= hi) return 0;
    const int m0 = (lo - qb + G - 1) / G, m1 = (hi - qb + G - 1) / G;
    first = qb + m0 * G;
    return max(0, m1 - m0);
  };
  // One pass over the sequences, kPThreads at a time: visit(s, groups, first token, groups before s);
  // returns the slice's total.
  auto scan = [&](auto&& visit) {
    int done = 0;
    for (int base = 0; base < a.num_seqs; base += kPThreads) {
      const int s = base + int(threadIdx.x);
      int first = 0;
      const int c = s < a.num_seqs ? count(s, first) : 0;
      int t = 0;
      const int excl = done + block_excl_scan(c, warp_tot, t);
      visit(s, c, first, excl);
      done += t;
    }
    return done;
  };
  const int g = scan([](int, int, int, int) {}) - 1 - int(blockIdx.x);
  if (g < 0) return false;
  if (threadIdx.x == 0) found[0] = found[1] = -1;
  scan([&](int s, int c, int first, int excl) {
    if (c > 0 && g >= excl && g < excl + c) {
      found[0] = s;
      found[1] = first + (g - excl) * G;
    }
  });
  __syncthreads();
  seq = found[0];
  t0 = found[1];
  return t0 >= 0;
}

// The kernel's parameter: the indexer's arguments and, for BF16 keys, the key cache [slots][128]
// as a TMA tensor (boxes of 64 dims x 128 keys, 128-byte swizzled).
struct PrefillArgs {
  CUtensorMap keys;
  IndexerArgs a;
};

// KS: the cache's index-key type (bf16 or e4m3).
template <class KS>
__global__ void __launch_bounds__(kPThreads, 1) msa_indexer_prefill_kernel(const __grid_constant__ PrefillArgs pa) {
  const IndexerArgs& a = pa.a;
  constexpr bool kF8 = sizeof(KS) == 1;
  constexpr bool kTma = !kF8;  // stages by TMA, released by a count (BF16 keys)
  using IK = std::conditional_t<kF8, __half, KS>;
  using Cf = PCfg<IK>;
  using Tr = IkTraits<IK>;
  constexpr int kStages = Cf::kStages, kStageBytes = Cf::kStageBytes;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  unsigned char* const smem = wgmma::align_1024(smem_raw);  // the swizzled stages repeat every 1024 bytes
  unsigned char* const stage_buf = smem;
  float* const q_s = reinterpret_cast<float*>(smem + Cf::kQOff);
  uint32_t* const cand_s = reinterpret_cast<uint32_t*>(smem + Cf::kCandOff);
  uint32_t* const best_s = reinterpret_cast<uint32_t*>(smem + Cf::kBestOff);
  float* const nk_s = reinterpret_cast<float*>(smem + Cf::kNkOff);
  float* const sig_s = reinterpret_cast<float*>(smem + Cf::kSigOff);
  float* const a_s = reinterpret_cast<float*>(smem + Cf::kAOff);
  int* const s_pos = reinterpret_cast<int*>(smem + Cf::kPosOff);
  float* const lst_s = reinterpret_cast<float*>(smem + Cf::kLstOff);
  __shared__ int s_scan[kPWarps];
  __shared__ int s_found[2];
  __shared__ int s_last;
  M3_PH_DECL;
  M3_PH_START();

  int s = 0, t0 = 0;
  if (!find_group(a, s_scan, s_found, s, t0)) {
    M3_PH_EXIT(false);
    return;
  }
  const int q_end = a.query_start[s + 1];
  const int T = min(a.group_tokens, q_end - t0), H = a.heads, P = T * H;
  const int tid = int(threadIdx.x), warp = tid >> 5, lane = tid & 31, gq = lane >> 2, cq = lane & 3;
  for (int i = tid; i < T; i += kPThreads) s_pos[i] = a.positions[t0 + i];
  for (int i = tid; i < kPRows; i += kPThreads) best_s[i] = kKeyMinusInf;
  __syncthreads();
  const GroupScan gs = group_scan(a, T, s_pos);
  if (gs.nb == 0) {  // every row takes all its blocks
    if (blockIdx.y == 0) {
      for (int p = warp; p < P; p += kPWarps) write_all_blocks(a, t0, p, s_pos[p / H] >> a.bs_shift);
    }
    M3_PH_EXIT(false);
    return;
  }
  auto local_of = [&](int r) { return s_pos[r / H] >> a.bs_shift; };
  const int64_t score_row0 = int64_t(t0 - a.tok_begin) * H;
  const int b0 = gs.b0, b1 = gs.b1;
  if (b0 < b1) {
    const int nstage = b1 - b0;
    const int32_t* table = a.block_tables + int64_t(s) * a.max_blocks;
    const unsigned char* keys = static_cast<const unsigned char*>(a.keys);
    // Byte offset of 16-byte chunk ch of key row `row` in a stage.
    auto key_chunk_off = [](int row, int ch) { return row * Cf::kRowPitch + stage_chunk_off<Cf::kHalfStride>(row, ch); };
    // The page of the next stage to copy, read a stage ahead (its L2 round trip sat in front of
    // every stage's copies).
    int next_page = 0;
    // Stage i = block b0 + i: thread = (16-byte column, row group), rows XOR-swizzled by row % 8.
    // FP8: thread t copies raw chunks 2 (t % 4), + 1 of key t / 4 (dims 32 (t % 4) .. + 31) into
    // the stage's upper half, chunk c of key r at r * 128 + (c ^ r % 8) * 16, where the upper
    // halves of the f16 rows of key r go (f8_to_f16 below).
    auto load_stage = [&](int i) {
      unsigned char* buf = stage_buf + (i % kStages) * kStageBytes;
      const uint64_t base = uint64_t(uint32_t(next_page)) * kPBlockKeys;
      if constexpr (kF8) {
        const int row = tid >> 2, c0 = 2 * (tid & 3);
        const unsigned char* src = keys + (base + row) * 128 + c0 * 16;
        unsigned char* dst = buf + Cf::kHalfStride + row * 128;
        cp_async16(smem_u32(dst + ((c0 ^ (row & 7)) << 4)), src, true);
        cp_async16(smem_u32(dst + (((c0 + 1) ^ (row & 7)) << 4)), src + 16, true);
      } else {
        constexpr int kChunks = 256 / 16, kRowsPerPass = kPThreads / kChunks;
        const int ch = tid % kChunks, row0 = tid / kChunks;
#pragma unroll
        for (int pss = 0; pss < kPBlockKeys / kRowsPerPass; ++pss) {
          const int row = row0 + pss * kRowsPerPass;
          cp_async16(smem_u32(buf + key_chunk_off(row, ch)), keys + (base + row) * 256 + ch * 16, true);
        }
      }
    };
    static_assert(!kF8 || kPThreads == 4 * kPBlockKeys, "FP8 stages: four threads per key");
    // FP8: this thread's raw chunks of stage i (landed: its own copies) -> f16 chunks 4 (t % 4) ..
    // + 3 of key t / 4, exact. The key's four threads are one warp's lanes, and the upper-half
    // writes overwrite only that key's raw chunks, so a warp barrier between the reads and the
    // writes is enough.
    auto f8_to_f16 = [&](int i) {
      unsigned char* buf = stage_buf + (i % kStages) * kStageBytes;
      const int row = tid >> 2, j = tid & 3;
      const unsigned char* src = buf + Cf::kHalfStride + row * 128;
      const uint4 r0 = *reinterpret_cast<const uint4*>(src + (((2 * j) ^ (row & 7)) << 4));
      const uint4 r1 = *reinterpret_cast<const uint4*>(src + (((2 * j + 1) ^ (row & 7)) << 4));
      __syncwarp();
      const uint32_t w[8] = {r0.x, r0.y, r0.z, r0.w, r1.x, r1.y, r1.z, r1.w};
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        const uint4 h = make_uint4(e4m3x2_lo_f16x2(w[2 * m]), e4m3x2_hi_f16x2(w[2 * m]), e4m3x2_lo_f16x2(w[2 * m + 1]),
                                   e4m3x2_hi_f16x2(w[2 * m + 1]));
        *reinterpret_cast<uint4*>(buf + key_chunk_off(row, 4 * j + m)) = h;
      }
    };
    // The rows' fp32 q into shared memory (the exact dots' operand), every row of the warp in
    // flight at once: read into registers a row at a time, the loop waited for a DRAM round trip
    // per row (~20 us per CTA, a quarter of the 8K indexer, whose groups run in 4 chunks of CTAs).
    // BF16: stage i's mbarrier (one arrival, the issuing thread's, plus the copies' bytes) and its
    // release count (every warp adds one when done with the stage; the 16th issues its refill).
    const uint32_t full0 = smem_u32(smem + Cf::kBarOff);
    unsigned* const rel_s = reinterpret_cast<unsigned*>(smem + Cf::kRelOff);
    auto issue_stage = [&](int i, int page) {
      const uint32_t bar = full0 + 8u * uint32_t(i % kStages);
      const uint32_t dst = smem_u32(stage_buf + (i % kStages) * kStageBytes);
      tma::arrive_expect_tx(bar, uint32_t(kStageBytes));
      tma::load_2d(dst, &pa.keys, 0, page * kPBlockKeys, bar);
      tma::load_2d(dst + Cf::kHalfStride, &pa.keys, 64, page * kPBlockKeys, bar);
    };
    if constexpr (kTma) {
      if (tid == 0) {
        for (int st = 0; st < kStages; ++st) {
          mbar_init(full0 + 8u * uint32_t(st), 1);
          rel_s[st] = 0;
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        for (int i = 0; i < kStages && i < nstage; ++i) issue_stage(i, __ldg(table + b0 + i));
      }
    }
    for (int r = warp; r < P && r < kPRows; r += kPWarps) {
      cp_async16(smem_u32(q_s + q_slot(r) * kPQStride + lane * 4), group_q_row(a, t0, r) + lane * 4, true);
    }
    cp_async_commit();
    if constexpr (!kTma) {
#pragma unroll 1
      for (int i = 0; i < kStages - 1; ++i) {
        if (i < nstage) {
          next_page = __ldg(table + b0 + i);
          load_stage(i);
        }
        cp_async_commit();
      }
      next_page = kStages - 1 < nstage ? __ldg(table + b0 + kStages - 1) : 0;
    }
    // Per row: sigma and the bound's row factor c |q sigma| + zero term (rounded up), from the
    // rows copied above.
    if constexpr (kTma) cp_async_wait<0>();  // this thread's q copies
    else cp_async_wait<kStages - 1>();       // this thread's q copies (the stages' may still fly)
    __syncwarp();
    for (int r = warp; r < kPRows; r += kPWarps) {
      float sig = 0.0f, fac = 0.0f;
      if (r < P) {
        const float4 v = *reinterpret_cast<const float4*>(q_s + q_slot(r) * kPQStride + lane * 4);
        float nq;
        warp_row_scale<IK>(v, sig, nq);
        fac = __fmaf_ru(Tr::kErr, nq, Tr::kZeroTerm);
      }
      if (lane == 0) {
        sig_s[r] = sig;
        a_s[r] = fac;
      }
    }
    __syncthreads();
    // A fragments (Q sigma) of this warp's 16 rows, in the key layout's k order.
    const int ra = 16 * warp + gq, rb = ra + 8;
    uint32_t af[8][4];
    q_frags<IK>(group_q_row(a, t0, ra < P ? ra : 0), group_q_row(a, t0, rb < P ? rb : 0), sig_s[ra], sig_s[rb], cq, af);
    const float fac_h[2] = {a_s[ra], a_s[rb]};
    const int loc_h[2] = {ra < P ? local_of(ra) : -1, rb < P ? local_of(rb) : -1};
    // Lane l < 16 writes row 16 warp + l's scores (its local block found once, not per stage).
    const int loc_w = lane < 16 && 16 * warp + lane < P ? local_of(16 * warp + lane) : -1;
    // Pruning: lim_h = the k-th largest block lower bound of the lane's rows so far (-inf: none
    // yet), k = top_k - 1. At least k blocks score >= lim, so a key with a + E < lim cannot be the
    // maximum of a selected block and is not listed. The block's score then stays below lim
    // (it is the maximum of its listed keys' exact dots, or -inf), every block scoring >= lim keeps
    // its exact maximum (its maximum key has a + E >= the lim of its stage), and the selection is
    // the same.
    const bool prune = a.top_k - 1 >= 1 && a.top_k - 1 <= kPListLen && nstage > kPPruneMinStages;
    float lim_h[2] = {-INFINITY, -INFINITY};
    if (prune) {  // the warp's rows' lists (no other warp reads them)
      for (int i = lane; i < 16 * kPListLen; i += 32) lst_s[16 * warp * kPListLen + i] = -INFINITY;
      __syncwarp();
    }
    uint32_t* const list = cand_s + warp * kPCandCap;
    uint32_t* const best = best_s + 16 * warp;
    auto exact_into_best = [&](uint32_t entry, const unsigned char* buf) {
      const int rw = int(entry >> 8), key = int(entry & 255u);
      const float x = exact_dot<IK, false, true, Cf::kHalfStride>(q_s + q_slot(16 * warp + rw) * kPQStride,
                                                                  buf + key * Cf::kRowPitch, key);
      if (x == x) atomicMax(&best[rw], msa::order_key(x));  // the reference skips NaN
    };

    M3_PH_LAP(8);
#pragma unroll 1
    for (int i = 0; i < nstage; ++i) {
      if constexpr (kTma) {
        mbar_wait(full0 + 8u * uint32_t(i % kStages), uint32_t((i / kStages) & 1));  // stage i landed
        M3_PH_LAP(0);
        // The page of the stage this warp's release may issue.
        if (lane == 0 && i + kStages < nstage) next_page = __ldg(table + b0 + i + kStages);
      } else {
        cp_async_wait<kStages - 2>();
        if constexpr (kF8) f8_to_f16(i);
        wgmma::fence_proxy_async();  // this thread's copies (or conversions), to the wgmma's reads
        __syncthreads();  // stage i visible; every warp is done with stage i - 1 (and nk_s)
        M3_PH_LAP(0);
        if (i + kStages - 1 < nstage) load_stage(i + kStages - 1);
        cp_async_commit();
        next_page = i + kStages < nstage ? __ldg(table + b0 + i + kStages) : 0;
      }
      M3_PH_LAP(1);
      const unsigned char* buf = stage_buf + (i % kStages) * kStageBytes;
      const uint32_t buf_u32 = smem_u32(buf);
      const int blk = b0 + i;
      // B fragments of n-tile nt (keys 8 nt .. + 7), k-steps 2 q, 2 q + 1.
      auto frags = [&](int nt, int q, uint32_t (&bf)[4][2]) {
        const int krow = 8 * nt + (lane & 7);
        uint32_t r4[4], r5[4];
        msa::ldmatrix_x4(r4, buf_u32 + key_chunk_off(krow, (2 * q) * 4 + (lane >> 3)));
        msa::ldmatrix_x4(r5, buf_u32 + key_chunk_off(krow, (2 * q + 1) * 4 + (lane >> 3)));
        bf[0][0] = r4[0];
        bf[0][1] = r4[1];
        bf[1][0] = r4[2];
        bf[1][1] = r4[3];
        bf[2][0] = r5[0];
        bf[2][1] = r5[1];
        bf[3][0] = r5[2];
        bf[3][1] = r5[3];
      };
      // |k| of the keys of n-tile `warp`: the Gram diagonal (A rows 0..7 = the keys themselves).
      // nk_s is double-buffered by stage parity: with one barrier per stage (TMA), a warp may write
      // stage i + 1's part while another still reads stage i's.
      auto gram = [&] {
        float gr[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          uint32_t bf[4][2];
          frags(warp, q, bf);
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const uint32_t ga[4] = {bf[j][0], 0u, bf[j][1], 0u};
            Tr::mma(gr, ga, bf[j][0], bf[j][1]);
          }
        }
        // Lane (gq, cq) holds (key gq, key 2 cq + {0, 1}): the diagonal where gq / 2 == cq.
        const float d = (gq >> 1) == cq ? ((gq & 1) ? gr[1] : gr[0]) : 0.0f;
        const bool bad = !(d <= 3.0e38f);  // NaN or inf
        float mx = bad ? 0.0f : d;
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
        const bool any_bad = __any_sync(0xffffffffu, bad);
        if (lane == 0) nk_s[(i & 1) * kPWarps + warp] = any_bad ? INFINITY : __fmul_ru(sqrtf(mx), 1.001f);
        __syncwarp();
      };
      const bool need0 = loc_h[0] > blk, need1 = loc_h[1] > blk;
      // acc[4 nt + v]: (row gq + 8 (v >> 1), key 8 nt + 2 cq + (v & 1)), the m16n8 and the
      // wgmma m64n128 accumulator layouts alike.
      float acc[64];
      const bool any = __any_sync(0xffffffffu, need0 || need1);  // warp-uniform
      {
        // The warpgroup's 64 rows x 128 keys in 8 wgmma m64n128k16 (A = this warp's Q fragments,
        // B = the stage), the Gram MMA under them. Same fp32 bits as the mma.sync chain over the
        // same operands and k order (wgmma.cuh), so the candidates are unchanged. Issued on every
        // stage, whether or not the warp's rows score the block (only the diagonal's last stage
        // and a sequence's partial group have rows that do not): a skip would be a divergent
        // path, and ptxas then serialises the wgmmas.
#pragma unroll
        for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
        wgmma::fence_regs(acc);
        wgmma::fence();
#pragma unroll
        for (int ks = 0; ks < 8; ++ks) {
          const uint64_t db = wgmma::desc_sw128(buf_u32 + (ks >> 2) * Cf::kHalfStride) + uint64_t(2 * (ks & 3));
          wgmma::WgmmaRS<!kF8, 128>::run(acc, af[ks], db);
        }
        wgmma::commit();
        gram();
        wgmma::wait<0>();
        wgmma::fence_regs(acc);
      }
      M3_PH_LAP(2);
      __syncthreads();  // every warp's |k| part
      M3_PH_LAP(3);
      float nkmax = 0.0f;
#pragma unroll
      for (int w = 0; w < kPWarps; w += 4) {
        const float4 v = *reinterpret_cast<const float4*>(nk_s + (i & 1) * kPWarps + w);
        nkmax = fmaxf(nkmax, fmaxf(fmaxf(v.x, v.y), fmaxf(v.z, v.w)));  // inf stays inf
      }
      unsigned mask[2] = {0u, 0u};  // element 2 nt + e: key 8 nt + 2 cq + e
      float lower[2] = {-INFINITY, -INFINITY};  // the rows' block lower bounds max a - E (rounded down)
      if (any) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const bool need = h == 0 ? need0 : need1;
          float m = -INFINITY;
#pragma unroll
          for (int nt = 0; nt < 16; ++nt) m = fmaxf(m, fmaxf(acc[4 * nt + 2 * h], acc[4 * nt + 2 * h + 1]));
          m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
          m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
          const float e1 = __fmaf_ru(fac_h[h], nkmax, 5.96046448e-08f);
          const float e2 = __fmul_ru(2.0f, e1);
          float thr = __fsub_rd(m, e2);
          const bool safe = fac_h[h] <= kMaxRowFactor && nkmax <= kMaxKeyNorm && thr > -INFINITY && thr < INFINITY;
          if (!need) continue;
          if (!safe) {
            mask[h] = 0xffffffffu;
            continue;
          }
          // The exact block maximum is >= max a - E; a key can reach the threshold only if a + E does.
          lower[h] = __fsub_rd(m, e1);
          thr = fmaxf(thr, __fsub_rd(lim_h[h], e1));
          if (thr > m) continue;  // no key of the block reaches it (a warp whose rows all skip saves the loop)
          // Element e is below thr iff acc - thr is negative (finite operands here: an exact
          // difference of distinct floats is never zero), so its sign bit is the complement of
          // the candidate bit: two instructions per element where the compare took three.
          unsigned below = 0u;
#pragma unroll
          for (int nt = 15; nt >= 0; --nt) {
            below = (below << 1) | (__float_as_uint(__fsub_rn(acc[4 * nt + 2 * h + 1], thr)) >> 31);
            below = (below << 1) | (__float_as_uint(__fsub_rn(acc[4 * nt + 2 * h], thr)) >> 31);
          }
          mask[h] = ~below;
        }
      }
      if (prune && any) {  // warp-uniform: this block's lower bounds into the rows' sorted lists
        // Row list: the row's kPListLen largest block lower bounds, descending; quad lane cq
        // holds entries 4 cq .. 4 cq + 3. Insert v: new[i] = max(old[i], min(old[i - 1], v)).
        const int kth = a.top_k - 2;  // index of the (top_k - 1)-th largest
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float4* const slot = reinterpret_cast<float4*>(lst_s + (16 * warp + gq + 8 * h) * kPListLen + 4 * cq);
          const float4 o = *slot;
          const float v = lower[h];
          float prev = __shfl_up_sync(0xffffffffu, o.w, 1);
          if (cq == 0) prev = INFINITY;
          float4 n;
          n.x = fmaxf(o.x, fminf(prev, v));
          n.y = fmaxf(o.y, fminf(o.x, v));
          n.z = fmaxf(o.z, fminf(o.y, v));
          n.w = fmaxf(o.w, fminf(o.z, v));
          *slot = n;
          const int j = kth & 3;
          const float mine = j == 0 ? n.x : j == 1 ? n.y : j == 2 ? n.z : n.w;
          lim_h[h] = __shfl_sync(0xffffffffu, mine, (lane & ~3) | (kth >> 2));
        }
      }
      M3_PH_LAP(4);
      // List the candidates (row in warp << 8 | key), warp-compacted; overflow runs in place.
      const int mine = __popc(mask[0]) + __popc(mask[1]);
      const int incl = msa::warp_inclusive_scan(mine);
      const int listed = __shfl_sync(0xffffffffu, incl, 31);
      int pos = incl - mine;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        unsigned m = mask[h];
        while (m) {
          const int idx = __ffs(m) - 1;
          m &= m - 1;
          const uint32_t entry = (uint32_t(gq + 8 * h) << 8) | uint32_t(8 * (idx >> 1) + 2 * cq + (idx & 1));
          if (pos < kPCandCap) list[pos] = entry;
          else exact_into_best(entry, buf);
          ++pos;
        }
      }
      __syncwarp();
      M3_PH_LAP(5);
      const int n = min(listed, kPCandCap);
      for (int c = lane; c < n; c += 32) exact_into_best(list[c], buf);
      __syncwarp();
      M3_PH_LAP(6);
      if (lane < 16) {
        if (loc_w > blk) a.scores[(score_row0 + 16 * warp + lane) * a.max_blocks + blk] = best[lane];
        best[lane] = kKeyMinusInf;
      }
      __syncwarp();
      if constexpr (kTma) {
        // Done with stage i: the last of the 16 warps to say so refills its slot with stage i + kStages
        // (every read of the slot, the wgmmas' included, is complete by now).
        if (lane == 0) {
          __threadfence_block();
          const unsigned prev = atomicAdd(rel_s + (i % kStages), 1u);
          if (prev % kPWarps == kPWarps - 1 && i + kStages < nstage) {
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
            issue_stage(i + kStages, next_page);
          }
        }
      }
      M3_PH_LAP(7);
      M3_PH_STAGE();
    }
    cp_async_wait<0>();
  }

  pdl_launch_dependents();  // the attention kernel may start its setup while the selection runs
  if (a.chunks > 1) {
    if (!msa::arrive_last(&a.counters[t0], unsigned(a.chunks), &s_last)) {
      M3_PH_DONE();
      return;
    }
  } else {
    __syncthreads();  // this CTA's score writes (and the ring's last reads) are done
  }
  uint32_t* const cache = reinterpret_cast<uint32_t*>(stage_buf) + warp * (Cf::kSelectCap + 256);
  select_group(a, t0, P, s_pos, cache, Cf::kSelectCap, cache + Cf::kSelectCap);
  M3_PH_DONE();
}

template <class KS>
void launch_prefill_one(const IndexerArgs& a, int64_t key_slots) {
  PrefillArgs pa{};
  pa.a = a;
  if constexpr (sizeof(KS) == 2) pa.keys = bf16_map_2d(a.keys, kDim, uint64_t(key_slots), kDim * 2, 64, kPBlockKeys);
  auto kernel = msa_indexer_prefill_kernel<KS>;
  constexpr size_t smem = PCfg<std::conditional_t<sizeof(KS) == 1, __half, KS>>::kBytes;
  M3_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  const int G = a.group_tokens;
  // Groups of the slice: at most one partial group per sequence beyond the full ones.
  const int64_t groups = (int64_t(a.tok_end - a.tok_begin) + G - 1) / G + a.num_seqs;
  kernel<<<dim3{unsigned(groups), unsigned(a.chunks)}, kPThreads, smem, current_stream()>>>(pa);
}

}  // namespace

bool prefill_kernel_takes(int bs, int heads) { return bs == kPBlockKeys && heads >= 1 && heads <= 16; }

int prefill_group_tokens(int heads) { return kPRows / heads; }

void launch_indexer_prefill(const IndexerArgs& a, bool fp8, int64_t key_slots) {
  if (fp8) launch_prefill_one<__nv_fp8_e4m3>(a, key_slots);
  else launch_prefill_one<__nv_bfloat16>(a, key_slots);
}

}  // namespace m3::cuda::msa_index
