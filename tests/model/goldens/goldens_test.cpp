// Parity of the CPU reference with the HF transformers oracle (tools/hf_oracle.py) on
// make-model checkpoints regenerated here from the committed seed, or on a committed model
// directory (metadata m3_model_dir): logits, MSA selections per (layer, position, KV group),
// routed experts, and a greedy continuation.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "backend/cpu/cpu_backend.h"
#include "exec/sequence_runner.h"
#include "loader/safetensors.h"
#include "model/minimax_m3/make_model.h"
#include "golden_fixture.h"

namespace m3 {
namespace {

namespace fs = std::filesystem;
using testing::env_or;
using testing::tensor_values;

class Goldens : public ::testing::TestWithParam<std::string> {};

TEST_P(Goldens, MatchHfReference) {
  testing::GoldenFixture fx;
  ASSERT_TRUE(testing::open_golden(GetParam(), "goldens", fx));
  auto& golden = fx.golden;
  const fs::path model_dir = fx.model_dir;
  auto model = MiniMaxM3Model::load(model_dir.string());
  ASSERT_TRUE(model.is_ok()) << model.error();
  const auto& c = (*model)->config();

  ops::KernelTable table;
  cpu::register_cpu_kernels(table);
  ops::DispatchStats stats;
  ops::OpContext ctx{&table, &stats, Device::kCpu};
  nlohmann::json report;
  testing::GoldenPrompt g;
  for (int p = 0; testing::read_prompt(*golden, p, g); ++p) {
    const auto& want_greedy = g.greedy;
    const int64_t T = int64_t(g.ids.size()), V = c.vocab_size;
    SequenceRunner runner(**model, ctx, T + int64_t(want_greedy.size()) + 1);
    ForwardTrace trace;
    auto logits = runner.extend(g.ids, true, &trace);
    ASSERT_EQ(logits.size(), size_t(T * V));
    const testing::LogitsDiff d = testing::compare_logits(logits, g, V);
    const double cosine = d.cosine, max_abs = d.max_abs;
    const int argmax_mismatch = d.argmax_mismatch;
    EXPECT_GE(cosine, 0.99999) << GetParam() << " prompt " << p;
    EXPECT_EQ(argmax_mismatch, 0) << GetParam() << " prompt " << p;
    const int64_t sel_mismatch = testing::selection_mismatches(trace, g, c.num_key_value_heads, c.index_topk_blocks);
    EXPECT_EQ(sel_mismatch, 0) << GetParam() << " prompt " << p;
    const int64_t exp_mismatch = testing::expert_mismatches(trace, g, c.num_experts_per_tok);
    EXPECT_EQ(exp_mismatch, 0) << GetParam() << " prompt " << p;

    // Greedy continuation through incremental decode (prefill logits' last row first).
    std::vector<int32_t> greedy;
    std::vector<float> last(logits.end() - V, logits.end());
    for (size_t n = 0; n < want_greedy.size(); ++n) {
      int32_t tok = int32_t(std::max_element(last.begin(), last.end()) - last.begin());
      greedy.push_back(tok);
      if (n + 1 < want_greedy.size()) last = runner.extend({tok}, false);
    }
    EXPECT_EQ(greedy, want_greedy) << GetParam() << " prompt " << p;
    report[GetParam()].push_back({{"prompt", p}, {"tokens", T}, {"cosine", cosine}, {"max_abs", max_abs},
                                  {"argmax_mismatch", argmax_mismatch}, {"selection_mismatch", sel_mismatch},
                                  {"expert_mismatch", exp_mismatch},
                                  {"greedy_equal", greedy == want_greedy}});
    std::printf("%s prompt %d (%lld tokens): cosine %.9f max_abs %.3e argmax mismatches %d, selection mismatches %lld, "
                "expert mismatches %lld, greedy %s\n",
                GetParam().c_str(), p, (long long)T, cosine, max_abs, argmax_mismatch, (long long)sel_mismatch,
                (long long)exp_mismatch, greedy == want_greedy ? "equal" : "DIFFERENT");
  }
  std::ofstream(fs::path(env_or("M3_BINARY_DIR", "/tmp")) / ("golden_report_" + GetParam() + ".json")) << report.dump(2);
}

INSTANTIATE_TEST_SUITE_P(Tiny, Goldens, ::testing::Values("tiny_bf16", "tiny_mxfp8"));
// The committed trained model (models/m3-small, tools/train_small_model.py) on held-out text.
INSTANTIATE_TEST_SUITE_P(Small, Goldens, ::testing::Values("m3_small_bf16", "m3_small_mxfp8"));

}  // namespace
}  // namespace m3
