#include "bench/cli.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <memory>

#include <nlohmann/json.hpp>

#include "bench/bench_serve.h"
#include "bench/gsm8k.h"
#include "bench/http_client.h"
#include "bench/replay.h"
#include "bench/results.h"
#include "tokenizer/tokenizer.h"

namespace m3::bench {
namespace {

[[noreturn]] void fail(const std::string& message) {
  std::fprintf(stderr, "error: %s\n", message.c_str());
  throw CLI::RuntimeError(1);
}

// The tokenizer from --tokenizer, else from --model when that is a local directory.
std::unique_ptr<Tokenizer> load_tokenizer(const std::string& tokenizer_dir, const std::string& model,
                                          bool required, const std::string& why) {
  std::string dir = tokenizer_dir;
  std::error_code ec;
  if (dir.empty() && !model.empty() && std::filesystem::is_directory(model, ec)) dir = model;
  if (dir.empty()) {
    if (required) fail(why + " needs --tokenizer MODEL_DIR");
    return nullptr;
  }
  auto tok = Tokenizer::from_dir(dir);
  if (!tok) fail("tokenizer: " + tok.error());
  return std::move(tok.value());
}

// --model defaults to the first model the server lists, as vLLM's client does.
std::string resolve_model(const std::string& model, const std::string& base_url) {
  if (!model.empty()) return model;
  auto base = parse_base_url(base_url);
  if (!base) fail(base.error());
  HttpClient client(base->scheme_host_port, 30.0);
  auto res = client.get(join_url_path(base->path_prefix, "/v1/models"));
  if (!res || res->status != 200) {
    fail("no --model given and GET /v1/models failed: " + (res ? "HTTP " + std::to_string(res->status) : res.error()));
  }
  auto j = nlohmann::json::parse(res->body, nullptr, false);
  if (j.is_discarded() || !j.contains("data") || !j["data"].is_array() || j["data"].empty() ||
      !j["data"][0].contains("id") || !j["data"][0]["id"].is_string()) {
    fail("no --model given and /v1/models lists none");
  }
  return j["data"][0]["id"].get<std::string>();
}

double parse_rate(const std::string& text) {
  if (text == "inf" || text == "INF" || text == "infinity") return std::numeric_limits<double>::infinity();
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (end == text.c_str() || *end != '\0' || !(v > 0)) fail("--request-rate must be a positive number or inf");
  return v;
}

std::string default_gsm8k_dir() {
  if (const char* shared = std::getenv("M3_SHARED_DIR")) return std::string(shared) + "/data/gsm8k";
  return "../shared/data/gsm8k";
}

void add_serve(CLI::App& bench) {
  auto* cmd = bench.add_subcommand("serve", "Load-test an OpenAI-compatible server (vllm bench serve)");
  auto cfg = std::make_shared<BenchServeConfig>();
  auto tokenizer_dir = std::make_shared<std::string>();
  auto rate = std::make_shared<std::string>("inf");
  auto no_progress = std::make_shared<bool>(false);
  auto no_usage = std::make_shared<bool>(false);
  cmd->add_option("--base-url", cfg->base_url, "server URL")->capture_default_str();
  cmd->add_option("--endpoint", cfg->endpoint, "completions | chat | /v1/... path")->capture_default_str();
  cmd->add_option("--model", cfg->model, "model name sent in requests (default: first of /v1/models)");
  cmd->add_option("--tokenizer", *tokenizer_dir, "model directory with the tokenizer (default: --model if a directory)");
  cmd->add_option("--dataset-name", cfg->dataset, "random | sharegpt | sonnet")->capture_default_str();
  cmd->add_option("--dataset-path", cfg->dataset_path, "ShareGPT JSON or sonnet text file");
  cmd->add_option("--random-input-len", cfg->random_input_len)->capture_default_str();
  cmd->add_option("--random-output-len", cfg->random_output_len)->capture_default_str();
  cmd->add_option("--random-range-ratio", cfg->random_range_ratio, "lengths uniform in len*[1-r, 1+r]")->capture_default_str();
  cmd->add_option("--random-prefix-len", cfg->random_prefix_len, "random tokens shared by all prompts")->capture_default_str();
  cmd->add_option("--sharegpt-output-len", cfg->sharegpt_output_len, "0: the recorded reply length")->capture_default_str();
  cmd->add_option("--sonnet-input-len", cfg->sonnet_input_len)->capture_default_str();
  cmd->add_option("--sonnet-output-len", cfg->sonnet_output_len)->capture_default_str();
  cmd->add_option("--sonnet-prefix-len", cfg->sonnet_prefix_len)->capture_default_str();
  cmd->add_option("--num-prompts", cfg->num_prompts)->capture_default_str();
  cmd->add_option("--max-concurrency", cfg->max_concurrency, "0: unlimited")->capture_default_str();
  cmd->add_option("--request-rate", *rate, "requests/s (Poisson arrivals) or inf")->capture_default_str();
  cmd->add_option("--burstiness", cfg->burstiness, "gamma shape of inter-arrival gaps (1: Poisson)")->capture_default_str();
  cmd->add_flag("--ignore-eos", cfg->ignore_eos, "ask the server to ignore EOS (ignore_eos)");
  cmd->add_option("--temperature", cfg->temperature, "negative: not sent")->capture_default_str();
  cmd->add_flag("--send-token-ids", cfg->send_token_ids, "completions: send prompts as token id lists");
  cmd->add_option("--num-warmups", cfg->num_warmups, "unmeasured requests sent first")->capture_default_str();
  cmd->add_option("--seed", cfg->seed)->capture_default_str();
  cmd->add_option("--num-gpus", cfg->num_gpus, "GPUs serving, for per-GPU throughput")->capture_default_str();
  cmd->add_option("--timeout", cfg->timeout_s, "per-read timeout in seconds")->capture_default_str();
  cmd->add_flag("--no-usage", *no_usage, "do not request stream_options.include_usage");
  cmd->add_flag("--no-progress,--disable-tqdm", *no_progress, "no progress bar");
  cmd->add_flag("--save-detailed", cfg->save_detailed, "per-request timings in the result JSON");
  cmd->add_option("--sweep-concurrency", cfg->sweep_concurrency, "comma list: one run per max concurrency")->delimiter(',');
  cmd->add_option("--sweep-prompts-per-concurrency", cfg->sweep_prompts_per_concurrency,
                  "sweep: prompts per point = concurrency * this (0: --num-prompts)")->capture_default_str();
  cmd->add_option("--result-dir", cfg->result_dir)->capture_default_str();
  cmd->add_option("--result-file", cfg->result_file, "single run: file name in --result-dir");
  cmd->add_option("--label", cfg->label, "prefix of result file names")->capture_default_str();
  cmd->callback([cfg, tokenizer_dir, rate, no_progress, no_usage] {
    BenchServeConfig c = *cfg;
    c.request_rate = parse_rate(*rate);
    c.progress = !*no_progress;
    c.include_usage = !*no_usage;
    auto tok = load_tokenizer(*tokenizer_dir, c.model, true, "bench serve");
    c.model = resolve_model(c.model, c.base_url);
    auto result = run_bench_serve(c, tok.get());
    if (!result) fail(result.error());
  });
}

void add_replay(CLI::App& bench) {
  auto* cmd = bench.add_subcommand("replay", "Replay Mooncake / agentic-coding traces with their prefix sharing");
  auto cfg = std::make_shared<ReplayConfig>();
  auto tokenizer_dir = std::make_shared<std::string>();
  auto no_progress = std::make_shared<bool>(false);
  auto no_ignore_eos = std::make_shared<bool>(false);
  cmd->add_option("--base-url", cfg->base_url)->capture_default_str();
  cmd->add_option("--endpoint", cfg->endpoint, "completions | chat")->capture_default_str();
  cmd->add_option("--model", cfg->model, "model name (default: first of /v1/models)");
  cmd->add_option("--tokenizer", *tokenizer_dir, "model directory with the tokenizer (needed for text prompts)");
  cmd->add_option("--trace", cfg->traces, "trace file or directory (repeatable)")->required();
  cmd->add_option("--time-scale", cfg->time_scale, "send at trace time * this (0.1: 10x faster)")->capture_default_str();
  cmd->add_flag("--fixed-concurrency", cfg->fixed_concurrency, "ignore timestamps; keep --max-concurrency in flight");
  cmd->add_flag("--sessions", cfg->sessions,
                "agentic: a session's next request waits for its previous one, plus the recorded gap * time-scale");
  cmd->add_option("--max-concurrency", cfg->max_concurrency, "0: unlimited")->capture_default_str();
  cmd->add_option("--session-stagger", cfg->session_stagger_s, "seconds between trace files' starts")->capture_default_str();
  cmd->add_option("--max-requests", cfg->max_requests, "0: all")->capture_default_str();
  cmd->add_option("--max-input-len", cfg->max_input_len, "skip longer requests (0: none)")->capture_default_str();
  cmd->add_option("--max-output-len", cfg->max_output_len, "cap output tokens (0: as traced)")->capture_default_str();
  cmd->add_option("--prompt-format", cfg->prompt_format, "auto | ids | text")->capture_default_str();
  cmd->add_option("--token-id-min", cfg->token_id_min, "no tokenizer: lowest token id used")->capture_default_str();
  cmd->add_option("--token-id-max", cfg->token_id_max, "no tokenizer: token ids below this");
  cmd->add_option("--server-block-size", cfg->server_block_size, "also report the ideal hit rate at this block size");
  cmd->add_option("--metrics-interval", cfg->metrics_interval_s, "seconds between /metrics polls (0: off)")->capture_default_str();
  cmd->add_flag("--no-ignore-eos", *no_ignore_eos, "let requests stop at EOS (default: traced output length)");
  cmd->add_option("--num-gpus", cfg->num_gpus)->capture_default_str();
  cmd->add_option("--seed", cfg->seed)->capture_default_str();
  cmd->add_option("--timeout", cfg->timeout_s)->capture_default_str();
  cmd->add_flag("--no-progress,--disable-tqdm", *no_progress);
  cmd->add_flag("--save-detailed", cfg->save_detailed);
  cmd->add_option("--result-dir", cfg->result_dir)->capture_default_str();
  cmd->add_option("--result-file", cfg->result_file);
  cmd->add_option("--label", cfg->label)->capture_default_str();
  cmd->callback([cfg, tokenizer_dir, no_progress, no_ignore_eos] {
    ReplayConfig c = *cfg;
    c.progress = !*no_progress;
    c.ignore_eos = !*no_ignore_eos;
    auto tok = load_tokenizer(*tokenizer_dir, c.model, false, "bench replay");
    c.model = resolve_model(c.model, c.base_url);
    auto result = run_replay(c, tok.get());
    if (!result) fail(result.error());
  });
}

void add_gsm8k(CLI::App& eval) {
  auto* cmd = eval.add_subcommand("gsm8k", "5-shot GSM8K accuracy against an OpenAI-compatible server");
  auto cfg = std::make_shared<Gsm8kConfig>();
  cfg->data_dir = default_gsm8k_dir();
  auto result_dir = std::make_shared<std::string>("bench-results");
  auto result_file = std::make_shared<std::string>("eval-gsm8k.json");
  auto no_progress = std::make_shared<bool>(false);
  cmd->add_option("--base-url", cfg->base_url)->capture_default_str();
  cmd->add_option("--endpoint", cfg->endpoint, "completions | chat")->capture_default_str();
  cmd->add_option("--model", cfg->model, "model name (default: first of /v1/models)");
  cmd->add_option("--data-dir", cfg->data_dir, "directory with test.jsonl and train.jsonl")->capture_default_str();
  cmd->add_option("--limit", cfg->limit, "first N test questions (0: all)")->capture_default_str();
  cmd->add_option("--concurrency", cfg->concurrency)->capture_default_str();
  cmd->add_option("--num-fewshot", cfg->num_fewshot)->capture_default_str();
  cmd->add_option("--seed", cfg->seed, "few-shot sampling seed")->capture_default_str();
  cmd->add_option("--max-tokens", cfg->max_tokens)->capture_default_str();
  cmd->add_option("--timeout", cfg->timeout_s)->capture_default_str();
  cmd->add_flag("--no-progress,--disable-tqdm", *no_progress);
  cmd->add_option("--result-dir", *result_dir)->capture_default_str();
  cmd->add_option("--result-file", *result_file)->capture_default_str();
  cmd->callback([cfg, result_dir, result_file, no_progress] {
    Gsm8kConfig c = *cfg;
    c.progress = !*no_progress;
    c.model = resolve_model(c.model, c.base_url);
    auto result = run_gsm8k(c);
    if (!result) fail(result.error());
    const auto& r = *result;
    for (const char* key : {"strict_match", "flexible_extract"}) {
      const auto& s = r[key];
      std::printf("gsm8k %-17s accuracy %.4f  (%lld/%lld, 95%% Wilson [%.4f, %.4f])\n", key,
                  s["accuracy"].get<double>(), static_cast<long long>(s["correct"].get<int64_t>()),
                  static_cast<long long>(r["num_questions"].get<int64_t>()), s["ci95_low"].get<double>(),
                  s["ci95_high"].get<double>());
    }
    if (r["failed_requests"].get<int64_t>() > 0) {
      std::printf("failed requests: %lld %s\n", static_cast<long long>(r["failed_requests"].get<int64_t>()),
                  r["failure_reasons"].dump().c_str());
    }
    const std::string path = path_in_dir(*result_dir, *result_file);
    Status st = write_json_file(path, r);
    if (!st) fail(st.message());
    std::fprintf(stderr, "wrote %s\n", path.c_str());
  });
}

}  // namespace
}  // namespace m3::bench

void register_bench_commands(CLI::App& app) {
  auto* bench = app.add_subcommand("bench", "Benchmark clients for OpenAI-compatible servers");
  bench->require_subcommand(1);
  m3::bench::add_serve(*bench);
  m3::bench::add_replay(*bench);
}

void register_eval_commands(CLI::App& app) {
  auto* eval = app.add_subcommand("eval", "Accuracy evaluations against OpenAI-compatible servers");
  eval->require_subcommand(1);
  m3::bench::add_gsm8k(*eval);
}
