// Prometheus text exposition (format 0.0.4).
#include "server/metrics.h"

#include <cstdio>

namespace m3::server {
namespace {

std::string number(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.15g", v);
  return buf;
}

// Latency buckets in seconds (vLLM-like spread from sub-millisecond to minutes).
const std::vector<double> kLatencyBuckets = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                                             1.0,   2.5,   5.0,  7.5,  10.0, 20.0, 40.0, 80.0, 160.0};

void header(std::string& out, const std::string& name, const char* type, const char* help) {
  out += "# HELP " + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
}

void sample(std::string& out, const std::string& name, const std::string& labels, double v) {
  out += name + "{" + labels + "} " + number(v) + "\n";
}

}  // namespace

Histogram::Histogram(std::vector<double> upper_bounds)
    : bounds_(std::move(upper_bounds)), counts_(bounds_.size() + 1, 0) {}

void Histogram::observe(double value) {
  size_t i = 0;
  while (i < bounds_.size() && value > bounds_[i]) ++i;
  ++counts_[i];
  sum_ += value;
  ++count_;
}

void Histogram::render(const std::string& name, const std::string& labels, std::string& out) const {
  int64_t cumulative = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cumulative += counts_[i];
    out += name + "_bucket{" + labels + ",le=\"" + number(bounds_[i]) + "\"} " + std::to_string(cumulative) + "\n";
  }
  out += name + "_bucket{" + labels + ",le=\"+Inf\"} " + std::to_string(count_) + "\n";
  out += name + "_sum{" + labels + "} " + number(sum_) + "\n";
  out += name + "_count{" + labels + "} " + std::to_string(count_) + "\n";
}

Metrics::Metrics(std::string model_name)
    : labels_("model_name=\"" + model_name + "\""),
      ttft_(kLatencyBuckets),
      tpot_(kLatencyBuckets),
      itl_(kLatencyBuckets),
      e2e_(kLatencyBuckets) {}

void Metrics::observe_step(const EngineStepStats& stats) {
  std::lock_guard<std::mutex> lock(mu_);
  const StepStats& s = stats.scheduler;
  num_running_ = s.num_running;
  num_waiting_ = s.num_waiting;
  kv_blocks_used_ = s.kv_blocks_used;
  const int32_t total = s.kv_blocks_used + s.kv_blocks_free;
  kv_usage_ = total > 0 ? double(s.kv_blocks_used) / total : 0.0;
  prefix_queries_ += s.prefix_query_tokens;
  prefix_hits_ += s.prefix_hit_tokens;
  preemptions_ += s.num_preemptions;
  ++num_steps_;
}

void Metrics::observe_idle() {
  std::lock_guard<std::mutex> lock(mu_);
  num_running_ = 0;
  num_waiting_ = 0;
}

void Metrics::observe_first_token(double ttft_s) {
  std::lock_guard<std::mutex> lock(mu_);
  ttft_.observe(ttft_s);
}

void Metrics::observe_inter_token(double itl_s) {
  std::lock_guard<std::mutex> lock(mu_);
  itl_.observe(itl_s);
}

void Metrics::observe_finished(const std::string& finished_reason, double e2e_s, int32_t prompt_tokens,
                               int32_t generation_tokens, double tpot_s) {
  std::lock_guard<std::mutex> lock(mu_);
  ++finished_[finished_reason];
  e2e_.observe(e2e_s);
  prompt_tokens_ += prompt_tokens;
  generation_tokens_ += generation_tokens;
  if (generation_tokens > 1) tpot_.observe(tpot_s);
}

void Metrics::count_refused() {
  std::lock_guard<std::mutex> lock(mu_);
  ++refused_;
}

void Metrics::count_client_disconnect() {
  std::lock_guard<std::mutex> lock(mu_);
  ++disconnects_;
}

void Metrics::set_kv_total_blocks(int32_t blocks) {
  std::lock_guard<std::mutex> lock(mu_);
  kv_total_blocks_ = blocks;
}

std::string Metrics::render() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::string out;
  out.reserve(16384);
  auto gauge = [&](const char* name, const char* help, double v) {
    header(out, name, "gauge", help);
    sample(out, name, labels_, v);
  };
  auto counter = [&](const char* name, const char* help, double v) {
    header(out, name, "counter", help);
    sample(out, name, labels_, v);
  };
  gauge("vllm:num_requests_running", "Requests in the running batch.", num_running_);
  gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled (including preempted).", num_waiting_);
  gauge("vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).", kv_usage_);
  gauge("m3:kv_cache_blocks_used", "KV cache blocks held by requests.", kv_blocks_used_);
  gauge("m3:kv_cache_blocks_total", "KV cache blocks in the pool.", kv_total_blocks_);
  counter("vllm:prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.", double(prefix_queries_));
  counter("vllm:prefix_cache_hits_total", "Prompt tokens served from the prefix cache.", double(prefix_hits_));
  counter("vllm:num_preemptions_total", "Preemptions (requests that lost their KV blocks).", double(preemptions_));
  counter("vllm:prompt_tokens_total", "Prefill tokens of finished requests.", double(prompt_tokens_));
  counter("vllm:generation_tokens_total", "Generated tokens of finished requests.", double(generation_tokens_));
  counter("m3:engine_steps_total", "Engine steps run.", double(num_steps_));
  counter("m3:requests_refused_total", "Requests refused with 503 (queue full or draining).", double(refused_));
  counter("m3:client_disconnects_total", "Streaming clients that went away; their requests were aborted.",
          double(disconnects_));
  header(out, "vllm:request_success_total", "counter", "Finished requests by finish reason.");
  for (const char* reason : {"stop", "length", "abort"}) {
    auto it = finished_.find(reason);
    sample(out, "vllm:request_success_total", labels_ + ",finished_reason=\"" + reason + "\"",
           it == finished_.end() ? 0.0 : double(it->second));
  }
  header(out, "vllm:time_to_first_token_seconds", "histogram", "Time to first token.");
  ttft_.render("vllm:time_to_first_token_seconds", labels_, out);
  header(out, "vllm:time_per_output_token_seconds", "histogram", "Mean time per output token after the first, per request.");
  tpot_.render("vllm:time_per_output_token_seconds", labels_, out);
  header(out, "vllm:inter_token_latency_seconds", "histogram", "Time between consecutive output tokens.");
  itl_.render("vllm:inter_token_latency_seconds", labels_, out);
  header(out, "vllm:e2e_request_latency_seconds", "histogram", "Request latency from arrival to finish.");
  e2e_.render("vllm:e2e_request_latency_seconds", labels_, out);
  return out;
}

}  // namespace m3::server
