// `m3serve serve`: loads the tokenizer and the engine, starts the HTTP server, and on
// SIGINT/SIGTERM drains in-flight requests before exiting.
#include "server/cli.h"

#include <pthread.h>
#include <signal.h>
#include <unistd.h>
#include <sys/resource.h>
#include <sys/socket.h>

#include <cstdio>
#include <filesystem>
#include <ctime>
#include <future>
#include <fstream>
#include <sstream>
#include <memory>
#include <optional>
#include <stdexcept>
#include <thread>
#include <tuple>

#include "chat/chat_template.h"
#include "core/log.h"
#include "server/async_engine.h"
#include "server/routes.h"
#include "server/kv_transfer_config.h"
#include "server/speculative_config.h"

#ifndef M3_DEFAULT_MODEL_DIR
#define M3_DEFAULT_MODEL_DIR "models/m3-small"
#endif

namespace m3::server {
namespace {

constexpr int kListenBacklog = 4096;
constexpr int kIdleCloseWaitSeconds = 1;

struct ServeOptions {
  std::string model_dir = M3_DEFAULT_MODEL_DIR;
  std::string tokenizer_dir;
  std::string host = "0.0.0.0";
  int port = 8000;
  EngineConfig engine;
  std::vector<std::string> served_model_names;
  ServerOptions server;  // the flags that go to the API server as they are
  // vLLM flags accepted for command-line compatibility, checked in check_vllm_flags().
  std::string tool_call_parser, reasoning_parser, dtype = "auto";
  bool compat_flag = false;  // --enable-auto-tool-choice, --trust-remote-code: nothing to change
  std::optional<double> gpu_memory_utilization;
  std::string allowed_origins = "*", allowed_methods = "*", allowed_headers = "*";
  bool allow_credentials = false;
  int32_t max_pending = 1024;
  int http_threads = 1100;
  double log_stats_interval_s = 10.0;
  bool disable_log_stats = false;
  std::string speculative_config;
  double kv_offloading_size_gib = 0.0;
  std::string kv_offloading_backend = "native";
  std::string kv_transfer_config;
};

// vLLM's flags that have one meaning here are accepted (the M3 parsers always run, the weights
// load as stored); those asking for what this server does not do stop it with the reason.
void check_vllm_flags(const ServeOptions& o) {
  for (const auto& [flag, value] : {std::pair{"--tool-call-parser", &o.tool_call_parser},
                                    std::pair{"--reasoning-parser", &o.reasoning_parser}})
    if (!value->empty() && value->rfind("minimax", 0) != 0)
      throw std::runtime_error(std::string(flag) + " " + *value +
                               ": this server parses MiniMax-M3's format only (give a minimax_* parser or leave it out)");
  if (o.dtype != "auto" && o.dtype != "bfloat16" && o.dtype != "bf16")
    throw std::runtime_error("--dtype " + o.dtype + ": weights load as stored (BF16 or MXFP8); give auto or bfloat16");
  if (o.gpu_memory_utilization)
    throw std::runtime_error("--gpu-memory-utilization: the KV cache is sized by --kv-cache-memory BYTES or "
                             "--num-gpu-blocks-override N (no memory profiling run here)");
}

// A one-line progress bar on stderr, redrawn when the percentage changes.
std::function<void(size_t, size_t)> progress_bar() {
  auto last = std::make_shared<int>(-1);
  const int step = isatty(STDERR_FILENO) ? 1 : 25;  // a log file gets a few lines, a terminal a live bar
  return [last, step](size_t done, size_t total) {
    if (total == 0) return;
    const int pct = int(100.0 * double(done) / double(total)) / step * step;
    if (pct == *last) return;
    *last = pct;
    const int width = 40, filled = pct * width / 100;
    std::fprintf(stderr, "%sloading weights [%s%s] %3d%% %.1f/%.1f MB", step == 1 ? "\r" : "",
                 std::string(size_t(filled), '#').c_str(),
                 std::string(size_t(width - filled), '.').c_str(), pct, double(done) / 1e6, double(total) / 1e6);
    if (done >= total || step > 1) std::fprintf(stderr, "\n");
    std::fflush(stderr);
  };
}

void serve(ServeOptions& o, const EngineFactory& factory) {
  // Signals are taken synchronously by this thread (sigwait); every thread started below
  // inherits the blocked mask. A client that vanishes must not kill the process.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  signal(SIGPIPE, SIG_IGN);
  // One socket per open connection: take the hard file limit, as a server should.
  rlimit files{};
  if (getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur < files.rlim_max) {
    files.rlim_cur = files.rlim_max;
    setrlimit(RLIMIT_NOFILE, &files);
  }

  check_vllm_flags(o);
  CorsPolicy cors;
  for (auto [flag, value, list] : {std::tuple{"--allowed-origins", &o.allowed_origins, &cors.origins},
                                   std::tuple{"--allowed-methods", &o.allowed_methods, &cors.methods},
                                   std::tuple{"--allowed-headers", &o.allowed_headers, &cors.headers}})
    if (auto err = parse_cors_list(flag, *value, *list)) throw std::runtime_error(*err);
  cors.credentials = o.allow_credentials;
  if (o.kv_offloading_size_gib < 0) throw std::runtime_error("--kv-offloading-size must be >= 0 GiB");
  if (o.kv_offloading_backend != "native")
    throw std::runtime_error("--kv-offloading-backend " + o.kv_offloading_backend +
                             ": only native (host memory in this process) is built in");
  o.engine.kv_offload_bytes = int64_t(o.kv_offloading_size_gib * double(int64_t(1) << 30));
  if (!o.speculative_config.empty())
    if (auto err = parse_speculative_config(o.speculative_config, o.engine)) throw std::runtime_error(*err);
  if (!o.kv_transfer_config.empty())
    if (auto err = parse_kv_transfer_config(o.kv_transfer_config, o.host, o.port, o.server.kv_transfer, o.engine))
      throw std::runtime_error(*err);

  o.engine.model_dir = o.model_dir;
  o.engine.on_load_progress = progress_bar();
  if (o.served_model_names.empty()) o.served_model_names.push_back(o.model_dir);
  const std::string tokenizer_dir = o.tokenizer_dir.empty() ? o.model_dir : o.tokenizer_dir;

  if (!std::filesystem::is_directory(o.model_dir))
    throw std::runtime_error("model directory " + o.model_dir + " not found" +
                             (o.model_dir == M3_DEFAULT_MODEL_DIR ? " (the bundled m3-small is not there; pass MODEL_DIR)" : ""));
  auto tokenizer = Tokenizer::from_dir(tokenizer_dir);
  if (!tokenizer) throw std::runtime_error("tokenizer: " + tokenizer.error());
  ChatTemplateCheck check = check_chat_template(o.model_dir);
  if (!check.found) M3_LOG_INFO("chat template: " + check.message);
  else if (!check.matches) M3_LOG_WARN("chat template: " + check.message);
  else M3_LOG_INFO("chat template: " + check.message);

  Result<std::unique_ptr<Engine>> engine = factory ? factory(o.engine, **tokenizer) : Engine::create(o.engine);
  if (!engine) throw std::runtime_error("engine: " + engine.error());
  const ModelSummary summary = (*engine)->model();
  M3_LOG_INFO("model " + o.model_dir + ": vocab " + std::to_string(summary.vocab_size) + ", max_model_len " +
              std::to_string(summary.max_model_len) + ", " + std::to_string(summary.num_kv_blocks) + " KV blocks of " +
              std::to_string(summary.block_size) + " tokens (KV " + summary.kv_cache_dtype + ", index keys " +
              summary.index_cache_dtype + "), on " + summary.device +
              (summary.tensor_parallel_size > 1 ? " x " + std::to_string(summary.tensor_parallel_size) + " ranks" : "") +
              " (" + std::to_string(summary.weight_bytes >> 20) + " MiB of weights)");
  if (summary.msa_index_reuse > 1)
    M3_LOG_WARN("MSA index sharing: groups of " + std::to_string(summary.msa_index_reuse) +
                " sparse layers share one block selection (an approximation of the model)");
  if (summary.num_host_kv_blocks > 0)
    M3_LOG_INFO("KV offloading: " + std::to_string(summary.num_host_kv_blocks) + " blocks of host memory (" +
                std::to_string(o.engine.kv_offload_bytes >> 20) + " MiB)");
  if (o.server.kv_transfer.producer || o.server.kv_transfer.consumer)
    M3_LOG_INFO(std::string("disaggregated prefill: ") +
                (o.server.kv_transfer.producer && o.server.kv_transfer.consumer ? "kv_both"
                 : o.server.kv_transfer.producer                                ? "kv_producer"
                                                                                : "kv_consumer") +
                (o.server.kv_transfer.producer ? ", blocks fetched from " + o.server.kv_transfer.advertise_url : "") +
                ", KV layout " + (*engine)->kv_layout());
  if (summary.speculative_method == "ngram")
    M3_LOG_INFO("speculative decoding: ngram, " + std::to_string(o.engine.ngram.num_speculative_tokens) +
                " draft tokens, prompt lookup " + std::to_string(o.engine.ngram.prompt_lookup_min) + ".." +
                std::to_string(o.engine.ngram.prompt_lookup_max) + " tokens");
  else if (summary.speculative_method == "eagle3")
    M3_LOG_INFO("speculative decoding: EAGLE-3 draft " + summary.speculative_model + " (" +
                std::to_string(summary.draft_weight_bytes >> 20) + " MiB of weights per rank), " +
                std::to_string(o.engine.ngram.num_speculative_tokens) + " draft tokens");
  if ((*tokenizer)->vocab_size() > summary.vocab_size)
    M3_LOG_WARN("the tokenizer has " + std::to_string((*tokenizer)->vocab_size()) + " ids but the model only " +
                std::to_string(summary.vocab_size));

  Metrics metrics(o.served_model_names.front(), summary.max_model_len);
  AsyncEngine async(std::move(*engine), metrics,
                    AsyncEngineConfig{o.max_pending, o.disable_log_stats ? 0.0 : o.log_stats_interval_s});
  ServerOptions server_options = o.server;
  server_options.served_model_names = o.served_model_names;
  server_options.model_dir = o.model_dir;
  server_options.cors = cors;
  ApiServer api(server_options, **tokenizer, async, metrics);

  httplib::Server http;
  const size_t threads = size_t(std::max(4, o.http_threads));
  http.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  http.set_payload_max_length(size_t(64) << 20);
  http.set_read_timeout(30, 0);
  // httplib closes a connection whose (first) request has not arrived within the keep-alive
  // timeout (5 s by default): too short for a burst of clients on a busy host.
  http.set_keep_alive_timeout(30);
  http.set_write_timeout(30, 0);
  // cpp-httplib 0.11 listens with a backlog of 5, which resets connections under a burst;
  // remember the socket and widen the backlog after binding (listen() again updates it).
  auto listen_socket = std::make_shared<socket_t>(INVALID_SOCKET);
  http.set_socket_options([listen_socket](socket_t sock) {
    httplib::default_socket_options(sock);
    *listen_socket = sock;
  });
  api.install(http);
  if (!http.bind_to_port(o.host, o.port))
    throw std::runtime_error("cannot listen on " + o.host + ":" + std::to_string(o.port));
  if (*listen_socket != INVALID_SOCKET && ::listen(*listen_socket, kListenBacklog) != 0)
    M3_LOG_WARN("could not widen the listen backlog");
  std::promise<void> listener_done;
  std::future<void> listener_finished = listener_done.get_future();
  std::thread listener([&http, &listener_done] {
    http.listen_after_bind();
    listener_done.set_value();
  });
  M3_LOG_INFO("serving " + o.served_model_names.front() + " on http://" + o.host + ":" + std::to_string(o.port) +
              " (" + std::to_string(threads) + " HTTP threads, max " + std::to_string(o.max_pending) + " pending)");

  int sig = 0;
  sigwait(&signals, &sig);
  M3_LOG_INFO(std::string("received ") + (sig == SIGINT ? "SIGINT" : "SIGTERM") + ": draining " +
              std::to_string(async.num_in_flight()) + " in-flight requests (signal again to stop waiting)");
  api.start_draining();
  while (api.num_active() > 0 || async.num_in_flight() > 0) {
    timespec wait{0, 50 * 1000 * 1000};
    if (sigtimedwait(&signals, nullptr, &wait) > 0) {
      M3_LOG_WARN("second signal: closing connections without waiting");
      break;
    }
  }
  http.stop();
  async.shutdown();
  // Every response is written by now. httplib 0.11 joins its workers only when idle
  // keep-alive connections time out (up to the keep-alive timeout), and cannot close them
  // early; give them a moment, then exit without waiting for idle sockets.
  if (listener_finished.wait_for(std::chrono::seconds(kIdleCloseWaitSeconds)) != std::future_status::ready) {
    M3_LOG_INFO("server stopped (idle keep-alive connections closed)");
    std::fflush(nullptr);
    std::_Exit(0);
  }
  listener.join();
  M3_LOG_INFO("server stopped");
}

}  // namespace

void register_serve_command(CLI::App& app, EngineFactory factory) {
  auto* cmd = app.add_subcommand("serve", "OpenAI-compatible HTTP server (vllm serve flags)");
  auto o = std::make_shared<ServeOptions>();
  cmd->add_option("model", o->model_dir, "HF model directory (default: the bundled m3-small)")->capture_default_str();
  cmd->add_option("--tokenizer", o->tokenizer_dir, "tokenizer directory (default: the model directory)");
  cmd->add_option("--host", o->host)->capture_default_str();
  cmd->add_option("--port", o->port)->capture_default_str();
  cmd->add_option("--max-model-len", o->engine.max_model_len, "0 = the model / KV pool limit")->capture_default_str();
  cmd->add_option("--max-num-seqs", o->engine.max_num_seqs)->capture_default_str();
  cmd->add_option("--max-num-batched-tokens", o->engine.max_num_batched_tokens)->capture_default_str();
  cmd->add_flag("--enable-prefix-caching,!--no-enable-prefix-caching", o->engine.enable_prefix_caching,
                "prefix caching (on by default)");
  cmd->add_option("--served-model-name", o->served_model_names, "model name(s) clients use (default: the model dir)");
  cmd->add_option("--api-key", o->server.api_key, "require 'Authorization: Bearer KEY' on every route but /health");
  cmd->add_option("--allowed-origins", o->allowed_origins,
                  "origins allowed cross-origin requests: a JSON list as vLLM's ('[\"http://a\"]') or a comma list; "
                  "default \"*\" (any)");
  cmd->add_option("--allowed-methods", o->allowed_methods, "methods allowed cross-origin (default \"*\")");
  cmd->add_option("--allowed-headers", o->allowed_headers, "request headers allowed cross-origin (default \"*\")");
  cmd->add_flag("--allow-credentials", o->allow_credentials, "allow cross-origin requests with credentials");
  cmd->add_option("--long-prefill-token-threshold", o->engine.long_prefill_token_threshold,
                  "most prompt tokens one request prefills per step (0: the whole --max-num-batched-tokens), so "
                  "a long prompt leaves room for other requests' decode steps")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd->add_option("--seed", o->engine.seed,
                  "seed of the engine's sampling: requests without a seed become reproducible run to run "
                  "(default: unseeded)");
  cmd->add_option("--speculative-config", o->speculative_config,
                  "speculative decoding as vLLM's JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": K, "
                  "\"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}: drafts from the request's own tokens; or "
                  "{\"method\": \"eagle3\", \"model\": DRAFT_DIR, \"num_speculative_tokens\": K}: drafts from an "
                  "EAGLE-3 draft model fed the model's hidden states. Drafts are verified in one step; the output "
                  "is unchanged");
  cmd->add_option("--kv-transfer-config", o->kv_transfer_config,
                  "disaggregated prefill as vLLM's JSON: {\"kv_connector\": \"M3HttpConnector\" | \"M3CudaIpcConnector\", \"kv_role\": "
                  "\"kv_producer\" | \"kv_consumer\" | \"kv_both\", \"kv_buffer_size\": BYTES, \"kv_ip\": HOST, "
                  "\"kv_load_failure_policy\": \"recompute\" | \"fail\"}; a producer keeps a finished prefill's KV "
                  "blocks for a decode server (requests with kv_transfer_params.do_remote_decode), a consumer "
                  "fetches them (do_remote_prefill) into its host KV tier; `m3serve disagg-proxy` routes between them");
  cmd->add_flag("--speculative-cuda-graphs", o->engine.spec_cuda_graphs,
                "with --speculative-config: verification steps replay a CUDA graph (every request verifies a "
                "full-length draft, short ones filled); pays where steps are bound by weight reads");
  cmd->add_flag("--enable-chunked-prefill", o->compat_flag, "vLLM compatibility: prefills are always chunked");
  cmd->add_flag("--enable-server-load-tracking", o->compat_flag, "vLLM compatibility: GET /load always answers");
  cmd->add_option("--scheduling-policy", o->engine.scheduling_policy,
                  "fcfs (arrival order) or priority (requests' 'priority', lower first; the least urgent is "
                  "preempted first)")
      ->check(CLI::IsMember({"fcfs", "priority"}))
      ->capture_default_str();
  cmd->add_flag("--enable-request-id-headers", o->server.request_id_headers,
                "answer generation requests with X-Request-Id (the request's X-Request-Id or request_id, else the "
                "response id)");
  cmd->add_flag("--enable-log-requests,!--disable-log-requests", o->server.log_requests,
                "log one line per generation request (off by default)");
  cmd->add_flag("--disable-log-stats", o->disable_log_stats,
                "no periodic stats line (prompt / generation throughput, running / waiting, KV use, prefix hits)");
  cmd->add_option("--log-stats-interval", o->log_stats_interval_s, "seconds between stats lines while busy")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->add_option("--max-log-len", o->server.max_log_len, "prompt characters in a logged request (default: all)");
  cmd->add_option("--tool-call-parser", o->tool_call_parser, "vLLM compatibility: minimax_* (M3's parser always runs)");
  cmd->add_option("--reasoning-parser", o->reasoning_parser, "vLLM compatibility: minimax_* (M3's parser always runs)");
  cmd->add_flag("--enable-auto-tool-choice", o->compat_flag, "vLLM compatibility: tool calls are always parsed");
  cmd->add_flag("--trust-remote-code", o->compat_flag, "vLLM compatibility: no code is loaded from the model directory");
  cmd->add_option("--dtype", o->dtype, "vLLM compatibility: auto or bfloat16 (weights load as stored)");
  cmd->add_option("--tensor-parallel-size", o->engine.tensor_parallel_size,
                  "split the model's heads and MLP / expert widths over N ranks (threads of this process; the "
                  "CPU backend for now, CUDA ranks need NCCL)");
  cmd->add_option("--gpu-memory-utilization", o->gpu_memory_utilization,
                  "not supported: size the KV cache with --kv-cache-memory or --num-gpu-blocks-override");
  cmd->add_option("--responses-store-size", o->server.responses_store_size,
                  "Responses API responses kept in memory for GET /v1/responses/{id} and previous_response_id "
                  "(least recently used dropped first; 0 = store none)");
  cmd->add_option("--kv-cache-memory", o->engine.kv_cache_memory_bytes, "bytes of KV cache")->capture_default_str();
  cmd->add_option("--kv-offloading-size", o->kv_offloading_size_gib,
                  "GiB of host memory that keep KV blocks evicted from the KV cache; a later request with their "
                  "prefix loads them back instead of recomputing them (0: off; needs prefix caching)")
      ->capture_default_str();
  cmd->add_option("--msa-index-reuse", o->engine.msa_index_reuse,
                  "MSA index sharing: groups of N consecutive sparse layers use the first one's block selection "
                  "(the others skip their indexer and index-key cache); changes the output, 1 = off")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  cmd->add_option("--kv-offloading-backend", o->kv_offloading_backend, "native (the only one built in)")
      ->capture_default_str();
  cmd->add_option("--num-gpu-blocks-override", o->engine.num_kv_blocks, "KV blocks (overrides --kv-cache-memory)");
  cmd->add_option("--device", o->engine.device, "auto (CUDA when a GPU is present), cuda or cpu")
      ->check(CLI::IsMember({"auto", "cuda", "cpu"}))
      ->capture_default_str();
  cmd->add_option("--device-id", o->engine.device_id,
                  "CUDA device ordinal (tensor parallel rank r runs on this + r)")->capture_default_str();
  cmd->add_option("--kv-cache-dtype", o->engine.kv_cache_dtype, "KV cache element type: auto (bf16 on CUDA, f32 on CPU), f32, bf16")
      ->check(CLI::IsMember({"auto", "f32", "bf16"}))
      ->capture_default_str();
  cmd->add_option("--index-cache-dtype", o->engine.index_cache_dtype,
                  "MSA index-key cache element type: auto (the KV cache's), f32, bf16, fp8 (e4m3: half of bf16's "
                  "bytes for the indexer's scan, coarser block scores)")
      ->check(CLI::IsMember({"auto", "f32", "bf16", "fp8"}))
      ->capture_default_str();
  cmd->add_flag("--enforce-eager{false}", o->engine.cuda_graphs,
                "run decode steps eagerly instead of replaying a CUDA graph per batch bucket");
  cmd->add_flag("--dequantize-mxfp8", o->engine.dequantize_mxfp8, "hold MXFP8 weights as BF16 on the GPU (twice the bytes)");
  cmd->add_flag("--no-batch-invariant{false}", o->engine.batch_invariant,
                "allow kernels whose per-token results depend on the batch (cuBLAS / BLAS GEMMs)");
  cmd->add_flag("--trace-dispatch", o->engine.trace_dispatch, "log the first use of each (op, kernel, shape class)");
  cmd->add_option("--max-pending", o->max_pending, "requests in flight before new ones get 503")->capture_default_str();
  cmd->add_option("--http-threads", o->http_threads, "HTTP worker threads (one per open connection)")
      ->capture_default_str();
  cmd->add_option("--prefix-hash-seed", o->engine.prefix_hash_seed, "seed of the prefix-cache block hashes");
  cmd->callback([o, factory] { serve(*o, factory); });
}

}  // namespace m3::server
