#include "bench/replay.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <thread>

#include "bench/datasets.h"
#include "bench/http_client.h"
#include "bench/load_runner.h"
#include "bench/metrics.h"
#include "bench/progress.h"
#include "bench/results.h"
#include "bench/trace_replay.h"
#include "tokenizer/tokenizer.h"

namespace m3::bench {

using nlohmann::json;

namespace {

const std::vector<std::string> kKvUsageNames = {"vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
                                                "m3:kv_cache_usage_perc"};
const std::vector<std::string> kHitNames = {"vllm:prefix_cache_hits_total", "vllm:prefix_cache_hits",
                                            "vllm:gpu_prefix_cache_hits_total", "m3:prefix_cache_hits_total"};
const std::vector<std::string> kQueryNames = {"vllm:prefix_cache_queries_total", "vllm:prefix_cache_queries",
                                              "vllm:gpu_prefix_cache_queries_total", "m3:prefix_cache_queries_total"};

struct MetricsSnapshot {
  bool ok = false;
  std::map<std::string, double> values;
};

MetricsSnapshot scrape(HttpClient& client, const std::string& path) {
  MetricsSnapshot snap;
  auto res = client.get(path);
  if (res && res->status == 200) {
    snap.ok = true;
    snap.values = parse_prometheus_text(res->body);
  }
  return snap;
}

// Polls /metrics for KV-cache usage while the replay runs.
class KvUsagePoller {
 public:
  KvUsagePoller(const std::string& host, const std::string& path, double interval_s)
      : host_(host), path_(path), interval_s_(interval_s) {
    if (interval_s_ > 0) thread_ = std::thread([this] { loop(); });
  }
  ~KvUsagePoller() { stop(); }
  void stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }
  std::vector<double> samples() const { return samples_; }  // after stop()

 private:
  void loop() {
    HttpClient client(host_, 5.0);
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      lock.unlock();
      MetricsSnapshot snap = scrape(client, path_);
      lock.lock();
      if (!snap.ok) break;  // no /metrics: stop asking
      if (const double* v = find_metric(snap.values, kKvUsageNames)) samples_.push_back(*v);
      else break;
      cv_.wait_for(lock, std::chrono::duration<double>(interval_s_), [this] { return stop_; });
    }
  }
  std::string host_, path_;
  double interval_s_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::vector<double> samples_;
  std::thread thread_;
};

Result<std::vector<int32_t>> token_pool(const ReplayConfig& c, const Tokenizer* tokenizer) {
  std::vector<int32_t> pool;
  if (tokenizer != nullptr) {
    pool = word_token_pool(*tokenizer);
    if (pool.size() < 64) {
      return Status::error("tokenizer has too few plain word tokens (" + std::to_string(pool.size()) +
                           ") to synthesise prompts");
    }
    return pool;
  }
  if (c.token_id_max <= c.token_id_min || c.token_id_min < 0) {
    return Status::error("without --tokenizer, give the token id range (--token-id-min/--token-id-max)");
  }
  for (int32_t id = c.token_id_min; id < c.token_id_max; ++id) pool.push_back(id);
  return pool;
}

// Whether the completions endpoint takes a list of token ids as the prompt.
bool server_accepts_token_ids(const std::string& host, const std::string& path, const std::string& model,
                              const std::vector<int32_t>& pool, std::string* detail) {
  HttpClient client(host, 60.0);
  json body = {{"model", model}, {"prompt", {pool[0], pool[1], pool[2]}}, {"max_tokens", 1}, {"stream", false}};
  auto res = client.post_json(path, body.dump());
  if (!res) {
    *detail = res.error();
    return false;
  }
  *detail = "HTTP " + std::to_string(res->status);
  return res->status == 200;
}

}  // namespace

Result<json> run_replay(const ReplayConfig& c, const Tokenizer* tokenizer) {
  auto api = parse_api_kind(c.endpoint);
  if (!api) return api.status();
  auto base = parse_base_url(c.base_url);
  if (!base) return base.status();
  if (c.traces.empty()) return Status::error("no trace given (--trace FILE_OR_DIR)");
  if (c.time_scale < 0) return Status::error("--time-scale must be >= 0");
  if (c.fixed_concurrency && c.max_concurrency <= 0) {
    return Status::error("--fixed-concurrency needs --max-concurrency");
  }
  std::vector<Trace> traces;
  std::vector<std::string> trace_paths;
  for (const std::string& t : c.traces) {
    auto files = list_trace_files(t);
    if (!files) return files.status();
    for (const std::string& f : *files) {
      auto trace = load_trace(f);
      if (!trace) return trace.status();
      trace_paths.push_back(f);
      traces.push_back(std::move(*trace));
    }
  }
  if (c.sessions) {
    for (const Trace& t : traces) {
      if (t.format != TraceFormat::kAgentic) return Status::error("--sessions needs agentic traces, not " + t.path);
    }
  }
  std::vector<TraceRequest> requests = merge_traces(traces, c.session_stagger_s);
  size_t skipped_long = 0;
  if (c.max_input_len > 0) {
    const size_t before = requests.size();
    requests.erase(std::remove_if(requests.begin(), requests.end(),
                                  [&](const TraceRequest& r) { return r.input_len > c.max_input_len; }),
                   requests.end());
    skipped_long = before - requests.size();
  }
  if (c.max_requests > 0 && requests.size() > c.max_requests) requests.resize(c.max_requests);
  if (requests.empty()) return Status::error("the traces hold no requests to send");
  const double t0 = requests.front().arrival_s;

  auto pool = token_pool(c, tokenizer);
  if (!pool) return pool.status();
  const PromptSynthesizer synth(std::move(*pool), c.seed);
  const std::string path = join_url_path(base->path_prefix, endpoint_path(c.endpoint));

  // Token ids need the completions endpoint and a server that takes them.
  bool send_ids = false;
  std::string probe_detail;
  if (c.prompt_format == "ids") {
    if (*api != ApiKind::kCompletions) return Status::error("--prompt-format ids needs the completions endpoint");
    send_ids = true;
  } else if (c.prompt_format == "auto") {
    const std::vector<int32_t> probe_ids = synth.block_tokens(0, 0, 3);
    send_ids = *api == ApiKind::kCompletions &&
               server_accepts_token_ids(base->scheme_host_port, path, c.model, probe_ids, &probe_detail);
  } else if (c.prompt_format != "text") {
    return Status::error("--prompt-format must be auto, ids or text");
  }
  if (!send_ids && tokenizer == nullptr) {
    return Status::error("sending prompts as text needs --tokenizer" +
                         (probe_detail.empty() ? std::string() : " (token-id probe: " + probe_detail + ")"));
  }

  const PrefixHitStats theory = theoretical_prefix_hits(requests, c.server_block_size);
  std::atomic<int64_t> text_len_max_error{0};
  std::atomic<int64_t> text_len_mismatches{0};
  auto make_spec = [&](size_t i) {
    const TraceRequest& r = requests[i];
    RequestSpec spec;
    std::vector<int32_t> ids = synth.synthesize(r, i);
    spec.prompt_len = static_cast<int64_t>(ids.size());
    if (send_ids) {
      spec.prompt_ids = std::move(ids);
    } else {
      spec.prompt = tokenizer->decode(ids);
      const auto err = std::abs(static_cast<int64_t>(tokenizer->encode(spec.prompt).size()) - spec.prompt_len);
      if (err != 0) ++text_len_mismatches;
      int64_t seen = text_len_max_error.load();
      while (err > seen && !text_len_max_error.compare_exchange_weak(seen, err)) {}
    }
    spec.max_tokens = std::max<int64_t>(1, c.max_output_len > 0 ? std::min(r.output_len, c.max_output_len) : r.output_len);
    spec.ignore_eos = c.ignore_eos;
    spec.temperature = 0.0;
    return spec;
  };
  std::vector<double> arrivals(requests.size(), 0.0);
  if (!c.fixed_concurrency) {
    for (size_t i = 0; i < requests.size(); ++i) arrivals[i] = (requests[i].arrival_s - t0) * c.time_scale;
  }
  std::vector<RequestDependency> dependencies;
  if (c.sessions) {
    for (const SessionLink& link : session_links(requests, c.time_scale)) {
      dependencies.push_back({link.after, link.gap_s});
    }
    for (size_t i = 0; i < requests.size(); ++i) {
      if (dependencies[i].after >= 0) arrivals[i] = 0.0;  // paced by its predecessor instead
    }
  }

  LoadConfig load;
  load.scheme_host_port = base->scheme_host_port;
  load.path = path;
  load.options.api = *api;
  load.options.model = c.model;
  load.timeout_s = c.timeout_s;
  load.max_concurrency = c.max_concurrency;

  // /metrics sits at the server root, beside (not under) the /v1 API prefix.
  std::string root = base->path_prefix;
  if (root.size() >= 3 && root.compare(root.size() - 3, 3, "/v1") == 0) root.resize(root.size() - 3);
  const std::string metrics_path = join_url_path(root, "/metrics");
  HttpClient metrics_client(base->scheme_host_port, 10.0);
  const MetricsSnapshot before = scrape(metrics_client, metrics_path);
  LoadResult run;
  std::vector<double> kv_samples;
  {
    KvUsagePoller poller(base->scheme_host_port, metrics_path, before.ok ? c.metrics_interval_s : 0.0);
    ProgressBar bar("replay", static_cast<int64_t>(requests.size()), c.progress);
    run = run_load(load, requests.size(), make_spec, arrivals, &bar, dependencies);
    poller.stop();
    kv_samples = poller.samples();
  }
  const MetricsSnapshot after = scrape(metrics_client, metrics_path);

  const TokenCountSources sources = resolve_output_tokens(run.outcomes, tokenizer);
  BenchSummary summary = summarize(run.outcomes, run.duration_s, c.num_gpus);
  summary.output_token_sources = sources;

  json prefix = {{"theoretical_hit_rate", theory.hit_rate()},
                 {"theoretical_hit_tokens", theory.hit_tokens},
                 {"theoretical_input_tokens", theory.input_tokens}};
  if (c.server_block_size > 0) {
    prefix["server_block_size"] = c.server_block_size;
    prefix["theoretical_hit_rate_server_blocks"] = theory.hit_rate_server_blocks();
  }
  if (summary.requests_with_cached_tokens > 0 && summary.usage_prompt_tokens > 0) {
    prefix["usage_hit_rate"] = static_cast<double>(summary.usage_cached_tokens) /
                               static_cast<double>(summary.usage_prompt_tokens);
  }
  if (before.ok && after.ok) {
    const double* h0 = find_metric(before.values, kHitNames);
    const double* q0 = find_metric(before.values, kQueryNames);
    const double* h1 = find_metric(after.values, kHitNames);
    const double* q1 = find_metric(after.values, kQueryNames);
    if (h0 && q0 && h1 && q1) {
      const double hits = *h1 - *h0, queries = *q1 - *q0;
      prefix["metrics_hits"] = hits;
      prefix["metrics_queries"] = queries;
      if (queries > 0) prefix["metrics_hit_rate"] = hits / queries;
    }
  }
  json kv = {{"samples", kv_samples.size()}};
  if (!kv_samples.empty()) {
    const Distribution d = summarize_distribution(kv_samples);
    kv["mean"] = d.mean;
    kv["max"] = d.max;
    kv["p90"] = d.p90;
  }
  json cfg = {{"base_url", c.base_url},
              {"endpoint", c.endpoint},
              {"model", c.model},
              {"traces", trace_paths},
              {"time_scale", c.time_scale},
              {"fixed_concurrency", c.fixed_concurrency},
              {"sessions", c.sessions},
              {"max_concurrency", c.max_concurrency},
              {"session_stagger_s", c.session_stagger_s},
              {"max_requests", c.max_requests},
              {"max_input_len", c.max_input_len},
              {"max_output_len", c.max_output_len},
              {"ignore_eos", c.ignore_eos},
              {"seed", c.seed},
              {"num_gpus", c.num_gpus}};
  json result = {{"date", utc_timestamp()},
                 {"command", "bench replay"},
                 {"config", cfg},
                 {"num_requests", requests.size()},
                 {"skipped_over_max_input_len", skipped_long},
                 {"prompt_format", send_ids ? "token_ids" : "text"},
                 {"summary", summary_to_json(summary)},
                 {"prefix_cache", prefix},
                 {"kv_cache_usage", kv}};
  if (!send_ids) {
    result["text_prompt_length"] = {{"mismatched_requests", text_len_mismatches.load()},
                                    {"max_abs_error_tokens", text_len_max_error.load()}};
  }
  if (c.save_detailed) result["requests"] = outcomes_to_json(run.outcomes);

  std::fputs(format_summary(summary, "Trace Replay Result").c_str(), stdout);
  std::printf("%-40s %12.4f\n", "Theoretical prefix hit rate:", theory.hit_rate());
  if (prefix.contains("usage_hit_rate")) {
    std::printf("%-40s %12.4f\n", "Server hit rate (usage cached_tokens):", prefix["usage_hit_rate"].get<double>());
  }
  if (prefix.contains("metrics_hit_rate")) {
    std::printf("%-40s %12.4f\n", "Server hit rate (/metrics):", prefix["metrics_hit_rate"].get<double>());
  }
  if (kv.contains("max")) std::printf("%-40s %12.4f\n", "KV cache usage max:", kv["max"].get<double>());
  std::fflush(stdout);

  const std::string name = c.result_file.empty() ? c.label + ".json" : c.result_file;
  const std::string out_path = path_in_dir(c.result_dir, name);
  M3_RETURN_IF_ERROR(write_json_file(out_path, result));
  std::fprintf(stderr, "wrote %s\n", out_path.c_str());
  return result;
}

}  // namespace m3::bench
