#include "bench/openai_stream.h"

#include <nlohmann/json.hpp>

namespace m3::bench {

using nlohmann::json;

Result<ApiKind> parse_api_kind(const std::string& endpoint) {
  if (endpoint == "completions" || endpoint == "/v1/completions") return ApiKind::kCompletions;
  if (endpoint == "chat" || endpoint.find("chat/completions") != std::string::npos) {
    return ApiKind::kChat;
  }
  if (endpoint.find("completions") != std::string::npos) return ApiKind::kCompletions;
  return Status::error("unknown endpoint '" + endpoint +
                       "' (expected completions, chat, or a /v1/... path)");
}

std::string endpoint_path(const std::string& endpoint) {
  if (endpoint == "completions") return "/v1/completions";
  if (endpoint == "chat") return "/v1/chat/completions";
  return endpoint.empty() || endpoint[0] == '/' ? endpoint : "/" + endpoint;
}

std::string build_request_body(const RequestSpec& spec, const RequestOptions& options) {
  json body;
  body["model"] = options.model;
  if (options.api == ApiKind::kChat) {
    json messages = json::array();
    if (spec.messages.empty()) {
      messages.push_back({{"role", "user"}, {"content", spec.prompt}});
    } else {
      for (const ChatMessage& m : spec.messages) {
        messages.push_back({{"role", m.role}, {"content", m.content}});
      }
    }
    body["messages"] = std::move(messages);
  } else if (!spec.prompt_ids.empty()) {
    body["prompt"] = spec.prompt_ids;
  } else {
    body["prompt"] = spec.prompt;
  }
  if (spec.max_tokens > 0) body["max_tokens"] = spec.max_tokens;
  if (spec.temperature >= 0.0) body["temperature"] = spec.temperature;
  if (spec.ignore_eos) body["ignore_eos"] = true;
  if (!spec.stop.empty()) body["stop"] = spec.stop;
  body["stream"] = options.stream;
  if (options.stream && options.include_usage) {
    body["stream_options"] = {{"include_usage", true}};
  }
  return body.dump(-1, ' ', false, json::error_handler_t::replace);
}

void SseParser::feed(std::string_view bytes, const EventFn& on_event) {
  size_t begin = 0;
  for (size_t i = 0; i < bytes.size(); ++i) {
    if (bytes[i] != '\n') continue;
    line_.append(bytes.data() + begin, i - begin);
    handle_line(line_, on_event);
    line_.clear();
    begin = i + 1;
  }
  line_.append(bytes.data() + begin, bytes.size() - begin);
}

void SseParser::finish(const EventFn& on_event) {
  if (!line_.empty()) {
    handle_line(line_, on_event);
    line_.clear();
  }
  handle_line("", on_event);
}

void SseParser::handle_line(std::string_view line, const EventFn& on_event) {
  if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
  if (line.empty()) {  // blank line ends an event
    if (has_data_) on_event(data_);
    data_.clear();
    has_data_ = false;
    return;
  }
  if (line[0] == ':') return;  // comment / keep-alive
  const size_t colon = line.find(':');
  const std::string_view field = line.substr(0, colon);
  std::string_view value = colon == std::string_view::npos ? std::string_view() : line.substr(colon + 1);
  if (!value.empty() && value[0] == ' ') value.remove_prefix(1);
  if (field != "data") return;  // event/id/retry carry nothing we use
  if (has_data_) data_.push_back('\n');
  data_.append(value);
  has_data_ = true;
}

namespace {

int64_t int_or(const json& j, const char* key, int64_t fallback) {
  auto it = j.find(key);
  return it != j.end() && it->is_number_integer() ? it->get<int64_t>() : fallback;
}

void append_string(const json& obj, const char* key, std::string& out, bool& has_text) {
  auto it = obj.find(key);
  if (it == obj.end() || !it->is_string()) return;
  const auto& s = it->get_ref<const std::string&>();
  if (s.empty()) return;
  out += s;
  has_text = true;
}

}  // namespace

Result<ResponseChunk> parse_response_chunk(std::string_view data, ApiKind api) {
  ResponseChunk chunk;
  std::string_view trimmed = data;
  while (!trimmed.empty() && (trimmed.back() == ' ' || trimmed.back() == '\n')) trimmed.remove_suffix(1);
  if (trimmed == "[DONE]") {
    chunk.done = true;
    return chunk;
  }
  json j = json::parse(data.begin(), data.end(), nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    return Status::error("malformed JSON chunk: " + std::string(data.substr(0, 200)));
  }
  if (auto e = j.find("error"); e != j.end() && !e->is_null()) {
    if (e->is_object() && e->contains("message") && (*e)["message"].is_string()) {
      chunk.error = (*e)["message"].get<std::string>();
    } else {
      chunk.error = e->dump();
    }
    if (chunk.error.empty()) chunk.error = "error";
  }
  if (auto c = j.find("choices"); c != j.end() && c->is_array()) {
    for (const json& choice : *c) {
      if (!choice.is_object()) continue;
      if (api == ApiKind::kChat) {
        for (const char* key : {"delta", "message"}) {
          auto d = choice.find(key);
          if (d == choice.end() || !d->is_object()) continue;
          append_string(*d, "reasoning_content", chunk.text, chunk.has_text);
          append_string(*d, "reasoning", chunk.text, chunk.has_text);
          append_string(*d, "content", chunk.text, chunk.has_text);
        }
      } else {
        append_string(choice, "text", chunk.text, chunk.has_text);
      }
      if (auto f = choice.find("finish_reason"); f != choice.end() && f->is_string()) {
        chunk.finish_reason = f->get<std::string>();
      }
    }
  }
  if (auto u = j.find("usage"); u != j.end() && u->is_object()) {
    chunk.has_usage = true;
    chunk.usage.prompt_tokens = int_or(*u, "prompt_tokens", -1);
    chunk.usage.completion_tokens = int_or(*u, "completion_tokens", -1);
    if (auto d = u->find("prompt_tokens_details"); d != u->end() && d->is_object()) {
      chunk.usage.cached_tokens = int_or(*d, "cached_tokens", -1);
    }
  }
  return chunk;
}

}  // namespace m3::bench
