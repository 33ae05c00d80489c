// Host-side plan of the tensor-core invariant linear (linear_mma.h): no GPU needed, so CI runs it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/linear_mma.h"
#include "ops/ops.h"
#include "plan_of.h"

namespace m3 {
namespace {

// Its K segments must be a function of (N, K) alone and tile K exactly, or a row's bits would
// depend on the batch; the tiles and the split may follow M within launch limits.
TEST(MmaLinearPlan, SegmentsDependOnTheShapeOnly) {
  struct Shape {
    int64_t n, k;
    DType dtype;
  };
  const std::vector<Shape> shapes = {{8192, 6144, DType::kF8E4M3}, {6144, 8192, DType::kF8E4M3},
                                     {512, 6144, DType::kF8E4M3},  {128, 6144, DType::kF8E4M3},
                                     {12288, 6144, DType::kF8E4M3}, {6144, 12288, DType::kF8E4M3},
                                     {200064, 6144, DType::kBF16},  {129, 1152, DType::kF8E4M3},
                                     {300, 1024, DType::kBF16},     {1, 1024, DType::kBF16}};
  for (const Shape& s : shapes) {
    ASSERT_EQ(cuda::mma_linear_eligible(s.dtype, s.n, s.k), "") << s.n << " x " << s.k;
    const cuda::MmaLinearPlan one = cuda::mma_linear_plan(1, s.n, s.k, s.dtype);
    const int64_t steps = s.k / 64;
    EXPECT_GE(one.nseg, 1);
    EXPECT_LT(int64_t(one.seg_stages) * (one.nseg - 1), steps) << "empty last segment";
    EXPECT_GE(int64_t(one.seg_stages) * one.nseg, steps) << "segments do not cover K";
    EXPECT_GE(int64_t(one.seg_stages), std::min<int64_t>(12, steps)) << "segments of at least 12 stages";
    for (int64_t m : {1, 2, 7, 8, 9, 16, 17, 32, 33, 128, 256, 257, 4096, 65536}) {
      const cuda::MmaLinearPlan p = cuda::mma_linear_plan(m, s.n, s.k, s.dtype);
      EXPECT_EQ(p.seg_stages, one.seg_stages) << s.n << " x " << s.k << ", m " << m;
      EXPECT_EQ(p.nseg, one.nseg) << s.n << " x " << s.k << ", m " << m;
      EXPECT_TRUE(p.tokens_per_cta == 8 || p.tokens_per_cta == 16 || p.tokens_per_cta == 32 || p.tokens_per_cta == 128);
      // The wide tile past 256 rows (32 for weights far larger than L2: the LM head).
      const bool big = s.n * s.k * (s.dtype == DType::kBF16 ? 2 : 1) > (int64_t(128) << 20);
      EXPECT_EQ(p.tokens_per_cta == 128, m > (big ? 32 : 256)) << s.n << " x " << s.k << ", m " << m;
      EXPECT_GE(p.grid_y * p.tokens_per_cta, m);
      EXPECT_LE(p.grid_y, 65535);
      EXPECT_EQ(p.grid_z, p.split ? p.nseg : 1);
      if (p.split) {
        EXPECT_LE(m, 256) << "split partials are bounded by 256 rows";
      }
    }
  }
  // M3's projections at one token: q 64 tiles x 4 segments of 24 stages; k/v/index q 4 tiles x 8
  // segments of 12; the index key 1 tile x 8 segments; the layer's group 360 CTAs.
  const cuda::MmaLinearPlan q = cuda::mma_linear_plan(1, 8192, 6144, DType::kF8E4M3);
  const cuda::MmaLinearPlan kv = cuda::mma_linear_plan(1, 512, 6144, DType::kF8E4M3);
  const cuda::MmaLinearPlan ik = cuda::mma_linear_plan(1, 128, 6144, DType::kF8E4M3);
  EXPECT_EQ(q.nseg, 4);
  EXPECT_EQ(kv.nseg, 8);
  EXPECT_EQ(kv.seg_stages, 12);
  EXPECT_EQ(ik.nseg, 8);
  EXPECT_EQ(q.grid_x * q.grid_z + 3 * kv.grid_x * kv.grid_z + ik.grid_x * ik.grid_z, 360);
  // 129-256 rows: 32-token tiles, K split where the tiles' last wave of 264 CTAs is under 85 % full
  // (o_proj at 192 rows: 48 x 6 = 288 tiles -> 5 segments each), not where it is full (q_proj at
  // 256 rows: 64 x 8 = 512 of 528).
  const cuda::MmaLinearPlan o192 = cuda::mma_linear_plan(192, 6144, 8192, DType::kF8E4M3);
  EXPECT_EQ(o192.tokens_per_cta, 32);
  EXPECT_TRUE(o192.split);
  EXPECT_EQ(o192.grid_z, o192.nseg);
  const cuda::MmaLinearPlan q256 = cuda::mma_linear_plan(256, 8192, 6144, DType::kF8E4M3);
  EXPECT_EQ(q256.tokens_per_cta, 32);
  EXPECT_FALSE(q256.split);
  EXPECT_FALSE(cuda::mma_linear_plan(128, 6144, 8192, DType::kF8E4M3).split);  // 192 tiles: the rule starts past 128 rows
  // The plan names its kernel: narrow up to 256 rows, the wide tile beyond, and with the wgmma
  // entry MXFP8 calls of more than 256 rows on wgmma (128 x 128 tiles, the overlapped form, never
  // split past 256 rows); BF16 never.
  EXPECT_EQ(q256.kernel, cuda::MmaLinearKernel::kNarrow);
  // Weights of >= 4096 outputs take wgmma from 96 rows (not in groups); smaller ones keep the tiles.
  EXPECT_EQ(cuda::mma_linear_plan(256, 8192, 6144, DType::kF8E4M3, true).kernel, cuda::MmaLinearKernel::kWgmma);
  EXPECT_EQ(cuda::mma_linear_plan(96, 6144, 8192, DType::kF8E4M3, true).kernel, cuda::MmaLinearKernel::kWgmma);
  EXPECT_FALSE(cuda::mma_linear_plan(96, 6144, 8192, DType::kF8E4M3, true).split);  // no K split by default
  EXPECT_EQ(cuda::mma_linear_plan(95, 6144, 8192, DType::kF8E4M3, true).kernel, cuda::MmaLinearKernel::kNarrow);
  EXPECT_EQ(cuda::mma_linear_plan(256, 512, 6144, DType::kF8E4M3, true).kernel, cuda::MmaLinearKernel::kNarrow);
  EXPECT_EQ(cuda::mma_linear_plan(256, 8192, 6144, DType::kF8E4M3, true, cuda::mma_group_rule()).kernel,
            cuda::MmaLinearKernel::kNarrow);
  EXPECT_EQ(cuda::mma_linear_plan(257, 8192, 6144, DType::kF8E4M3, true, cuda::mma_group_rule()).kernel,
            cuda::MmaLinearKernel::kWgmma);
  EXPECT_EQ(cuda::mma_linear_plan(257, 8192, 6144, DType::kF8E4M3).kernel, cuda::MmaLinearKernel::kWide);
  EXPECT_EQ(cuda::mma_linear_plan(257, 8192, 6144, DType::kF8E4M3, true).kernel, cuda::MmaLinearKernel::kWgmma);
  EXPECT_FALSE(cuda::mma_linear_plan(257, 512, 6144, DType::kF8E4M3, true).split);
  const cuda::MmaLinearPlan wg = cuda::mma_linear_plan(512, 8192, 6144, DType::kF8E4M3, true);
  EXPECT_EQ(wg.kernel, cuda::MmaLinearKernel::kWgmma);
  EXPECT_EQ(wg.tokens_per_cta, 128);
  EXPECT_EQ(wg.grid_x * wg.grid_y, 64 * 4);
  EXPECT_FALSE(wg.split);
  EXPECT_EQ(wg.nseg, q.nseg);  // the same K segments: the same bits
  EXPECT_EQ(cuda::mma_linear_plan(4096, 8192, 6144, DType::kF8E4M3, false).kernel, cuda::MmaLinearKernel::kWide);
  // BF16 weights (the LM head) take wgmma where the rule allows it, in its overlapped form only.
  cuda::MmaLinearRule bf16;
  bf16.wgmma_bf16 = true;
  EXPECT_EQ(cuda::mma_linear_plan(4096, 8192, 6144, DType::kBF16, true).kernel,
            cuda::MmaLinearRule{}.wgmma_bf16 ? cuda::MmaLinearKernel::kWgmma : cuda::MmaLinearKernel::kWide);
  EXPECT_EQ(cuda::mma_linear_plan(4096, 8192, 6144, DType::kBF16, true, bf16).kernel, cuda::MmaLinearKernel::kWgmma);
  EXPECT_TRUE(cuda::mma_linear_plan(4096, 8192, 6144, DType::kBF16, true, bf16).overlap);
  EXPECT_EQ(cuda::mma_linear_plan(128, 200064, 6144, DType::kBF16, true, bf16).kernel, cuda::MmaLinearKernel::kWgmma);
  // The LM head from 64 rows (BF16's own threshold), not below; MXFP8 wide weights from 96.
  EXPECT_EQ(cuda::mma_linear_plan(64, 200064, 6144, DType::kBF16, true).kernel, cuda::MmaLinearKernel::kWgmma);
  EXPECT_NE(cuda::mma_linear_plan(63, 200064, 6144, DType::kBF16, true).kernel, cuda::MmaLinearKernel::kWgmma);
  EXPECT_NE(cuda::mma_linear_plan(64, 8192, 6144, DType::kF8E4M3, true).kernel, cuda::MmaLinearKernel::kWgmma);
  EXPECT_EQ(cuda::mma_linear_plan(96, 8192, 6144, DType::kF8E4M3, true).kernel, cuda::MmaLinearKernel::kWgmma);
  cuda::MmaLinearRule plain = bf16;
  plain.wgmma_overlap = false;
  EXPECT_EQ(cuda::mma_linear_plan(4096, 8192, 6144, DType::kBF16, true, plain).kernel, cuda::MmaLinearKernel::kWide);
  EXPECT_EQ(cuda::mma_linear_plan(4096, 8192, 6144, DType::kF8E4M3, true, plain).kernel, cuda::MmaLinearKernel::kWgmma);
  // Other rules (linear_bench --variants) move the switches, never the segments.
  cuda::MmaLinearRule low;
  low.wgmma_min_rows = 1;
  low.wgmma_overlap = false;
  const cuda::MmaLinearPlan wg1 = cuda::mma_linear_plan(1, 8192, 6144, DType::kF8E4M3, true, low);
  EXPECT_EQ(wg1.kernel, cuda::MmaLinearKernel::kWgmma);
  EXPECT_EQ(wg1.grid_y, 1);
  EXPECT_EQ(wg1.seg_stages, q.seg_stages);
  EXPECT_FALSE(wg1.split);  // the plain wgmma form never splits
  // The overlapped form splits K where its tiles leave SMs idle (q_proj at 128 rows: 64 tiles x 4
  // segments), not where they fill them (384 rows: 192 tiles) nor past 256 rows.
  cuda::MmaLinearRule ov = low;
  ov.wgmma_overlap = true;
  ov.wgmma_split = true;
  const cuda::MmaLinearPlan q128 = cuda::mma_linear_plan(128, 8192, 6144, DType::kF8E4M3, true, ov);
  EXPECT_EQ(q128.kernel, cuda::MmaLinearKernel::kWgmma);
  EXPECT_TRUE(q128.split);
  EXPECT_EQ(q128.grid_z, q.nseg);
  EXPECT_FALSE(cuda::mma_linear_plan(384, 8192, 6144, DType::kF8E4M3, true, ov).split);  // 192 tiles
  EXPECT_FALSE(cuda::mma_linear_plan(512, 512, 6144, DType::kF8E4M3, true, ov).split);   // past 256 rows
  cuda::MmaLinearRule narrow{int64_t(1) << 62, int64_t(1) << 62, 85};
  narrow.wgmma_wide_min_rows = int64_t(1) << 62;
  EXPECT_EQ(cuda::mma_linear_plan(4096, 8192, 6144, DType::kF8E4M3, true, narrow).tokens_per_cta, 32);
  cuda::MmaLinearRule nosplit = narrow;
  nosplit.split_fill = 0;
  EXPECT_FALSE(cuda::mma_linear_plan(192, 6144, 8192, DType::kF8E4M3, false, nosplit).split);
  cuda::MmaLinearRule wide{int64_t(1) << 62, 0, 0};
  wide.wgmma_wide_min_rows = int64_t(1) << 62;
  EXPECT_EQ(cuda::mma_linear_plan(33, 6144, 8192, DType::kF8E4M3, true, wide).kernel, cuda::MmaLinearKernel::kWide);
  // The split wgmma form's work items: a tile's items cover its K stages once, in order, each
  // one of the plan's segments (the partial the whole-K loop folds), for every shape above.
  for (const auto& [n, k] : std::vector<std::pair<int64_t, int64_t>>{
           {8192, 6144}, {6144, 8192}, {512, 6144}, {128, 6144}, {1000, 1152}, {300, 1024}, {129, 1152}}) {
    const cuda::MmaLinearPlan p = cuda::mma_linear_plan(1, n, k, DType::kF8E4M3);
    const int kst = int(k / 64);
    for (int tile = 0; tile < 3; ++tile) {
      int next = 0;
      for (int seg = 0; seg < p.nseg; ++seg) {
        const cuda::WgStageRange r = cuda::wg_item_stages(tile * p.nseg + seg, p.nseg, p.seg_stages, kst);
        EXPECT_EQ(r.s0, next) << n << " x " << k << " segment " << seg;
        EXPECT_EQ(r.s1 - r.s0, std::min(p.seg_stages, kst - r.s0)) << n << " x " << k << " segment " << seg;
        EXPECT_GT(r.s1, r.s0);
        next = r.s1;
      }
      EXPECT_EQ(next, kst) << n << " x " << k;
    }
    const cuda::WgStageRange whole = cuda::wg_item_stages(5, 1, p.seg_stages, kst);
    EXPECT_EQ(whole.s0, 0);
    EXPECT_EQ(whole.s1, kst);
  }
  // Shapes the entry refuses keep the row-dot.
  EXPECT_NE(cuda::mma_linear_eligible(DType::kF8E4M3, 4096, 1088), "");  // MXFP8 in % 128 != 0
  EXPECT_NE(cuda::mma_linear_eligible(DType::kBF16, 4096, 512), "");     // small layers
  EXPECT_NE(cuda::mma_linear_eligible(DType::kF32, 4096, 4096), "");
}

// The tensor-core entries trace their plan: the kernel, tiles and K split that run a problem.
// The 8- and 16-token tiles' CTAs per SM (no bit depends on it): two up to one wave of two per
// SM, past it the count whose last wave is fuller, three on a tie; forced by the rule.
TEST(MmaLinearPlan, NarrowTilesPickTheirCtasPerSm) {
  EXPECT_EQ(cuda::narrow_ctas_per_sm(256, 0), 2);  // q_proj at one token: spread over the SMs
  EXPECT_EQ(cuda::narrow_ctas_per_sm(264, 0), 2);
  EXPECT_EQ(cuda::narrow_ctas_per_sm(512, 0), 2);  // 512 of 528 slots against 512 of 792
  EXPECT_EQ(cuda::narrow_ctas_per_sm(480, 0), 2);
  EXPECT_EQ(cuda::narrow_ctas_per_sm(720, 0), 3);  // 792 slots either way
  EXPECT_EQ(cuda::narrow_ctas_per_sm(396, 0), 3);  // one wave of three, two of two
  EXPECT_EQ(cuda::narrow_ctas_per_sm(512, 3), 3);
  EXPECT_EQ(cuda::narrow_ctas_per_sm(720, 2), 2);
  // q_proj at 32 rows: two 16-token tiles x 64 x 4 segments = 512 CTAs, two per SM, in the trace.
  const cuda::MmaLinearPlan q32 = cuda::mma_linear_plan(32, 8192, 6144, DType::kF8E4M3);
  EXPECT_EQ(q32.tokens_per_cta, 16);
  EXPECT_EQ(q32.grid_x * q32.grid_y * q32.grid_z, 512);
  EXPECT_EQ(q32.ctas_per_sm, 2);
  EXPECT_NE(cuda::mma_linear_plan_text(q32).find(", 2 CTAs per SM"), std::string::npos);
  cuda::MmaLinearRule three;
  three.narrow_ctas_per_sm = 3;
  EXPECT_EQ(cuda::mma_linear_plan(32, 8192, 6144, DType::kF8E4M3, false, three).ctas_per_sm, 3);
  EXPECT_EQ(cuda::mma_linear_plan(1, 8192, 6144, DType::kF8E4M3).ctas_per_sm, 2);
  // The 32-token and wide tiles fit two at most: left to the kernel.
  EXPECT_EQ(cuda::mma_linear_plan(64, 8192, 6144, DType::kF8E4M3).ctas_per_sm, 0);
  EXPECT_EQ(cuda::mma_linear_plan(512, 8192, 6144, DType::kF8E4M3).ctas_per_sm, 0);
}

TEST(MmaLinearPlan, EntriesTraceTheirPlan) {
  ops::KernelTable table;
  cuda::register_cuda_kernels(table);
  using test::plan_of;
  ops::Problem p;
  p.device = Device::kCuda;
  p.dtype = DType::kF8E4M3;
  p.batch_invariant = true;
  p.op = "linear";
  p.n = 6144, p.k = 8192;
  p.m = 192;
  EXPECT_EQ(plan_of(table.linear.entries(), "linear.mma_hilo_invariant.sm90", p),
            "narrow 32-token tiles x 48 x 6, K in 5 segments of 26 x 64 on separate CTAs");
  p.m = 4096;
  EXPECT_EQ(plan_of(table.linear.entries(), "linear.wgmma_hilo_invariant.sm90", p),
            "wgmma overlapped 128 x 128 tiles x 48 x 32, K in 5 segments of 26 x 64");
  p.op = "dense_mlp";
  p.n = 12288, p.k = 6144, p.m = 1;
  const std::string mlp = plan_of(table.mlp.entries(), "dense_mlp.mma_hilo_invariant_swiglu_oai.sm90", p);
  EXPECT_EQ(mlp.rfind("gate, up: narrow 8-token tiles x 96 x 1", 0), 0u) << mlp;
  EXPECT_NE(mlp.find("; down: narrow 8-token tiles x 48 x 1"), std::string::npos) << mlp;
  p.op = "linear_group";
  p.n = 8192 + 3 * 512 + 128, p.k = 6144, p.m = 1024, p.extra = 5;
  EXPECT_EQ(plan_of(table.linear_group.entries(), "linear_group.wgmma_hilo_invariant.sm90", p),
            "wgmma overlapped 128 x 128 tiles for each of 5 weights (K split per weight as linear)");
}

// A group of weights with a wide one runs as one launch of 32-token tiles up to 191 rows, as
// separate calls (the wide weight on wgmma) at 192-256, and as one wgmma launch from 257.
TEST(MmaLinearPlan, GroupsWithAWideWeightSplitAt192Rows) {
  ops::KernelTable table;
  cuda::register_cuda_kernels(table);
  ops::Problem p;
  p.device = Device::kCuda;
  p.dtype = DType::kF8E4M3;
  p.batch_invariant = true;
  p.op = "linear_group";
  p.n = 8192 + 3 * 512 + 128, p.k = 6144, p.extra = 5;
  const auto name = [&](int64_t m) {
    p.m = m;
    const auto* e = table.linear_group.find(p, nullptr);
    return e ? e->name : std::string("separate");
  };
  EXPECT_EQ(name(128), "linear_group.mma_hilo_invariant.sm90");
  EXPECT_EQ(name(191), "linear_group.mma_hilo_invariant.sm90");
  EXPECT_EQ(name(192), "separate");
  EXPECT_EQ(name(256), "separate");
  EXPECT_EQ(name(257), "linear_group.wgmma_hilo_invariant.sm90");
  // Each weight then takes its own rule: the wide one wgmma, the 512-output ones the tiles.
  ops::Problem w = p;
  w.op = "linear", w.extra = 0, w.m = 224, w.n = 8192;
  EXPECT_EQ(table.linear.find(w, nullptr)->name, "linear.wgmma_hilo_invariant.sm90");
  w.n = 512;
  EXPECT_EQ(table.linear.find(w, nullptr)->name, "linear.mma_hilo_invariant.sm90");
  // A group of small weights keeps its launch.
  p.n = 3 * 512 + 128;
  EXPECT_EQ(name(224), "linear_group.mma_hilo_invariant.sm90");
  // BF16 groups are not affected (no wgmma form).
  p.dtype = DType::kBF16, p.n = 8192 + 3 * 512 + 128;
  EXPECT_EQ(name(224), "linear_group.mma_hilo_invariant.sm90");
}

}  // namespace
}  // namespace m3
