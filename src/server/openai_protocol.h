#pragma once
// OpenAI request bodies → validated request structs. Every problem becomes an ApiError that
// names the offending field; nothing here asserts on user input. Bodies are ordered_json so
// tool schemas keep their key order (the chat template prints them as given).
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "chat/byte_regex.h"
#include "chat/chat_template.h"
#include "chat/json_schema.h"
#include "exec/sampler.h"

namespace m3::server {

struct ApiError {
  int http_status = 400;
  std::string message;
  std::string type = "invalid_request_error";
  std::string param;  // "" is written as null
  std::string code;   // "" is written as null
  OrderedJson to_json() const;  // {"error": {message, type, param, code}}
};

inline ApiError invalid_request(std::string message, std::string param = {}) {
  return ApiError{400, std::move(message), "invalid_request_error", std::move(param), {}};
}

// Fields shared by /v1/completions and /v1/chat/completions.
struct CommonRequest {
  std::string model;                // "" when absent
  int n = 1;
  std::optional<int> max_tokens;    // absent: whatever is left of max_model_len
  SamplingParams sampling;          // max_tokens and logprobs are filled in later
  std::vector<std::string> stop;    // non-empty strings only
  bool stream = false;
  bool include_usage = false;       // stream_options.include_usage
  bool continuous_usage = false;    // vLLM's stream_options.continuous_usage_stats (with include_usage): usage in every chunk
  int logprobs = -1;                // -1: none; N: the sampled token plus the top N
  bool include_stop_str_in_output = false;  // vLLM's: a matched stop string stays in the text
  int prompt_logprobs = -1;                 // vLLM's: -1 none; N: each prompt token's plus the top N
  bool json_object = false;                 // response_format json_object or json_schema
  std::shared_ptr<const JsonSchema> json_schema;  // json_schema's schema (null: any object)
  std::shared_ptr<const RegexNfa> pattern;  // guided_regex / guided_choice: what the output must match
  std::optional<int> truncate_prompt_tokens;  // vLLM's: keep the prompt's last N tokens (-1: max_model_len)
  std::vector<std::string> bad_words;       // vLLM's: never generate these (token sequences made by the route)
  int32_t priority = 0;                     // vLLM's: scheduling priority, lower first (priority policy only)
  std::string request_id;                   // vLLM's: the response id's suffix ("" = random)
  bool return_token_ids = false;            // vLLM's: prompt and generated token ids beside the text
  // vLLM's kv_transfer_params (disaggregated prefill): do_remote_decode asks this (prefill) server
  // to keep the prompt's KV blocks for a decode server; do_remote_prefill, with remote_url and
  // transfer_id (what the prefill server answered), asks this (decode) server to fetch them.
  struct KvTransferParams {
    bool do_remote_decode = false;
    bool do_remote_prefill = false;
    std::string remote_url, transfer_id;
  };
  std::optional<KvTransferParams> kv_transfer;
  std::vector<std::string> ignored_fields;  // present in the body, unknown to the server (logged)
};

struct CompletionRequest {
  CommonRequest common;
  // Each prompt is text or token ids; several prompts give several choice groups.
  std::vector<std::variant<std::string, std::vector<int32_t>>> prompts;
  bool echo = false;  // the prompt leads each choice's text (and its logprobs, with logprobs)
};

enum class ToolChoice { kAuto, kNone, kRequired, kNamed };

struct ChatRequest {
  CommonRequest common;
  OrderedJson messages;  // array
  OrderedJson tools;     // null or array
  ToolChoice tool_choice = ToolChoice::kAuto;
  std::string tool_choice_name;  // kNamed
  std::optional<ThinkingMode> thinking_mode;  // chat_template_kwargs.thinking_mode
  std::optional<std::string> model_identity;  // chat_template_kwargs.model_identity: the default developer prompt
  bool add_generation_prompt = true;
  bool parallel_tool_calls = true;  // false: the first call only (generation stops at a second)
  // vLLM's: the output continues the last (assistant) message instead of starting a new turn.
  bool continue_final_message = false;
};

// Parse errors (malformed JSON) are the caller's; these check an already parsed body.
std::optional<ApiError> parse_completion_request(const OrderedJson& body, CompletionRequest& out);
std::optional<ApiError> parse_chat_request(const OrderedJson& body, ChatRequest& out);

// The tools array alone (also used by /tokenize): [{type: "function", function: {name, parameters?}}].
std::optional<ApiError> validate_tools(const OrderedJson& tools);

// JSON text with invalid UTF-8 replaced (model output can hold partial sequences).
std::string dump_json(const OrderedJson& value);

}  // namespace m3::server
