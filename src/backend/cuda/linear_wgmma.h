#pragma once
// The batch-invariant linear (linear_mma.h's numerics) on wgmma for MXFP8 and BF16 weights: launched by
// linear_mma.cu's run() for calls of at least kWgLinearMinRows rows, after the x split has written
// the pieces in wg_col order. Same bits as the mma.sync kernel for every output.
#include <cstdint>

namespace m3::cuda {

// Fewest rows for the wgmma path (below it the mma.sync tiles; see docs/linear_kernels.md), the
// default of MmaLinearRule::wgmma_min_rows: past the 32-token tiles' 256 rows. H200, every kernel
// forced (tools/gpu_linear_rule.sh, forty-sixth session): at 320-448 rows the wide mma.sync tile
// the rule took there was 2-3x the overlapped wgmma form (o_proj 509-597 -> 218-255 us, the dense
// MLP 1952-2214 -> 823-988, the grouped projections 1301-1386 -> 485-528).
constexpr int64_t kWgLinearMinRows = 257;
// A tile: 128 weight rows (64 per consumer warpgroup) x 128 tokens (the wgmma N).
constexpr int kWgLinearTileRows = 128, kWgLinearTileTokens = 128;

struct WgLinearArgs {
  const uint16_t* xhi;  // [m][k] pieces in wg_col order: f16 (MXFP8 weights) or bf16 (BF16 weights)
  const uint16_t* xlo;
  const float* xscale;  // [m] the rows' powers of two (f16 pieces), else null
  const uint8_t* w;     // [n][k] e4m3 or bf16
  const uint8_t* ws;    // [n][k / 32] e8m0 (MXFP8), else null
  const uint8_t* wref;  // [n] each scale row's largest byte (LinearWeight::scale_max), or null
  float* y;
  int64_t ldy;
  int m, n, k;
  int seg_stages;       // the fixed K segments (mma_linear_plan)
  bool overlap = false; // build stage s + 1's weight fragments while stage s's wgmmas run (same bits)
  // K split (overlapped form only): nsplit > 1 (= the plan's segments) runs each K segment of a
  // tile as its own work item, writing its fp32 partial to partial [nsplit][m][n]; the tile's
  // last item (tickets[tile], zeroed before the launch) adds them in segment order.
  int nsplit = 1;
  float* partial = nullptr;
  int* tickets = nullptr;
  // BF16 weights (the LM head): the mma.sync kernel's BF16 fragments and bf16 wgmmas, no block
  // scales; the overlapped form only.
  bool bf16 = false;
};

// The K stages [s0, s1) of work item i (overlapped form): with nsplit > 1 the items of a tile are
// its K segments in order, each exactly one segment of seg_stages (the last shorter), so that an
// item's partial is the segment sum the whole-K loop folds; with nsplit == 1 the whole K. (Device
// code calls it as a constexpr function: --expt-relaxed-constexpr.)
struct WgStageRange {
  int s0, s1;
};
constexpr WgStageRange wg_item_stages(int i, int nsplit, int seg_stages, int kst) {
  if (nsplit <= 1) return {0, kst};
  const int s0 = (i % nsplit) * seg_stages;
  return {s0, s0 + seg_stages < kst ? s0 + seg_stages : kst};
}

void launch_linear_wgmma(const WgLinearArgs& a);

}  // namespace m3::cuda
