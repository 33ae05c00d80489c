#pragma once
// Prometheus metrics with vLLM's names where vLLM has one. The engine thread records steps
// and request timings; HTTP threads record refusals and disconnects; /metrics renders text.
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "m3serve/engine.h"
#include "server/spec_decode_counts.h"

namespace m3::server {

class Histogram {
 public:
  explicit Histogram(std::vector<double> upper_bounds);
  void observe(double value);
  // name_bucket{labels,le=...}, name_sum, name_count.
  void render(const std::string& name, const std::string& labels, std::string& out) const;
  int64_t count() const { return count_; }

 private:
  std::vector<double> bounds_;
  std::vector<int64_t> counts_;  // per bucket (not cumulative); +Inf is the last
  double sum_ = 0.0;
  int64_t count_ = 0;
};

// One finished request's timings (seconds) and sizes, as vLLM's request-level metrics define
// them: queue = arrival → first scheduled, prefill = scheduled → first token, decode = first →
// last token, inference = scheduled → last token.
struct FinishedRequest {
  std::string reason;  // "stop" | "length" | "abort"
  double e2e_s = 0.0, queue_s = 0.0, prefill_s = 0.0, decode_s = 0.0, inference_s = 0.0, tpot_s = 0.0;
  bool scheduled = false;  // false: aborted while waiting (no prefill / decode / inference times)
  int32_t prompt_tokens = 0, generation_tokens = 0, max_tokens = 0;
};

class Metrics {
 public:
  // max_model_len bounds the token-count buckets (1, 2, 5, 10, ... as vLLM builds them).
  explicit Metrics(std::string model_name, int32_t max_model_len = 1 << 20);

  // Engine thread.
  void observe_step(const EngineStepStats& stats);
  void observe_idle();  // no unfinished requests: running and waiting are 0
  void observe_first_token(double ttft_s);
  void observe_inter_token(double itl_s);
  void observe_finished(const FinishedRequest& r);
  // vLLM's cache_config_info: block size, blocks, dtypes, prefix caching (labels, value 1).
  void set_cache_info(const ModelSummary& summary);
  // HTTP threads.
  void count_refused();           // 503: the pending queue was full or the server is draining
  void count_client_disconnect();  // a streaming client went away; its request was aborted
  // Disaggregated prefill: blocks handed to decode servers (producer), blocks written into the
  // host tier from prefill servers (consumer), and transfers that failed (the prompt computed here).
  void count_kv_export(int64_t blocks, int64_t bytes);
  void count_kv_import(int64_t blocks, int64_t bytes);
  void count_kv_transfer_failure();

  std::string render() const;

 private:
  mutable std::mutex mu_;
  std::string labels_;  // model_name="..."
  int32_t num_running_ = 0, num_waiting_ = 0;
  double kv_usage_ = 0.0;
  int32_t kv_blocks_used_ = 0, kv_total_blocks_ = 0;
  int64_t prefix_queries_ = 0, prefix_hits_ = 0, preemptions_ = 0;
  int64_t prompt_tokens_ = 0, generation_tokens_ = 0;
  int64_t num_steps_ = 0, refused_ = 0, disconnects_ = 0;
  int64_t kv_exported_blocks_ = 0, kv_exported_bytes_ = 0, kv_imported_blocks_ = 0, kv_imported_bytes_ = 0;
  int64_t kv_transfer_failures_ = 0;
  int64_t kv_offloaded_ = 0, kv_loaded_ = 0, host_hit_tokens_ = 0;
  int32_t host_blocks_used_ = 0, host_blocks_total_ = 0;
  bool speculative_ = false;  // the spec_decode counters are rendered (vLLM shows them only then)
  SpecDecodeCounts spec_;
  std::map<std::string, int64_t> finished_;  // by reason
  std::string cache_info_labels_;
  Histogram ttft_, tpot_, itl_, e2e_, queue_, prefill_, decode_, inference_;
  Histogram request_prompt_tokens_, request_generation_tokens_, request_max_tokens_, iteration_tokens_;
};

}  // namespace m3::server
