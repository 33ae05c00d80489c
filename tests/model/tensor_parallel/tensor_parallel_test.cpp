// The model split over tensor-parallel ranks (threads of one process, in-process all_reduce) on
// the CPU, against the whole model: the same greedy continuation, logits within fp32 rounding of
// the reordered sums, every rank holding the same logits bit for bit, and batch invariance kept
// (a chunked prefill gives the one-chunk logits bit for bit at TP 2).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <thread>

#include "backend/cpu/cpu_backend.h"
#include "dist/in_process_group.h"
#include "exec/sequence_runner.h"
#include "model/minimax_m3/model.h"

namespace m3 {
namespace {

std::string model_path(const std::string& name) {
  const char* src = std::getenv("M3_SOURCE_DIR");
  return std::string(src ? src : M3_SOURCE_DIR_DEFAULT) + "/models/" + name;
}

std::vector<int32_t> prompt_of(int len, uint32_t seed, int64_t vocab) {
  std::vector<int32_t> p;
  uint32_t x = seed;
  for (int i = 0; i < len; ++i) {
    x = x * 1664525u + 1013904223u;
    p.push_back(int32_t((x >> 8) % uint32_t(vocab)));
  }
  return p;
}

struct RankResult {
  std::vector<int32_t> tokens;             // greedy continuation
  std::vector<std::vector<float>> logits;  // the logits each greedy token came from
  std::vector<float> chunked_last;         // prefill in chunks: the last position's logits
  size_t weight_bytes = 0;                 // the rank's share
  std::string error;
};

// Each rank loads its share and runs: prompt, then `steps` greedy tokens; with `chunk` > 0 a second
// sequence prefills the same prompt in chunks of `chunk` tokens.
std::vector<RankResult> run(const std::string& model_dir, int tp, const std::vector<int32_t>& prompt, int steps,
                            int chunk) {
  dist::InProcessGroup group(tp);
  std::vector<RankResult> out(static_cast<size_t>(tp));
  std::vector<std::thread> threads;
  for (int r = 0; r < tp; ++r) {
    threads.emplace_back([&, r] {
      RankResult& res = out[size_t(r)];
      LoadOptions lo;
      lo.tp_size = tp;
      lo.tp_rank = r;
      auto dir = ModelDir::open(model_dir);
      if (!dir) {
        res.error = dir.error();
        return;
      }
      auto model = MiniMaxM3Model::load(**dir, {}, lo);
      if (!model) {
        res.error = model.error();  // every rank fails the same way before any collective
        return;
      }
      res.weight_bytes = (*model)->weight_bytes();
      ops::KernelTable table;
      cpu::register_cpu_kernels(table);
      auto comm = group.communicator(r);
      ops::DispatchStats stats;
      const ops::OpContext ctx{&table, &stats, Device::kCpu, true, comm.get()};
      SequenceRunner seq(**model, ctx, int64_t(prompt.size()) + steps + 1);
      std::vector<float> logits = seq.extend(prompt, false);
      for (int i = 0; i < steps; ++i) {
        const int32_t tok = int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
        res.tokens.push_back(tok);
        res.logits.push_back(logits);
        logits = seq.extend({tok}, false);
      }
      if (chunk > 0) {
        SequenceRunner chunked(**model, ctx, int64_t(prompt.size()));
        for (size_t b = 0; b < prompt.size(); b += size_t(chunk)) {
          const size_t e = std::min(prompt.size(), b + size_t(chunk));
          res.chunked_last = chunked.extend(std::vector<int32_t>(prompt.begin() + long(b), prompt.begin() + long(e)), false);
        }
      }
      // The trace shows the collectives ran: two all-reduces per layer, the vocab-parallel LM head's gather.
      bool reduced = tp == 1, gathered = tp == 1;
      for (const auto& [key, count] : stats.entry_counts()) {
        reduced = reduced || (key.first == "all_reduce" && key.second == "all_reduce.in_process.cpu" && count > 0);
        gathered = gathered || (key.first == "all_gather" && key.second == "all_gather.in_process.cpu" && count > 0);
      }
      if (!reduced || !gathered) res.error = "no all_reduce / all_gather in the dispatch trace";
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, double(std::fabs(a[i] - b[i])));
  return m;
}

class TensorParallel : public ::testing::TestWithParam<std::string> {};

TEST_P(TensorParallel, MatchesTheWholeModel) {
  const std::string dir = model_path(GetParam());
  if (!std::filesystem::exists(dir + "/config.json")) GTEST_SKIP() << "no " << dir;
  const auto prompt = prompt_of(150, 7, 6144);  // past the 4 x 32-token selection: sparse
  const int steps = 8;
  const auto whole = run(dir, 1, prompt, steps, 0);
  ASSERT_TRUE(whole[0].error.empty()) << whole[0].error;
  for (int tp : {2, 4}) {
    const auto ranks = run(dir, tp, prompt, steps, tp == 2 ? 64 : 0);
    for (int r = 0; r < tp; ++r) {
      const RankResult& res = ranks[size_t(r)];
      ASSERT_TRUE(res.error.empty()) << "tp " << tp << " rank " << r << ": " << res.error;
      EXPECT_EQ(res.tokens, whole[0].tokens) << "tp " << tp << " rank " << r;
      ASSERT_EQ(res.logits.size(), whole[0].logits.size());
      for (size_t i = 0; i < res.logits.size(); ++i) {
        // Same bits on every rank (so every rank samples the same token).
        EXPECT_TRUE(res.logits[i] == ranks[0].logits[i]) << "tp " << tp << " rank " << r << " step " << i;
        // Against the whole model: the row-parallel sums are reordered, nothing else changes.
        EXPECT_LT(max_abs_diff(res.logits[i], whole[0].logits[i]), 2e-3) << "tp " << tp << " step " << i;
      }
    }
    // Every weight but the norms, the router and the index-key projection is split, the
    // embedding and LM head included.
    for (int r = 0; r < tp; ++r)
      EXPECT_LT(double(ranks[size_t(r)].weight_bytes), 1.1 * double(whole[0].weight_bytes) / tp) << "tp " << tp;
    if (tp == 2) {
      // Batch invariance survives: the prompt in chunks of 64 ends with the one-chunk logits.
      ASSERT_EQ(ranks[0].chunked_last.size(), ranks[0].logits[0].size());
      EXPECT_TRUE(ranks[0].chunked_last == ranks[0].logits[0]) << "chunked prefill differs at tp 2";
    }
    std::printf("%s tp %d: greedy tokens equal, max |logit - whole| %.2e\n", GetParam().c_str(), tp,
                max_abs_diff(ranks[0].logits.back(), whole[0].logits.back()));
  }
}

// A shape that does not divide is refused by name when the weights load.
TEST(TensorParallelLoad, RefusesASizeThatDoesNotDivide) {
  const std::string dir = model_path("m3-small");
  if (!std::filesystem::exists(dir + "/config.json")) GTEST_SKIP() << "no " << dir;
  LoadOptions lo;
  lo.tp_size = 3;
  lo.tp_rank = 0;
  auto d = ModelDir::open(dir);
  ASSERT_TRUE(d.is_ok());
  auto model = MiniMaxM3Model::load(**d, {}, lo);
  ASSERT_FALSE(model.is_ok());
  EXPECT_NE(model.error().find("num_attention_heads 8 does not divide"), std::string::npos) << model.error();
}

INSTANTIATE_TEST_SUITE_P(Small, TensorParallel, ::testing::Values("m3-small", "m3-small-mxfp8"),
                         [](const auto& info) { return info.param == "m3-small" ? std::string("bf16") : std::string("mxfp8"); });

}  // namespace
}  // namespace m3
