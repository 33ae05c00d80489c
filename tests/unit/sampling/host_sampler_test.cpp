// The host Sampler (exec/sampler.h), which serves every request the on-device sample op cannot:
// logit_bias, the penalties, top-k / top-p / min-p. Each case builds logits whose expected
// choice or distribution follows from the definition (vLLM's order: logit bias, then the
// penalties, then temperature and the truncations), and checks that reported logprobs stay
// those of the unmodified logits.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "exec/sampler.h"

namespace m3 {
namespace {

SampleResult sample_once(const SamplingParams& p, std::vector<float> logits, const std::vector<int32_t>& prompt = {},
                         const std::vector<int32_t>& output = {}) {
  Sampler s(p);
  return s.sample(logits.data(), int64_t(logits.size()), prompt, output);
}

SamplingParams greedy() {
  SamplingParams p;
  p.temperature = 0.0f;
  return p;
}

TEST(HostSampler, LogitBiasMovesTheGreedyChoice) {
  const std::vector<float> logits = {0.5f, 3.0f, 1.0f, 2.9f};
  EXPECT_EQ(sample_once(greedy(), logits).token, 1);
  SamplingParams p = greedy();
  p.logit_bias = {{3, 0.2f}};  // 2.9 + 0.2 > 3.0
  EXPECT_EQ(sample_once(p, logits).token, 3);
  p.logit_bias = {{1, -100.0f}};  // bans the argmax: the next one wins
  EXPECT_EQ(sample_once(p, logits).token, 3);
  p.logit_bias = {{0, 100.0f}};
  EXPECT_EQ(sample_once(p, logits).token, 0);
}

TEST(HostSampler, LogitBiasOfMinus100BansATokenUnderTemperature) {
  // Two equal logits: without the bias both come up; with -100 on token 0 only token 1 does.
  SamplingParams p;
  p.temperature = 1.0f;
  p.seed = 7;
  p.logit_bias = {{0, -100.0f}};
  Sampler s(p);
  for (int i = 0; i < 200; ++i) {
    std::vector<float> logits = {1.0f, 1.0f};
    EXPECT_EQ(s.sample(logits.data(), 2, {}, {}).token, 1);
  }
}

TEST(HostSampler, ReportedLogprobsIgnoreTheBias) {
  const std::vector<float> logits = {0.0f, 1.0f, 2.0f};
  SamplingParams p = greedy();
  p.logprobs = 3;
  p.logit_bias = {{0, 10.0f}};
  const SampleResult r = sample_once(p, logits);
  EXPECT_EQ(r.token, 0);
  const double z = std::log(std::exp(0.0) + std::exp(1.0) + std::exp(2.0));
  EXPECT_NEAR(r.logprob, 0.0 - z, 1e-5);
  ASSERT_EQ(r.top.size(), 3u);
  EXPECT_EQ(r.top[0].token, 2);  // the unmodified order
  EXPECT_NEAR(r.top[0].logprob, 2.0 - z, 1e-5);
  EXPECT_EQ(r.top[2].token, 0);
}

TEST(HostSampler, BiasComesBeforeTheRepetitionPenalty) {
  // Token 0 (logit 1, bias +1) is in the prompt, penalty 4: bias first gives (1 + 1) / 4 = 0.5 and
  // token 1 (1.0) wins; the penalty first would give 1 / 4 + 1 = 1.25 and token 0.
  SamplingParams p = greedy();
  p.repetition_penalty = 4.0f;
  p.logit_bias = {{0, 1.0f}};
  EXPECT_EQ(sample_once(p, {1.0f, 1.0f}, /*prompt=*/{0}).token, 1);
}

TEST(HostSampler, RepetitionPenaltyDividesPositiveAndMultipliesNegativeLogits) {
  SamplingParams p = greedy();
  p.repetition_penalty = 2.0f;
  // Token 0 (seen, 3.0 -> 1.5) falls below token 1 (2.0).
  EXPECT_EQ(sample_once(p, {3.0f, 2.0f}, {0}, {}).token, 1);
  // Seen negative logits get more negative: token 1 (-1 -> -2) falls below token 0 (-1.5).
  EXPECT_EQ(sample_once(p, {-1.5f, -1.0f}, {}, {1}).token, 0);
}

TEST(HostSampler, PresenceAndFrequencyPenaltiesCountTheOutputOnly) {
  SamplingParams p = greedy();
  p.frequency_penalty = 0.4f;  // token 0 twice in the output: 2.0 - 0.8 = 1.2 < 1.5
  EXPECT_EQ(sample_once(p, {2.0f, 1.5f}, {}, {0, 0}).token, 1);
  EXPECT_EQ(sample_once(p, {2.0f, 1.5f}, {0, 0, 0}, {}).token, 0);  // the prompt does not count
  SamplingParams q = greedy();
  q.presence_penalty = 0.6f;  // once, whatever the count: 2.0 - 0.6 = 1.4 < 1.5
  EXPECT_EQ(sample_once(q, {2.0f, 1.5f}, {}, {0}).token, 1);
}

// Empirical frequencies over n draws against the expected probabilities.
void expect_distribution(const SamplingParams& p, const std::vector<float>& logits, const std::vector<double>& want,
                         int n = 20000) {
  Sampler s(p);
  std::vector<int> counts(logits.size(), 0);
  for (int i = 0; i < n; ++i) {
    std::vector<float> l = logits;
    counts[size_t(s.sample(l.data(), int64_t(l.size()), {}, {}).token)]++;
  }
  for (size_t t = 0; t < logits.size(); ++t) {
    const double f = double(counts[t]) / n;
    const double tol = 4.0 * std::sqrt(std::max(want[t] * (1.0 - want[t]), 1e-12) / n) + 1e-9;
    EXPECT_NEAR(f, want[t], tol) << "token " << t;
  }
}

TEST(HostSampler, TopKTopPAndMinPTruncateTheDistribution) {
  const std::vector<float> logits = {std::log(0.5f), std::log(0.3f), std::log(0.15f), std::log(0.05f)};
  SamplingParams p;
  p.temperature = 1.0f;
  p.seed = 11;
  expect_distribution(p, logits, {0.5, 0.3, 0.15, 0.05});
  p.top_k = 2;  // renormalised over {0, 1}
  expect_distribution(p, logits, {0.625, 0.375, 0.0, 0.0});
  p.top_k = 0;
  p.top_p = 0.75f;  // 0.5 + 0.3 reaches it: {0, 1}
  expect_distribution(p, logits, {0.625, 0.375, 0.0, 0.0});
  p.top_p = 1.0f;
  p.min_p = 0.25f;  // keeps p >= 0.125: {0, 1, 2}
  expect_distribution(p, logits, {0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0});
}

TEST(HostSampler, ASeedGivesTheSameSequence) {
  SamplingParams p;
  p.temperature = 1.0f;
  p.seed = 1234;
  auto draw = [&] {
    Sampler s(p);
    std::vector<int32_t> out;
    for (int i = 0; i < 64; ++i) {
      std::vector<float> l = {0.1f, 0.2f, 0.3f, 0.4f, 0.5f};
      out.push_back(s.sample(l.data(), 5, {}, {}).token);
    }
    return out;
  };
  EXPECT_EQ(draw(), draw());
}

TEST(HostSampler, MinTokensBansTheStopIdsUntilEnoughTokensExist) {
  SamplingParams p = greedy();
  p.min_tokens = 2;
  p.max_tokens = 5;
  Sampler s(p, /*stop_ids=*/{2, 3});
  const std::vector<float> logits = {0.0f, 1.0f, 5.0f, 4.0f};  // the stop ids lead
  auto next = [&](const std::vector<int32_t>& out) {
    std::vector<float> l = logits;
    return s.sample(l.data(), 4, {}, out).token;
  };
  EXPECT_EQ(next({}), 1);
  EXPECT_EQ(next({1}), 1);
  EXPECT_EQ(next({1, 1}), 2);  // two tokens exist: EOS may come
  // Without stop ids (ignore_eos and none given) nothing is banned.
  Sampler free(p);
  std::vector<float> l = logits;
  EXPECT_EQ(free.sample(l.data(), 4, {}, {}).token, 2);
}

TEST(HostSampler, AllowedTokenIdsComeBeforeTheBias) {
  SamplingParams p = greedy();
  p.allowed_token_ids = {0, 2};
  EXPECT_EQ(sample_once(p, {1.0f, 9.0f, 2.0f}).token, 2);
  p.logit_bias = {{1, 100.0f}};  // a bias cannot bring back an id outside the list
  EXPECT_EQ(sample_once(p, {1.0f, 9.0f, 2.0f}).token, 2);
  SamplingParams q;
  q.temperature = 1.0f;
  q.seed = 5;
  q.allowed_token_ids = {1, 3};
  expect_distribution(q, {0.0f, std::log(1.0f), 5.0f, std::log(3.0f)}, {0.0, 0.25, 0.0, 0.75});
}

// vLLM's bad_words: a one-token word is banned everywhere; a longer one only its last token, and
// only right after the output has produced the others.
TEST(HostSampler, BadWordsBanTheLastTokenAfterTheirPrefix) {
  const std::vector<float> logits = {0.0f, 1.0f, 2.0f, 3.0f, 4.0f};
  SamplingParams p = greedy();
  p.bad_words = {{4}, {1, 2, 3}};
  EXPECT_EQ(sample_once(p, logits).token, 3);                 // 4 banned; [1, 2, 3] not begun
  EXPECT_EQ(sample_once(p, logits, {}, {1, 2}).token, 2);     // after 1, 2: 3 banned too
  EXPECT_EQ(sample_once(p, logits, {1}, {2}).token, 3);       // the prompt does not count
  EXPECT_EQ(sample_once(p, logits, {}, {2, 1, 2, 0}).token, 3);
  SamplingParams bad;
  bad.bad_words = {{}, {3, 10}};
  ASSERT_EQ(bad.validate(10).size(), 1u);
  EXPECT_EQ(bad.validate(10)[0].rfind("bad_words", 0), 0u);
}

TEST(HostSampler, ValidateNamesEveryProblemOnce) {
  SamplingParams p;
  EXPECT_TRUE(p.validate().empty());
  p.logit_bias = {{-1, 0.0f}, {-2, 0.0f}, {3, 100.5f}, {4, NAN}};
  const auto problems = p.validate();
  ASSERT_EQ(problems.size(), 2u);
  EXPECT_NE(problems[0].find("logit_bias token ids"), std::string::npos);
  EXPECT_NE(problems[1].find("logit_bias values"), std::string::npos);
  p.logit_bias.assign(size_t(kMaxLogitBias) + 1, {0, 1.0f});
  const auto many = p.validate();
  ASSERT_EQ(many.size(), 1u);
  EXPECT_NE(many[0].find("at most"), std::string::npos);
  SamplingParams in_vocab;  // with the vocabulary, ids past it are named too
  in_vocab.logit_bias = {{12, 1.0f}};
  in_vocab.allowed_token_ids = {3, 10};
  EXPECT_TRUE(in_vocab.validate().empty());
  const auto past = in_vocab.validate(10);
  ASSERT_EQ(past.size(), 2u);
  EXPECT_EQ(past[0], "logit_bias token ids must be in the vocabulary [0, 10)");
  EXPECT_EQ(past[1], "allowed_token_ids must be in the vocabulary [0, 10)");
  SamplingParams q;
  q.max_tokens = 4;
  q.min_tokens = 5;
  ASSERT_EQ(q.validate().size(), 1u);
  EXPECT_EQ(q.validate()[0].rfind("min_tokens", 0), 0u);  // the route takes the first word as the param
}

}  // namespace
}  // namespace m3
