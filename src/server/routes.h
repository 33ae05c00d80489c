#pragma once
// HTTP routes of the OpenAI-compatible server (cpp-httplib). Handler threads parse and
// validate, render the chat template, tokenize, submit to the AsyncEngine and stream back.
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include <httplib.h>

#include "disagg/transfer_store.h"
#include "server/async_engine.h"
#include "server/cors.h"
#include "server/json_mode.h"
#include "server/pattern_mode.h"
#include "server/responses_api.h"
#include "server/metrics.h"
#include "server/openai_protocol.h"
#include "tokenizer/tokenizer.h"

namespace m3::server {

struct ServerOptions {
  std::vector<std::string> served_model_names;  // the first is reported in responses
  std::string model_dir;
  std::string api_key;  // "" = no authentication
  size_t responses_store_size = 1024;  // stored Responses API responses (least recently used go first); 0 = none
  CorsPolicy cors;                     // cross-origin (browser) requests: any origin by default, as vLLM
  bool request_id_headers = false;     // vLLM's --enable-request-id-headers: X-Request-Id on generation answers
  bool log_requests = false;           // vLLM's --enable-log-requests: one line per generation request
  int max_log_len = -1;                // prompt characters logged with it (-1: all)
  // Disaggregated prefill (--kv-transfer-config).
  struct KvTransfer {
    bool producer = false;  // kv_producer / kv_both: keeps prompts' KV blocks for decode servers
    bool consumer = false;  // kv_consumer / kv_both: fetches them from prefill servers
    std::string advertise_url;           // the base URL decode servers fetch this server's blocks from
    size_t buffer_bytes = size_t(4) << 30;  // producer: serialized blocks held at most
    int64_t timeout_ms = 120000;           // producer: unfetched blocks dropped after this; consumer: fetch timeout
    bool fail_on_load_error = false;       // kv_load_failure_policy "fail" (else "recompute")
    bool device = false;  // M3CudaIpcConnector: pages stay in the producer's device memory for the consumer to copy
  } kv_transfer;
};

struct GenerationJob;

class ApiServer {
 public:
  ApiServer(ServerOptions options, const Tokenizer& tokenizer, AsyncEngine& engine, Metrics& metrics);
  void install(httplib::Server& http);
  // New generation requests get 503 from now on; in-flight ones run to completion.
  void start_draining() { draining_ = true; }
  // Generation requests whose response is not completely written yet.
  int32_t num_active() const { return active_.load(); }

 private:
  void handle_generation(const httplib::Request& req, httplib::Response& res, bool chat);
  void handle_responses(const httplib::Request& req, httplib::Response& res);
  void handle_stored_response(const httplib::Request& req, httplib::Response& res, bool input_items);
  void run_generation(GenerationJob&& job, httplib::Response& res);
  void handle_tokenize(const httplib::Request& req, httplib::Response& res);
  void handle_detokenize(const httplib::Request& req, httplib::Response& res);
  void handle_models(httplib::Response& res) const;
  OrderedJson model_card(const std::string& name) const;  // one entry of /v1/models
  void handle_debug_kernels(httplib::Response& res) const;
  void handle_debug_shapes(httplib::Response& res) const;
  // Consumer: a client to a prefill server (timeouts, the API key in `headers`), or null and why.
  std::unique_ptr<httplib::Client> kv_producer_client(const std::string& url, httplib::Headers& headers,
                                                      std::string& error) const;
  // Consumer: the blocks a prefill server kept for this request ("" error) or why not.
  std::shared_ptr<const KvBlocks> fetch_kv_blocks(const CommonRequest::KvTransferParams& params, std::string& error,
                                                  size_t& wire_bytes);
  // Consumer: tells the prefill server it may drop (and reuse the memory of) a transfer.
  void acknowledge_kv_blocks(const CommonRequest::KvTransferParams& params);
  // Producer: holds the blocks for a decode server; the answer's kv_transfer_params (null if too big).
  OrderedJson keep_kv_blocks(const KvBlocks& blocks);
  std::string new_response_id(const char* prefix);
  // 404 model_not_found when `model` is neither empty nor a served name.
  std::optional<ApiError> check_model(const std::string& model) const;

  ServerOptions options_;
  const Tokenizer& tokenizer_;
  AsyncEngine& engine_;
  Metrics& metrics_;
  std::atomic<bool> draining_{false};
  std::atomic<int32_t> active_{0};
  std::shared_ptr<const TokenBytes> token_bytes();  // built on the first structured-output request

  std::mutex id_mu_;
  std::once_flag token_bytes_once_;
  std::shared_ptr<const TokenBytes> token_bytes_;
  std::mt19937_64 id_rng_;
  ResponseStore store_;
  std::unique_ptr<KvTransferStore> kv_store_;  // producer only
};

void send_error(httplib::Response& res, const ApiError& error);

}  // namespace m3::server
