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
  for (int p = 0;; ++p) {
    const std::string pre = "prompt." + std::to_string(p) + ".";
    if (!golden->find(pre + "input_ids")) break;
    auto ids = tensor_values<int32_t>(*golden, pre + "input_ids");
    auto want_logits = tensor_values<float>(*golden, pre + "logits");
    auto want_sel = tensor_values<int32_t>(*golden, pre + "selected_blocks");
    auto want_exp = tensor_values<int32_t>(*golden, pre + "expert_ids");
    auto want_greedy = tensor_values<int32_t>(*golden, pre + "greedy");
    const int64_t T = int64_t(ids.size()), V = c.vocab_size;

    // Large goldens keep the logits of some positions only (prompt.i.logit_positions, ascending).
    std::vector<int32_t> rows;
    if (golden->find(pre + "logit_positions")) {
      rows = tensor_values<int32_t>(*golden, pre + "logit_positions");
    } else {
      for (int64_t t = 0; t < T; ++t) rows.push_back(int32_t(t));
    }

    SequenceRunner runner(**model, ctx, T + int64_t(want_greedy.size()) + 1);
    ForwardTrace trace;
    auto logits = runner.extend(ids, true, &trace);
    ASSERT_EQ(logits.size(), size_t(T * V));
    ASSERT_EQ(want_logits.size(), rows.size() * size_t(V));
    double dot = 0, na = 0, nb = 0, max_abs = 0;
    int argmax_mismatch = 0;
    for (size_t r = 0; r < rows.size(); ++r) {
      ASSERT_TRUE(rows[r] >= 0 && rows[r] < T) << "logit position out of range";
      const float* a = logits.data() + int64_t(rows[r]) * V;
      const float* b = want_logits.data() + int64_t(r) * V;
      for (int64_t i = 0; i < V; ++i) {
        dot += double(a[i]) * b[i];
        na += double(a[i]) * a[i];
        nb += double(b[i]) * b[i];
        max_abs = std::max(max_abs, double(std::fabs(a[i] - b[i])));
      }
      argmax_mismatch += (std::max_element(a, a + V) - a) != (std::max_element(b, b + V) - b);
    }
    const double cosine = dot / std::sqrt(na * nb);
    EXPECT_GE(cosine, 0.99999) << GetParam() << " prompt " << p;
    EXPECT_EQ(argmax_mismatch, 0) << GetParam() << " prompt " << p;

    // Selected blocks: ours [G, T, K] per sparse layer (ascending, -1 padded); golden [Ls, T, G, K].
    const int G = c.num_key_value_heads, K = c.index_topk_blocks;
    ASSERT_EQ(int64_t(want_sel.size()), int64_t(trace.selected_blocks.size()) * T * G * K);
    int64_t sel_mismatch = 0;
    for (size_t l = 0; l < trace.selected_blocks.size(); ++l)
      for (int64_t t = 0; t < T; ++t)
        for (int g = 0; g < G; ++g)
          for (int k = 0; k < K; ++k)
            sel_mismatch += trace.selected_blocks[l][size_t((g * T + t) * K + k)] !=
                            want_sel[size_t(((int64_t(l) * T + t) * G + g) * K + k)];
    EXPECT_EQ(sel_mismatch, 0) << GetParam() << " prompt " << p;

    // Experts: ours in choice order per token; golden sorted ascending.
    const int E = c.num_experts_per_tok;
    ASSERT_EQ(int64_t(want_exp.size()), int64_t(trace.expert_ids.size()) * T * E);
    int64_t exp_mismatch = 0;
    for (size_t l = 0; l < trace.expert_ids.size(); ++l)
      for (int64_t t = 0; t < T; ++t) {
        std::vector<int32_t> got(trace.expert_ids[l].begin() + t * E, trace.expert_ids[l].begin() + (t + 1) * E);
        std::sort(got.begin(), got.end());
        for (int e = 0; e < E; ++e) exp_mismatch += got[size_t(e)] != want_exp[size_t((int64_t(l) * T + t) * E + e)];
      }
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
