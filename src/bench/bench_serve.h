#pragma once
// `bench serve`: a load generator for any OpenAI-compatible endpoint, one run or a sweep
// over concurrencies (one JSON per point, a summary JSON and an SVG chart).
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/status.h"

namespace m3 {
class Tokenizer;
}

namespace m3::bench {

struct BenchServeConfig {
  std::string base_url = "http://127.0.0.1:8000";
  std::string endpoint = "completions";  // completions | chat | a /v1/... path
  std::string model;
  std::string dataset = "random";        // random | sharegpt | sonnet
  std::string dataset_path;              // sharegpt JSON / sonnet text
  int64_t random_input_len = 1024;
  int64_t random_output_len = 128;
  double random_range_ratio = 0.0;
  int64_t random_prefix_len = 0;
  int64_t sharegpt_output_len = 0;  // 0: the recorded reply's length
  int64_t sonnet_input_len = 550;
  int64_t sonnet_output_len = 150;
  int64_t sonnet_prefix_len = 200;
  size_t num_prompts = 1000;
  int max_concurrency = 0;  // 0: unlimited
  double request_rate = std::numeric_limits<double>::infinity();
  double burstiness = 1.0;
  bool ignore_eos = false;
  double temperature = 0.0;  // greedy
  bool send_token_ids = false;  // completions: send the prompt's token ids, not text
  int num_warmups = 0;
  uint64_t seed = 0;
  int num_gpus = 1;
  double timeout_s = 600;
  bool include_usage = true;
  bool progress = true;
  bool save_detailed = false;
  std::vector<int> sweep_concurrency;   // non-empty: sweep mode
  size_t sweep_prompts_per_concurrency = 0;  // >0: a point sends concurrency * this prompts
  std::string result_dir = "bench-results";
  std::string result_file;  // single run: the file name (default derived from the config)
  std::string label = "bench-serve";
};

// Runs the benchmark, prints the summary table(s) to stdout, writes the result files and
// returns the result (one run) or the sweep summary. The tokenizer builds the datasets and
// counts output tokens when the server reports no usage.
Result<nlohmann::json> run_bench_serve(const BenchServeConfig& config, const Tokenizer* tokenizer);

// The chart for sweep points (each a run's "summary" plus "max_concurrency").
std::string render_sweep_chart(const nlohmann::json& points, const std::string& title);

}  // namespace m3::bench
