// The engine with tensor_parallel_size 2 (CPU ranks as threads) on a fresh tiny checkpoint: the
// same greedy tokens as one rank over a batch with chunked prefill, each prompt alone giving its
// batched logprobs bit for bit, a KV pool small enough to preempt, prefix-cache hits, the host
// KV tier and speculative decoding all leaving the output unchanged.
#include <gtest/gtest.h>

#include <cmath>
#include <map>

#include "m3serve/engine.h"
#include "../../support/tiny_model/tiny_model.h"

namespace m3 {
namespace {

const std::string& tiny_dir() {
  static const std::string dir = test::make_tiny_model("tp_engine_tiny", 31);
  return dir;
}

struct Knobs {
  int tp = 1;
  int32_t blocks = 256;
  int64_t offload_bytes = 0;
  int spec = 0;
  int prompt_logprobs = -1;
};

struct EngineRun {
  std::vector<std::vector<TokenOutput>> out;
  int64_t preemptions = 0, cached_tokens = 0, host_loaded_blocks = 0, accepted = 0;
  std::vector<PromptLogprob> prompt_logprobs;  // in arrival order
  std::string error;
};

EngineRun run(const Knobs& k, const std::vector<std::vector<int32_t>>& prompts, bool serial = false) {
  EngineConfig cfg;
  cfg.model_dir = tiny_dir();
  cfg.device = "cpu";
  cfg.tensor_parallel_size = k.tp;
  cfg.max_num_batched_tokens = 64;
  cfg.max_num_seqs = 8;
  cfg.num_kv_blocks = k.blocks;
  cfg.kv_offload_bytes = k.offload_bytes;
  cfg.check_invariants = true;
  if (k.spec > 0) {
    cfg.speculative_method = "ngram";
    cfg.ngram.num_speculative_tokens = k.spec;
    cfg.ngram.prompt_lookup_min = 1;
  }
  EngineRun r;
  auto engine = Engine::create(cfg);
  if (!engine) {
    r.error = engine.error();
    return r;
  }
  EXPECT_EQ((*engine)->model().tensor_parallel_size, k.tp);
  SamplingParams sp;
  sp.temperature = 0.0f;
  sp.max_tokens = 16;
  sp.ignore_eos = true;
  sp.logprobs = 1;
  sp.prompt_logprobs = k.prompt_logprobs;
  r.out.resize(prompts.size());
  std::map<RequestId, size_t> index;
  auto drain = [&] {
    while ((*engine)->has_unfinished_requests()) {
      EngineStepStats st;
      for (auto& ev : (*engine)->step(&st)) {
        for (auto& t : ev.new_tokens) r.out[index[ev.request_id]].push_back(t);
        for (auto& lp : ev.prompt_logprobs) r.prompt_logprobs.push_back(lp);
        if (ev.finished) r.cached_tokens += ev.num_cached_prompt_tokens;
      }
      r.preemptions += st.scheduler.num_preemptions;
      r.host_loaded_blocks += st.scheduler.kv_loaded_blocks;
      r.accepted += st.spec_num_accepted_tokens;
    }
  };
  for (size_t i = 0; i < prompts.size(); ++i) {
    auto id = (*engine)->submit({prompts[i], sp});
    EXPECT_TRUE(id.is_ok()) << id.error();
    index[*id] = i;
    if (serial) drain();
  }
  drain();
  return r;
}

std::vector<std::vector<int32_t>> prompts() {
  std::vector<std::vector<int32_t>> p;
  for (int i = 0; i < 6; ++i) p.push_back(test::random_prompt(9 + 37 * i, 100 + i));
  p.push_back(p[4]);  // a repeat: a prefix-cache hit
  // One that repeats itself: prompt lookup finds drafts.
  std::vector<int32_t> phrase = test::random_prompt(7, 5), rep;
  for (int i = 0; i < 8; ++i) rep.insert(rep.end(), phrase.begin(), phrase.end());
  p.push_back(rep);
  return p;
}

void expect_same(const EngineRun& a, const EngineRun& b, bool same_bits, const std::string& what) {
  ASSERT_TRUE(a.error.empty() && b.error.empty()) << a.error << b.error;
  ASSERT_EQ(a.out.size(), b.out.size());
  for (size_t i = 0; i < a.out.size(); ++i) {
    ASSERT_EQ(a.out[i].size(), b.out[i].size()) << what << " prompt " << i;
    for (size_t t = 0; t < a.out[i].size(); ++t) {
      EXPECT_EQ(a.out[i][t].token, b.out[i][t].token) << what << " prompt " << i << " token " << t;
      if (same_bits) EXPECT_EQ(a.out[i][t].logprob, b.out[i][t].logprob) << what << " prompt " << i << " token " << t;
      else EXPECT_NEAR(a.out[i][t].logprob, b.out[i][t].logprob, 1e-3) << what << " prompt " << i << " token " << t;
    }
  }
}

TEST(TensorParallelEngine, TwoRanksMatchOneAndKeepEveryInvariance) {
  const auto p = prompts();
  const EngineRun one = run({1}, p), two = run({2}, p);
  expect_same(one, two, false, "tp 2 vs tp 1");
  EXPECT_GT(two.cached_tokens, 0) << "the repeated prompt should hit the prefix cache";
  // Batch invariance at TP 2: one request at a time gives the batched logprobs bit for bit.
  expect_same(two, run({2}, p, /*serial=*/true), true, "tp 2 serial vs batched");
  // A pool too small for the batch preempts and recomputes: the same bits.
  const EngineRun tight = run({2, 14}, p);
  EXPECT_GT(tight.preemptions, 0);
  expect_same(two, tight, true, "tp 2 preempting");
  // Host KV tier: evicted blocks come back on a hit through every rank's copies.
  const EngineRun offload = run({2, 14, int64_t(64) << 20}, p, /*serial=*/true);
  expect_same(two, offload, true, "tp 2 with the host KV tier");
  EXPECT_GT(offload.host_loaded_blocks, 0) << "no block came back from the host tier";
  // Speculative decoding verifies drafts through the same ranks: plain decoding's tokens.
  const EngineRun spec = run({2, 256, 0, 3}, p);
  expect_same(two, spec, true, "tp 2 with ngram drafts");
  EXPECT_GT(spec.accepted, 0) << "no draft token was accepted";
}

// Prompt logprobs go through the LM head again on every rank (its vocabulary is split).
TEST(TensorParallelEngine, PromptLogprobs) {
  const std::vector<std::vector<int32_t>> p = {test::random_prompt(70, 3)};
  Knobs one{1}, two{2};
  one.prompt_logprobs = two.prompt_logprobs = 2;
  const EngineRun a = run(one, p), b = run(two, p);
  ASSERT_TRUE(a.error.empty() && b.error.empty()) << a.error << b.error;
  ASSERT_EQ(a.prompt_logprobs.size(), 69u);
  ASSERT_EQ(b.prompt_logprobs.size(), a.prompt_logprobs.size());
  for (size_t i = 0; i < a.prompt_logprobs.size(); ++i) {
    EXPECT_EQ(a.prompt_logprobs[i].position, b.prompt_logprobs[i].position);
    EXPECT_NEAR(a.prompt_logprobs[i].logprob, b.prompt_logprobs[i].logprob, 1e-3) << "position " << i + 1;
  }
  expect_same(a, b, false, "tp 2 with prompt logprobs");
}

TEST(TensorParallelEngine, RefusesSizesThatDoNotFitTheModel) {
  EngineRun r = run({3}, {{5, 6, 7}});
  EXPECT_NE(r.error.find("num_attention_heads 4 does not divide for tensor parallel size 3"), std::string::npos) << r.error;
  r = run({0}, {{5}});
  EXPECT_NE(r.error.find("tensor_parallel_size must be in [1, 64]"), std::string::npos) << r.error;
}

}  // namespace
}  // namespace m3
