#include "bench/bench_serve.h"

#include <cmath>
#include <cstdio>

#include "bench/datasets.h"
#include "bench/http_client.h"
#include "bench/load_runner.h"
#include "bench/metrics.h"
#include "bench/progress.h"
#include "bench/results.h"
#include "bench/svg_chart.h"

namespace m3::bench {

using nlohmann::json;

namespace {

Result<std::vector<BenchPrompt>> make_prompts(const BenchServeConfig& c, const Tokenizer* tokenizer,
                                              size_t count) {
  if (tokenizer == nullptr) {
    return Status::error("dataset '" + c.dataset + "' needs a tokenizer (--tokenizer MODEL_DIR)");
  }
  if (c.dataset == "random") {
    RandomDatasetConfig r;
    r.input_len = c.random_input_len;
    r.output_len = c.random_output_len;
    r.range_ratio = c.random_range_ratio;
    r.prefix_len = c.random_prefix_len;
    r.num_prompts = count;
    r.seed = c.seed;
    return make_random_dataset(*tokenizer, r);
  }
  if (c.dataset == "sharegpt") {
    if (c.dataset_path.empty()) return Status::error("--dataset-name sharegpt needs --dataset-path");
    return load_sharegpt_dataset(*tokenizer, {c.dataset_path, count, c.sharegpt_output_len, c.seed});
  }
  if (c.dataset == "sonnet") {
    if (c.dataset_path.empty()) return Status::error("--dataset-name sonnet needs --dataset-path (a text file)");
    return make_sonnet_dataset(*tokenizer, {c.dataset_path, c.sonnet_input_len, c.sonnet_output_len,
                                            c.sonnet_prefix_len, count, c.seed});
  }
  return Status::error("unknown dataset '" + c.dataset + "' (random, sharegpt, sonnet)");
}

json config_to_json(const BenchServeConfig& c) {
  return {{"base_url", c.base_url},
          {"endpoint", c.endpoint},
          {"model", c.model},
          {"dataset", c.dataset},
          {"dataset_path", c.dataset_path},
          {"random_input_len", c.random_input_len},
          {"random_output_len", c.random_output_len},
          {"random_range_ratio", c.random_range_ratio},
          {"random_prefix_len", c.random_prefix_len},
          {"num_prompts", c.num_prompts},
          {"max_concurrency", c.max_concurrency},
          {"request_rate", std::isfinite(c.request_rate) ? json(c.request_rate) : json("inf")},
          {"burstiness", c.burstiness},
          {"ignore_eos", c.ignore_eos},
          {"temperature", c.temperature},
          {"send_token_ids", c.send_token_ids},
          {"num_warmups", c.num_warmups},
          {"seed", c.seed},
          {"num_gpus", c.num_gpus}};
}

struct PointResult {
  json result;
  BenchSummary summary;
};

Result<PointResult> run_point(const BenchServeConfig& c, const Tokenizer* tokenizer,
                              const std::vector<BenchPrompt>& prompts, size_t num_prompts,
                              const LoadConfig& base_load) {
  auto api = parse_api_kind(c.endpoint);
  if (!api) return api.status();
  std::vector<RequestSpec> specs;
  specs.reserve(num_prompts);
  for (size_t i = 0; i < num_prompts; ++i) {
    const BenchPrompt& p = prompts[i % prompts.size()];
    RequestSpec s;
    s.prompt = p.text;
    if (c.send_token_ids && *api == ApiKind::kCompletions) s.prompt_ids = p.ids;
    s.prompt_len = p.prompt_len;
    s.max_tokens = p.output_len;
    s.ignore_eos = c.ignore_eos;
    s.temperature = c.temperature;
    specs.push_back(std::move(s));
  }
  LoadConfig load = base_load;
  load.max_concurrency = c.max_concurrency;

  if (c.num_warmups > 0) {
    std::vector<RequestSpec> warm(specs.begin(), specs.begin() + std::min<size_t>(specs.size(), c.num_warmups));
    LoadConfig warm_load = load;
    warm_load.max_concurrency = c.max_concurrency > 0 ? std::min(c.max_concurrency, c.num_warmups) : c.num_warmups;
    ProgressBar warm_bar("warm-up", static_cast<int64_t>(warm.size()), c.progress);
    LoadResult w = run_load(warm_load, warm, {}, &warm_bar);
    size_t failed = 0;
    for (const auto& o : w.outcomes) failed += o.success ? 0 : 1;
    if (failed == w.outcomes.size()) {
      const auto& o = w.outcomes.front();
      return Status::error("all warm-up requests failed: " + o.error + " " + o.error_detail);
    }
  }

  const std::vector<double> arrivals = make_arrival_times(specs.size(), c.request_rate, c.burstiness, c.seed);
  char label[64];
  std::snprintf(label, sizeof(label), "c=%s", c.max_concurrency > 0 ? std::to_string(c.max_concurrency).c_str() : "inf");
  ProgressBar bar(label, static_cast<int64_t>(specs.size()), c.progress);
  LoadResult run = run_load(load, specs, arrivals, &bar);
  PointResult point;
  const TokenCountSources sources = resolve_output_tokens(run.outcomes, tokenizer);
  point.summary = summarize(run.outcomes, run.duration_s, c.num_gpus);
  point.summary.output_token_sources = sources;
  json cfg = config_to_json(c);
  cfg["num_prompts"] = num_prompts;
  point.result = {{"date", utc_timestamp()},
                  {"command", "bench serve"},
                  {"config", cfg},
                  {"max_concurrency", c.max_concurrency},
                  {"summary", summary_to_json(point.summary)}};
  if (c.save_detailed) point.result["requests"] = outcomes_to_json(run.outcomes);
  std::fputs(format_summary(point.summary, "Serving Benchmark Result (" + std::string(label) + ")").c_str(), stdout);
  std::fflush(stdout);
  return point;
}

}  // namespace

std::string render_sweep_chart(const json& points, const std::string& title) {
  ChartSeries tput{"output tok/s per GPU", {}, {}, {}};
  ChartSeries ttft_median{"median TTFT", {}, {}, {}};
  ChartSeries ttft_p99{"p99 TTFT", {}, {}, {}};
  for (const json& p : points) {
    const json& s = p["summary"];
    const double conc = p.value("max_concurrency", 0);
    const std::string tag = "c=" + std::to_string(static_cast<long>(conc));
    tput.x.push_back(s.value("interactivity_tok_s", 0.0));
    tput.y.push_back(s["per_gpu"].value("output_throughput", 0.0));
    tput.point_labels.push_back(tag);
    ttft_median.x.push_back(conc);
    ttft_median.y.push_back(s["ttft_ms"].value("median", 0.0));
    ttft_p99.x.push_back(conc);
    ttft_p99.y.push_back(s["ttft_ms"].value("p99", 0.0));
  }
  ChartPanel left{title + ": throughput vs interactivity", "interactivity (tok/s/user = 1000 / median TPOT ms)",
                  "output throughput per GPU (tok/s)", false, {tput}};
  ChartPanel right{title + ": TTFT vs concurrency", "max concurrency", "TTFT (ms)", true,
                   {ttft_median, ttft_p99}};
  return render_svg_chart({left, right});
}

Result<json> run_bench_serve(const BenchServeConfig& config, const Tokenizer* tokenizer) {
  auto api = parse_api_kind(config.endpoint);
  if (!api) return api.status();
  auto base = parse_base_url(config.base_url);
  if (!base) return base.status();
  if (config.num_prompts == 0 && config.sweep_prompts_per_concurrency == 0) {
    return Status::error("--num-prompts must be positive");
  }
  if (config.num_gpus < 1) return Status::error("--num-gpus must be at least 1");
  for (int conc : config.sweep_concurrency) {
    if (conc < 1) return Status::error("sweep concurrencies must be positive");
  }
  LoadConfig load;
  load.scheme_host_port = base->scheme_host_port;
  load.path = join_url_path(base->path_prefix, endpoint_path(config.endpoint));
  load.options.api = *api;
  load.options.model = config.model;
  load.options.stream = true;
  load.options.include_usage = config.include_usage;
  load.timeout_s = config.timeout_s;

  auto prompts_for = [&](int conc) {
    return config.sweep_prompts_per_concurrency > 0 ? config.sweep_prompts_per_concurrency * static_cast<size_t>(conc)
                                                    : config.num_prompts;
  };
  size_t max_prompts = config.num_prompts;
  for (int conc : config.sweep_concurrency) max_prompts = std::max(max_prompts, prompts_for(conc));
  auto prompts = make_prompts(config, tokenizer, std::max<size_t>(1, max_prompts));
  if (!prompts) return prompts.status();
  if (prompts->empty()) return Status::error("the dataset produced no prompts");

  if (config.sweep_concurrency.empty()) {
    auto point = run_point(config, tokenizer, *prompts, config.num_prompts, load);
    if (!point) return point.status();
    std::string name = config.result_file;
    if (name.empty()) {
      name = config.label + "-" + config.dataset + "-c" +
             (config.max_concurrency > 0 ? std::to_string(config.max_concurrency) : "inf") + ".json";
    }
    const std::string path = path_in_dir(config.result_dir, name);
    M3_RETURN_IF_ERROR(write_json_file(path, point->result));
    std::fprintf(stderr, "wrote %s\n", path.c_str());
    return point->result;
  }

  json points = json::array();
  for (int conc : config.sweep_concurrency) {
    BenchServeConfig c = config;
    c.max_concurrency = conc;
    auto point = run_point(c, tokenizer, *prompts, prompts_for(conc), load);
    if (!point) return point.status();
    const std::string path = path_in_dir(config.result_dir, config.label + "-c" + std::to_string(conc) + ".json");
    M3_RETURN_IF_ERROR(write_json_file(path, point->result));
    std::fprintf(stderr, "wrote %s\n", path.c_str());
    points.push_back(point->result);
  }
  json sweep = {{"date", utc_timestamp()},
                {"command", "bench serve (sweep)"},
                {"config", config_to_json(config)},
                {"concurrencies", config.sweep_concurrency},
                {"points", json::array()}};
  for (const json& p : points) {
    sweep["points"].push_back({{"max_concurrency", p["max_concurrency"]}, {"summary", p["summary"]}});
  }
  const std::string json_path = path_in_dir(config.result_dir, config.label + "-sweep.json");
  const std::string svg_path = path_in_dir(config.result_dir, config.label + "-sweep.svg");
  M3_RETURN_IF_ERROR(write_json_file(json_path, sweep));
  M3_RETURN_IF_ERROR(write_text_file(svg_path, render_sweep_chart(sweep["points"], config.label)));
  std::fprintf(stderr, "wrote %s and %s\n", json_path.c_str(), svg_path.c_str());
  return sweep;
}

}  // namespace m3::bench
