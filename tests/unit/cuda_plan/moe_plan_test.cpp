// Host-side plans of the MoE router and the MXFP8 expert GEMMs (moe_router.h, moe_mxfp8.h): the
// launch geometry the launchers take and the dispatch trace prints. No GPU needed, so CI runs it.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/moe_mxfp8.h"
#include "backend/cuda/moe_router.h"
#include "ops/ops.h"
#include "plan_of.h"

namespace m3 {
namespace {

using cuda::moe_mxfp8::GemmPlan;
using cuda::moe_mxfp8::Path;
using cuda::moe_mxfp8::gemm_plan;

constexpr int64_t kInter = 3072, kHidden = 6144;  // M3 at TP1

// The decode path's geometry: 4-warp CTAs over 16-row items below 64 tokens, 8-warp CTAs over
// 64-row items from there; every column of the widest expert covered once.
TEST(MoeGemmPlan, W8A16FollowsTheTokenCount) {
  const GemmPlan one = gemm_plan(Path::kW8A16, 1, kInter, kHidden);
  EXPECT_EQ(one.rows_per_item, 16);
  EXPECT_EQ(one.token_tile, 2);
  EXPECT_EQ(one.threads, 128);
  EXPECT_EQ(one.gu_col_tiles * one.gu_cols, kInter);
  EXPECT_EQ(one.dn_col_tiles * one.dn_cols, kHidden);
  EXPECT_EQ(one.gu_col_tiles, 96);
  EXPECT_EQ(one.dn_col_tiles, 96);
  EXPECT_FALSE(one.persistent);
  EXPECT_EQ(one.combine_ctas_per_token, 6);  // 1024 columns per CTA
  EXPECT_EQ(cuda::moe_mxfp8::plan_text(one),
            "W8A16 mma.sync, items of <= 16 rows, 16-token tiles (8 for items of <= 8 rows) with a 4-stage "
            "shared-memory weight ring; gate+up: CTAs of 4 warps over 32 columns, 96 per item; down: 64 columns, 96 "
            "per item, each CTA starting once its item's gate+up CTAs have arrived; combine: 6 CTAs per token");
  EXPECT_EQ(gemm_plan(Path::kW8A16, 63, kInter, kHidden).rows_per_item, 16);
  const GemmPlan wide = gemm_plan(Path::kW8A16, 64, kInter, kHidden);
  EXPECT_EQ(wide.rows_per_item, 64);
  EXPECT_EQ(wide.token_tile, 0);
  EXPECT_EQ(wide.threads, 256);
  EXPECT_EQ(wide.gu_col_tiles, 48);
  EXPECT_EQ(wide.dn_col_tiles, 48);
  EXPECT_NE(cuda::moe_mxfp8::plan_text(wide).find("or a 64-token tile with weights in registers"), std::string::npos);
  // A whole row per combine CTA from 256 tokens.
  EXPECT_EQ(gemm_plan(Path::kW8A16, 255, kInter, kHidden).combine_ctas_per_token, 6);
  EXPECT_EQ(gemm_plan(Path::kW8A16, 256, kInter, kHidden).combine_ctas_per_token, 1);
  // TP-local intermediate sizes still tile exactly.
  for (int64_t inter : {kInter / 2, kInter / 4, int64_t(128)}) {
    for (int64_t t : {1, 64}) {
      const GemmPlan p = gemm_plan(Path::kW8A16, t, inter, kHidden);
      EXPECT_GE(p.gu_col_tiles * p.gu_cols, inter);
      EXPECT_LT((p.gu_col_tiles - 1) * p.gu_cols, inter);
    }
  }
}

// Every path covers the widest expert's columns and the hidden size exactly once per item, for
// any sizes the entries take (multiples of 128), at any token count.
TEST(MoeGemmPlan, TilesCoverTheOutputsOnce) {
  int checked = 0;
  for (Path path : {Path::kW8A16, Path::kW8A8, Path::kW8A16Wg}) {
    for (int64_t t : {1, 15, 16, 63, 64, 65, 255, 256, 1024, 1025, 16384}) {
      for (int64_t inter : {128, 384, 768, 1536, 3072, 12288}) {
        for (int64_t hidden : {1024, 1152, 6144, 7168}) {
          const GemmPlan p = gemm_plan(path, t, inter, hidden);
          const std::string at = cuda::moe_mxfp8::plan_text(p);
          EXPECT_EQ(p.path, path);
          EXPECT_EQ(p.rows_per_item, cuda::moe_mxfp8::rows_per_item(path, t)) << at;
          EXPECT_GE(p.gu_col_tiles * p.gu_cols, inter) << at;
          EXPECT_LT((p.gu_col_tiles - 1) * p.gu_cols, inter) << at;
          EXPECT_GE(p.dn_col_tiles * p.dn_cols, hidden) << at;
          EXPECT_LT((p.dn_col_tiles - 1) * p.dn_cols, hidden) << at;
          if (path == Path::kW8A16) {
            EXPECT_EQ(hidden % p.dn_cols, 0) << at;  // its down CTAs have no column guard
          }
          EXPECT_GE(p.combine_ctas_per_token * 4 * 256, t >= 256 ? 1 : hidden) << at;
          ++checked;
        }
      }
    }
  }
  EXPECT_EQ(checked, 3 * 11 * 6 * 4);
}

TEST(MoeGemmPlan, WgmmaPathsArePersistentWithTheirStages) {
  const GemmPlan w8 = gemm_plan(Path::kW8A8, 512, kInter, kHidden);
  EXPECT_TRUE(w8.persistent);
  EXPECT_EQ(w8.rows_per_item, 128);
  EXPECT_EQ(w8.stages, 6);
  EXPECT_EQ(w8.gu_col_tiles, 48);  // 64 SwiGLU columns (128 interleaved weight rows) per tile
  EXPECT_EQ(w8.dn_col_tiles, 48);
  EXPECT_EQ(gemm_plan(Path::kW8A8, 1024, kInter, kHidden).stages, 6);
  EXPECT_EQ(gemm_plan(Path::kW8A8, 1025, kInter, kHidden).stages, 4);
  EXPECT_EQ(cuda::moe_mxfp8::plan_text(gemm_plan(Path::kW8A8, 4096, kInter, kHidden)),
            "W8A8 wgmma e4m3, items of <= 128 rows, persistent CTAs (a producer and two consumer warpgroups) taking "
            "the tiles in order from a counter, 4-stage pipeline, 32..128-token tiles per item; gate+up: 64-column "
            "tiles, 48 per item; h to e4m3 per row; down: 128-column tiles, 48 per item, y in bf16; combine: 1 CTA "
            "per token");
  const GemmPlan wg = gemm_plan(Path::kW8A16Wg, 4096, kInter, kHidden);
  EXPECT_EQ(wg.stages, 4);
  EXPECT_EQ(wg.gu_col_tiles, 24);
  EXPECT_EQ(wg.dn_col_tiles, 24);
}

TEST(MoeRouterPlan, StagedRowsToTiledGroups) {
  // M3: 128 experts over hidden 6144 = 32 segments of 192 in 8 groups of 4.
  const cuda::RouterPlan one = cuda::fused_router_plan(1, 128, kHidden);
  EXPECT_FALSE(one.wide);
  EXPECT_TRUE(one.per_seg);
  EXPECT_EQ(one.nseg, 32);
  EXPECT_EQ(one.spg, 4);
  EXPECT_EQ(one.ngroups, 8);
  EXPECT_EQ(one.grid[0] * one.grid[1] * one.grid[2], 128);  // 128 CTAs at one token
  EXPECT_EQ(cuda::fused_router_plan_text(one),
            "logits: 4 x 32 x 1 CTAs of 32 experts x 8 tokens x one 192-wide segment (rows staged in shared memory), "
            "32 segment partials; select: 2 tokens per CTA");
  EXPECT_EQ(cuda::fused_router_plan(33, 128, kHidden).tokens_per_cta, 32);
  EXPECT_EQ(cuda::fused_router_plan(256, 128, kHidden).grid[2], 8);
  const cuda::RouterPlan mid = cuda::fused_router_plan(300, 128, kHidden);
  EXPECT_TRUE(mid.wide);
  EXPECT_TRUE(mid.per_seg);
  EXPECT_EQ(mid.grid[0], 5);
  EXPECT_EQ(mid.grid[2], 32);
  EXPECT_EQ(mid.select_tokens_per_cta, 2);
  const cuda::RouterPlan big = cuda::fused_router_plan(4096, 128, kHidden);
  EXPECT_FALSE(big.per_seg);
  EXPECT_EQ(big.nstored, 8);
  EXPECT_EQ(big.select_tokens_per_cta, 8);
  EXPECT_EQ(cuda::fused_router_plan_text(big),
            "logits: 64 x 1 x 8 CTAs of 128 experts x 64 tokens x one group of 4 segments (register-tiled), 8 group "
            "partials; select: 8 tokens per CTA");
}

// The dispatch entries hand the trace these plans.
TEST(MoePlans, EntriesTraceTheirPlan) {
  ops::KernelTable table;
  cuda::register_cuda_kernels(table);
  using test::plan_of;
  ops::Problem p;
  p.device = Device::kCuda;
  p.op = "moe_experts";
  p.dtype = DType::kF8E4M3;
  p.m = 1, p.n = kInter, p.k = kHidden, p.extra = 4;
  EXPECT_EQ(plan_of(table.moe.entries(), "moe_experts.mxfp8_w8a16_mma.sm90", p),
            cuda::moe_mxfp8::plan_text(gemm_plan(Path::kW8A16, 1, kInter, kHidden)));
  p.m = 4096;
  EXPECT_EQ(plan_of(table.moe.entries(), "moe_experts.mxfp8_w8a8_wgmma.sm90", p).rfind("W8A8 wgmma e4m3, ", 0), 0u);
  EXPECT_EQ(plan_of(table.moe.entries(), "moe_experts.mxfp8_w8a16_wgmma.sm90", p).rfind("W8A16 wgmma f16, ", 0), 0u);
  p.op = "moe_router";
  p.dtype = DType::kF32;
  p.m = 1, p.n = 128, p.k = kHidden;
  EXPECT_EQ(plan_of(table.router.entries(), "moe_router.sigmoid_bias_topk.sm90", p),
            cuda::fused_router_plan_text(cuda::fused_router_plan(1, 128, kHidden)));
  p.n = 300;  // more experts than the fused router takes
  EXPECT_EQ(plan_of(table.router.entries(), "moe_router.sigmoid_bias_topk.sm90", p),
            "row-dot logits, a thread per token selects");
}

}  // namespace
}  // namespace m3
