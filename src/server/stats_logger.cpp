// The periodic stats line, vLLM's wording.
#include "server/stats_logger.h"

#include <cstdio>

namespace m3::server {

StatsLogger::StatsLogger(double interval_s, Clock::time_point start) : interval_s_(interval_s), last_(start) {}

std::optional<std::string> StatsLogger::observe_step(const EngineStepStats& stats, Clock::time_point now) {
  const StepStats& s = stats.scheduler;
  prompt_ += s.num_prefill_tokens;
  queries_ += s.prefix_query_tokens;
  hits_ += s.prefix_hit_tokens;
  const double elapsed = std::chrono::duration<double>(now - last_).count();
  if (interval_s_ <= 0 || elapsed < interval_s_) return std::nullopt;
  const bool active = prompt_ > 0 || generated_ > 0 || s.num_running > 0 || s.num_waiting > 0;
  const int32_t blocks = s.kv_blocks_used + s.kv_blocks_free;
  char line[320];
  std::snprintf(line, sizeof line,
                "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, Running: %d reqs, "
                "Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
                double(prompt_) / elapsed, double(generated_) / elapsed, s.num_running, s.num_waiting,
                blocks > 0 ? 100.0 * s.kv_blocks_used / blocks : 0.0, queries_ > 0 ? 100.0 * hits_ / queries_ : 0.0);
  last_ = now;
  prompt_ = generated_ = queries_ = hits_ = 0;
  if (!active) return std::nullopt;
  return std::string(line);
}

}  // namespace m3::server
