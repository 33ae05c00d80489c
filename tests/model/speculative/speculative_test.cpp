// Speculative decoding (ngram drafts) through the engine on the tiny random checkpoint: the
// tokens, their logprobs and seeded samples are those of decoding without drafts, while steps
// verify several drafts and accept some; the counters add up.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <map>
#include <random>

#include "m3serve/engine.h"
#include "model/minimax_m3/make_model.h"
#include "../../support/tiny_model/tiny_model.h"

namespace m3 {
namespace {

const std::string& tiny_dir() {
  static const std::string dir = test::make_tiny_model("speculative_test_tiny", 11);
  return dir;
}

// Prompts that repeat themselves (a phrase said twice, a list), so lookups find matches.
std::vector<int32_t> prompt(int len, int seed) {
  std::mt19937 rng{uint32_t(seed)};
  std::vector<int32_t> phrase;
  for (int i = 0; i < 6 + seed % 5; ++i) phrase.push_back(3 + int32_t(rng() % 300));
  std::vector<int32_t> p;
  while (int(p.size()) < len) {
    p.insert(p.end(), phrase.begin(), phrase.end());
    p.push_back(3 + int32_t(rng() % 300));
  }
  p.resize(size_t(len));
  return p;
}

struct RunResult {
  std::map<RequestId, std::vector<TokenOutput>> tokens;
  int64_t steps = 0, drafts = 0, draft_tokens = 0, accepted = 0, decode_tokens = 0;
  int64_t drafts_above_2 = 0;  // drafts verified in steps with more than 2 requests running
  std::vector<int64_t> per_pos;
};

RunResult run_engine(const std::vector<std::vector<int32_t>>& prompts, const std::vector<SamplingParams>& params, int k,
                     bool full_drafts = false, int disable_by_batch_size = 0) {
  EngineConfig cfg;
  cfg.model_dir = tiny_dir();
  cfg.max_num_batched_tokens = 64;
  cfg.max_num_seqs = 8;
  cfg.num_kv_blocks = 256;
  cfg.check_invariants = true;
  if (k > 0) {
    cfg.speculative_method = "ngram";
    cfg.ngram.num_speculative_tokens = k;
    cfg.ngram.prompt_lookup_min = 1;
    cfg.ngram.prompt_lookup_max = 3;
    cfg.spec_cuda_graphs = full_drafts;
    cfg.ngram.disable_by_batch_size = disable_by_batch_size;
  }
  auto engine = Engine::create(cfg);
  EXPECT_TRUE(engine.is_ok()) << engine.error();
  RunResult r;
  if (!engine) return r;
  for (size_t i = 0; i < prompts.size(); ++i) {
    auto id = (*engine)->submit({prompts[i], params[i % params.size()]});
    EXPECT_TRUE(id.is_ok()) << id.error();
  }
  while ((*engine)->has_unfinished_requests() && r.steps < 10000) {
    EngineStepStats st;
    for (auto& ev : (*engine)->step(&st))
      for (auto& t : ev.new_tokens) r.tokens[ev.request_id].push_back(t);
    ++r.steps;
    r.drafts += st.spec_num_drafts;
    if (st.scheduler.num_running > 2) r.drafts_above_2 += st.spec_num_drafts;
    r.draft_tokens += st.spec_num_draft_tokens;
    r.accepted += st.spec_num_accepted_tokens;
    r.decode_tokens += st.scheduler.num_decode_tokens;
    EXPECT_EQ(st.scheduler.num_spec_tokens, st.spec_num_draft_tokens);
    EXPECT_LE(st.spec_num_accepted_tokens, st.spec_num_draft_tokens);
    if (r.per_pos.size() < st.spec_accepted_per_pos.size()) r.per_pos.resize(st.spec_accepted_per_pos.size());
    for (size_t p = 0; p < st.spec_accepted_per_pos.size(); ++p) r.per_pos[p] += st.spec_accepted_per_pos[p];
  }
  EXPECT_FALSE((*engine)->has_unfinished_requests());
  return r;
}

std::vector<std::vector<int32_t>> prompts(int n) {
  std::vector<std::vector<int32_t>> p;
  for (int i = 0; i < n; ++i) p.push_back(prompt(20 + 13 * i, i));
  return p;
}

void expect_same_tokens(const RunResult& a, const RunResult& b, bool logprobs) {
  ASSERT_EQ(a.tokens.size(), b.tokens.size());
  for (const auto& [id, toks] : a.tokens) {
    const auto& other = b.tokens.at(id);
    ASSERT_EQ(toks.size(), other.size()) << "request " << id;
    for (size_t t = 0; t < toks.size(); ++t) {
      EXPECT_EQ(toks[t].token, other[t].token) << "request " << id << " token " << t;
      if (!logprobs) continue;
      EXPECT_EQ(toks[t].logprob, other[t].logprob) << "request " << id << " token " << t;
      ASSERT_EQ(toks[t].top_logprobs.size(), other[t].top_logprobs.size());
      for (size_t j = 0; j < toks[t].top_logprobs.size(); ++j)
        EXPECT_EQ(toks[t].top_logprobs[j].token, other[t].top_logprobs[j].token);
    }
  }
}

SamplingParams greedy(int max_tokens, int logprobs) {
  SamplingParams s;
  s.temperature = 0.0f;
  s.max_tokens = max_tokens;
  s.ignore_eos = true;
  s.logprobs = logprobs;
  return s;
}

TEST(Speculative, GreedyTokensAndLogprobsEqualPlainDecoding) {
  const SamplingParams s = greedy(40, 3);
  const auto p = prompts(6);
  const RunResult plain = run_engine(p, {s}, 0), spec = run_engine(p, {s}, 4);
  expect_same_tokens(plain, spec, /*logprobs=*/true);
  EXPECT_EQ(plain.drafts, 0);
  EXPECT_GT(spec.drafts, 20);
  EXPECT_GT(spec.accepted, 20) << spec.draft_tokens << " drafted";
  EXPECT_LT(spec.steps, plain.steps);
  // Every decode token is one fed back, a draft, or ... : per request and step, 1 + drafts.
  int64_t sum = 0;
  for (int64_t v : spec.per_pos) sum += v;
  EXPECT_EQ(sum, spec.accepted);
  ASSERT_FALSE(spec.per_pos.empty());
  for (size_t i = 1; i < spec.per_pos.size(); ++i) EXPECT_LE(spec.per_pos[i], spec.per_pos[i - 1]);
  std::printf("greedy: %lld steps plain, %lld with drafts; %lld drafts, %lld draft tokens, %lld accepted\n",
              static_cast<long long>(plain.steps), static_cast<long long>(spec.steps),
              static_cast<long long>(spec.drafts), static_cast<long long>(spec.draft_tokens),
              static_cast<long long>(spec.accepted));
}

// Seeded sampling through the host sampler (penalties, top-k, min_tokens): sampling stops at the
// first disagreement, so each request's generator advances as without drafts.
TEST(Speculative, SeededSamplingWithPenaltiesEqualsPlainDecoding) {
  std::vector<SamplingParams> params;
  for (int i = 0; i < 3; ++i) {
    SamplingParams s;
    s.temperature = 0.6f + 0.2f * float(i);
    s.top_k = i == 1 ? 20 : 0;
    s.repetition_penalty = i == 2 ? 1.1f : 1.0f;
    s.frequency_penalty = i == 0 ? 0.2f : 0.0f;
    s.min_tokens = i == 1 ? 10 : 0;
    s.seed = 1000 + i;
    s.max_tokens = 32;
    s.logprobs = i == 0 ? 2 : -1;
    params.push_back(s);
  }
  const auto p = prompts(6);
  const RunResult plain = run_engine(p, params, 0), spec = run_engine(p, params, 3);
  expect_same_tokens(plain, spec, /*logprobs=*/true);
  EXPECT_GT(spec.draft_tokens, 0);
}

// The graph-replay mode's full-length drafts (short ones filled with their last token): every
// verification step has the same shape, the output is still plain decoding's.
TEST(Speculative, FullLengthDraftsKeepTheOutput) {
  const SamplingParams s = greedy(24, 1);
  const auto p = prompts(4);
  const RunResult plain = run_engine(p, {s}, 0), full = run_engine(p, {s}, 3, /*full_drafts=*/true);
  expect_same_tokens(plain, full, /*logprobs=*/true);
  // Every verification is full length except where max_tokens leaves less room (drafts of 2 and
  // 1 at the end of each request: 3 tokens short per request at most).
  EXPECT_GE(full.draft_tokens, 3 * full.drafts - 4 * 3);
  EXPECT_GT(full.drafts, 4 * 10);
}

// disable_by_batch_size: no drafts while more requests are live; requests finishing at different
// lengths bring the batch under the cap, and drafting resumes for the rest.
TEST(Speculative, NoDraftsAboveTheBatchSizeCap) {
  std::vector<SamplingParams> params;
  for (int i = 0; i < 6; ++i) params.push_back(greedy(8 + 8 * i, -1));
  const auto p = prompts(6);
  const RunResult plain = run_engine(p, params, 0), all = run_engine(p, params, 3),
                  capped = run_engine(p, params, 3, false, /*disable_by_batch_size=*/2);
  expect_same_tokens(plain, capped, /*logprobs=*/false);
  EXPECT_GT(all.drafts_above_2, 0);
  EXPECT_EQ(capped.drafts_above_2, 0);
  EXPECT_GT(capped.drafts, 0);
  EXPECT_LT(capped.drafts, all.drafts);
}

TEST(Speculative, ConfigErrorsNameTheProblem) {
  EngineConfig cfg;
  cfg.model_dir = tiny_dir();
  cfg.num_kv_blocks = 16;
  cfg.speculative_method = "eagle3";
  auto e = Engine::create(cfg);
  ASSERT_FALSE(e.is_ok());
  EXPECT_NE(e.error().find("draft model"), std::string::npos) << e.error();
  cfg.speculative_method = "ngram";
  cfg.ngram.num_speculative_tokens = 3;
  cfg.ngram.prompt_lookup_min = 4;
  cfg.ngram.prompt_lookup_max = 2;
  e = Engine::create(cfg);
  ASSERT_FALSE(e.is_ok());
  EXPECT_NE(e.error().find("prompt_lookup_max"), std::string::npos) << e.error();
  cfg.ngram.prompt_lookup_max = 5;
  cfg.ngram.num_speculative_tokens = 16;  // 1 + 16 tokens exceed the tiny model's 16-token page
  cfg.spec_cuda_graphs = true;
  e = Engine::create(cfg);
  ASSERT_FALSE(e.is_ok());
  EXPECT_NE(e.error().find("spec_cuda_graphs"), std::string::npos) << e.error();
  cfg.spec_cuda_graphs = false;
  cfg.ngram.num_speculative_tokens = 3;
  e = Engine::create(cfg);
  ASSERT_TRUE(e.is_ok()) << e.error();
  EXPECT_EQ((*e)->model().speculative_method, "ngram");
  EXPECT_EQ((*e)->model().num_speculative_tokens, 3);
}

}  // namespace
}  // namespace m3
