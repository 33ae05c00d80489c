#pragma once
// Batch-invariant tensor-core linear (linear_mma.cu): y[m, n] = sum_k x[m, k] W[n, k] for F32
// activations and BF16 or MXFP8 weights, on mma.sync with fp32 accumulation.
//
// Numerics (the canonical computation of every output, whatever M, the tile or the launch):
//   x is split per element into hi + lo pieces (BF16 weights: bf16 pieces; MXFP8: f16 pieces of
//   x * 2^k, k a power of two per row from its largest |x|), so x keeps ~16 (bf16) or ~22 (f16)
//   significant bits; weights enter exactly (bf16, or e4m3 -> f16 with the block scale folded in
//   relative to the row's largest scale byte, as the MoE W8A16 kernel). K is cut into S fixed
//   segments (S a function of N and K only); a segment's partial is one MMA chain from +0 over
//   its 64-wide K steps in ascending order, per step the k-permuted m16n8k16 MMAs of the hi
//   piece then the lo piece; the partials are added in segment order; the result is multiplied
//   by the weight row's and the x row's powers of two. A row's bits therefore never depend on
//   the other rows, the token tile, or whether one CTA or several ran its segments.
#include <cstdint>
#include <string>

#include "backend/cuda/linear_wgmma.h"
#include "ops/ops.h"

namespace m3::cuda {

// Which kernel runs a call: the narrow tiles (8-32 tokens per CTA, mma.sync), the wide tile (128
// tokens, mma.sync) or the wgmma kernel (MXFP8, and BF16 in its overlapped form; 128 x 128 tiles;
// linear_wgmma.h). No choice changes a bit.
enum class MmaLinearKernel { kNarrow, kWide, kWgmma };
const char* mma_linear_kernel_name(MmaLinearKernel k);

// Where the tile rules switch. The defaults are the engine's, measured on the H200
// (docs/linear_kernels.md); linear_bench passes others to time every kernel at every size.
//   wgmma_min_rows: MXFP8 calls of at least this many rows run on wgmma (where the entry allows).
//   narrow_max_rows: 32-token tiles up to this many rows (weights over 128 MB, an LM head: 32),
//     the wide tile beyond. At 48-128 rows the 32-token tiles (two CTAs per SM, each weight tile
//     read once per 32 rows) took a layer's grouped projections 362-457 -> 109-190 us against the
//     wide tile (one CTA per SM, ~60 TFLOP/s split over K at these sizes), o_proj 145-194 -> 92-185,
//     the dense MLP 616-780 -> 379-692; at 129-256 rows, with the split below, the layer's three
//     calls 1976-2231 -> 1263-1979 us.
//   split_fill: past 128 rows, 32-token tiles whose last wave (two CTAs per SM) is under this
//     percentage full split K over CTAs too (o_proj at 192 rows 305 -> 253 us; the wide tile 272).
//   wgmma_overlap: the wgmma kernel builds stage s + 1's weight fragments while stage s's wgmmas
//     run (WgLinearArgs::overlap; same bits). On: 11-17 % faster than the plain form at 320-1024
//     rows on every M3 shape (H200, q_proj 1024 rows 403 -> 355 us, o_proj 406 -> 350).
//   wgmma_wide_min_rows, wgmma_wide_n: weights of at least wgmma_wide_n outputs (many 128-row
//     tiles) take wgmma from this many rows already. H200, plain wgmma against the 32-token tiles
//     at 96-256 rows: q_proj 99-150 vs 140-280 us, o_proj 132-175 vs 184-331, the dense MLP
//     381-706 vs 678-1300; at 64 rows the tiles win (q_proj 90 vs 112), and weights of 512
//     outputs (k/v: 4 tiles) keep them up to 256 rows (38 vs 102 us). Groups of weights do not
//     take this path (their small weights would follow the large one onto wgmma).
//   group_separate_min_rows: groups of weights (ops::linear_group) of at least this many rows,
//     below wgmma_min_rows, whose outputs total >= wgmma_wide_n leave the group entries and run
//     as separate calls (each weight on its own rule: the wide one on wgmma, the small ones on
//     the 32-token tiles; same bits). H200, a sparse layer's five projections: 192 rows 294 ->
//     256 us, 256 rows 351 -> 228 (at 128 rows the group is faster: 189 against 207).
//   wgmma_split: the overlapped form also splits K over work items where its tiles leave SMs
//     idle at <= 256 rows (WgLinearArgs::nsplit; same bits). Off: slower than not splitting at
//     160-256 rows (q_proj 256 rows 108 -> 319 us).
struct MmaLinearRule {
  int64_t wgmma_min_rows = kWgLinearMinRows;
  int64_t narrow_max_rows = 256;
  int split_fill = 85;
  bool wgmma_overlap = true;
  int64_t wgmma_wide_min_rows = 96;
  int64_t wgmma_wide_n = 4096;
  bool wgmma_split = false;
  int64_t group_separate_min_rows = 192;
  //   wgmma_bf16: BF16 weights (the LM head) take the wgmma kernel too, in its overlapped form,
  //     where the rules above send them (the wide-weight rule: an LM head from 96 rows); the same
  //     bits (kernels_cuda_parity forces it). H100, LM head 200064 x 6144 (linear_bench --shapes
  //     lm_head): 96 / 128 / 192 / 256 / 512 rows 2934 / 3063 / 5708 / 6164 / 12318 us on the
  //     wide tile -> 1799 / 1833 / 3552 / 3631 / 7626 us.
  bool wgmma_bf16 = true;
  //   wgmma_bf16_wide_min_rows: the wide-weight rule's row threshold for BF16 weights (the LM head
  //     at 64 rows: 2657 us on the 128-token mma.sync tile, 1940 on wgmma, H100).
  int64_t wgmma_bf16_wide_min_rows = 64;
  //   narrow_ctas_per_sm: CTAs per SM of an 8- or 16-token-tile launch (three fit as compiled:
  //     at most 80 registers, 44 / 52 KB with MXFP8 weights; BF16's rings allow two): 0 picks per
  //     launch two up to one wave of two per SM (allowed three, a launch of 256 packed them onto
  //     fewer SMs: H100, q_proj at 16 rows 47.6 -> 39.0 us), past it the count whose last wave is
  //     fuller, three on a tie (q_proj at 32 rows, 512 CTAs: 73.1 -> 65.1 us at two per SM, 1.94
  //     waves against 1.29; the grouped attention projections' 720 keep three); 2 or 3 force it.
  int narrow_ctas_per_sm = 0;
};
// CTAs per SM an 8- or 16-token-tile launch of `ctas` CTAs runs at under `rule`
// (MmaLinearRule::narrow_ctas_per_sm): 2 or 3.
int narrow_ctas_per_sm(int64_t ctas, int rule);
// What the occupancy calculator gives the 8- or 16-token-tile kernel (FP8 or BF16 weights)
// launched for `per_sm` (0: unpadded, 2 or 3) CTAs per SM on the current device: the check that
// the padding works (and that no tile's registers crept past its count); 32: the 32-token tile
// as launched (per_sm ignored).
int narrow_occupancy_check(int tokens_per_cta, bool fp8, int per_sm);
// The rule of weight groups (ops::linear_group): the default without the wide-weight path.
MmaLinearRule mma_group_rule();

// How one call is cut (host-side; the launch uses it, tests check it). The K segments are a
// function of (n, k) only; the rest may follow m, as no tile choice changes a bit.
struct MmaLinearPlan {
  MmaLinearKernel kernel = MmaLinearKernel::kNarrow;
  int seg_stages = 0;      // 64-wide K steps per segment (the last may be shorter)
  int nseg = 0;            // segments, added in order
  int tokens_per_cta = 0;  // 8, 16 or 32 (narrow tiles) or 128 (wide, wgmma)
  bool split = false;      // one segment per CTA (grid z), partials added by the tile's last CTA
  bool overlap = false;    // wgmma: the overlapped form (MmaLinearRule::wgmma_overlap)
  int64_t grid_x = 0, grid_y = 0, grid_z = 0;  // tiles over n, over m, and segments (wgmma: persistent CTAs walk the tiles)
  int ctas_per_sm = 0;  // 8- and 16-token tiles launched alone: narrow_ctas_per_sm() (a group's launch decides on its sum)
};
// wgmma: whether the call may take the wgmma kernel (its dispatch entry was chosen).
MmaLinearPlan mma_linear_plan(int64_t m, int64_t n, int64_t k, DType dtype, bool wgmma = false,
                              const MmaLinearRule& rule = {});

// The plan in words for the dispatch trace: "narrow 32-token tiles x 48 x 6, K in 5 segments on
// separate CTAs", "wgmma 128 x 128 tiles x 64 x 4", ...
std::string mma_linear_plan_text(const MmaLinearPlan& p);
std::string mma_linear_tile_text(const MmaLinearPlan& p);  // "narrow 32-token tiles", "wgmma 128 x 128 tiles"

// "" when the tensor-core invariant linear takes weights of this type and shape.
std::string mma_linear_eligible(DType dtype, int64_t n, int64_t k);

// x F32 [m, k] (row stride ldx), y F32 [m, n] (row stride ldy); all on current_stream().
// wgmma and rule as for mma_linear_plan, which decides the kernel of the call.
void mma_linear(const float* x, int64_t ldx, int64_t m, const ops::LinearWeight& w, float* y, int64_t ldy,
                bool wgmma = false, const MmaLinearRule& rule = {});

// Linears over the same x (a layer's q/k/v/index projections; the dense MLP's gate and up): x is
// split once and the GEMMs share launches (same bits as one call each). Same dtype and in_features.
void mma_linear_group(const float* x, int64_t ldx, int64_t m, const ops::LinearWeight* const* w, float* const* y,
                      const int64_t* ldy, int count, bool wgmma = false, const MmaLinearRule& rule = {});

}  // namespace m3::cuda
