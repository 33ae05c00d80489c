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

// vLLM's 1-2-5 series up to a maximum: 1, 2, 5, 10, 20, 50, ...
std::vector<double> one_two_five(int64_t max_value) {
  std::vector<double> out;
  for (int64_t scale = 1;; scale *= 10)
    for (int64_t m : {1, 2, 5}) {
      if (m * scale > max_value) return out;
      out.push_back(double(m * scale));
    }
}

// Tokens per engine step.
const std::vector<double> kIterationBuckets = {1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384};

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

Metrics::Metrics(std::string model_name, int32_t max_model_len)
    : labels_("model_name=\"" + model_name + "\""),
      ttft_(kLatencyBuckets),
      tpot_(kLatencyBuckets),
      itl_(kLatencyBuckets),
      e2e_(kLatencyBuckets),
      queue_(kLatencyBuckets),
      prefill_(kLatencyBuckets),
      decode_(kLatencyBuckets),
      inference_(kLatencyBuckets),
      request_prompt_tokens_(one_two_five(max_model_len)),
      request_generation_tokens_(one_two_five(max_model_len)),
      request_max_tokens_(one_two_five(max_model_len)),
      iteration_tokens_(kIterationBuckets) {}

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
  const int32_t tokens = s.num_prefill_tokens + s.num_decode_tokens;
  if (tokens > 0) iteration_tokens_.observe(tokens);
  kv_offloaded_ += s.kv_offloaded_blocks;
  kv_loaded_ += s.kv_loaded_blocks;
  host_hit_tokens_ += s.prefix_host_hit_tokens;
  host_blocks_used_ = s.kv_host_blocks_used;
  spec_.add(stats);
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

void Metrics::observe_finished(const FinishedRequest& r) {
  std::lock_guard<std::mutex> lock(mu_);
  ++finished_[r.reason];
  e2e_.observe(r.e2e_s);
  prompt_tokens_ += r.prompt_tokens;
  generation_tokens_ += r.generation_tokens;
  if (r.generation_tokens > 1) tpot_.observe(r.tpot_s);
  request_prompt_tokens_.observe(r.prompt_tokens);
  request_generation_tokens_.observe(r.generation_tokens);
  if (r.max_tokens > 0) request_max_tokens_.observe(r.max_tokens);
  queue_.observe(r.queue_s);
  if (r.scheduled) {
    inference_.observe(r.inference_s);
    if (r.generation_tokens > 0) {
      prefill_.observe(r.prefill_s);
      decode_.observe(r.decode_s);
    }
  }
}

void Metrics::set_cache_info(const ModelSummary& summary) {
  std::lock_guard<std::mutex> lock(mu_);
  kv_total_blocks_ = summary.num_kv_blocks;
  cache_info_labels_ = ",block_size=\"" + std::to_string(summary.block_size) + "\",num_gpu_blocks=\"" +
                       std::to_string(summary.num_kv_blocks) + "\",cache_dtype=\"" + summary.kv_cache_dtype +
                       "\",index_cache_dtype=\"" + summary.index_cache_dtype + "\",enable_prefix_caching=\"" +
                       (summary.enable_prefix_caching ? "True" : "False") + "\"";
  host_blocks_total_ = summary.num_host_kv_blocks;
  speculative_ = !summary.speculative_method.empty();
  if (speculative_ && spec_.accepted_per_pos.size() < size_t(summary.num_speculative_tokens))
    spec_.accepted_per_pos.resize(size_t(summary.num_speculative_tokens), 0);
}

void Metrics::count_refused() {
  std::lock_guard<std::mutex> lock(mu_);
  ++refused_;
}

void Metrics::count_client_disconnect() {
  std::lock_guard<std::mutex> lock(mu_);
  ++disconnects_;
}

void Metrics::count_kv_export(int64_t blocks, int64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  kv_exported_blocks_ += blocks;
  kv_exported_bytes_ += bytes;
}

void Metrics::count_kv_import(int64_t blocks, int64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  kv_imported_blocks_ += blocks;
  kv_imported_bytes_ += bytes;
}

void Metrics::count_kv_transfer_failure() {
  std::lock_guard<std::mutex> lock(mu_);
  ++kv_transfer_failures_;
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
  counter("m3:kv_transfer_exported_blocks_total", "KV blocks of finished prefills kept for decode servers.",
          double(kv_exported_blocks_));
  counter("m3:kv_transfer_exported_bytes_total", "Bytes of those blocks (serialized).", double(kv_exported_bytes_));
  counter("m3:kv_transfer_imported_blocks_total", "KV blocks fetched from prefill servers into the host tier.",
          double(kv_imported_blocks_));
  counter("m3:kv_transfer_imported_bytes_total", "Bytes fetched for them (serialized).", double(kv_imported_bytes_));
  counter("m3:kv_transfer_failures_total",
          "KV transfers that failed (fetch, checksum or layout); the prompt was computed here instead.",
          double(kv_transfer_failures_));
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
  auto histogram = [&](const char* name, const char* help, const Histogram& h) {
    header(out, name, "histogram", help);
    h.render(name, labels_, out);
  };
  histogram("vllm:request_queue_time_seconds", "Time from arrival to first being scheduled.", queue_);
  histogram("vllm:request_prefill_time_seconds", "Time from first being scheduled to the first token.", prefill_);
  histogram("vllm:request_decode_time_seconds", "Time from the first token to the last.", decode_);
  histogram("vllm:request_inference_time_seconds", "Time from first being scheduled to the last token.", inference_);
  histogram("vllm:request_prompt_tokens", "Prompt tokens per finished request.", request_prompt_tokens_);
  histogram("vllm:request_generation_tokens", "Generated tokens per finished request.", request_generation_tokens_);
  histogram("vllm:request_params_max_tokens", "max_tokens of finished requests.", request_max_tokens_);
  histogram("vllm:iteration_tokens_total", "Tokens (prefill + decode) per engine step.", iteration_tokens_);
  if (host_blocks_total_ > 0) {
    gauge("m3:kv_offload_blocks_used", "Host KV tier blocks holding an evicted block.", host_blocks_used_);
    gauge("m3:kv_offload_blocks_total", "Host KV tier blocks (--kv-offloading-size).", host_blocks_total_);
    counter("m3:kv_offload_stored_blocks_total", "KV blocks copied to host memory on eviction.", double(kv_offloaded_));
    counter("m3:kv_offload_loaded_blocks_total", "KV blocks copied back from host memory for a prefix hit.",
            double(kv_loaded_));
    counter("m3:kv_offload_prefix_hits_total", "Prompt tokens of prefix hits served from host memory.",
            double(host_hit_tokens_));
  }
  if (speculative_) {
    counter("vllm:spec_decode_num_drafts_total", "Requests' drafts verified.", double(spec_.drafts));
    counter("vllm:spec_decode_num_draft_tokens_total", "Draft tokens verified.", double(spec_.draft_tokens));
    counter("vllm:spec_decode_num_accepted_tokens_total", "Draft tokens accepted.", double(spec_.accepted));
    header(out, "vllm:spec_decode_num_accepted_tokens_per_pos_total", "counter", "Draft tokens accepted, by position in the draft.");
    for (size_t p = 0; p < spec_.accepted_per_pos.size(); ++p)
      sample(out, "vllm:spec_decode_num_accepted_tokens_per_pos_total", labels_ + ",position=\"" + std::to_string(p) + "\"",
             double(spec_.accepted_per_pos[p]));
  }
  if (!cache_info_labels_.empty()) {
    header(out, "vllm:cache_config_info", "gauge", "KV cache configuration (labels).");
    sample(out, "vllm:cache_config_info", labels_ + cache_info_labels_, 1.0);
  }
  return out;
}

}  // namespace m3::server
