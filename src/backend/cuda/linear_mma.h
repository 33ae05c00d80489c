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

#include "ops/ops.h"

namespace m3::cuda {

// How one call is cut (host-side; the launch uses it, tests check it). The K segments are a
// function of (n, k) only; the rest may follow m, as no tile choice changes a bit.
struct MmaLinearPlan {
  int seg_stages = 0;      // 64-wide K steps per segment (the last may be shorter)
  int nseg = 0;            // segments, added in order
  int tokens_per_cta = 0;  // 8, 16 or 32 (narrow tiles) or 128 (wide)
  bool split = false;      // one segment per CTA (grid z), partials added by the tile's last CTA
  int64_t grid_x = 0, grid_y = 0, grid_z = 0;
};
MmaLinearPlan mma_linear_plan(int64_t m, int64_t n, int64_t k, DType dtype);

// "" when the tensor-core invariant linear takes weights of this type and shape.
std::string mma_linear_eligible(DType dtype, int64_t n, int64_t k);

// x F32 [m, k] (row stride ldx), y F32 [m, n] (row stride ldy); all on current_stream().
// wgmma: MXFP8 calls of at least kWgLinearMinRows rows run on the wgmma kernel (linear_wgmma.h;
// same bits).
void mma_linear(const float* x, int64_t ldx, int64_t m, const ops::LinearWeight& w, float* y, int64_t ldy,
                bool wgmma = false);

// Linears over the same x (a layer's q/k/v/index projections; the dense MLP's gate and up): x is
// split once and the GEMMs share launches (same bits as one call each). Same dtype and in_features.
void mma_linear_group(const float* x, int64_t ldx, int64_t m, const ops::LinearWeight* const* w, float* const* y,
                      const int64_t* ldy, int count, bool wgmma = false);

}  // namespace m3::cuda
