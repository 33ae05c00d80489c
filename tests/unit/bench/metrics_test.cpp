#include "bench/metrics.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "bench/load_runner.h"
#include "bench/progress.h"
#include "fake_tokenizer.h"

namespace m3::bench {
namespace {

TEST(Percentile, LinearInterpolationLikeNumpy) {
  const std::vector<double> v = {40, 10, 30, 20};
  EXPECT_DOUBLE_EQ(percentile(v, 50), 25.0);
  EXPECT_DOUBLE_EQ(percentile(v, 90), 37.0);
  EXPECT_NEAR(percentile(v, 99), 39.7, 1e-12);
  EXPECT_DOUBLE_EQ(percentile(v, 0), 10.0);
  EXPECT_DOUBLE_EQ(percentile(v, 100), 40.0);
  EXPECT_DOUBLE_EQ(percentile({7}, 99), 7.0);
  EXPECT_DOUBLE_EQ(percentile({}, 50), 0.0);
}

TEST(Distribution, MeanStdMinMax) {
  const Distribution d = summarize_distribution({2, 4, 4, 4, 5, 5, 7, 9});
  EXPECT_DOUBLE_EQ(d.mean, 5.0);
  EXPECT_DOUBLE_EQ(d.std, 2.0);
  EXPECT_DOUBLE_EQ(d.median, 4.5);
  EXPECT_DOUBLE_EQ(d.min, 2.0);
  EXPECT_DOUBLE_EQ(d.max, 9.0);
  EXPECT_EQ(d.count, 8u);
}

RequestOutcome ok(double ttft, double latency, int64_t out_tokens, double itl, int64_t prompt_len) {
  RequestOutcome o;
  o.success = true;
  o.ttft_s = ttft;
  o.latency_s = latency;
  o.output_tokens = out_tokens;
  o.prompt_len = prompt_len;
  o.itl_s.assign(static_cast<size_t>(std::max<int64_t>(0, out_tokens - 1)), itl);
  return o;
}

RequestOutcome failed(const std::string& reason) {
  RequestOutcome o;
  o.error = reason;
  return o;
}

TEST(Summary, SyntheticTimelineExactValues) {
  std::vector<RequestOutcome> outcomes = {ok(0.1, 1.1, 11, 0.1, 100), ok(0.2, 3.2, 21, 0.15, 200),
                                          ok(0.3, 0.3, 1, 0.0, 300), failed("HTTP 500"),
                                          failed("HTTP 500"), failed("connection: Read")};
  const BenchSummary s = summarize(outcomes, 4.0, 2);
  EXPECT_EQ(s.completed, 3);
  EXPECT_EQ(s.failed, 3);
  EXPECT_EQ(s.failure_reasons.at("HTTP 500"), 2);
  EXPECT_EQ(s.failure_reasons.at("connection: Read"), 1);
  EXPECT_EQ(s.total_input_tokens, 600);
  EXPECT_EQ(s.total_output_tokens, 33);
  EXPECT_DOUBLE_EQ(s.request_throughput, 0.75);
  EXPECT_DOUBLE_EQ(s.output_throughput, 8.25);
  EXPECT_DOUBLE_EQ(s.total_token_throughput, 158.25);

  EXPECT_NEAR(s.ttft_ms.mean, 200, 1e-9);
  EXPECT_NEAR(s.ttft_ms.median, 200, 1e-9);
  EXPECT_NEAR(s.ttft_ms.p90, 280, 1e-9);
  EXPECT_NEAR(s.ttft_ms.p99, 298, 1e-9);
  // TPOT excludes the one-token request: (1.1-0.1)/10 = 100 ms, (3.2-0.2)/20 = 150 ms.
  EXPECT_EQ(s.tpot_ms.count, 2u);
  EXPECT_NEAR(s.tpot_ms.mean, 125, 1e-9);
  EXPECT_NEAR(s.tpot_ms.median, 125, 1e-9);
  EXPECT_NEAR(s.tpot_ms.p90, 145, 1e-9);
  EXPECT_NEAR(s.tpot_ms.p99, 149.5, 1e-9);
  EXPECT_NEAR(s.interactivity_tok_s, 8.0, 1e-9);
  // ITL: 10 gaps of 100 ms and 20 of 150 ms.
  EXPECT_EQ(s.itl_ms.count, 30u);
  EXPECT_NEAR(s.itl_ms.mean, 4000.0 / 30.0, 1e-9);
  EXPECT_NEAR(s.itl_ms.median, 150, 1e-9);
  EXPECT_NEAR(s.itl_ms.min, 100, 1e-9);
  EXPECT_NEAR(s.e2el_ms.median, 1100, 1e-9);
  EXPECT_NEAR(s.e2el_ms.p90, 2780, 1e-9);
  EXPECT_NEAR(s.e2el_ms.p99, 3158, 1e-9);

  const nlohmann::json j = summary_to_json(s);
  EXPECT_DOUBLE_EQ(j["per_gpu"]["output_throughput"].get<double>(), 4.125);
  EXPECT_DOUBLE_EQ(j["per_gpu"]["total_token_throughput"].get<double>(), 79.125);
  EXPECT_EQ(j["failure_reasons"]["HTTP 500"].get<int>(), 2);
  EXPECT_NE(format_summary(s, "t").find("Failed requests:"), std::string::npos);
}

TEST(Summary, ServerCachedTokensAggregate) {
  std::vector<RequestOutcome> outcomes = {ok(0.1, 0.2, 2, 0.1, 100), ok(0.1, 0.2, 2, 0.1, 100)};
  outcomes[0].usage.prompt_tokens = 100;
  outcomes[0].usage.cached_tokens = 0;
  outcomes[1].usage.prompt_tokens = 100;
  outcomes[1].usage.cached_tokens = 64;
  const BenchSummary s = summarize(outcomes, 1.0, 1);
  EXPECT_EQ(s.requests_with_cached_tokens, 2);
  EXPECT_DOUBLE_EQ(summary_to_json(s)["server_cached_tokens"]["hit_rate"].get<double>(), 0.32);
}

TEST(OutputTokens, UsageThenTokenizerThenChunks) {
  testing::FakeTokenizer tok;
  std::vector<RequestOutcome> outcomes(4);
  for (auto& o : outcomes) o.success = true;
  outcomes[0].usage.completion_tokens = 7;
  outcomes[0].text = " aa ab";
  outcomes[1].text = " aa ab ac";  // 3 tokens re-tokenised
  outcomes[1].num_text_chunks = 1;
  outcomes[2].success = false;
  TokenCountSources src = resolve_output_tokens(outcomes, &tok);
  EXPECT_EQ(outcomes[0].output_tokens, 7);
  EXPECT_EQ(outcomes[1].output_tokens, 3);
  EXPECT_EQ(outcomes[2].output_tokens, -1);
  EXPECT_EQ(src.from_usage, 1);
  EXPECT_EQ(src.from_tokenizer, 2);

  std::vector<RequestOutcome> no_tok(1);
  no_tok[0].success = true;
  no_tok[0].num_text_chunks = 5;
  src = resolve_output_tokens(no_tok, nullptr);
  EXPECT_EQ(no_tok[0].output_tokens, 5);
  EXPECT_EQ(src.from_chunks, 1);
}

TEST(Prometheus, ParsesLabelsAndSumsSeries) {
  const std::string text =
      "# HELP vllm:prefix_cache_hits_total hits\n"
      "# TYPE vllm:prefix_cache_hits_total counter\n"
      "vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"a}b\"} 120.0\n"
      "vllm:prefix_cache_hits_total{engine=\"1\",model_name=\"x\"} 30\n"
      "vllm:prefix_cache_queries_total 600\n"
      "vllm:kv_cache_usage_perc{engine=\"0\"} 0.25 1700000000000\n"
      "garbage line without value\n";
  const auto m = parse_prometheus_text(text);
  EXPECT_DOUBLE_EQ(m.at("vllm:prefix_cache_hits_total"), 150.0);
  EXPECT_DOUBLE_EQ(m.at("vllm:prefix_cache_queries_total"), 600.0);
  EXPECT_DOUBLE_EQ(m.at("vllm:kv_cache_usage_perc"), 0.25);
  const double* v = find_metric(m, {"vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc"});
  ASSERT_NE(v, nullptr);
  EXPECT_DOUBLE_EQ(*v, 0.25);
  EXPECT_EQ(find_metric(m, {"nope"}), nullptr);
}

TEST(Arrivals, InfiniteRateSendsAtOnceAndPoissonHasTheRightMean) {
  const auto at_once = make_arrival_times(5, std::numeric_limits<double>::infinity(), 1.0, 1);
  for (double t : at_once) EXPECT_EQ(t, 0.0);
  const auto a = make_arrival_times(20000, 10.0, 1.0, 42);
  const auto b = make_arrival_times(20000, 10.0, 1.0, 42);
  EXPECT_EQ(a, b);
  EXPECT_EQ(a[0], 0.0);
  for (size_t i = 1; i < a.size(); ++i) ASSERT_GE(a[i], a[i - 1]);
  const double mean_gap = a.back() / static_cast<double>(a.size() - 1);
  EXPECT_NEAR(mean_gap, 0.1, 0.003);
  // Exponential gaps: variance equals mean squared; burstiness 4 shrinks it four-fold.
  const auto bursty = make_arrival_times(20000, 10.0, 4.0, 42);
  double var_p = 0, var_b = 0;
  for (size_t i = 1; i < a.size(); ++i) {
    var_p += std::pow(a[i] - a[i - 1] - 0.1, 2);
    var_b += std::pow(bursty[i] - bursty[i - 1] - 0.1, 2);
  }
  EXPECT_NEAR(var_p / 19999, 0.01, 0.001);
  EXPECT_NEAR(var_b / 19999, 0.0025, 0.0003);
}

TEST(Progress, RendersCountsRateAndEta) {
  const std::string line = ProgressBar::render("c=4", 50, 2, 100, 10.0);
  EXPECT_EQ(line, "c=4 [###############...............] 50/100 (2 failed) 5.00 req/s 00:10<00:10");
}

}  // namespace
}  // namespace m3::bench
