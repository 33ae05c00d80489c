#pragma once
// `bench replay`: sends trace requests (see trace_replay.h) with their real prefix sharing,
// on the trace's clock (scaled) or at a fixed concurrency, and compares the theoretical
// prefix hit rate with what the server reports (usage cached_tokens, /metrics counters).
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/status.h"

namespace m3 {
class Tokenizer;
}

namespace m3::bench {

struct ReplayConfig {
  std::string base_url = "http://127.0.0.1:8000";
  std::string endpoint = "completions";
  std::string model;
  std::vector<std::string> traces;  // files or directories of *.json / *.jsonl
  double time_scale = 1.0;          // send at trace time * time_scale (0.1: ten times faster)
  bool fixed_concurrency = false;   // ignore timestamps; keep max_concurrency in flight
  // Agentic traces as closed loops: a session's next request is sent when its previous one
  // finishes plus the recorded gap (think and tool time) * time_scale; the first request of
  // each session (and sub-agent) keeps its scaled trace time.
  bool sessions = false;
  int max_concurrency = 0;          // 0: unlimited
  double session_stagger_s = 0.0;   // trace file k starts k * this later
  size_t max_requests = 0;          // 0: all (the earliest first)
  int64_t max_input_len = 0;        // >0: skip longer requests
  int64_t max_output_len = 0;       // >0: cap each request's output
  std::string prompt_format = "auto";  // auto | ids | text
  int32_t token_id_min = 1000;      // without a tokenizer: ids drawn from [min, max)
  int32_t token_id_max = 0;
  int64_t server_block_size = 0;    // also report the theoretical rate at this granularity
  double metrics_interval_s = 1.0;  // /metrics polling for KV usage; 0: off
  bool ignore_eos = true;
  int num_gpus = 1;
  uint64_t seed = 0;
  double timeout_s = 600;
  bool progress = true;
  bool save_detailed = false;
  std::string result_dir = "bench-results";
  std::string result_file;
  std::string label = "bench-replay";
};

Result<nlohmann::json> run_replay(const ReplayConfig& config, const Tokenizer* tokenizer);

}  // namespace m3::bench
