#pragma once
// The Responses API's output side: a chat choice's deltas (reasoning, text, tool-call fragments)
// become output items (reasoning, message, function_call), streamed as typed SSE events
// (response.created … response.output_text.delta … response.completed) and folded into the
// response object. Pure: tested with scripted deltas.
#include <cstdint>
#include <string>
#include <vector>

#include "server/responses.h"

namespace m3::server {

struct ResponsesShape {
  std::string id;          // "resp_…"
  int64_t created_at = 0;  // unix seconds
  std::string model;
  OrderedJson echo;        // request fields the object repeats (ResponsesRequest::echo)
  std::string item_seed;   // makes the output items' ids ("msg_<seed>_0", …)
  bool logprobs = false;   // output_text parts carry logprobs
};

class ResponsesWriter {
 public:
  ResponsesWriter(const Tokenizer& tokenizer, ResponsesShape shape);
  // response.created and response.in_progress.
  std::string start();
  // The events of one delta of the (single) choice.
  std::string on_delta(const ChoiceDelta& delta);
  // Closes the open item and ends with response.completed (or .incomplete at max_output_tokens).
  std::string finish(const ChoiceAssembler& choice, const Usage& usage);
  // The response object: in progress before finish(), final after.
  OrderedJson response() const;
  bool finished() const { return finished_; }

 private:
  enum class Open { kNone, kReasoning, kMessage, kCall };
  std::string event(const char* type, OrderedJson fields);
  std::string open_item(Open kind, const ToolCallDelta* call);
  std::string close_item(const char* status);
  std::string item_id(const char* prefix);

  const Tokenizer& tokenizer_;
  ResponsesShape shape_;
  int64_t sequence_ = 0;
  int32_t next_item_ = 0;
  OrderedJson output_ = OrderedJson::array();  // items; the open one is last
  Open open_ = Open::kNone;
  std::string text_;                           // the open item's text (reasoning, message, arguments)
  std::vector<LogprobEntry> held_logprobs_;    // of tokens whose text the parser still holds
  std::string status_ = "in_progress";
  OrderedJson incomplete_details_;
  OrderedJson usage_;
  bool finished_ = false;
};

// Responses usage: input / output tokens, cached input, reasoning tokens.
OrderedJson responses_usage_json(const Usage& usage, int64_t reasoning_tokens);

// "event: <type>\ndata: {...}\n\n"
std::string typed_sse_event(const std::string& type, const OrderedJson& data);

}  // namespace m3::server
