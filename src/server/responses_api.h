#pragma once
// OpenAI's Responses API (/v1/responses) over the chat path: a request's input items become
// chat messages (function_call → an assistant tool call, function_call_output → a tool
// message, reasoning → the next assistant turn's reasoning_content), its flat function tools
// and text.format become the chat request's tools and response_format, and a stored
// response's conversation continues through previous_response_id.
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>

#include "server/openai_protocol.h"

namespace m3::server {

// A finished response kept for GET /v1/responses/{id} and previous_response_id.
struct StoredResponse {
  OrderedJson response;     // the response object as returned
  OrderedJson input_items;  // the request's input, normalized to items with ids (input_items route)
  OrderedJson messages;     // the whole conversation in chat form, this response's output included
};

// Bounded in-memory store, least recently used evicted first, by count and by the entries' JSON
// size (long agentic conversations are megabytes each). Thread-safe.
class ResponseStore {
 public:
  static constexpr size_t kDefaultMaxBytes = size_t(512) << 20;
  explicit ResponseStore(size_t capacity, size_t max_bytes = kDefaultMaxBytes)
      : capacity_(capacity), max_bytes_(max_bytes) {}
  void put(const std::string& id, StoredResponse entry);
  // Shared, not copied: a stored conversation can be megabytes.
  std::shared_ptr<const StoredResponse> get(const std::string& id);
  bool erase(const std::string& id);
  size_t capacity() const { return capacity_; }
  size_t size() const;
  size_t bytes() const;

 private:
  using Order = std::list<std::string>;
  struct Slot {
    std::shared_ptr<const StoredResponse> entry;
    Order::iterator position;
    size_t bytes = 0;
  };
  void drop(std::unordered_map<std::string, Slot>::iterator it);
  const size_t capacity_, max_bytes_;
  size_t bytes_ = 0;
  mutable std::mutex mu_;
  Order order_;  // most recently used first
  std::unordered_map<std::string, Slot> slots_;
};

struct ResponsesRequest {
  ChatRequest chat;               // what runs: messages (history + input), tools, sampling
  bool store = true;
  bool stream = false;
  std::string previous_response_id;
  OrderedJson input_items;        // the input, normalized (ids given to items that had none)
  OrderedJson conversation;       // history + input as chat messages, instructions left out (what is stored)
  OrderedJson echo;               // request fields the response object repeats (instructions, tools, ...)
  bool output_logprobs = false;   // include: message.output_text.logprobs
};

// `previous` is the stored response named by previous_response_id (looked up by the caller,
// which answers an unknown id); null when the request names none. `new_item_id` makes ids for
// input items that lack one (prefix → id).
std::optional<ApiError> parse_responses_request(const OrderedJson& body, const StoredResponse* previous,
                                                const std::function<std::string(const char*)>& new_item_id,
                                                ResponsesRequest& out);

// GET /v1/responses/{id}/input_items: a page of `items` in `order` ("desc", newest first, by
// default, or "asc"), at most `limit` (1-100, default 20), starting after the item `after`.
struct ItemPageQuery {
  std::string order = "desc";
  std::string limit = "20";
  std::string after;
};
std::optional<ApiError> input_items_page(const OrderedJson& items, const ItemPageQuery& query, OrderedJson& out);

// The chat messages that continue a conversation after this response's output: one assistant
// message holding its reasoning, text and tool calls (nothing when the output is empty).
OrderedJson output_as_messages(const OrderedJson& output_items);

}  // namespace m3::server
