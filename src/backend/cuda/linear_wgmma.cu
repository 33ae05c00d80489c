// The batch-invariant linear of linear_mma.h on wgmma, for MXFP8 weights at prefill sizes (and
// BF16 weights: the LM head; the same structure, the weight bytes loaded as the mma.sync kernel's
// BF16 fragments, bf16 wgmmas, no block scales).
//
// Same bits as mma_linear_kernel for every output: a chain of wgmma m64nNk16 with A from
// registers sums a k16 step exactly as mma.sync m16n8k16 does (tools/wgmma_probe), so each thread
// builds its A fragments as that kernel does (the same 16 weight bytes per lane and 64-wide stage,
// the same exact e4m3 -> f16 conversion with the block scale folded in relative to the row's
// largest scale byte), and the x pieces are stored in wg_col order (split_x's kWg form) so that a
// contiguous k16 step of B holds the k the mma.sync fragments pair. Per K step the hi piece's
// wgmma precedes the lo piece's into the same accumulators; a K segment starts from +0 (zeroed
// registers, scale-d 1, as the mma.sync chain) and the segments are added in order; the epilogue
// multiplies by the same powers of two.
//
// Persistent CTAs of 3 warpgroups over tiles of 128 weight rows x 128 tokens (n tile fastest, so
// the CTAs running together share the token tile in L2):
//   WG0 (producer): cp.async of both pieces of the token tile, one 64-wide K stage per ring slot
//       (128-byte swizzled rows), arriving on the slot's mbarrier.
//   WG1, WG2 (consumers): 64 weight rows each; each thread copies its own 32 weight bytes per
//       stage into its own shared-memory slots kLwAhead stages ahead (no barrier: it alone reads
//       them), converts them into its A fragments, and issues the stage's 8 wgmmas. Accumulators:
//       the segment's and the total (2 x 64 registers at N = 128).
#include "backend/cuda/linear_wgmma.h"

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_internal.h"
#include "backend/cuda/mma_operands.cuh"
#include "backend/cuda/wgmma.cuh"

namespace m3::cuda {
namespace {

using namespace mma_ops;

constexpr int kLwThreads = 384;
constexpr int kLwTok = kWgLinearTileTokens;  // tokens per tile (the wgmma N)
constexpr int kLwRows = kWgLinearTileRows;   // weight rows per tile (64 per consumer warpgroup)
constexpr int kLwStages = 4;               // token ring slots, one 64-wide K stage each (6: no faster)
constexpr int kLwPiece = kLwTok * 128;     // one piece's stage: 128 rows of 64 f16
constexpr int kLwBStage = 2 * kLwPiece;    // hi, then lo
constexpr int kLwAhead = 3;                // weight stages a consumer thread has in flight
constexpr int kLwWBufs = kLwAhead + 1;     // its slots: the stage read now and those in flight
// Weight bytes per consumer thread and stage: 16 of each of its two rows (e4m3), 32 (bf16).
template <bool kBf16>
constexpr int kLwWStage = 256 * (kBf16 ? 64 : 32);
constexpr int kLwProducerRegs = 56, kLwConsumerRegs = 224;  // 128 * 56 + 256 * 224 <= 65536
template <bool kBf16>
constexpr size_t kLwSmem = size_t(kLwStages) * kLwBStage + size_t(kLwWBufs) * kLwWStage<kBf16> + 2 * kLwStages * 8 + 1024;
static_assert(kLwSmem<true> <= 232448, "linear wgmma kernel: shared memory per CTA");

struct Smem {
  uint32_t b, w, full, empty;  // token ring, weight slots, barriers
};

// Stages [s0, s1) of the token tile at m0 into the ring.
__device__ __forceinline__ void produce(const WgLinearArgs& a, const Smem& sm, int m0, int s0, int s1, int& stage,
                                        uint32_t& phase, int tid) {
  const int c8 = tid & 7, rb = tid >> 3;  // 16-byte chunk and first row (0..15): rows rb + 16 i
  const uint32_t sw = uint32_t((c8 ^ (rb & 7)) << 4);
  int64_t off[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    // Rows past m repeat row m - 1: their output columns are never stored, and real values keep
    // the products finite.
    off[i] = int64_t(min(m0 + rb + 16 * i, a.m - 1)) * a.k + c8 * 8;
  }
  for (int st = s0; st < s1; ++st) {
    mbar_wait(sm.empty + 8u * uint32_t(stage), phase ^ 1u);
    const uint32_t dst = sm.b + uint32_t(stage * kLwBStage + rb * 128) + sw;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      cp_async16(dst + uint32_t(16 * i * 128), a.xhi + off[i] + st * 64, 16u);
      cp_async16(dst + uint32_t(kLwPiece + 16 * i * 128), a.xlo + off[i] + st * 64, 16u);
    }
    cp_async_arrive_noinc(sm.full + 8u * uint32_t(stage));
    if (++stage == kLwStages) stage = 0, phase ^= 1u;
  }
}

// Stages [s0, s1) of the tile (n0, m0): the whole K, or (kOverlap, a.nsplit > 1) K segment seg of
// tile t. kBf16: BF16 weights (no block scales; the x pieces bf16, no row powers of two).
template <bool kOverlap, bool kBf16>
__device__ __forceinline__ void consume(const WgLinearArgs& a, const Smem& sm, int n0, int m0, int s0, int s1, int seg,
                                        int t, int& stage, uint32_t& phase, int cw, int tw) {
  const int w4 = tw >> 5, lane = tw & 31, g = lane >> 2, tig = lane & 3;
  const int kst = a.k / 64;
  const int row_lo = n0 + 64 * cw + 16 * w4 + g;  // and row_lo + 8
  const int r_lo = min(row_lo, a.n - 1), r_hi = min(row_lo + 8, a.n - 1);  // rows past n load row n - 1
  // A lane's 16 k of a 64-wide stage: 16 bytes of each row (e4m3) or 32 (bf16), the k the
  // mma.sync kernel's lane holds.
  constexpr int kEb = kBf16 ? 2 : 1, kSlot = 32 * kEb;
  const uint8_t* p_lo = a.w + (int64_t(r_lo) * a.k + 16 * tig) * kEb;
  const uint8_t* p_hi = a.w + (int64_t(r_hi) * a.k + 16 * tig) * kEb;
  const uint32_t* s_lo = kBf16 ? nullptr : reinterpret_cast<const uint32_t*>(a.ws + int64_t(r_lo) * (a.k / 32));
  const uint32_t* s_hi = kBf16 ? nullptr : reinterpret_cast<const uint32_t*>(a.ws + int64_t(r_hi) * (a.k / 32));
  const uint32_t slot = sm.w + uint32_t((128 * cw + tw) * kSlot);
  auto copy_w = [&](int st) {
    if (st < s1) {
      const uint32_t dst = slot + uint32_t((st % kLwWBufs) * kLwWStage<kBf16>);
      if constexpr (kBf16) {
        cp_async16_w(dst, p_lo + int64_t(st) * 128);
        cp_async16_w(dst + 16, p_lo + int64_t(st) * 128 + 16);
        cp_async16_w(dst + 32, p_hi + int64_t(st) * 128);
        cp_async16_w(dst + 48, p_hi + int64_t(st) * 128 + 16);
      } else {
        cp_async16_w(dst, p_lo + int64_t(st) * 64);
        cp_async16_w(dst + 16, p_hi + int64_t(st) * 64);
      }
    }
    cp_async_commit();  // one group per stage, empty or not, so wait_group counts stages
  };
#pragma unroll
  for (int d = 0; d < kLwAhead; ++d) copy_w(s0 + d);
  // Scale words of the 128-wide windows: [0, 1] the current window's (lo, hi rows), [2, 3] the next.
  const int w0 = s0 >> 1;
  uint32_t sc[4] = {0u, 0u, 0u, 0u};
  int ref[2] = {127, 127};  // BF16: the epilogue's factors are 1
  if constexpr (!kBf16) {
    sc[0] = __ldg(s_lo + w0);
    sc[1] = __ldg(s_hi + w0);
    sc[2] = 2 * (w0 + 1) < kst ? __ldg(s_lo + w0 + 1) : 0u;
    sc[3] = 2 * (w0 + 1) < kst ? __ldg(s_hi + w0 + 1) : 0u;
    if (a.wref != nullptr) {  // the load-time reference
      ref[0] = __ldg(a.wref + r_lo);
      ref[1] = __ldg(a.wref + r_hi);
    } else {
      const uint32_t* const rows[2] = {s_lo, s_hi};
      rows_max_byte<2, 8>(rows, a.k / 128, tig, ref);
    }
  }
  float acc[64], tot[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] = tot[i] = 0.0f;
  // A stage's steps: build (its A fragments), issue (its wgmmas), retire (their end). The plain
  // form runs them in order; the overlapped one (MmaLinearRule::wgmma_overlap, the default: 11-17 %
  // faster on the H200) moves stage st + 1's build between stage st's issue and retire.
  bool first = true;
  int seg_left = a.seg_stages;
  // Stage st's A fragments from this thread's weight slot (one cp.async group per stage: the
  // calls run in stage order).
  auto build = [&](int st, uint32_t(&af)[4][4]) {
    cp_async_wait<kLwAhead - 1>();  // this thread's weights of stage st have landed
    const uint32_t src = slot + uint32_t((st % kLwWBufs) * kLwWStage<kBf16>);
    if constexpr (kBf16) {
      // The mma.sync kernel's BF16 fragments: k16 step s4 = (half, s2) takes words 2 s2, 2 s2 + 1
      // of the half's 16 bytes of each row.
      uint4 q[4];  // row lo halves 0, 1; row hi halves 0, 1
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(q[i].x), "=r"(q[i].y), "=r"(q[i].z), "=r"(q[i].w)
                     : "r"(src + 16u * uint32_t(i)));
      }
      copy_w(st + kLwAhead);  // into the slots stage st - 1 used
#pragma unroll
      for (int s4 = 0; s4 < 4; ++s4) {
        const uint4& l = q[s4 >> 1];
        const uint4& h = q[2 + (s4 >> 1)];
        af[s4][0] = word_of(l, 2 * (s4 & 1));
        af[s4][1] = word_of(h, 2 * (s4 & 1));
        af[s4][2] = word_of(l, 2 * (s4 & 1) + 1);
        af[s4][3] = word_of(h, 2 * (s4 & 1) + 1);
      }
    } else {
      uint4 ql, qh;
      asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(ql.x), "=r"(ql.y), "=r"(ql.z), "=r"(ql.w) : "r"(src));
      asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(qh.x), "=r"(qh.y), "=r"(qh.z), "=r"(qh.w) : "r"(src + 16));
      copy_w(st + kLwAhead);  // into the slots stage st - 1 used
      const int sh = 8 * (2 * (st & 1) + (tig >> 1));  // this lane's 32-wide block in the 128-wide window
      const __half2 mul_lo = pow2_h2(int((sc[0] >> sh) & 0xffu) - ref[0]);
      const __half2 mul_hi = pow2_h2(int((sc[1] >> sh) & 0xffu) - ref[1]);
      if (st & 1) {  // the window ends: the next one's words move up, the one after is requested
        sc[0] = sc[2];
        sc[1] = sc[3];
        const int nw = (st >> 1) + 2;
        if (2 * nw < kst) {
          sc[2] = __ldg(s_lo + nw);
          sc[3] = __ldg(s_hi + nw);
        }
      }
#pragma unroll
      for (int s4 = 0; s4 < 4; ++s4) {
        const uint32_t wl = word_of(ql, s4), wh = word_of(qh, s4);
        af[s4][0] = e4m3x2_scaled(wl, mul_lo);
        af[s4][1] = e4m3x2_scaled(wh, mul_hi);
        af[s4][2] = e4m3x2_scaled<true>(wl, mul_lo);
        af[s4][3] = e4m3x2_scaled<true>(wh, mul_hi);
      }
    }
  };
  // Stage st's 8 wgmmas (hi then lo per k16 step) on the token slot, committed as one group.
  auto issue = [&](const uint32_t(&af)[4][4]) {
    mbar_wait(sm.full + 8u * uint32_t(stage), phase);
    wgmma::fence_proxy_async();
    const uint32_t bh = sm.b + uint32_t(stage * kLwBStage), bl = bh + uint32_t(kLwPiece);
    wgmma::fence_regs(acc);
    wgmma::fence();
#pragma unroll
    for (int s4 = 0; s4 < 4; ++s4) {
      wgmma::WgmmaRS<kBf16, kLwTok>::run(acc, af[s4], wgmma::desc_sw128(bh + uint32_t(32 * s4)));
      wgmma::WgmmaRS<kBf16, kLwTok>::run(acc, af[s4], wgmma::desc_sw128(bl + uint32_t(32 * s4)));
    }
    wgmma::commit();
  };
  // The group's end: the token slot goes back to the producer; a K segment's end folds it in order.
  auto retire = [&](int st) {
    wgmma::wait<0>();
    wgmma::fence_regs(acc);
    if (lane == 0) mbar_arrive(sm.empty + 8u * uint32_t(stage));
    if (++stage == kLwStages) stage = 0, phase ^= 1u;
    if (--seg_left == 0 || st + 1 == s1) {  // end of a K segment: fold in order
      seg_left = a.seg_stages;
#pragma unroll
      for (int i = 0; i < 64; ++i) {
        tot[i] = first ? acc[i] : tot[i] + acc[i];
        acc[i] = 0.0f;
      }
      first = false;
    }
  };
  if constexpr (!kOverlap) {
    static_assert(!kBf16, "BF16 weights run the overlapped form only");
    for (int st = s0; st < s1; ++st) {
      uint32_t af[4][4];
      build(st, af);
      issue(af);
      retire(st);
    }
  } else {
    // Stage st + 1's fragments are built while stage st's wgmmas run: two fragment sets taking
    // turns (two stages per trip, so each set keeps its registers), the set in flight fenced
    // until its group's wait. The same operands in the same order: the same bits.
    uint32_t f0[4][4], f1[4][4];
    build(s0, f0);
    for (int st = s0; st < s1; st += 2) {
      issue(f0);
      if (st + 1 < s1) build(st + 1, f1);
      retire(st);
      wgmma::fence_regs(f0);
      if (st + 1 == s1) break;
      issue(f1);
      if (st + 2 < s1) build(st + 2, f0);
      retire(st + 1);
      wgmma::fence_regs(f1);
    }
  }
  cp_async_wait<0>();

  // Fragment: acc[4 j + cc] row row_lo, token 8 j + 2 tig + cc; acc[4 j + 2 + cc] row row_lo + 8.
  const float f_lo = ldexpf(1.0f, ref[0] - 127), f_hi = ldexpf(1.0f, ref[1] - 127);
  if constexpr (kOverlap) {
    if (a.nsplit > 1) {
      // This segment's partial, then the tile's last item adds all of them in segment order
      // (the additions the whole-K loop makes in registers) and scales as below.
      const int64_t plane = int64_t(a.m) * a.n;
      float* part = a.partial + seg * plane;
#pragma unroll
      for (int j = 0; j < kLwTok / 8; ++j) {
#pragma unroll
        for (int cc = 0; cc < 2; ++cc) {
          const int tok = m0 + 8 * j + 2 * tig + cc;
          if (tok >= a.m) continue;
          if (row_lo < a.n) part[int64_t(tok) * a.n + row_lo] = tot[4 * j + cc];
          if (row_lo + 8 < a.n) part[int64_t(tok) * a.n + row_lo + 8] = tot[4 * j + 2 + cc];
        }
      }
      __threadfence();
      __shared__ int lw_last;
      asm volatile("bar.sync 1, 256;\n" ::: "memory");  // the two consumer warpgroups
      if (cw == 0 && tw == 0) lw_last = atomicAdd(a.tickets + t, 1) == a.nsplit - 1;
      asm volatile("bar.sync 1, 256;\n" ::: "memory");
      if (!lw_last) return;
      __threadfence();
      auto sum = [&](int tok, int row) {
        const float* p = a.partial + int64_t(tok) * a.n + row;
        float v = __ldcg(p);
        for (int s = 1; s < a.nsplit; ++s) v = v + __ldcg(p + s * plane);
        return v;
      };
#pragma unroll 1
      for (int j = 0; j < kLwTok / 8; ++j) {
#pragma unroll
        for (int cc = 0; cc < 2; ++cc) {
          const int tok = m0 + 8 * j + 2 * tig + cc;
          if (tok >= a.m) continue;
          const float xs = a.xscale ? __ldcg(a.xscale + tok) : 1.0f;
          float* y = a.y + int64_t(tok) * a.ldy;
          if (row_lo < a.n) {
            const float v = sum(tok, row_lo);
            y[row_lo] = a.xscale ? (v * f_lo) * xs : v * f_lo;
          }
          if (row_lo + 8 < a.n) {
            const float v = sum(tok, row_lo + 8);
            y[row_lo + 8] = a.xscale ? (v * f_hi) * xs : v * f_hi;
          }
        }
      }
      return;
    }
  }
#pragma unroll
  for (int j = 0; j < kLwTok / 8; ++j) {
#pragma unroll
    for (int cc = 0; cc < 2; ++cc) {
      const int tok = m0 + 8 * j + 2 * tig + cc;
      if (tok >= a.m) continue;
      const float xs = a.xscale ? __ldcg(a.xscale + tok) : 1.0f;
      float* y = a.y + int64_t(tok) * a.ldy;
      if (row_lo < a.n) y[row_lo] = a.xscale ? (tot[4 * j + cc] * f_lo) * xs : tot[4 * j + cc] * f_lo;
      if (row_lo + 8 < a.n) y[row_lo + 8] = a.xscale ? (tot[4 * j + 2 + cc] * f_hi) * xs : tot[4 * j + 2 + cc] * f_hi;
    }
  }
}

template <bool kOverlap, bool kBf16>
__global__ void __launch_bounds__(kLwThreads, 1) linear_wgmma_kernel(const __grid_constant__ WgLinearArgs a) {
  extern __shared__ unsigned char lw_smem[];
  Smem sm;
  sm.b = smem_u32(wgmma::align_1024(lw_smem));
  sm.w = sm.b + uint32_t(kLwStages * kLwBStage);
  sm.full = sm.w + uint32_t(kLwWBufs * kLwWStage<kBf16>);
  sm.empty = sm.full + 8u * kLwStages;
  const int tid = int(threadIdx.x), wg = tid >> 7;
  if (tid == 0) {
    for (int s = 0; s < kLwStages; ++s) {
      mbar_init(sm.full + 8u * uint32_t(s), 128);
      mbar_init(sm.empty + 8u * uint32_t(s), 8);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  const int gx = (a.n + kLwRows - 1) / kLwRows, tiles = gx * ((a.m + kLwTok - 1) / kLwTok);
  int stage = 0;
  uint32_t phase = 0;
  if constexpr (!kOverlap && !kBf16) {
    if (wg == 0) {
      asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kLwProducerRegs));
      for (int t = int(blockIdx.x); t < tiles; t += int(gridDim.x)) {
        produce(a, sm, (t / gx) * kLwTok, 0, a.k / 64, stage, phase, tid);
      }
      cp_async_wait<0>();
    } else {
      asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kLwConsumerRegs));
      for (int t = int(blockIdx.x); t < tiles; t += int(gridDim.x)) {
        consume<false, kBf16>(a, sm, (t % gx) * kLwRows, (t / gx) * kLwTok, 0, a.k / 64, 0, t, stage, phase, wg - 1,
                       tid - 128 * wg);
      }
    }
    return;
  }
  // Work items: the tiles, or (a.nsplit > 1) each tile's K segments, a tile's segments adjacent;
  // item i covers stages [s0, s1) of tile i / ns.
  const int kst = a.k / 64, ns = a.nsplit, items = tiles * ns;
  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kLwProducerRegs));
    for (int i = int(blockIdx.x); i < items; i += int(gridDim.x)) {
      const WgStageRange r = wg_item_stages(i, ns, a.seg_stages, kst);
      produce(a, sm, (i / ns / gx) * kLwTok, r.s0, r.s1, stage, phase, tid);
    }
    cp_async_wait<0>();
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kLwConsumerRegs));
    for (int i = int(blockIdx.x); i < items; i += int(gridDim.x)) {
      const WgStageRange r = wg_item_stages(i, ns, a.seg_stages, kst);
      const int t = i / ns;
      consume<true, kBf16>(a, sm, (t % gx) * kLwRows, (t / gx) * kLwTok, r.s0, r.s1, i % ns, t, stage, phase, wg - 1,
                    tid - 128 * wg);
    }
  }
}

}  // namespace

void launch_linear_wgmma(const WgLinearArgs& a) {
  if (a.m < 1 || a.n < 1 || (a.bf16 ? a.k % 64 != 0 || a.xscale != nullptr : a.k % 128 != 0 || a.ws == nullptr)) {
    throw std::runtime_error(
        "linear.wgmma_hilo_invariant.sm90: MXFP8 weights with in_features % 128 == 0, or BF16 weights with "
        "in_features % 64 == 0 and bf16 x pieces, only");
  }
  if (a.bf16 && !a.overlap) {
    throw std::runtime_error("linear.wgmma_hilo_invariant.sm90: BF16 weights run the overlapped form only");
  }
  if (a.nsplit > 1 && (!a.overlap || a.partial == nullptr || a.tickets == nullptr)) {
    throw std::runtime_error("linear.wgmma_hilo_invariant.sm90: a K split needs the overlapped form, partials and tickets");
  }
  const int64_t tiles = (int64_t(a.n) + kLwRows - 1) / kLwRows * ((int64_t(a.m) + kLwTok - 1) / kLwTok) *
                        std::max(1, a.nsplit);
  if (tiles > INT32_MAX) throw std::runtime_error("linear.wgmma_hilo_invariant.sm90: problem too large");
  const auto kernel = a.bf16 ? linear_wgmma_kernel<true, true>
                      : a.overlap ? linear_wgmma_kernel<true, false>
                                  : linear_wgmma_kernel<false, false>;
  const size_t smem = a.bf16 ? kLwSmem<true> : kLwSmem<false>;
  const int sms = allow_dynamic_smem(reinterpret_cast<const void*>(kernel), smem);
  kernel<<<unsigned(std::min<int64_t>(sms, tiles)), kLwThreads, smem, current_stream()>>>(a);
  M3_CUDA_CHECK_LAUNCH();
}

}  // namespace m3::cuda
