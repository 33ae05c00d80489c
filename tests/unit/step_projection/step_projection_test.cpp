// The projection of a measured m3-layers:N decode step to M3's layer list: each kind's mean
// layer time times the number of M3 layers of that kind, the head and embedding once, the graph
// step scaled like the eager one; a kind M3 has and the checkpoint lacks refuses to project.
#include <gtest/gtest.h>

#include "step_projection.h"

namespace m3 {
namespace {

TEST(StepProjection, CountsM3sLayersByKind) {
  const MiniMaxM3Config m3 = *MiniMaxM3Config::preset("m3");
  const MiniMaxM3Config small = *MiniMaxM3Config::preset("m3-layers:5");  // 3 dense + 2 MSA/MoE
  ASSERT_EQ(bench::layer_kind(small, 0), "dense+mlp");
  ASSERT_EQ(bench::layer_kind(small, 4), "msa+moe");
  // Dense layers 1.0, 1.2, 0.8 ms (mean 1.0); MoE layers 2.0 and 3.0 (mean 2.5); embed 0.1, head 0.9.
  const std::vector<double> layer_ms = {1.0, 1.2, 0.8, 2.0, 3.0};
  const double eager = 0.1 + 0.9 + 8.0;
  const bench::StepProjection p = bench::project_step(m3, small, layer_ms, 0.1, 0.9, /*graph_ms=*/6.0);
  ASSERT_TRUE(p.ok) << p.missing;
  EXPECT_EQ(p.layers, 60);
  EXPECT_DOUBLE_EQ(p.eager_ms, 0.1 + 0.9 + 3 * 1.0 + 57 * 2.5);
  EXPECT_DOUBLE_EQ(p.graph_ms, 6.0 * p.eager_ms / eager);
}

TEST(StepProjection, NeedsEveryKindMeasured) {
  const MiniMaxM3Config m3 = *MiniMaxM3Config::preset("m3");
  const MiniMaxM3Config one = *MiniMaxM3Config::preset("m3-layers:1");  // one MSA/MoE layer, no dense one
  const bench::StepProjection p = bench::project_step(m3, one, {2.0}, 0.1, 0.9, 3.0);
  EXPECT_FALSE(p.ok);
  EXPECT_EQ(p.missing, "dense+mlp");
}

}  // namespace
}  // namespace m3
