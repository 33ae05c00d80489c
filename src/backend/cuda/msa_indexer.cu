// MSA lightning indexer, tuned for Hopper: BF16 or FP8 (e4m3) index-K, dim 128, exact
// selections. This file holds the 128-row tiles and the launcher, which sends prefills with
// 128-key blocks to msa_indexer_prefill.cu and decode and speculative verification to the
// warp-streamed kernel of msa_indexer_decode.cu (blocks of 16..128 keys; 8-key blocks run the
// tiles here).
//
// One launch. A CTA owns a query group of one sequence (rows = (token, index head) pairs:
// 128) and one chunk of that sequence's earlier blocks (chunks spread a long context over all
// SMs when there are few groups). Keys stream through a cp.async pipeline into XOR-swizzled
// shared memory and every key read is shared by all the group's rows.
//
// Scores are exact without an exact dot per (row, key). The tensor cores compute an
// approximate dot a for every (row, key): Q scaled by a power of two sigma (exact) and rounded
// to bf16 (BF16 keys) or f16 (FP8 keys, converted exactly to f16), fp32 accumulation. Its
// distance to the CPU reference's dot (sequential fp32 sum of rounded products, scaled by
// sigma) is bounded by e = c |q sigma| |k| (+ terms for the elements zeroed below the
// operand's normal range), with c = 2^-7 (bf16 Q) or 2^-10 (f16 Q), about twice the worst
// case of Q rounding + tensor-core accumulation + the reference's own rounding; |k| comes
// from the same MMA (the keys' Gram diagonal). Per (row, block) lo = max(a - e) (rounded down)
// is a lower bound of the exact block score, so only keys with a + e (rounded up) >= lo can be
// the block's maximum: the CTA computes the reference's exact dot for those (typically one or
// two per block; every key when scores tie, e.g. duplicated keys) and the block score is their
// max, bit-identical to the CPU's. Keys whose a or e is not finite are always recomputed.
// The last CTA of a group to finish (arrival counter; the CTA itself with one chunk) selects
// the top_k - 1 earlier blocks per row with a warp (ranks of the few blocks that can make it,
// ties to the lower id: warp_select) and writes ascending ids plus the local block.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <climits>
#include <stdexcept>
#include <string>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_internal.h"
#include "backend/cuda/msa.h"
#include "backend/cuda/msa_common.cuh"
#include "backend/cuda/msa_indexer_common.cuh"

namespace m3::cuda {
namespace {

using namespace msa_index;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kStageBufBytes = 96 * 1024;
constexpr size_t kMaxScoreBytes = size_t(512) << 20;
constexpr size_t kFixedScoreBytes = size_t(4) << 20;  // decode batches' score rows (below)

__device__ unsigned g_indexer_counters[msa::kMaxCounters];
__device__ unsigned g_indexer_unit_counters[msa::kMaxCounters];  // the decode kernel's per-group unit counters

// Score scratch of decode batches (M3 at 128K: ~16 KB per token; up to 4 MB). Every
// indexer launch is a plain one (it starts after all earlier work on its stream has completed),
// so consecutive calls never overlap on it.
__device__ __align__(256) uint4 g_indexer_scores[kFixedScoreBytes / 16];

// Tiles: kWM warps along the rows (kMTiles m-tiles each), 8 / kWM along the keys.
template <class IK, int kWM, int kMTiles>
struct Cfg {
  static constexpr int kWN = kWarps / kWM;
  static constexpr int kRows = 16 * kMTiles * kWM;
  static constexpr int kSK = 128;  // keys per stage
  static constexpr int kKPW = kSK / kWN;  // keys per warp per stage
  static constexpr int kNT = kKPW / 8;    // n-tiles per warp
  static constexpr int kGT = kSK / 64;    // Gram n-tiles per warp
  static_assert(kGT * kWM == kNT, "the Gram tiles of a warp lie among its own n-tiles");
  static constexpr int kRowBytes = IkTraits<IK>::kRowBytes;
  static constexpr int kStageBytes = kSK * kRowBytes;
  static constexpr int kStages = kStageBufBytes / kStageBytes;
  static constexpr int kBps = kSK / kMinBs;  // blocks per stage at most
  static constexpr size_t kNkOff = kStageBufBytes;
  static constexpr size_t kLoOff = kNkOff + size_t(kSK) * 4;
  static constexpr size_t kScOff = kLoOff + size_t(kRows) * kBps * 4;
  static constexpr size_t kNqOff = kScOff + size_t(kRows) * kBps * 4;
  static constexpr size_t kSigOff = kNqOff + size_t(kRows) * 4;
  static constexpr size_t kHistOff = kSigOff + size_t(kRows) * 4;
  static constexpr size_t kPosOff = kHistOff + size_t(kWarps) * 256 * 4;
  static constexpr size_t kBytes = kPosOff + size_t(kRows) * 4;
  static constexpr int kSelectCap = kStageBufBytes / 4 / kWarps;  // block scores per warp cached for selection
};


template <class IK, int kWM, int kMTiles>
__global__ void __launch_bounds__(kThreads, 1) msa_indexer_kernel(IndexerArgs a) {
  using Cf = Cfg<IK, kWM, kMTiles>;
  using Tr = IkTraits<IK>;
  constexpr int kRows = Cf::kRows, kSK = Cf::kSK, kNT = Cf::kNT, kGT = Cf::kGT, kBps = Cf::kBps;
  constexpr int kStages = Cf::kStages, kRowBytes = Cf::kRowBytes, kStageBytes = Cf::kStageBytes;
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned char* const stage_buf = smem;
  float* const nk_s = reinterpret_cast<float*>(smem + Cf::kNkOff);
  uint32_t* const lo_s = reinterpret_cast<uint32_t*>(smem + Cf::kLoOff);
  uint32_t* const sc_s = reinterpret_cast<uint32_t*>(smem + Cf::kScOff);
  float* const nq_s = reinterpret_cast<float*>(smem + Cf::kNqOff);
  float* const sig_s = reinterpret_cast<float*>(smem + Cf::kSigOff);
  unsigned* const hist = reinterpret_cast<unsigned*>(smem + Cf::kHistOff);
  int* const s_pos = reinterpret_cast<int*>(smem + Cf::kPosOff);
  __shared__ int s_last;
  __shared__ int s_ncand;  // exact-dot candidates listed (a.defer)

  const int t0 = a.tok_end - 1 - int(blockIdx.x);  // longest causal prefixes first
  const int s = msa::seq_of_token(a.query_start, a.num_seqs, t0);
  const int q_begin = a.query_start[s], q_end = a.query_start[s + 1];
  if ((t0 - q_begin) % a.group_tokens != 0) return;  // not the first token of a query group
  const int T = min(a.group_tokens, q_end - t0), H = a.heads, P = T * H;
  const int bs = a.bs, bs_shift = a.bs_shift;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, cq = lane & 3;
  const int wm = warp / Cf::kWN, wn = warp % Cf::kWN;
  for (int i = tid; i < T; i += kThreads) s_pos[i] = a.positions[t0 + i];
  if (tid == 0) s_ncand = 0;
  __syncthreads();
  const GroupScan gs = group_scan(a, T, s_pos);
  if (gs.nb == 0) {  // every row takes all its blocks
    if (blockIdx.y == 0) {
      for (int p = warp; p < P; p += kWarps) write_all_blocks(a, t0, p, s_pos[p / H] >> bs_shift);
    }
    return;
  }
  auto q_row = [&](int r) { return a.q + (int64_t(t0 + r / H) * H + r % H) * kDim; };
  auto local_of = [&](int r) { return s_pos[r / H] >> bs_shift; };

  // Blocks per stage (a power of two: kSK and bs are), and row r's score row (r = token * H + head).
  const int bps_shift = max(0, __ffs(kSK) - 1 - bs_shift), bps = 1 << bps_shift;
  const int64_t score_row0 = int64_t(t0 - a.tok_begin) * H;
  const int b0 = gs.b0, b1 = gs.b1;
  if (b0 < b1) {
    const int key_begin = b0 << bs_shift, key_end = b1 << bs_shift;
    const int nstage = (key_end - key_begin + kSK - 1) / kSK;
    const int32_t* table = a.block_tables + int64_t(s) * a.max_blocks;
    const unsigned char* keys = static_cast<const unsigned char*>(a.keys);
    // Stage loads: thread = (16-byte column, row group), fixed column per thread; 32-bit slots.
    auto load_stage = [&](int i) {
      unsigned char* buf = stage_buf + (i % kStages) * kStageBytes;
      const int j0 = key_begin + i * kSK;
      constexpr int kChunks = kRowBytes / 16, kRowsPerPass = kThreads / kChunks;
      static_assert(kSK % kRowsPerPass == 0, "whole passes per stage");
      const int ch = tid % kChunks, row0 = tid / kChunks;
#pragma unroll
      for (int pss = 0; pss < kSK / kRowsPerPass; ++pss) {
        const int row = row0 + pss * kRowsPerPass, j = j0 + row;
        const bool ok = j < key_end;
        const int jj = ok ? j : key_begin;
        const uint32_t slot = uint32_t(__ldg(table + (jj >> bs_shift))) * uint32_t(bs) + uint32_t(jj & (bs - 1));
        cp_async16(smem_u32(buf + row * kRowBytes + ((ch ^ (row & 7)) << 4)), keys + uint64_t(slot) * kRowBytes + ch * 16,
                   ok);
      }
    };
    // The first stages' loads overlap the setup below.
#pragma unroll 1
    for (int i = 0; i < kStages - 1; ++i) {
      if (i < nstage) load_stage(i);
      cp_async_commit();
    }
    // Per row: sigma and |q sigma| (an upper bound).
    for (int r = warp; r < kRows; r += kWarps) {
      float sig = 0.0f, nq = 0.0f;
      if (r < P) warp_row_scale<IK>(*reinterpret_cast<const float4*>(q_row(r) + lane * 4), sig, nq);
      if (lane == 0) {
        sig_s[r] = sig;
        nq_s[r] = nq;
      }
    }
    __syncthreads();
    // A fragments (Q sigma) of this thread's rows, in the key layout's k order.
    uint32_t af[kMTiles][8][4];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
      const int ra = (wm * kMTiles + mt) * 16 + gq, rb = ra + 8;
      const float sa = sig_s[ra], sb = sig_s[rb];
      q_frags<IK>(q_row(ra < P ? ra : 0), q_row(rb < P ? rb : 0), sa, sb, cq, af[mt]);
    }

    // Error bound of (row, key), scaled units, rounded up.
    auto bound = [&](int r, int k) {
      return __fmaf_ru(__fmaf_ru(Tr::kErr, nq_s[r], Tr::kZeroTerm), nk_s[k], 5.96046448e-08f);
    };
    uint32_t* const cand_list = hist;
    // Runs the listed exact dots (one per thread) and clears the list; all threads call it.
    auto drain = [&](int cap) {
      const int n = min(s_ncand, cap);
      for (int c = tid; c < n; c += kThreads) {
        const int r = int(cand_list[c] >> 24), j = int(cand_list[c] & 0xffffffu);
        const uint32_t slot = uint32_t(__ldg(table + (j >> bs_shift))) * uint32_t(bs) + uint32_t(j & (bs - 1));
        const float x = exact_dot<IK, true>(q_row(r), keys + uint64_t(slot) * kRowBytes, 0);
        if (x == x) {  // the reference skips NaN
          atomicMax(a.scores + (score_row0 + r) * a.max_blocks + (j >> bs_shift),
                    order_key(x));
        }
      }
      __syncthreads();
      if (tid == 0) s_ncand = 0;
      __syncthreads();
    };
    int loc[kMTiles][2];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
      const int ra = (wm * kMTiles + mt) * 16 + gq;
      loc[mt][0] = ra < P ? local_of(ra) : -1;
      loc[mt][1] = ra + 8 < P ? local_of(ra + 8) : -1;
    }

#pragma unroll 1
    for (int i = 0; i < nstage; ++i) {
      cp_async_wait<kStages - 2>();
      __syncthreads();
      if (i + kStages - 1 < nstage) load_stage(i + kStages - 1);
      cp_async_commit();
      const unsigned char* buf = stage_buf + (i % kStages) * kStageBytes;
      const uint32_t buf_u32 = smem_u32(buf);
      const int kb = key_begin + i * kSK, nkeys = min(kSK, key_end - kb), first_blk = kb >> bs_shift;
      // Only the P live rows' entries of this stage's blocks are ever raised or read.
      for (int e = tid; e < P * bps; e += kThreads) {
        const int at = (e >> bps_shift) * kBps + (e & (bps - 1));
        lo_s[at] = 0u;
        sc_s[at] = msa::kKeyMinusInf;
      }
      // Approximate dots (and the Gram diagonal of this warp's Gram tiles).
      float acc[kMTiles][kNT][4];
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
        const int key0 = wn * Cf::kKPW + nt * 8;
        const int krow = key0 + (lane & 7);
        uint32_t bf[8][2];
        if constexpr (sizeof(IK) == 2) {
#pragma unroll
          for (int q4 = 0; q4 < 4; ++q4) {
            uint32_t r4[4];
            msa::ldmatrix_x4(r4, buf_u32 + krow * kRowBytes + (((q4 * 4 + (lane >> 3)) ^ (krow & 7)) << 4));
            bf[2 * q4][0] = r4[0];
            bf[2 * q4][1] = r4[1];
            bf[2 * q4 + 1][0] = r4[2];
            bf[2 * q4 + 1][1] = r4[3];
          }
        } else {
#pragma unroll
          for (int q2 = 0; q2 < 2; ++q2) {
            uint32_t r4[4];
            msa::ldmatrix_x4(r4, buf_u32 + krow * kRowBytes + (((q2 * 4 + (lane >> 3)) ^ (krow & 7)) << 4));
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              bf[q2 * 4 + j][0] = e4m3x2_lo_f16x2(r4[j]);
              bf[q2 * 4 + j][1] = e4m3x2_hi_f16x2(r4[j]);
            }
          }
        }
        if (nt >= kGT * wm && nt < kGT * wm + kGT) {
          // Gram of the 8 keys (A rows 0..7 = the keys themselves): diagonal = |k|^2.
          float gr[4] = {0, 0, 0, 0};
#pragma unroll
          for (int ks = 0; ks < 8; ++ks) {
            const uint32_t ga[4] = {bf[ks][0], 0u, bf[ks][1], 0u};
            Tr::mma(gr, ga, bf[ks][0], bf[ks][1]);
          }
          if ((gq >> 1) == cq) nk_s[key0 + gq] = __fmul_ru(sqrtf((gq & 1) ? gr[1] : gr[0]), 1.001f);
        }
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] = acc[mt][nt][3] = 0.0f;
#pragma unroll
          for (int ks = 0; ks < 8; ++ks) Tr::mma(acc[mt][nt], af[mt][ks], bf[ks][0], bf[ks][1]);
        }
      }
      __syncthreads();
      // Lower bounds per (row, block): max over the block's keys of a - e.
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        const int ra = (wm * kMTiles + mt) * 16 + gq;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if ((wm * kMTiles + mt) * 16 + 8 * h >= P) continue;  // warp-uniform: no live row in this half
          const int r = ra + 8 * h;
          float run = -INFINITY;
          int cur = -1;
#pragma unroll
          for (int nt = 0; nt < kNT; ++nt) {
            const int k0 = wn * Cf::kKPW + nt * 8 + 2 * cq;
            const int bi = (wn * Cf::kKPW + nt * 8) >> bs_shift;  // warp-uniform
            if (bi != cur) {
              if (cur >= 0) {
                run = fmaxf(run, __shfl_xor_sync(0xffffffffu, run, 1));
                run = fmaxf(run, __shfl_xor_sync(0xffffffffu, run, 2));
                if (cq == 0 && run > -INFINITY) atomicMax(&lo_s[r * kBps + cur], order_key(run));
              }
              run = -INFINITY;
              cur = bi;
            }
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int k = k0 + e;
              const float av = acc[mt][nt][2 * h + e];
              if (loc[mt][h] > first_blk + bi && k < nkeys) {
                const float ev = bound(r, k);
                if (isfinite(av) && isfinite(ev)) run = fmaxf(run, __fsub_rd(av, ev));
              }
            }
          }
          run = fmaxf(run, __shfl_xor_sync(0xffffffffu, run, 1));
          run = fmaxf(run, __shfl_xor_sync(0xffffffffu, run, 2));
          if (cq == 0 && run > -INFINITY) atomicMax(&lo_s[r * kBps + cur], order_key(run));
        }
      }
      __syncthreads();
      // Keys that can be their block's maximum: the reference's exact dot, a sequential 128-step
      // chain. Run in place, one or two lanes of a warp at a time, the chains stall every warp of
      // the stage at the next barrier; so candidates are listed (the selection's histogram space
      // holds the list) and their chains run in batches of hundreds, one per thread, reading the
      // key again from the cache (mostly L2), with atomicMax into the global block scores. Only
      // overflow (ties) or keys >= 2^24 run in place.
      constexpr int kCandCap = kWarps * 256, kDrainAt = kCandCap - kCandCap / 4;
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        const int ra = (wm * kMTiles + mt) * 16 + gq;
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
          const int bi = (wn * Cf::kKPW + nt * 8) >> bs_shift;
#pragma unroll
          for (int v = 0; v < 4; ++v) {
            if ((wm * kMTiles + mt) * 16 + 8 * (v >> 1) >= P) continue;  // warp-uniform
            const int h = v >> 1, r = ra + 8 * h, k = wn * Cf::kKPW + nt * 8 + 2 * cq + (v & 1);
            if (!(loc[mt][h] > first_blk + bi && k < nkeys)) continue;
            const float av = acc[mt][nt][v], ev = bound(r, k);
            const bool forced = !(isfinite(av) && isfinite(ev));
            if (forced || order_key(__fadd_ru(av, ev)) >= lo_s[r * kBps + bi]) {
              const int slot = a.defer ? atomicAdd(&s_ncand, 1) : kCandCap;
              if (slot < kCandCap) {
                cand_list[slot] = (uint32_t(r) << 24) | uint32_t(kb + k);
              } else {
                const float x = exact_dot<IK>(q_row(r), buf + k * kRowBytes, k);
                if (x == x) atomicMax(&sc_s[r * kBps + bi], order_key(x));  // the reference skips NaN
              }
            }
          }
        }
      }
      __syncthreads();
      // Every scanned (row, block): the in-place maximum (-inf when none); listed candidates
      // raise it later with atomicMax.
      for (int e = tid; e < P * bps; e += kThreads) {
        const int r = e >> bps_shift, bi = e & (bps - 1), blk = first_blk + bi;
        if ((bi << bs_shift) < nkeys && blk < local_of(r)) {
          a.scores[(score_row0 + r) * a.max_blocks + blk] = sc_s[r * kBps + bi];
        }
      }
      if (s_ncand >= kDrainAt) {  // uniform: s_ncand changes only after the next barriers
        __syncthreads();
        drain(kCandCap);
      }
    }
    cp_async_wait<0>();
    if (a.defer) {
      __syncthreads();
      drain(kWarps * 256);
    }
  }

  pdl_launch_dependents();  // the attention kernel may start its setup while the selection runs
  if (a.chunks > 1) {
    if (!msa::arrive_last(&a.counters[t0], unsigned(a.chunks), &s_last)) return;
  } else {
    __syncthreads();  // this CTA's score writes (and the stage buffers' last reads) are done
  }
  // Last CTA of the group: one warp per row selects its blocks.
  select_group(a, t0, P, s_pos, reinterpret_cast<uint32_t*>(stage_buf) + warp * Cf::kSelectCap, Cf::kSelectCap,
               hist + warp * 256);
}

int ilog2(int v) {
  int s = 0;
  while ((1 << s) < v) ++s;
  return s;
}

}  // namespace

int current_sm_count() { return current_device_attribute(cudaDevAttrMultiProcessorCount); }

// Shapes outside the tuned kernel (index dim != 128, block size not a power of two in
// 8..128, more than 16 heads, top_k > 64) run the generic kernel.
namespace {
MsaIndexerShape indexer_shape(int64_t tokens, int64_t heads, int64_t dim, const ops::AttentionMetadata& meta,
                              int top_k, DType keys) {
  MsaIndexerShape s;
  s.tokens = tokens;
  s.heads = heads;
  s.dim = dim;
  s.num_seqs = meta.num_seqs;
  s.max_blocks = meta.max_blocks_per_seq;
  s.bs = meta.block_size;
  s.top_k = top_k;
  s.bf16 = keys == DType::kBF16;
  s.fp8 = keys == DType::kF8E4M3;
  s.after_prologue = meta.indexer_after_prologue;
  return s;
}
}  // namespace

MsaIndexerShape msa_indexer_shape(const TensorView& index_q, const TensorView& index_k_cache,
                                  const ops::AttentionMetadata& meta, int top_k) {
  return indexer_shape(index_q.shape[0], index_q.shape[1], index_q.shape[2], meta, top_k, index_k_cache.dtype);
}

// ops::indexer_topk's problem: m tokens, n index heads, k index dim, extra top_k, the index-K
// cache's dtype and the batch's metadata.
MsaIndexerShape msa_indexer_shape(const ops::Problem& p) {
  return indexer_shape(p.m, p.n, p.k, *p.attention, int(p.extra), p.dtype);
}

std::string msa_indexer_refusal(const MsaIndexerShape& s) {
  if (!s.bf16 && !s.fp8) return "index-K cache is not BF16 or F8E4M3";
  if (s.dim != kDim) return "index head dim is not 128";
  if (s.bs < kMinBs || s.bs > 128 || (s.bs & (s.bs - 1)) != 0) return "page size is not a power of two in 8..128";
  if (s.heads < 1 || s.heads > 16) return "index heads outside 1..16";
  if (s.top_k < 1 || s.top_k > kMaxTopK) return "top_k outside 1..64";
  if (s.tokens >= (int64_t(1) << 30)) return "2^30 or more query tokens";
  return "";
}

MsaIndexerPlan msa_indexer_plan(const MsaIndexerShape& s, int64_t sms, MsaIndexerLayout layout) {
  MsaIndexerPlan p;
  const int64_t tokens = s.tokens;
  const int bs = s.bs, heads = int(s.heads);
  p.tuned = msa_indexer_refusal(s).empty();
  if (!p.tuned || tokens == 0) return p;
  // Prefills (sequences averaging at least half a 256-row group) with blocks of 128 keys: the
  // prefill kernel. Else the warp-streamed kernel wherever it takes the shape (groups of 16 rows
  // re-read a sequence's keys per 4 tokens, from L2 mostly, and still beat the 128-row tiles:
  // docs/msa_kernels.md); blocks of 8 keys (a 16-key tile would span two) run the tiles.
  const bool prefill_shaped = 2 * tokens >= int64_t(s.num_seqs) * prefill_group_tokens(heads);
  const bool sliced = layout == MsaIndexerLayout::kPrefillSliced;
  p.prefill = prefill_kernel_takes(bs, heads) &&
              (layout == MsaIndexerLayout::kPrefill || sliced || (layout == MsaIndexerLayout::kAuto && prefill_shaped));
  // Warp-kernel groups: 8 rows (one MMA n-tile) when every sequence may have one token, else 16.
  const bool narrow = tokens == s.num_seqs && heads <= 8;
  p.tma = p.prefill && !s.fp8;  // FP8 stages are converted in place by the threads that copy them
  p.tiles = !p.prefill && (layout == MsaIndexerLayout::kTiles || !decode_kernel_takes(bs, s.max_blocks));
  p.max_blocks = std::max(1, s.max_blocks);
  p.group_tokens = p.prefill ? prefill_group_tokens(heads) : std::max(1, (p.tiles ? 128 : narrow ? 8 : 16) / heads);
  p.exact_max = layout == MsaIndexerLayout::kExact ? INT_MAX : layout == MsaIndexerLayout::kAuto ? kExactMaxRowBlocks : 0;
  // Chunks per query group: enough CTAs for the SMs (the tiles run one CTA per SM, the warp
  // kernel one or two; the prefill kernel four waves, so that its groups of unequal causal
  // lengths balance) over the groups there are (the host does not know the contexts: chunks
  // past a sequence's blocks exit).
  p.groups = tokens == s.num_seqs ? tokens : (tokens + p.group_tokens - 1) / p.group_tokens + s.num_seqs;
  const int64_t max_scored = std::max(1, p.max_blocks - 1);
  p.ctas_per_sm = p.prefill ? 4 : p.tiles ? 1 : decode_ctas_per_sm(s.fp8, p.group_tokens * heads);
  const int64_t target = sms * p.ctas_per_sm;
  p.chunks = int(std::clamp<int64_t>(target / std::max<int64_t>(1, p.groups), 1, std::min<int64_t>(max_scored, 1024)));
  // kDynamic (the parity test's): two CTAs per group, so that the counters are shared across CTAs
  // and every warp's share is at least one unit from 16 units up.
  if (layout == MsaIndexerLayout::kDynamic) p.chunks = int(std::min<int64_t>(2, max_scored));
  if (tokens > msa::kMaxCounters) p.chunks = 1;
  // The warp-streamed kernel's warps take their units from a counter per query group where each
  // would stream at least kDynamicMinUnits of a fixed split (kAuto; kDynamic: at least one; the
  // forced kStreamed layout keeps the fixed split: the parity test checks all three).
  const bool dynamic = layout == MsaIndexerLayout::kAuto || layout == MsaIndexerLayout::kDynamic;
  p.dyn_min_units = layout == MsaIndexerLayout::kDynamic ? 1 : kDynamicMinUnits;
  p.unit_counters = !p.prefill && !p.tiles && dynamic && tokens <= msa::kMaxCounters;
  // Score scratch for a slice of the tokens (long prefills run in several launches). The
  // remainder is the first slice, the full ones follow: as the last slice (64K at M3 TP1: 65472
  // + 64 tokens) the remainder's groups, the longest causal prefixes, ran alone on a few SMs
  // after the rest (H200, BF16 keys: 64K 20.4 -> 16.6 ms, 128K 74.7 -> 66.4 ms). Slices of
  // equal size were slower at 128K (79.3 ms: five launches of 410 groups of nearly equal
  // length, so 14 SMs ran a fourth one while the rest idled).
  p.row_bytes = size_t(heads) * size_t(p.max_blocks) * 4;
  const size_t budget = sliced && p.prefill ? 4 * size_t(p.group_tokens) * p.row_bytes : kMaxScoreBytes;
  p.slice = std::max<int64_t>(p.group_tokens, int64_t(budget / p.row_bytes) - p.group_tokens);
  p.first_slice = tokens - (std::max<int64_t>(1, (tokens + p.slice - 1) / p.slice) - 1) * p.slice;
  p.launches = (tokens - p.first_slice + p.slice - 1) / p.slice + 1;
  // Decode batches take the fixed buffer where they fit, so that no free node separates this
  // launch from the attention, its programmatic dependent (the early units at B <= 4; the
  // attention's setup during the selection above: H200, B = 8 2-6 % and B = 64 at 2K-8K 1-2 %
  // faster steps). Prefill slices keep the pool.
  p.score_bytes = size_t(std::min<int64_t>(tokens, p.slice) + p.group_tokens) * p.row_bytes;
  p.fixed_scores = !p.prefill && tokens == s.num_seqs && p.score_bytes <= kFixedScoreBytes;
  // A decode row scores the blocks before its own, all written by earlier steps, so the keys
  // may be requested while the prologue (which writes this step's into the row's own block)
  // runs. With several tokens of a sequence a row's earlier blocks may hold this step's keys.
  // After any other kernel there is nothing to overlap, and q first is faster (H100: the
  // indexer alone at 128K, B = 1, FP8 keys 18.3-19.4 -> 19.9-20.7 us with the keys first).
  p.keys_before_wait = !p.prefill && !p.tiles && tokens == s.num_seqs && s.after_prologue;
  return p;
}

std::string msa_indexer_plan_text(const MsaIndexerPlan& p) {
  if (!p.tuned) return "the generic kernel (shape outside the tuned ones)";
  std::string s = p.prefill ? (p.tma ? "prefill kernel (a warp per 16 rows, whole blocks by TMA)" : "prefill kernel (a warp per 16 rows, whole blocks by cp.async)")
                  : p.tiles ? "128-row tiles"
                            : "warp-streamed decode kernel";
  s += ", " + std::to_string(p.groups) + (p.groups == 1 ? " query group of " : " query groups of ") + std::to_string(p.group_tokens) + " token" +
       (p.group_tokens == 1 ? "" : "s") + " x " + std::to_string(p.chunks) + " CTA" + (p.chunks == 1 ? "" : "s") + " (" +
       std::to_string(p.ctas_per_sm) + " per SM)";
  if (p.unit_counters) s += ", units from a counter per group where a warp's share is >= " + std::to_string(p.dyn_min_units);
  if (p.exact_max > 0 && !p.prefill && !p.tiles) s += ", exact scan in CTAs of <= " + std::to_string(p.exact_max) + " (row, block) pairs";
  if (p.launches > 1) s += ", " + std::to_string(p.launches) + " launches (score slices)";
  s += p.fixed_scores ? ", scores in the fixed buffer" : ", scores from the pool";
  if (p.keys_before_wait) s += ", the prologue's programmatic dependent (page ids and first key tiles requested before its wait)";
  return s;
}

void launch_msa_indexer_layout(const TensorView& index_q, const TensorView& index_k_cache,
                               const ops::AttentionMetadata& meta, const ops::IndexerParams& params,
                               const TensorView& selected, MsaIndexerLayout layout) {
  const int64_t tokens = index_q.shape[0], heads = index_q.shape[1];
  if (tokens == 0) return;
  if (params.block_size != meta.block_size) throw std::runtime_error("indexer_topk: block size differs from the page size");
  const int bs = params.block_size;
  const MsaIndexerShape shape = msa_indexer_shape(index_q, index_k_cache, meta, params.top_k);
  if (!msa_indexer_refusal(shape).empty()) return launch_generic_indexer_topk(index_q, index_k_cache, meta, params, selected);
  const MsaIndexerPlan plan = msa_indexer_plan(shape, current_sm_count(), layout);
  const bool prefill = plan.prefill, tiles = plan.tiles, fp8 = shape.fp8;
  IndexerArgs a{};
  a.q = index_q.as<const float>();
  a.keys = index_k_cache.data;
  a.selected = selected.as<int32_t>();
  a.query_start = meta.query_start;
  a.positions = meta.positions;
  a.block_tables = meta.block_tables;
  a.num_seqs = meta.num_seqs;
  a.num_tokens = int(tokens);
  a.max_blocks = plan.max_blocks;
  a.bs = bs;
  a.bs_shift = ilog2(bs);
  a.heads = int(heads);
  a.top_k = params.top_k;
  a.group_tokens = plan.group_tokens;
  a.exact_max = plan.exact_max;
  a.defer = int64_t(a.max_blocks) * bs <= (int64_t(1) << 24) ? 1 : 0;
  a.early_dependents = tokens == meta.num_seqs && tokens <= kEarlyUnitsMaxSeqs ? 1 : 0;
  a.chunks = plan.chunks;
  if (a.chunks > 1) {
    static FixedScratch counters_of(g_indexer_counters);  // the layouts' launches never overlap on a stream
    a.counters = static_cast<unsigned*>(counters_of.address());
  }
  a.dyn_min_units = plan.dyn_min_units;
  if (plan.unit_counters) {
    static FixedScratch unit_counters_of(g_indexer_unit_counters);
    a.unit_counters = static_cast<unsigned*>(unit_counters_of.address());
  }
  const int64_t slice = plan.slice, first = plan.first_slice;
  static FixedScratch scores_of(g_indexer_scores);
  Scratch scores = !prefill && tokens == meta.num_seqs ? Scratch(plan.score_bytes, scores_of) : Scratch(plan.score_bytes);
  a.scores = scores.as<uint32_t>();
  auto launch_tiles = [&](auto kernel, size_t smem) {
    M3_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    kernel<<<dim3{unsigned(a.tok_end - a.tok_begin), unsigned(a.chunks)}, kThreads, smem, current_stream()>>>(a);
  };
  for (int64_t tb = 0; tb < tokens; tb = a.tok_end) {
    a.tok_begin = int(tb);
    a.tok_end = int(std::min<int64_t>(tokens, tb + (tb == 0 ? first : slice)));
    if (prefill) launch_indexer_prefill(a, fp8, index_k_cache.shape[0]);
    else if (!tiles) launch_indexer_decode(a, fp8, a.group_tokens * a.heads, plan.keys_before_wait);
    else if (fp8) launch_tiles(msa_indexer_kernel<__nv_fp8_e4m3, 4, 2>, Cfg<__nv_fp8_e4m3, 4, 2>::kBytes);
    else launch_tiles(msa_indexer_kernel<__nv_bfloat16, 4, 2>, Cfg<__nv_bfloat16, 4, 2>::kBytes);
  }
  M3_CUDA_CHECK_LAUNCH();
}

std::vector<MsaFixedBuffer> msa_indexer_fixed_buffers() {
  static FixedScratch scores_of(g_indexer_scores), counters_of(g_indexer_counters), units_of(g_indexer_unit_counters);
  return {{scores_of.address(), scores_of.bytes()}, {counters_of.address(), counters_of.bytes()},
          {units_of.address(), units_of.bytes()}};
}

void launch_msa_indexer(const TensorView& index_q, const TensorView& index_k_cache, const ops::AttentionMetadata& meta,
                        const ops::IndexerParams& params, const TensorView& selected) {
  launch_msa_indexer_layout(index_q, index_k_cache, meta, params, selected, MsaIndexerLayout::kAuto);
}

}  // namespace m3::cuda
