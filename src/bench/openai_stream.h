#pragma once
// OpenAI wire format: request bodies for /v1/completions and /v1/chat/completions, a
// Server-Sent-Events splitter that copes with arbitrary chunk boundaries, and the parse of
// one streamed (or whole) response into text, finish reason, usage and error.
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace m3::bench {

enum class ApiKind { kCompletions, kChat };

// "completions", "chat", or a path such as "/v1/chat/completions".
Result<ApiKind> parse_api_kind(const std::string& endpoint);
// The request path for an endpoint flag ("completions" -> "/v1/completions").
std::string endpoint_path(const std::string& endpoint);

struct ChatMessage {
  std::string role;
  std::string content;
};

// One request, independent of transport.
struct RequestSpec {
  std::string prompt;                 // completions prompt, or the single chat user message
  std::vector<int32_t> prompt_ids;    // completions only: when non-empty, sent instead of text
  std::vector<ChatMessage> messages;  // chat only: when non-empty, sent instead of prompt
  int64_t prompt_len = 0;             // prompt tokens as the client computed them
  int64_t max_tokens = 0;             // 0: not sent
  bool ignore_eos = false;
  double temperature = 0.0;           // negative: not sent
  std::vector<std::string> stop;
};

struct RequestOptions {
  ApiKind api = ApiKind::kCompletions;
  std::string model;
  bool stream = true;
  bool include_usage = true;  // stream_options.include_usage
};

std::string build_request_body(const RequestSpec& spec, const RequestOptions& options);

// Splits an SSE byte stream into events; feed() may be called with any chunking.
class SseParser {
 public:
  using EventFn = std::function<void(std::string_view data)>;
  void feed(std::string_view bytes, const EventFn& on_event);
  // At end of stream: dispatches a final event that lacked its blank line.
  void finish(const EventFn& on_event);

 private:
  void handle_line(std::string_view line, const EventFn& on_event);
  std::string line_;
  std::string data_;
  bool has_data_ = false;
};

struct Usage {
  int64_t prompt_tokens = -1;
  int64_t completion_tokens = -1;
  int64_t cached_tokens = -1;  // prompt_tokens_details.cached_tokens
};

// One streamed chunk (or a whole non-streamed response).
struct ResponseChunk {
  bool done = false;      // the "[DONE]" sentinel
  std::string text;       // content (plus reasoning content, which is also generated output)
  bool has_text = false;  // a choice carried a non-empty delta
  std::string finish_reason;
  bool has_usage = false;
  Usage usage;
  std::string error;  // server-reported error object, if any
};

Result<ResponseChunk> parse_response_chunk(std::string_view data, ApiKind api);

}  // namespace m3::bench
