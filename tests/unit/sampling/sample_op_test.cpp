// The `sample` op through the CPU dispatch table (the reference): greedy ties, logprobs
// against a double-precision log-softmax, top-N ordering, determinism per (seed, step),
// the Gumbel-max definition of ops/sample_gumbel.h, and the empirical distribution of
// temperature sampling against softmax(logits / T).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <set>
#include <stdexcept>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "ops/ops.h"
#include "ops/sample_gumbel.h"

namespace m3 {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr int kTop = ops::kMaxTopLogprobs;

struct Result {
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;
  std::vector<int32_t> top_ids;
  std::vector<float> top_lp;
};

class SampleOp : public ::testing::Test {
 protected:
  SampleOp() { cpu::register_cpu_kernels(table_); }

  // Outputs are pre-filled with garbage so an unwritten element fails.
  Result run(const std::vector<float>& logits, int64_t rows, int64_t vocab, const std::vector<ops::SampleRowParams>& p,
             int64_t top_cols = kTop) {
    Result r{std::vector<int32_t>(size_t(rows), 12345), std::vector<float>(size_t(rows), 777.0f),
             std::vector<int32_t>(size_t(rows * top_cols), 4242), std::vector<float>(size_t(rows * top_cols), 999.0f)};
    std::vector<ops::SampleRowParams> params = p;
    ops::OpContext ctx{&table_, &stats_, Device::kCpu, true};
    auto view = [](void* d, DType t, Shape s) { return TensorView{d, t, std::move(s), Device::kCpu}; };
    ops::sample(ctx, view(const_cast<float*>(logits.data()), DType::kF32, {rows, vocab}),
                view(params.data(), DType::kU8, {rows * int64_t(sizeof(ops::SampleRowParams))}),
                view(r.tokens.data(), DType::kI32, {rows}), view(r.logprobs.data(), DType::kF32, {rows}),
                view(r.top_ids.data(), DType::kI32, {rows, top_cols}),
                view(r.top_lp.data(), DType::kF32, {rows, top_cols}));
    return r;
  }

  ops::KernelTable table_;
  ops::DispatchStats stats_;
};

ops::SampleRowParams P(float t, int top_n = 0, uint64_t seed = 0, uint64_t step = 0) {
  ops::SampleRowParams p;
  p.temperature = t;
  p.top_n = top_n;
  p.seed = seed;
  p.step = step;
  return p;
}

// log_softmax(x)[v] in double.
double ref_logprob(const float* x, int64_t vocab, int64_t v) {
  double m = -INFINITY;
  for (int64_t i = 0; i < vocab; ++i) m = std::max(m, double(x[i]));
  double s = 0;
  for (int64_t i = 0; i < vocab; ++i) s += std::exp(double(x[i]) - m);
  return double(x[v]) - m - std::log(s);
}

void expect_close(double got, double want, double tol, const std::string& what) {
  if (std::isinf(want)) {
    EXPECT_EQ(got, want) << what;
  } else {
    EXPECT_NEAR(got, want, tol) << what;
  }
}

TEST_F(SampleOp, GreedyTiesGoToTheLowerId) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<std::vector<float>> rows = {
      {1, 5, 3, 5, 5, 0},        {2, 2, 2, 2, 2, 2},         {-1, -3, -2, 0.5f, -7, 0.5f},
      {-kInf, -kInf, 4, 4, -kInf, 1}, {-5, -0.0f, 0.0f, -1, -2, -0.0f}, {nan, 1, 3, nan, 3, 2},
      {0, 1, 2, 3, 4, 5},        {9, 1, 2, 3, 4, 9}};
  const std::vector<int32_t> want = {1, 0, 3, 2, 1, 2, 5, 0};
  std::vector<float> logits;
  std::vector<ops::SampleRowParams> p;
  for (size_t r = 0; r < rows.size(); ++r) {
    logits.insert(logits.end(), rows[r].begin(), rows[r].end());
    p.push_back(P(0.0f, 0, /*seed=*/r * 977 + 5, /*step=*/r * 13));  // seeds must not matter when greedy
  }
  const Result res = run(logits, int64_t(rows.size()), 6, p);
  EXPECT_EQ(res.tokens, want);
  for (size_t r = 0; r < rows.size(); ++r) {
    if (r == 5) continue;  // a NaN logit makes the log-sum-exp NaN
    expect_close(res.logprobs[r], ref_logprob(rows[r].data(), 6, want[r]), 1e-5, "row " + std::to_string(r));
  }
  EXPECT_EQ(stats_.entry_counts().count({"sample", "sample.gumbel_argmax.cpu"}), 1u);
}

TEST_F(SampleOp, LogprobsMatchADoublePrecisionReference) {
  const int64_t vocab = 3001;
  const std::vector<float> temps = {0.0f, 0.8f, 1.3f, 0.0f, 2.0f, 1.0f};
  const int64_t rows = int64_t(temps.size());
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 4.0f);
  std::vector<float> logits(size_t(rows * vocab));
  for (auto& v : logits) v = nd(rng);
  for (int64_t i = 0; i < vocab; ++i) logits[size_t(1 * vocab + i)] += 60.0f;   // large offset
  for (int64_t i = 0; i < vocab; i += 3) logits[size_t(2 * vocab + i)] = -kInf;  // masked tokens
  for (int64_t i = 0; i < vocab; ++i) logits[size_t(3 * vocab + i)] *= 0.01f;    // nearly flat
  std::vector<ops::SampleRowParams> p;
  for (int64_t r = 0; r < rows; ++r) p.push_back(P(temps[size_t(r)], kTop, 11, uint64_t(r)));
  const Result res = run(logits, rows, vocab, p);
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = logits.data() + r * vocab;
    ASSERT_GE(res.tokens[size_t(r)], 0);
    ASSERT_LT(res.tokens[size_t(r)], vocab);
    EXPECT_TRUE(std::isfinite(x[res.tokens[size_t(r)]])) << "a masked token was sampled, row " << r;
    expect_close(res.logprobs[size_t(r)], ref_logprob(x, vocab, res.tokens[size_t(r)]), 1e-5, "token row " + std::to_string(r));
    for (int k = 0; k < kTop; ++k) {
      const int32_t id = res.top_ids[size_t(r * kTop + k)];
      ASSERT_GE(id, 0);
      expect_close(res.top_lp[size_t(r * kTop + k)], ref_logprob(x, vocab, id), 1e-5,
                   "top " + std::to_string(k) + " row " + std::to_string(r));
    }
  }
}

TEST_F(SampleOp, TopNIsOrderedByLogitWithTiesToTheLowerId) {
  const std::vector<float> x = {3, 7, 7, 1, 9, 7, -kInf, 9, 2, -0.5f};
  const int64_t vocab = int64_t(x.size());
  std::vector<float> logits;
  for (int r = 0; r < 4; ++r) logits.insert(logits.end(), x.begin(), x.end());
  const std::vector<ops::SampleRowParams> p = {P(0.0f, 20), P(0.0f, 3), P(0.9f, 4, 1, 2), P(1.0f, 1, 3, 4)};
  const Result res = run(logits, 4, vocab, p);
  const std::vector<int32_t> full = {4, 7, 1, 2, 5, 0, 8, 3, 9, 6};  // every token, -inf last
  const std::vector<int> n = {10, 3, 4, 1};  // vocab 10 < top_n 20: ten listed
  for (int r = 0; r < 4; ++r) {
    for (int k = 0; k < kTop; ++k) {
      const int32_t id = res.top_ids[size_t(r * kTop + k)];
      const float lp = res.top_lp[size_t(r * kTop + k)];
      if (k < n[size_t(r)]) {
        EXPECT_EQ(id, full[size_t(k)]) << "row " << r << " rank " << k;
        expect_close(lp, ref_logprob(x.data(), vocab, full[size_t(k)]), 1e-5, "rank " + std::to_string(k));
      } else {
        EXPECT_EQ(id, -1) << "row " << r << " rank " << k;
        EXPECT_EQ(lp, -kInf) << "row " << r << " rank " << k;
      }
    }
  }
  EXPECT_EQ(res.tokens[0], 4);
  EXPECT_EQ(res.tokens[1], 4);
}

TEST_F(SampleOp, TopNZeroLeavesEveryUnusedSlot) {
  std::vector<float> logits = {0.1f, 0.4f, -1.0f, 0.4f, 2.0f, 0.0f, 0.0f, 0.0f};
  const Result res = run(logits, 2, 4, {P(0.0f, 0), P(1.0f, 0, 9, 9)});
  for (size_t i = 0; i < res.top_ids.size(); ++i) {
    EXPECT_EQ(res.top_ids[i], -1) << i;
    EXPECT_EQ(res.top_lp[i], -kInf) << i;
  }
  EXPECT_EQ(res.tokens[0], 1);
  EXPECT_GE(res.tokens[1], 0);
  EXPECT_LT(res.tokens[1], 4);
  EXPECT_LT(res.logprobs[1], 0.0f);
}

TEST_F(SampleOp, RejectsBadRowsAndViews) {
  const std::vector<float> logits(8, 0.0f);
  EXPECT_THROW(run(logits, 2, 4, {P(0.0f, 0), P(0.0f, 21)}), std::invalid_argument);
  EXPECT_THROW(run(logits, 2, 4, {P(0.0f, -1), P(0.0f, 0)}), std::invalid_argument);
  EXPECT_THROW(run(logits, 2, 4, {P(-0.5f, 0), P(0.0f, 0)}), std::invalid_argument);
  EXPECT_THROW(run(logits, 2, 4, {P(std::nanf(""), 0), P(0.0f, 0)}), std::invalid_argument);
  EXPECT_THROW(run(logits, 2, 4, {P(0.0f, 0), P(0.0f, 0)}, /*top_cols=*/5), std::invalid_argument);
  EXPECT_NO_THROW(run(logits, 2, 4, {P(0.0f, 20), P(2.0f, 0)}));
}

TEST_F(SampleOp, SamplingIsDeterministicPerSeedAndStep) {
  const int64_t vocab = 1000, rows = 64;
  const std::vector<float> logits(size_t(rows * vocab), 0.0f);  // uniform: every token equally likely
  auto distinct = [](const std::vector<int32_t>& t) { return std::set<int32_t>(t.begin(), t.end()).size(); };
  std::vector<ops::SampleRowParams> by_step, by_seed, same;
  for (int64_t r = 0; r < rows; ++r) {
    by_step.push_back(P(1.0f, 0, 42, uint64_t(r)));
    by_seed.push_back(P(1.0f, 0, uint64_t(r) * 1000003ull, 5));
    same.push_back(P(0.7f, 0, 42, 17));
  }
  const Result a = run(logits, rows, vocab, by_step), b = run(logits, rows, vocab, by_step);
  EXPECT_EQ(a.tokens, b.tokens);
  EXPECT_EQ(a.logprobs, b.logprobs);
  // 64 draws from 1000 tokens: ~2 collisions expected; a generator ignoring the step gives 1.
  EXPECT_GE(distinct(a.tokens), 55u);
  EXPECT_GE(distinct(run(logits, rows, vocab, by_seed).tokens), 55u);
  EXPECT_EQ(distinct(run(logits, rows, vocab, same).tokens), 1u);
  // A row's draw does not depend on the batch around it.
  for (int64_t r : {0, 17, 63}) {
    const std::vector<float> one(size_t(vocab), 0.0f);
    EXPECT_EQ(run(one, 1, vocab, {by_step[size_t(r)]}).tokens[0], a.tokens[size_t(r)]) << r;
  }
  for (float lp : a.logprobs) EXPECT_NEAR(lp, -std::log(1000.0), 1e-5);
}

TEST_F(SampleOp, FollowsTheGumbelMaxDefinition) {
  const int64_t vocab = 257, rows = 24;
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  std::vector<float> logits(size_t(rows * vocab));
  for (auto& v : logits) v = nd(rng);
  std::vector<ops::SampleRowParams> p;
  const float temps[] = {0.3f, 1.0f, 2.5f};
  for (int64_t r = 0; r < rows; ++r) p.push_back(P(temps[r % 3], 0, 1234567890123ull + uint64_t(r / 3), uint64_t(r) * 7));
  const Result res = run(logits, rows, vocab, p);
  int differs_from_greedy = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = logits.data() + r * vocab;
    const uint64_t key = ops::sample_row_key(p[size_t(r)].seed, p[size_t(r)].step);
    int32_t want = 0, greedy = 0;
    float best = -kInf;
    for (int32_t v = 0; v < vocab; ++v) {
      const float s = x[v] / p[size_t(r)].temperature + ops::sample_gumbel(key, uint32_t(v));
      if (s > best) best = s, want = v;
      if (x[v] > x[greedy]) greedy = v;
    }
    EXPECT_EQ(res.tokens[size_t(r)], want) << "row " << r;
    differs_from_greedy += want != greedy;
  }
  EXPECT_GT(differs_from_greedy, 4);  // the noise matters (else this test proves little)
}

TEST(SampleGenerator, UniformsStayInsideTheOpenInterval) {
  EXPECT_GT(ops::sample_uniform(0), 0.0f);
  EXPECT_LT(ops::sample_uniform((1u << 23) - 1), 1.0f);
  EXPECT_TRUE(std::isfinite(-std::log(-std::log(ops::sample_uniform(0)))));
  EXPECT_TRUE(std::isfinite(-std::log(-std::log(ops::sample_uniform((1u << 23) - 1)))));
  // The 23 bits are roughly uniform: mean of bits / 2^23 over 100000 tokens near 1/2.
  const uint64_t key = ops::sample_row_key(1, 2);
  double mean = 0;
  for (uint32_t v = 0; v < 100000; ++v) {
    const uint32_t b = ops::sample_token_bits(key, v);
    ASSERT_LT(b, 1u << 23);
    mean += double(b) / double(1u << 23);
  }
  EXPECT_NEAR(mean / 100000, 0.5, 0.005);
}

// 20000 draws from a 4-token vocab: counts against softmax(logits / T) by Pearson's
// chi-square (3 degrees of freedom; 21.1 is the 1e-4 upper quantile) and 4 sigma per token.
TEST_F(SampleOp, EmpiricalDistributionMatchesSoftmaxOverTemperature) {
  const std::vector<float> x = {1.0f, 0.5f, -0.3f, 2.0f};
  const int64_t n = 20000, vocab = 4;
  std::vector<float> logits;
  for (int64_t i = 0; i < n; ++i) logits.insert(logits.end(), x.begin(), x.end());
  std::printf("%-5s %-5s %-28s %-28s %-8s %s\n", "T", "key", "expected p", "observed p", "chi2", "chi2 vs softmax(l*T)");
  for (float t : {0.5f, 1.0f, 1.7f}) {
    for (const char* key : {"step", "seed"}) {
      std::vector<ops::SampleRowParams> p;
      for (int64_t i = 0; i < n; ++i)
        p.push_back(key[1] == 't' ? P(t, 0, 99, uint64_t(i)) : P(t, 0, uint64_t(i) * 2654435761ull + 1, 3));
      const Result res = run(logits, n, vocab, p);
      std::vector<double> count(4, 0), want(4), wrong(4);
      for (int32_t tok : res.tokens) {
        ASSERT_GE(tok, 0);
        ASSERT_LT(tok, 4);
        count[size_t(tok)] += 1;
      }
      double z = 0, zw = 0;
      for (int v = 0; v < 4; ++v) z += want[size_t(v)] = std::exp(double(x[size_t(v)]) / t);
      for (int v = 0; v < 4; ++v) zw += wrong[size_t(v)] = std::exp(double(x[size_t(v)]) * t);
      double chi2 = 0, chi2_wrong = 0;
      char exp_s[64], obs_s[64];
      for (int v = 0; v < 4; ++v) {
        want[size_t(v)] /= z;
        wrong[size_t(v)] /= zw;
        const double e = n * want[size_t(v)], ew = n * wrong[size_t(v)];
        chi2 += (count[size_t(v)] - e) * (count[size_t(v)] - e) / e;
        chi2_wrong += (count[size_t(v)] - ew) * (count[size_t(v)] - ew) / ew;
        const double sigma = std::sqrt(n * want[size_t(v)] * (1 - want[size_t(v)]));
        EXPECT_LE(std::fabs(count[size_t(v)] - e), 4 * sigma) << "T " << t << " key " << key << " token " << v;
      }
      std::snprintf(exp_s, sizeof exp_s, "%.4f %.4f %.4f %.4f", want[0], want[1], want[2], want[3]);
      std::snprintf(obs_s, sizeof obs_s, "%.4f %.4f %.4f %.4f", count[0] / n, count[1] / n, count[2] / n, count[3] / n);
      std::printf("%-5.2f %-5s %-28s %-28s %-8.2f %.1f\n", t, key, exp_s, obs_s, chi2, chi2_wrong);
      EXPECT_LT(chi2, 21.1) << "T " << t << " key " << key;
      if (t != 1.0f) {
        EXPECT_GT(chi2_wrong, 100.0) << "the test cannot tell T from 1/T";
      }
    }
  }
}

}  // namespace
}  // namespace m3
