#pragma once
// vLLM's periodic engine log line (prompt / generation throughput, running and waiting
// requests, KV cache use, prefix-cache hit rate over the interval), for operators reading logs.
// Pure: steps and generated-token counts in, a line out when one is due.
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "m3serve/engine.h"
#include "server/spec_decode_counts.h"

namespace m3::server {

class StatsLogger {
 public:
  using Clock = std::chrono::steady_clock;
  // interval_s <= 0: never logs.
  StatsLogger(double interval_s, Clock::time_point start);
  void add_generated(int64_t tokens) { generated_ += tokens; }
  // After each engine step: the line to log, when the interval has passed and anything happened.
  std::optional<std::string> observe_step(const EngineStepStats& stats, Clock::time_point now);
  // With speculative decoding: vLLM's "SpecDecoding metrics" line over the interval the last
  // line returned by observe_step covered (once; nullopt when no draft was verified).
  std::optional<std::string> take_spec_line() { return std::exchange(spec_line_, std::nullopt); }

 private:
  double interval_s_;
  Clock::time_point last_;
  int64_t prompt_ = 0, generated_ = 0, queries_ = 0, hits_ = 0;
  SpecDecodeCounts spec_;  // over the interval
  std::optional<std::string> spec_line_;
};

}  // namespace m3::server
