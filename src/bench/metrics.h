#pragma once
// Latency and throughput statistics over measured requests, as vLLM's benchmark reports
// them: TTFT, TPOT ((E2EL - TTFT) / (output tokens - 1)), ITL (every inter-chunk gap of
// every request), E2EL; mean / median / p90 / p99 with numpy's linear interpolation.
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/request.h"

namespace m3 {
class Tokenizer;
}

namespace m3::bench {

// Percentile p in [0, 100] of values (any order), linear between closest ranks (numpy's
// default); 0 for an empty input.
double percentile(std::vector<double> values, double p);

struct Distribution {
  size_t count = 0;
  double mean = 0, std = 0, median = 0, p90 = 0, p99 = 0, min = 0, max = 0;
};
Distribution summarize_distribution(const std::vector<double>& values);
nlohmann::json distribution_to_json(const Distribution& d);

struct TokenCountSources {
  int64_t from_usage = 0;      // usage.completion_tokens (stream_options.include_usage)
  int64_t from_tokenizer = 0;  // re-tokenised generated text
  int64_t from_chunks = 0;     // neither available: one token per text chunk
};
// Sets output_tokens on every successful outcome from the best source available.
TokenCountSources resolve_output_tokens(std::vector<RequestOutcome>& outcomes,
                                        const Tokenizer* tokenizer);

struct BenchSummary {
  int64_t num_requests = 0;
  int64_t completed = 0;
  int64_t failed = 0;
  std::map<std::string, int64_t> failure_reasons;
  double duration_s = 0;
  int64_t total_input_tokens = 0;
  int64_t total_output_tokens = 0;
  double request_throughput = 0;      // completed requests / s
  double output_throughput = 0;       // output tokens / s
  double total_token_throughput = 0;  // (input + output) tokens / s
  int num_gpus = 1;
  Distribution ttft_ms, tpot_ms, itl_ms, e2el_ms;
  double interactivity_tok_s = 0;  // 1000 / median TPOT: tokens/s one user sees
  // Server-reported prompt caching, over requests whose usage carried cached_tokens.
  int64_t usage_prompt_tokens = 0;
  int64_t usage_cached_tokens = 0;
  int64_t requests_with_cached_tokens = 0;
  TokenCountSources output_token_sources;
};

// output_tokens must be resolved first (resolve_output_tokens).
BenchSummary summarize(const std::vector<RequestOutcome>& outcomes, double duration_s,
                       int num_gpus);
nlohmann::json summary_to_json(const BenchSummary& s);
// Human-readable table in the style of `vllm bench serve`.
std::string format_summary(const BenchSummary& s, const std::string& title);
// Per-request details (for --save-detailed).
nlohmann::json outcomes_to_json(const std::vector<RequestOutcome>& outcomes);

// Prometheus text exposition: each metric name (labels dropped) to the sum of its samples.
std::map<std::string, double> parse_prometheus_text(const std::string& text);
// The first of names present in metrics, or nullptr.
const double* find_metric(const std::map<std::string, double>& metrics,
                          const std::vector<std::string>& names);

}  // namespace m3::bench
