// Route handlers. Generation: validate → prompt ids → submit → stream or collect.
#include "server/routes.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>

#include "chat/chat_template.h"
#include "core/log.h"
#include "server/generation.h"

namespace m3::server {
namespace {

constexpr auto kPollInterval = std::chrono::milliseconds(50);
// An SSE comment after this much silence (queued or in a long prefill): a write is the only
// way to notice that a streaming client went away, and SSE clients ignore comments.
constexpr auto kHeartbeatInterval = std::chrono::seconds(1);
// The same probe for a JSON answer (a space): later, so quick answers come back unpadded.
constexpr auto kPlainProbeInterval = std::chrono::seconds(2);

int64_t unix_seconds() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

void send_json(httplib::Response& res, const OrderedJson& body, int status = 200) {
  res.status = status;
  res.set_content(dump_json(body), "application/json");
}

std::optional<ApiError> parse_body(const httplib::Request& req, OrderedJson& out) {
  try {
    out = OrderedJson::parse(req.body);
  } catch (const std::exception& e) {
    return invalid_request(std::string("malformed JSON in the request body: ") + e.what(), "body");
  }
  if (!out.is_object()) return invalid_request("the request body must be a JSON object", "body");
  return std::nullopt;
}

// A chat-template error names its field ("messages[2].role: ..."); report that field.
ApiError template_error(const std::string& message) {
  std::string param = message.substr(0, message.find(':'));
  if (param.size() == message.size() || param.find(' ') != std::string::npos) param = "messages";
  return invalid_request(message, param);
}

std::optional<ApiError> render_messages(const ChatRequest& chat, std::string& prompt) {
  ChatRenderOptions opts;
  opts.add_generation_prompt = chat.add_generation_prompt;
  opts.thinking_mode = chat.thinking_mode;
  opts.continue_final_message = chat.continue_final_message;
  opts.model_identity = chat.model_identity;
  auto rendered = render_chat(chat.messages, chat.tools, opts);
  if (!rendered) return template_error(rendered.error());
  prompt = std::move(*rendered);
  return std::nullopt;
}

ApiError response_not_found(const std::string& id) {
  return ApiError{404, "Response with id '" + id + "' not found.", "NotFoundError", "response_id", "response_not_found"};
}

}  // namespace

std::shared_ptr<const TokenBytes> ApiServer::token_bytes() {
  std::call_once(token_bytes_once_, [&] { token_bytes_ = std::make_shared<const TokenBytes>(tokenizer_); });
  return token_bytes_;
}

void send_error(httplib::Response& res, const ApiError& error) { send_json(res, error.to_json(), error.http_status); }

ApiServer::ApiServer(ServerOptions options, const Tokenizer& tokenizer, AsyncEngine& engine, Metrics& metrics)
    : options_(std::move(options)),
      tokenizer_(tokenizer),
      engine_(engine),
      metrics_(metrics),
      id_rng_(std::random_device{}()),
      store_(options_.responses_store_size) {
  if (options_.kv_transfer.producer)
    kv_store_ = std::make_unique<KvTransferStore>(options_.kv_transfer.buffer_bytes,
                                                  std::chrono::milliseconds(options_.kv_transfer.timeout_ms));
}

std::unique_ptr<httplib::Client> ApiServer::kv_producer_client(const std::string& url, httplib::Headers& headers,
                                                               std::string& error) const {
  auto cli = std::make_unique<httplib::Client>(url);
  if (url.rfind("http://", 0) != 0 || !cli->is_valid()) {
    error = "remote_url '" + url + "' is not an http://host:port URL";
    return nullptr;
  }
  const auto timeout = std::chrono::milliseconds(options_.kv_transfer.timeout_ms);
  cli->set_connection_timeout(timeout);
  cli->set_read_timeout(timeout);
  // The servers of a deployment share one API key.
  if (!options_.api_key.empty()) headers.emplace("Authorization", "Bearer " + options_.api_key);
  return cli;
}

std::shared_ptr<const KvBlocks> ApiServer::fetch_kv_blocks(const CommonRequest::KvTransferParams& params,
                                                           std::string& error, size_t& wire_bytes) {
  httplib::Headers headers;
  auto cli = kv_producer_client(params.remote_url, headers, error);
  if (!cli) return nullptr;
  const std::string path = "/v1/kv_transfer/" + params.transfer_id;
  auto r = cli->Get(path, headers);
  if (!r) {
    error = "fetching " + params.remote_url + path + " failed: " + httplib::to_string(r.error());
    return nullptr;
  }
  if (r->status != 200) {
    error = "fetching " + params.remote_url + path + " answered HTTP " + std::to_string(r->status) + ": " +
            r->body.substr(0, 300);
    return nullptr;
  }
  wire_bytes = r->body.size();
  Result<KvBlocks> blocks = parse_kv_blocks(r->body);
  if (!blocks) {
    error = blocks.error();
    return nullptr;
  }
  return std::make_shared<const KvBlocks>(std::move(*blocks));
}

std::string ApiServer::new_response_id(const char* prefix) {
  std::lock_guard<std::mutex> lock(id_mu_);
  char buf[40];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(id_rng_()));
  return std::string(prefix) + buf;
}

std::optional<ApiError> ApiServer::check_model(const std::string& model) const {
  if (model.empty()) return std::nullopt;
  for (const auto& name : options_.served_model_names)
    if (name == model) return std::nullopt;
  return ApiError{404, "The model `" + model + "` does not exist.", "NotFoundError", "model", "model_not_found"};
}

void ApiServer::install(httplib::Server& http) {
  http.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    // CORS first: a browser's preflight carries no API key, and every answer to an allowed
    // origin (errors included) must say so or the page cannot read it.
    const std::string origin = req.get_header_value("Origin");
    if (!origin.empty()) {
      if (req.method == "OPTIONS" && req.has_header("Access-Control-Request-Method")) {
        PreflightAnswer a = cors_preflight(options_.cors, origin, req.get_header_value("Access-Control-Request-Method"),
                                           req.get_header_value("Access-Control-Request-Headers"));
        for (const auto& [k, v] : a.headers) res.set_header(k.c_str(), v);
        res.status = a.status;
        res.set_content(a.body, "text/plain; charset=utf-8");
        return httplib::Server::HandlerResponse::Handled;
      }
      for (const auto& [k, v] : cors_response_headers(options_.cors, origin)) res.set_header(k.c_str(), v);
    }
    if (options_.api_key.empty() || req.path == "/health") return httplib::Server::HandlerResponse::Unhandled;
    if (req.get_header_value("Authorization") == "Bearer " + options_.api_key)
      return httplib::Server::HandlerResponse::Unhandled;
    send_error(res, ApiError{401, "Incorrect or missing API key (send 'Authorization: Bearer <key>').",
                             "AuthenticationError", "", "invalid_api_key"});
    return httplib::Server::HandlerResponse::Handled;
  });
  http.set_error_handler(httplib::Server::HandlerWithResponse([](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
    if (res.status == 404) {
      send_error(res, ApiError{404, "no route for " + req.method + " " + req.path, "NotFoundError", "", ""});
    } else {
      send_error(res, ApiError{res.status, "HTTP error " + std::to_string(res.status), "invalid_request_error", "", ""});
    }
    return httplib::Server::HandlerResponse::Handled;
  }));
  http.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
    std::string what = "internal error";
    try {
      if (ep) std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    send_error(res, ApiError{500, what, "InternalServerError", "", ""});
  });
  http.Get("/health", [](const httplib::Request&, httplib::Response& res) { res.status = 200; });
  http.Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) { handle_models(res); });
  // OpenAI's retrieve (client.models.retrieve); names may hold '/' (an HF repo id).
  http.Get(R"(/v1/models/(.+))", [this](const httplib::Request& req, httplib::Response& res) {
    const std::string id = req.matches[1];
    if (auto err = check_model(id)) return send_error(res, *err);
    send_json(res, model_card(id));
  });
  // vLLM's liveness probes and version.
  http.Get("/ping", [](const httplib::Request&, httplib::Response& res) { res.status = 200; });
  http.Post("/ping", [](const httplib::Request&, httplib::Response& res) { res.status = 200; });
  // vLLM's server-load probe (what its routers balance on): generation requests being answered.
  http.Get("/load", [this](const httplib::Request&, httplib::Response& res) {
    send_json(res, OrderedJson{{"server_load", active_.load()}});
  });
  http.Get("/version", [](const httplib::Request&, httplib::Response& res) {
    send_json(res, OrderedJson{{"version", M3_VERSION}});
  });
  http.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics_.render(), "text/plain; version=0.0.4; charset=utf-8");
  });
  http.Get("/debug/kernels", [this](const httplib::Request&, httplib::Response& res) { handle_debug_kernels(res); });
  http.Get("/debug/shapes", [this](const httplib::Request&, httplib::Response& res) { handle_debug_shapes(res); });
  http.Post("/tokenize", [this](const httplib::Request& req, httplib::Response& res) { handle_tokenize(req, res); });
  http.Post("/detokenize", [this](const httplib::Request& req, httplib::Response& res) { handle_detokenize(req, res); });
  http.Post("/v1/completions",
            [this](const httplib::Request& req, httplib::Response& res) { handle_generation(req, res, false); });
  http.Post("/v1/chat/completions",
            [this](const httplib::Request& req, httplib::Response& res) { handle_generation(req, res, true); });
  http.Post("/v1/responses", [this](const httplib::Request& req, httplib::Response& res) { handle_responses(req, res); });
  // SageMaker's single route (as vLLM serves it): the body's shape picks the API.
  http.Post("/invocations", [this](const httplib::Request& req, httplib::Response& res) {
    OrderedJson body;
    if (auto err = parse_body(req, body)) return send_error(res, *err);
    if (body.contains("messages")) return handle_generation(req, res, true);
    if (body.contains("prompt")) return handle_generation(req, res, false);
    if (body.contains("input")) return handle_responses(req, res);
    send_error(res, invalid_request("/invocations takes a chat ('messages'), completion ('prompt') or Responses "
                                    "('input') request body",
                                    "body"));
  });
  http.Get(R"(/v1/responses/([^/]+))", [this](const httplib::Request& req, httplib::Response& res) {
    handle_stored_response(req, res, false);
  });
  http.Get(R"(/v1/responses/([^/]+)/input_items)", [this](const httplib::Request& req, httplib::Response& res) {
    handle_stored_response(req, res, true);
  });
  if (kv_store_) {  // disaggregated prefill: decode servers fetch, then acknowledge, a prompt's blocks
    http.Get(R"(/v1/kv_transfer/([0-9a-f]+))", [this](const httplib::Request& req, httplib::Response& res) {
      auto blob = kv_store_->get(req.matches[1]);
      if (!blob)
        return send_error(res, ApiError{404, "KV transfer '" + std::string(req.matches[1]) +
                                                 "' is not held here (unknown, expired or already acknowledged)",
                                        "NotFoundError", "transfer_id", "kv_transfer_not_found"});
      res.status = 200;
      res.set_content(*blob, "application/octet-stream");
    });
    http.Delete(R"(/v1/kv_transfer/([0-9a-f]+))", [this](const httplib::Request& req, httplib::Response& res) {
      const std::string id = req.matches[1];
      if (!kv_store_->acknowledge(id))
        return send_error(res, ApiError{404, "KV transfer '" + id + "' is not held here", "NotFoundError", "transfer_id",
                                        "kv_transfer_not_found"});
      send_json(res, OrderedJson{{"id", id}, {"object", "kv_transfer"}, {"deleted", true}});
    });
  }
  http.Delete(R"(/v1/responses/([^/]+))", [this](const httplib::Request& req, httplib::Response& res) {
    const std::string id = req.matches[1];
    if (!store_.erase(id)) return send_error(res, response_not_found(id));
    send_json(res, OrderedJson{{"id", id}, {"object", "response.deleted"}, {"deleted", true}});
  });
}

OrderedJson ApiServer::model_card(const std::string& name) const {
  OrderedJson m = OrderedJson::object();
  m["id"] = name;
  m["object"] = "model";
  m["created"] = unix_seconds();
  m["owned_by"] = "m3serve";
  m["root"] = options_.model_dir;
  m["max_model_len"] = engine_.model().max_model_len;
  return m;
}

void ApiServer::handle_models(httplib::Response& res) const {
  OrderedJson data = OrderedJson::array();
  for (const auto& name : options_.served_model_names) data.push_back(model_card(name));
  send_json(res, OrderedJson{{"object", "list"}, {"data", std::move(data)}});
}

void ApiServer::handle_debug_kernels(httplib::Response& res) const {
  // "entries": every entry of every table with its rule and how often it was chosen (entries
  // that never ran, e.g. CUDA paths on a CPU run, show 0). "counts": the raw per (op, entry)
  // counts, where op is the problem's name (attention records attention_dense / _sparse).
  const auto& stats = engine_.dispatch_stats();
  const auto counts = stats.entry_counts();
  std::map<std::string, int64_t> by_entry;
  OrderedJson raw = OrderedJson::array();
  for (const auto& [key, count] : counts) {
    by_entry[key.second] += count;
    raw.push_back(OrderedJson{{"op", key.first}, {"entry", key.second}, {"count", count}});
  }
  OrderedJson entries = OrderedJson::array();
  for (const auto& e : engine_.kernel_entries())
    entries.push_back(OrderedJson{{"op", e.op}, {"entry", e.entry}, {"condition", e.condition}, {"count", by_entry[e.entry]}});
  OrderedJson first = OrderedJson::array();
  for (const auto& r : stats.first_uses())
    first.push_back(OrderedJson{
        {"op", r.op}, {"entry", r.entry}, {"shape_class", r.shape_class}, {"reason", r.reason}, {"plan", r.plan}});
  send_json(res, OrderedJson{{"entries", std::move(entries)}, {"counts", std::move(raw)}, {"first_uses", std::move(first)}});
}

void ApiServer::handle_debug_shapes(httplib::Response& res) const {
  OrderedJson ops = OrderedJson::object();
  for (const auto& [op, shapes] : engine_.dispatch_stats().shape_histogram()) {
    OrderedJson list = OrderedJson::array();
    for (const auto& [mnk, count] : shapes)
      list.push_back(OrderedJson{{"m", std::get<0>(mnk)}, {"n", std::get<1>(mnk)}, {"k", std::get<2>(mnk)}, {"count", count}});
    ops[op] = std::move(list);
  }
  send_json(res, OrderedJson{{"ops", std::move(ops)}});
}

void ApiServer::handle_tokenize(const httplib::Request& req, httplib::Response& res) {
  OrderedJson body;
  if (auto err = parse_body(req, body)) return send_error(res, *err);
  std::string text;
  if (body.contains("messages")) {
    ChatRequest chat;
    if (auto err = parse_chat_request(body, chat)) return send_error(res, *err);
    if (auto err = render_messages(chat, text)) return send_error(res, *err);
  } else if (body.contains("prompt")) {
    if (!body["prompt"].is_string()) return send_error(res, invalid_request("'prompt' must be a string", "prompt"));
    text = body["prompt"].get<std::string>();
  } else {
    return send_error(res, invalid_request("give 'prompt' (a string) or 'messages'", "prompt"));
  }
  if (body.contains("model") && body["model"].is_string())
    if (auto err = check_model(body["model"].get<std::string>())) return send_error(res, *err);
  bool token_strs = false;
  if (auto it = body.find("return_token_strs"); it != body.end() && !it->is_null()) {
    if (!it->is_boolean()) return send_error(res, invalid_request("'return_token_strs' must be a boolean", "return_token_strs"));
    token_strs = it->get<bool>();
  }
  auto ids = tokenizer_.encode(text, /*allow_special=*/true);
  OrderedJson out = OrderedJson::object();
  out["count"] = ids.size();
  out["max_model_len"] = engine_.model().max_model_len;
  out["tokens"] = ids;
  if (token_strs) {
    // vLLM's: each id's vocabulary entry (byte-level BPE spelling, as the tokenizer file has it).
    OrderedJson strs = OrderedJson::array();
    for (int32_t id : ids) strs.push_back(tokenizer_.id_to_token(id));
    out["token_strs"] = std::move(strs);
  }
  send_json(res, out);
}

void ApiServer::handle_detokenize(const httplib::Request& req, httplib::Response& res) {
  OrderedJson body;
  if (auto err = parse_body(req, body)) return send_error(res, *err);
  if (!body.contains("tokens") || !body["tokens"].is_array())
    return send_error(res, invalid_request("'tokens' must be an array of token ids", "tokens"));
  std::vector<int32_t> ids;
  for (const auto& t : body["tokens"]) {
    if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() >= tokenizer_.vocab_size())
      return send_error(res, invalid_request("'tokens' must hold ids in [0, " + std::to_string(tokenizer_.vocab_size()) + ")",
                                             "tokens"));
    ids.push_back(int32_t(t.get<int64_t>()));
  }
  send_json(res, OrderedJson{{"prompt", tokenizer_.decode(ids, false)}});
}

// One validated generation: what handle_generation and handle_responses hand to run_generation.
struct GenerationJob {
  bool chat = false;
  CompletionRequest completion;
  ChatRequest chat_req;
  bool stream = false;
  const char* prompt_param = "prompt";          // the field an over-long or empty prompt is blamed on
  const char* max_tokens_param = "max_tokens";  // the field an over-large token budget is blamed on
  std::optional<ResponsesShape> responses;      // the Responses API's output
  // After the last event, on the handler's thread (stores a Responses API response).
  std::function<void(const Generation&)> on_complete;
  std::string base_id;  // X-Request-Id, else the body's request_id, else "" (random)
};

namespace {

// vLLM's request id: the X-Request-Id header, else the body's request_id.
std::string base_request_id(const httplib::Request& req, const std::string& from_body) {
  std::string id = req.get_header_value("X-Request-Id");
  if (id.size() > 256) id.resize(256);
  return id.empty() ? from_body : id;
}

}  // namespace

void ApiServer::handle_generation(const httplib::Request& req, httplib::Response& res, bool chat) {
  OrderedJson body;
  if (auto err = parse_body(req, body)) return send_error(res, *err);
  GenerationJob job;
  job.chat = chat;
  if (auto err = chat ? parse_chat_request(body, job.chat_req) : parse_completion_request(body, job.completion))
    return send_error(res, *err);
  job.stream = chat ? job.chat_req.common.stream : job.completion.common.stream;
  job.base_id = base_request_id(req, chat ? job.chat_req.common.request_id : job.completion.common.request_id);
  job.prompt_param = chat ? "messages" : "prompt";
  if (chat && body.contains("max_completion_tokens")) job.max_tokens_param = "max_completion_tokens";
  run_generation(std::move(job), res);
}

void ApiServer::handle_responses(const httplib::Request& req, httplib::Response& res) {
  OrderedJson body;
  if (auto err = parse_body(req, body)) return send_error(res, *err);
  // The stored conversation this one continues.
  std::shared_ptr<const StoredResponse> previous;
  if (auto it = body.find("previous_response_id"); it != body.end() && it->is_string()) {
    previous = store_.get(it->get<std::string>());
    if (!previous)
      return send_error(res, ApiError{400, "Previous response with id '" + it->get<std::string>() + "' not found.",
                                      "invalid_request_error", "previous_response_id", "previous_response_not_found"});
  }
  ResponsesRequest request;
  auto new_id = [this](const char* prefix) { return new_response_id(prefix); };
  if (auto err = parse_responses_request(body, previous.get(), new_id, request))
    return send_error(res, *err);
  GenerationJob job;
  job.chat = true;
  job.chat_req = std::move(request.chat);
  job.stream = request.stream;
  job.prompt_param = "input";
  job.max_tokens_param = "max_output_tokens";
  // The response id stays random (it keys the store); the header still names the request.
  job.base_id = base_request_id(req, job.chat_req.common.request_id);
  ResponsesShape shape;
  shape.id = new_response_id("resp_");
  shape.created_at = unix_seconds();
  shape.model = options_.served_model_names.front();
  shape.echo = std::move(request.echo);
  shape.item_seed = new_response_id("");
  shape.logprobs = request.output_logprobs;
  job.responses = std::move(shape);
  if (request.store && store_.capacity() > 0) {
    auto conversation = std::make_shared<OrderedJson>(std::move(request.conversation));
    auto items = std::make_shared<OrderedJson>(std::move(request.input_items));
    job.on_complete = [this, conversation, items](const Generation& generation) {
      StoredResponse entry;
      entry.response = generation.response();
      entry.input_items = *items;
      entry.messages = *conversation;
      for (auto& m : output_as_messages(entry.response["output"])) entry.messages.push_back(std::move(m));
      const std::string id = entry.response["id"].get<std::string>();
      store_.put(id, std::move(entry));
    };
  }
  run_generation(std::move(job), res);
}

void ApiServer::handle_stored_response(const httplib::Request& req, httplib::Response& res, bool input_items) {
  const std::string id = req.matches[1];
  auto entry = store_.get(id);
  if (!entry) return send_error(res, response_not_found(id));
  if (!input_items) return send_json(res, entry->response);
  ItemPageQuery query;
  if (req.has_param("order")) query.order = req.get_param_value("order");
  if (req.has_param("limit")) query.limit = req.get_param_value("limit");
  if (req.has_param("after")) query.after = req.get_param_value("after");
  OrderedJson page;
  if (auto err = input_items_page(entry->input_items, query, page)) return send_error(res, *err);
  send_json(res, page);
}

void ApiServer::acknowledge_kv_blocks(const CommonRequest::KvTransferParams& params) {
  httplib::Headers headers;
  std::string error;
  auto cli = kv_producer_client(params.remote_url, headers, error);
  if (!cli) return;
  auto r = cli->Delete("/v1/kv_transfer/" + params.transfer_id, headers);
  if (!r || (r->status != 200 && r->status != 404))
    M3_LOG_WARN("KV transfer: acknowledging " + params.transfer_id + " to " + params.remote_url + " failed" +
                (r ? ": HTTP " + std::to_string(r->status) : ": " + httplib::to_string(r.error())) +
                " (it expires there)");
}

OrderedJson ApiServer::keep_kv_blocks(const KvBlocks& blocks) {
  auto blob = std::make_shared<const std::string>(serialize_kv_blocks(blocks));
  // Pages left in device memory are freed with the entry (acknowledged, expired or evicted).
  std::function<void()> on_drop;
  if (blocks.on_device())
    on_drop = [this, slots = blocks.device_slots] { engine_.release_kv_export(slots); };
  const std::string id = kv_store_->put(blob, std::move(on_drop));
  if (id.empty()) {
    M3_LOG_WARN("KV transfer: " + std::to_string(blob->size()) + " bytes of blocks exceed kv_buffer_size (" +
                std::to_string(options_.kv_transfer.buffer_bytes) + "); the decode server computes the prompt");
    return nullptr;
  }
  metrics_.count_kv_export(blocks.num_blocks(), int64_t(blob->size()));
  return OrderedJson{{"do_remote_prefill", true},
                     {"remote_url", options_.kv_transfer.advertise_url},
                     {"transfer_id", id},
                     {"num_blocks", blocks.num_blocks()},
                     {"num_tokens", int64_t(blocks.num_blocks()) * blocks.block_size},
                     {"in_device_memory", blocks.on_device()}};
}

void ApiServer::run_generation(GenerationJob&& job, httplib::Response& res) {
  const bool chat = job.chat;
  const CompletionRequest& completion = job.completion;
  const ChatRequest& chat_req = job.chat_req;
  const CommonRequest& common = chat ? chat_req.common : completion.common;
  if (auto err = check_model(common.model)) return send_error(res, *err);

  // Prompts → token ids.
  std::vector<std::vector<int32_t>> prompts;
  const char* prompt_param = job.prompt_param;
  if (chat) {
    std::string text;
    if (auto err = render_messages(chat_req, text)) {
      // The Responses API's conversation is the client's input (and stored history), not 'messages'.
      if (job.responses) err->param = "input";
      return send_error(res, *err);
    }
    prompts.push_back(tokenizer_.encode(text, /*allow_special=*/true));
  } else {
    for (const auto& p : completion.prompts) {
      if (std::holds_alternative<std::string>(p)) prompts.push_back(tokenizer_.encode(std::get<std::string>(p), true));
      else prompts.push_back(std::get<std::vector<int32_t>>(p));
    }
  }
  const int32_t max_len = engine_.model().max_model_len;
  // vLLM's truncate_prompt_tokens: the prompt's last N tokens (-1: the model's context length).
  std::vector<char> truncated(prompts.size(), 0);
  if (common.truncate_prompt_tokens) {
    const size_t keep = size_t(*common.truncate_prompt_tokens < 0 ? max_len : *common.truncate_prompt_tokens);
    for (size_t p = 0; p < prompts.size(); ++p) {
      if (prompts[p].size() <= keep) continue;
      prompts[p].erase(prompts[p].begin(), prompts[p].end() - std::ptrdiff_t(keep));
      truncated[p] = 1;
    }
  }
  // vLLM's bad_words: each word as it would be tokenized at the start of a text and, when that
  // gives other tokens of the same count, after a space.
  std::vector<std::vector<int32_t>> bad_words;
  for (const std::string& word : common.bad_words) {
    const std::string bare = word.substr(word.find_first_not_of(' '));
    std::vector<int32_t> plain = tokenizer_.encode(bare, false), spaced = tokenizer_.encode(" " + bare, false);
    if (plain.empty()) continue;
    if (!spaced.empty() && spaced.size() == plain.size() && spaced[0] != plain[0]) bad_words.push_back(std::move(spaced));
    bad_words.push_back(std::move(plain));
  }
  if (!common.ignored_fields.empty()) {
    std::string names;
    for (const auto& f : common.ignored_fields) names += (names.empty() ? "" : ", ") + f;
    M3_LOG_WARN("request fields ignored (unknown to this server): " + names);
  }
  if (common.priority != 0 && engine_.model().scheduling_policy != "priority")
    return send_error(res, invalid_request("'priority' is " + std::to_string(common.priority) +
                                               " but the server schedules first come, first served (start it with "
                                               "--scheduling-policy priority)",
                                           "priority"));
  const std::string model_name = options_.served_model_names.front();
  GenerationSpec spec;
  spec.chat = chat;
  spec.include_usage = common.include_usage;
  spec.continuous_usage = common.continuous_usage;
  spec.response_id = job.base_id.empty() ? new_response_id(chat ? "chatcmpl-" : "cmpl-")
                                          : std::string(chat ? "chatcmpl-" : "cmpl-") + job.base_id;
  spec.responses = std::move(job.responses);
  spec.created = unix_seconds();
  spec.model = model_name;
  std::vector<GenerationRequest> requests;
  for (size_t p = 0; p < prompts.size(); ++p) {
    const int32_t num_prompt = int32_t(prompts[p].size());
    if (num_prompt == 0) return send_error(res, invalid_request("the prompt is empty (0 tokens)", prompt_param));
    if (num_prompt >= max_len)
      return send_error(res, invalid_request("This model's maximum context length is " + std::to_string(max_len) +
                                                 " tokens, but the prompt (" + std::string(prompt_param) + ") has " +
                                                 std::to_string(num_prompt) + " tokens.",
                                             prompt_param));
    const int32_t room = max_len - num_prompt;
    if (common.max_tokens && *common.max_tokens > room)
      return send_error(res, invalid_request("This model's maximum context length is " + std::to_string(max_len) +
                                                 " tokens; the prompt has " + std::to_string(num_prompt) +
                                                 " tokens, so '" + std::string(job.max_tokens_param) + "' may be at most " + std::to_string(room) +
                                                 ", got " + std::to_string(*common.max_tokens) + ".",
                                             job.max_tokens_param));
    spec.prompt_tokens.push_back(num_prompt);
    for (int i = 0; i < common.n; ++i) {
      GenerationRequest g;
      g.prompt_token_ids = prompts[p];
      g.sampling = common.sampling;
      g.priority = common.priority;
      g.sampling.max_tokens = common.max_tokens.value_or(room);
      g.sampling.logprobs = common.logprobs;
      const bool echo = !chat && completion.echo;
      // Echoed logprobs are the prompt's own: computed as vLLM's prompt_logprobs with the same N.
      g.sampling.prompt_logprobs = std::max(common.prompt_logprobs, echo ? common.logprobs : -1);
      if (g.sampling.seed >= 0) g.sampling.seed += int64_t(requests.size());  // distinct choices, still reproducible
      g.sampling.bad_words = bad_words;
      if (common.json_object || common.pattern) {
        // The text's end admits the stop ids and EOS (with ignore_eos too: nothing else may follow).
        std::vector<int32_t> end_ids = g.sampling.stop_token_ids;
        end_ids.insert(end_ids.end(), engine_.model().eos_token_ids.begin(), engine_.model().eos_token_ids.end());
        using Start = ByteConstraint::Start;
        // The prompt ends inside reasoning (enabled), after it (disabled: "</mm:think>"), or lets
        // the model choose (adaptive).
        const Start start = !chat || chat_req.thinking_mode == ThinkingMode::kDisabled ? Start::kAtOnce
                            : chat_req.thinking_mode == ThinkingMode::kEnabled       ? Start::kReasoning
                                                                                     : Start::kMayReason;
        if (common.pattern)
          g.sampling.constraint =
              std::make_shared<PatternConstraint>(token_bytes(), std::move(end_ids), start, common.pattern);
        else
          g.sampling.constraint = std::make_shared<JsonObjectConstraint>(
              token_bytes(), std::move(end_ids), start, common.json_schema ? common.json_schema : JsonSchema::any_object());
      }
      ChoiceOptions opts;
      opts.stop = common.stop;
      opts.include_stop_str = common.include_stop_str_in_output;
      opts.echo = echo;
      opts.prompt_logprobs = common.prompt_logprobs;
      opts.return_token_ids = common.return_token_ids;
      if (g.sampling.prompt_logprobs >= 0 || echo || common.return_token_ids) opts.prompt_ids = prompts[p];
      if (echo) {
        const auto& given = completion.prompts[p];
        opts.prompt_text = std::holds_alternative<std::string>(given) && !truncated[p]
                               ? std::get<std::string>(given)
                               : tokenizer_.decode(prompts[p], false);
      }
      opts.min_tokens = g.sampling.min_tokens;
      opts.stop_token_ids.insert(g.sampling.stop_token_ids.begin(), g.sampling.stop_token_ids.end());
      if (!g.sampling.ignore_eos)
        opts.stop_token_ids.insert(engine_.model().eos_token_ids.begin(), engine_.model().eos_token_ids.end());
      opts.chat = chat;
      opts.logprobs = common.logprobs;
      if (chat) {
        // A continued message goes on as content (its reasoning, if any, is already closed).
        opts.parser.thinking_mode = chat_req.continue_final_message ? ThinkingMode::kAdaptive
                                                                    : chat_req.thinking_mode.value_or(ThinkingMode::kAdaptive);
        opts.parser.tools = chat_req.tools;
        opts.parser.parse_tool_calls = true;  // even without tools: calls are dropped, never shown as XML
        opts.drop_tool_calls = chat_req.tool_choice == ToolChoice::kNone || chat_req.tools.is_null();
        opts.parallel_tool_calls = chat_req.parallel_tool_calls;
      }
      spec.choices.push_back(std::move(opts));
      spec.choice_prompt.push_back(int32_t(p));
      requests.push_back(std::move(g));
    }
  }
  for (const auto& g : requests) {
    auto problems = g.sampling.validate(engine_.model().vocab_size);
    if (!problems.empty()) return send_error(res, invalid_request(problems.front(), problems.front().substr(0, problems.front().find(' '))));
  }

  // (Before any KV transfer is fetched: a refused request must leave none held.)
  if (draining_) {
    metrics_.count_refused();
    return send_error(res, ApiError{503, "the server is shutting down", "ServiceUnavailableError", "", ""});
  }
  // Disaggregated prefill: this server prefills for a decode server (its blocks kept under an id
  // the answer names), or decodes after a prefill server (its blocks fetched and written into the
  // host KV tier first, so the prompt's admission hits them).
  std::optional<KvImport> kv_import;
  std::optional<CommonRequest::KvTransferParams> kv_ack;  // what to acknowledge once the import ran
  bool kv_export = false;
  if (common.kv_transfer) {
    const auto& kv = *common.kv_transfer;
    if (kv.do_remote_decode) {
      if (!options_.kv_transfer.producer)
        return send_error(res, invalid_request("kv_transfer_params.do_remote_decode: this server does not keep KV for "
                                               "decode servers (start it with --kv-transfer-config "
                                               "'{\"kv_role\": \"kv_producer\"}')",
                                               "kv_transfer_params"));
      if (requests.size() != 1 || job.stream)
        return send_error(res, invalid_request("kv_transfer_params.do_remote_decode needs one prompt, n = 1 and "
                                               "stream false (the answer carries the transfer id)",
                                               "kv_transfer_params"));
      requests[0].kv_export = kv_export = true;
    } else if (kv.do_remote_prefill) {
      if (!options_.kv_transfer.consumer)
        return send_error(res, invalid_request("kv_transfer_params.do_remote_prefill: this server does not fetch KV "
                                               "from prefill servers (start it with --kv-transfer-config "
                                               "'{\"kv_role\": \"kv_consumer\"}')",
                                               "kv_transfer_params"));
      if (prompts.size() != 1)
        return send_error(res, invalid_request("kv_transfer_params.do_remote_prefill needs one prompt", "kv_transfer_params"));
      std::string error;
      size_t wire_bytes = 0;
      const auto fetched_at = std::chrono::steady_clock::now();
      auto blocks = fetch_kv_blocks(kv, error, wire_bytes);
      kv_ack = kv;
      if (!blocks) {
        metrics_.count_kv_transfer_failure();
        if (options_.kv_transfer.fail_on_load_error) {
          acknowledge_kv_blocks(kv);
          return send_error(res, ApiError{502, "KV transfer: " + error, "BadGatewayError", "kv_transfer_params", ""});
        }
        M3_LOG_WARN("KV transfer: " + error + "; computing the prompt here (kv_load_failure_policy recompute)");
      } else {
        metrics_.count_kv_import(0, int64_t(wire_bytes));
        kv_import = KvImport{prompts[0], std::move(blocks), options_.kv_transfer.fail_on_load_error,
                             fetched_at + std::chrono::milliseconds(options_.kv_transfer.timeout_ms / 2)};
      }
    }
  }

  const std::string spec_id = spec.responses ? spec.responses->id : spec.response_id;
  auto generation = std::make_shared<Generation>(tokenizer_, std::move(spec));
  auto channel = std::make_shared<RequestChannel>();
  SubmitOutcome submitted = engine_.submit(std::move(requests), channel, std::move(kv_import));
  if (kv_ack) acknowledge_kv_blocks(*kv_ack);  // the pages were copied (or refused): the producer may reuse them
  if (!submitted.kv_import_error.empty()) {
    metrics_.count_kv_transfer_failure();
    M3_LOG_WARN("KV transfer refused: " + submitted.kv_import_error +
                (options_.kv_transfer.fail_on_load_error ? "" : "; computing the prompt here"));
  }
  if (submitted.kv_import) metrics_.count_kv_import(submitted.kv_import->imported, 0);
  if (!submitted.ok()) {
    if (submitted.overloaded) {
      metrics_.count_refused();
      return send_error(res, ApiError{503, submitted.error, "ServiceUnavailableError", "", ""});
    }
    if (!submitted.kv_import_error.empty() && options_.kv_transfer.fail_on_load_error)
      return send_error(res, ApiError{502, submitted.error, "BadGatewayError", "kv_transfer_params", ""});
    return send_error(res, invalid_request(submitted.error, prompt_param));
  }
  generation->bind(submitted.ids);
  ++active_;
  if (options_.request_id_headers) res.set_header("X-Request-Id", job.base_id.empty() ? spec_id : job.base_id);
  if (options_.log_requests) {
    std::string line = "request " + spec_id + ": " + std::to_string(prompts.size()) + " prompt(s) of ";
    for (size_t p = 0; p < prompts.size(); ++p) line.append(p ? ", " : "").append(std::to_string(prompts[p].size()));
    line.append(" tokens, n ").append(std::to_string(common.n));
    line.append(", max_tokens ").append(common.max_tokens ? std::to_string(*common.max_tokens) : "(the rest)");
    line.append(", temperature ").append(std::to_string(common.sampling.temperature));
    line.append(", top_p ").append(std::to_string(common.sampling.top_p));
    line.append(job.stream ? ", streamed" : "");
    if (common.priority != 0) line.append(", priority ").append(std::to_string(common.priority));
    // Decode no more tokens than characters are wanted (a token is at least one character).
    const size_t shown = options_.max_log_len >= 0 ? std::min(prompts[0].size(), size_t(options_.max_log_len))
                                                   : prompts[0].size();
    std::string text = tokenizer_.decode({prompts[0].begin(), prompts[0].begin() + std::ptrdiff_t(shown)}, false);
    if (options_.max_log_len >= 0 && text.size() > size_t(options_.max_log_len)) text.resize(size_t(options_.max_log_len));
    M3_LOG_INFO(line + ", prompt: " + OrderedJson(text).dump(-1, ' ', false, OrderedJson::error_handler_t::replace));
  }

  auto on_complete = std::move(job.on_complete);
  // Both forms are written by a content provider: a write is the only way to notice that a client
  // went away, and a dropped client's request must free its KV blocks then, not at max_tokens.
  // Streams send SSE comments when idle; a plain JSON answer taking long sends single spaces
  // first (whitespace before a JSON value is still the same JSON).
  struct StreamState {
    std::shared_ptr<Generation> generation;
    std::shared_ptr<RequestChannel> channel;
    std::function<void(const Generation&)> on_complete;
    bool stream = false;
    bool started = false;
    bool complete = false;
    std::chrono::steady_clock::time_point last_write = std::chrono::steady_clock::now();
    bool kv_export = false;
    OrderedJson kv_transfer_params;  // the producer's answer: where the decode server finds the blocks
  };
  auto state = std::make_shared<StreamState>();
  state->generation = generation;
  state->channel = channel;
  state->on_complete = std::move(on_complete);
  state->stream = job.stream;
  state->kv_export = kv_export;
  if (job.stream) res.set_header("Cache-Control", "no-cache");
  res.set_chunked_content_provider(
      job.stream ? "text/event-stream" : "application/json",
      [this, state](size_t, httplib::DataSink& sink) {
        Generation& gen = *state->generation;
        std::string out;
        if (!state->started) {
          if (state->stream) out = gen.stream_start();
          state->started = true;
        }
        std::vector<RequestId> to_abort;
        std::vector<RequestEvent> events = state->channel->wait(kPollInterval);
        if (state->kv_export)
          for (const RequestEvent& ev : events)
            if (ev.kv_export) state->kv_transfer_params = keep_kv_blocks(*ev.kv_export);
        std::string sse = gen.on_events(std::move(events), to_abort);
        if (state->stream) out += sse;
        for (RequestId id : to_abort) engine_.abort(id);
        const bool done = gen.done();
        if (done) {
          if (state->on_complete) state->on_complete(gen);
          if (state->stream) {
            out += gen.stream_end();
          } else {
            OrderedJson body = gen.response();
            if (state->kv_export) body["kv_transfer_params"] = state->kv_transfer_params;
            out += dump_json(body);
          }
        }
        const auto now = std::chrono::steady_clock::now();
        if (out.empty() && now - state->last_write >= (state->stream ? kHeartbeatInterval : kPlainProbeInterval))
          out = state->stream ? ": keep-alive\n\n" : " ";
        if (!out.empty()) {
          if (!sink.write(out.data(), out.size())) return false;  // client went away
          state->last_write = now;
        }
        if (done) {
          state->complete = true;
          sink.done();
        }
        return true;
      },
      [this, state](bool) {
        if (!state->complete) {
          // The client disconnected: free its KV blocks now rather than at max_tokens.
          for (RequestId id : state->generation->unfinished_ids()) engine_.abort(id);
          metrics_.count_client_disconnect();
        }
        --active_;
      });
}

}  // namespace m3::server
