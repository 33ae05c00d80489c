// Responses API output: items and typed stream events from a chat choice's deltas.
#include "server/responses_output.h"

#include <algorithm>

namespace m3::server {

std::string typed_sse_event(const std::string& type, const OrderedJson& data) {
  std::string out;
  out.append("event: ").append(type).append("\ndata: ").append(dump_json(data)).append("\n\n");
  return out;
}

OrderedJson responses_usage_json(const Usage& usage, int64_t reasoning_tokens) {
  OrderedJson u = OrderedJson::object();
  u["input_tokens"] = usage.prompt_tokens;
  u["input_tokens_details"] = OrderedJson{{"cached_tokens", usage.cached_tokens}};
  u["output_tokens"] = usage.completion_tokens;
  u["output_tokens_details"] = OrderedJson{{"reasoning_tokens", reasoning_tokens}};
  u["total_tokens"] = usage.prompt_tokens + usage.completion_tokens;
  return u;
}

ResponsesWriter::ResponsesWriter(const Tokenizer& tokenizer, ResponsesShape shape)
    : tokenizer_(tokenizer), shape_(std::move(shape)) {}

std::string ResponsesWriter::item_id(const char* prefix) {
  std::string id(prefix);
  id.append(shape_.item_seed).append("_").append(std::to_string(next_item_++));
  return id;
}

std::string ResponsesWriter::event(const char* type, OrderedJson fields) {
  OrderedJson data = OrderedJson::object();
  data["type"] = type;
  data["sequence_number"] = sequence_++;
  for (auto it = fields.begin(); it != fields.end(); ++it) data[it.key()] = std::move(it.value());
  return typed_sse_event(type, data);
}

OrderedJson ResponsesWriter::response() const {
  OrderedJson r = OrderedJson::object();
  r["id"] = shape_.id;
  r["object"] = "response";
  r["created_at"] = shape_.created_at;
  r["status"] = status_;
  r["background"] = false;
  r["error"] = status_ == "failed" ? OrderedJson{{"code", "server_error"},
                                                  {"message", "the generation was aborted before it finished"}}
                                   : OrderedJson();
  r["incomplete_details"] = incomplete_details_;
  r["model"] = shape_.model;
  r["output"] = output_;
  for (auto it = shape_.echo.begin(); it != shape_.echo.end(); ++it) r[it.key()] = it.value();
  r["usage"] = usage_;
  return r;
}

std::string ResponsesWriter::start() {
  std::string sse = event("response.created", OrderedJson{{"response", response()}});
  sse += event("response.in_progress", OrderedJson{{"response", response()}});
  return sse;
}

std::string ResponsesWriter::open_item(Open kind, const ToolCallDelta* call) {
  OrderedJson item = OrderedJson::object();
  OrderedJson part;
  if (kind == Open::kReasoning) {
    item["id"] = item_id("rs_");
    item["type"] = "reasoning";
    item["summary"] = OrderedJson::array();
    item["content"] = OrderedJson::array();
    item["status"] = "in_progress";
    part = OrderedJson{{"type", "reasoning_text"}, {"text", ""}};
  } else if (kind == Open::kMessage) {
    item["id"] = item_id("msg_");
    item["type"] = "message";
    item["role"] = "assistant";
    item["status"] = "in_progress";
    item["content"] = OrderedJson::array();
    part = OrderedJson{{"type", "output_text"}, {"text", ""}, {"annotations", OrderedJson::array()}};
    if (shape_.logprobs) part["logprobs"] = OrderedJson::array();
  } else {
    item["id"] = item_id("fc_");
    item["type"] = "function_call";
    item["status"] = "in_progress";
    item["arguments"] = "";
    item["call_id"] = call->id;
    item["name"] = call->name;
  }
  open_ = kind;
  text_.clear();
  const size_t index = output_.size();
  std::string sse = event("response.output_item.added", OrderedJson{{"output_index", index}, {"item", item}});
  if (!part.is_null()) {
    sse += event("response.content_part.added", OrderedJson{{"item_id", item["id"]},
                                                            {"output_index", index},
                                                            {"content_index", 0},
                                                            {"part", part}});
    item["content"].push_back(std::move(part));
  }
  output_.push_back(std::move(item));
  return sse;
}

std::string ResponsesWriter::close_item(const char* status) {
  if (open_ == Open::kNone) return {};
  OrderedJson& item = output_.back();
  const size_t index = output_.size() - 1;
  const OrderedJson id = item["id"];
  std::string sse;
  if (open_ == Open::kCall) {
    item["arguments"] = text_;
    sse += event("response.function_call_arguments.done",
                 OrderedJson{{"item_id", id}, {"output_index", index}, {"name", item["name"]}, {"arguments", text_}});
  } else {
    OrderedJson& part = item["content"][0];
    part["text"] = text_;
    const bool reasoning = open_ == Open::kReasoning;
    OrderedJson done = OrderedJson{{"item_id", id}, {"output_index", index}, {"content_index", 0}, {"text", text_}};
    if (!reasoning && part.contains("logprobs")) done["logprobs"] = part["logprobs"];
    sse += event(reasoning ? "response.reasoning_text.done" : "response.output_text.done", std::move(done));
    sse += event("response.content_part.done",
                 OrderedJson{{"item_id", id}, {"output_index", index}, {"content_index", 0}, {"part", part}});
  }
  item["status"] = status;
  sse += event("response.output_item.done", OrderedJson{{"output_index", index}, {"item", item}});
  open_ = Open::kNone;
  text_.clear();
  return sse;
}

std::string ResponsesWriter::on_delta(const ChoiceDelta& delta) {
  std::string sse;
  const OutputDelta& d = delta.chat;
  // Logprobs belong to the visible text: those of tokens the parser held back wait for it.
  held_logprobs_.insert(held_logprobs_.end(), delta.logprobs.begin(), delta.logprobs.end());
  if (d.empty()) return sse;
  if (!d.reasoning_content.empty()) {
    if (open_ != Open::kReasoning) {
      sse += close_item("completed");
      sse += open_item(Open::kReasoning, nullptr);
    }
    text_ += d.reasoning_content;
    sse += event("response.reasoning_text.delta", OrderedJson{{"item_id", output_.back()["id"]},
                                                              {"output_index", output_.size() - 1},
                                                              {"content_index", 0},
                                                              {"delta", d.reasoning_content}});
    if (d.content.empty()) held_logprobs_.clear();
  }
  if (!d.content.empty()) {
    if (open_ != Open::kMessage) {
      // After reasoning or a call, what was held back is the boundary's tags (</mm:think>, …).
      if (!output_.empty())
        held_logprobs_.erase(held_logprobs_.begin(),
                             held_logprobs_.end() - std::ptrdiff_t(std::min(delta.logprobs.size(), held_logprobs_.size())));
      sse += close_item("completed");
      sse += open_item(Open::kMessage, nullptr);
    }
    text_ += d.content;
    OrderedJson lps = OrderedJson::array();
    if (shape_.logprobs) {
      lps = chat_logprobs_json(tokenizer_, held_logprobs_)["content"];
      OrderedJson& all = output_.back()["content"][0]["logprobs"];
      for (const auto& e : lps) all.push_back(e);
    }
    held_logprobs_.clear();
    sse += event("response.output_text.delta", OrderedJson{{"item_id", output_.back()["id"]},
                                                           {"output_index", output_.size() - 1},
                                                           {"content_index", 0},
                                                           {"delta", d.content},
                                                           {"logprobs", std::move(lps)}});
  }
  for (const ToolCallDelta& call : d.tool_calls) {
    if (!call.id.empty()) {
      sse += close_item("completed");
      sse += open_item(Open::kCall, &call);
    }
    if (open_ != Open::kCall) continue;  // a fragment of no open call: nothing to attach it to
    text_ += call.arguments;
    if (!call.arguments.empty())
      sse += event("response.function_call_arguments.delta", OrderedJson{{"item_id", output_.back()["id"]},
                                                                         {"output_index", output_.size() - 1},
                                                                         {"delta", call.arguments}});
    held_logprobs_.clear();
  }
  return sse;
}

std::string ResponsesWriter::finish(const ChoiceAssembler& choice, const Usage& usage) {
  std::string sse;
  const std::string& reason = choice.finish_reason();
  const char* item_status = reason == "length" ? "incomplete" : "completed";
  // Always some output: an empty message when the model said nothing.
  if (output_.empty() && open_ == Open::kNone) sse += open_item(Open::kMessage, nullptr);
  sse += close_item(item_status);
  int64_t reasoning_tokens = 0;
  for (const auto& item : output_)
    if (item["type"] == "reasoning")
      reasoning_tokens += int64_t(tokenizer_.encode(item["content"][0]["text"].get<std::string>(), false).size());
  usage_ = responses_usage_json(usage, std::min<int64_t>(reasoning_tokens, usage.completion_tokens));
  const char* terminal = "response.completed";
  if (reason == "length") {
    status_ = "incomplete";
    incomplete_details_ = OrderedJson{{"reason", "max_output_tokens"}};
    terminal = "response.incomplete";
  } else if (reason == "abort") {
    status_ = "failed";
    terminal = "response.failed";
  } else {
    status_ = "completed";
  }
  finished_ = true;
  sse += event(terminal, OrderedJson{{"response", response()}});
  return sse;
}

}  // namespace m3::server
