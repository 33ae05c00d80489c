// Responses API requests → chat requests, and the store that previous_response_id reads.
#include "server/responses_api.h"

#include <algorithm>
#include <functional>
#include <unordered_set>

namespace m3::server {

void ResponseStore::drop(std::unordered_map<std::string, Slot>::iterator it) {
  bytes_ -= it->second.bytes;
  order_.erase(it->second.position);
  slots_.erase(it);
}

void ResponseStore::put(const std::string& id, StoredResponse entry) {
  if (capacity_ == 0) return;
  const size_t bytes = entry.response.dump().size() + entry.input_items.dump().size() + entry.messages.dump().size();
  if (bytes > max_bytes_) return;  // larger than the whole store: kept nowhere
  std::lock_guard<std::mutex> lock(mu_);
  if (auto it = slots_.find(id); it != slots_.end()) drop(it);
  order_.push_front(id);
  slots_.emplace(id, Slot{std::make_shared<const StoredResponse>(std::move(entry)), order_.begin(), bytes});
  bytes_ += bytes;
  while (slots_.size() > capacity_ || bytes_ > max_bytes_) drop(slots_.find(order_.back()));
}

std::shared_ptr<const StoredResponse> ResponseStore::get(const std::string& id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = slots_.find(id);
  if (it == slots_.end()) return nullptr;
  order_.splice(order_.begin(), order_, it->second.position);
  return it->second.entry;
}

bool ResponseStore::erase(const std::string& id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = slots_.find(id);
  if (it == slots_.end()) return false;
  drop(it);
  return true;
}

size_t ResponseStore::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return slots_.size();
}

size_t ResponseStore::bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return bytes_;
}

namespace {

ApiError bad(const std::string& field, const std::string& rule) {
  std::string message;
  message.append("'").append(field).append("' ").append(rule);
  return invalid_request(std::move(message), field);
}

std::string at(const std::string& base, size_t k) { return base + "[" + std::to_string(k) + "]"; }

const OrderedJson* present(const OrderedJson& obj, const char* key) {
  auto it = obj.find(key);
  return it == obj.end() || it->is_null() ? nullptr : &*it;
}

// Fields read here, and the chat-request fields (vLLM's sampling extensions) passed through.
const char* const kResponsesFields[] = {
    "model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "max_output_tokens",
    "temperature", "top_p", "top_logprobs", "stream", "store", "previous_response_id", "metadata", "user",
    "service_tier", "truncation", "reasoning", "text", "include", "background", "stream_options",
    "prompt_cache_key", "safety_identifier", "max_tool_calls", "prompt", "conversation"};
const char* const kPassThrough[] = {
    "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "stop",
    "stop_token_ids", "ignore_eos", "logit_bias", "allowed_token_ids", "min_tokens", "include_stop_str_in_output",
    "bad_words", "chat_template_kwargs", "request_id", "priority", "skip_special_tokens",
    "spaces_between_special_tokens"};

// Content parts (or a string) → the text they hold. Non-text parts are refused by name.
std::optional<ApiError> content_text(const OrderedJson& content, const std::string& where, std::string& out) {
  if (content.is_string()) {
    out = content.get<std::string>();
    return std::nullopt;
  }
  if (!content.is_array()) return bad(where, "must be a string or an array of content parts");
  for (size_t k = 0; k < content.size(); ++k) {
    const OrderedJson& part = content[k];
    const std::string pw = at(where, k);
    if (!part.is_object()) return bad(pw, "must be an object");
    const OrderedJson* type = present(part, "type");
    if (!type || !type->is_string()) return bad(pw + ".type", "must be a string");
    const std::string t = type->get<std::string>();
    const char* key = t == "input_text" || t == "output_text" || t == "text" || t == "summary_text" ||
                              t == "reasoning_text"
                          ? "text"
                      : t == "refusal" ? "refusal"
                                       : nullptr;
    if (!key) {
      if (t == "input_image" || t == "input_file" || t == "input_audio")
        return bad(pw + ".type", "is '" + t + "': this server runs MiniMax-M3's text path only (no image, file or audio input)");
      return bad(pw + ".type", "is '" + t + "'; expected input_text, output_text or refusal");
    }
    const OrderedJson* text = present(part, key);
    if (!text || !text->is_string()) return bad(pw + "." + key, "must be a string");
    out += text->get<std::string>();
  }
  return std::nullopt;
}

// Input items → chat messages appended to `messages`; `items` receives the normalized items.
std::optional<ApiError> convert_input(const OrderedJson& input, const std::function<std::string(const char*)>& new_id,
                                      OrderedJson& messages, OrderedJson& items) {
  if (input.is_string()) {
    OrderedJson part = OrderedJson{{"type", "input_text"}, {"text", input}};
    items.push_back(OrderedJson{{"id", new_id("msg_")}, {"type", "message"}, {"role", "user"},
                                {"content", OrderedJson::array({part})}});
    messages.push_back(OrderedJson{{"role", "user"}, {"content", input}});
    return std::nullopt;
  }
  if (!input.is_array()) return bad("input", "must be a string or an array of input items");
  // Calls a function_call_output may answer: those of the history, then the input's own.
  std::unordered_set<std::string> call_ids;
  for (const auto& m : messages)
    if (m.contains("tool_calls"))
      for (const auto& c : m["tool_calls"])
        if (c.contains("id") && c["id"].is_string()) call_ids.insert(c["id"].get<std::string>());
  std::string reasoning;  // a reasoning item's text, for the assistant turn that follows it
  // The assistant message the next function_call joins (none once anything else came between).
  std::optional<size_t> open_assistant;
  auto assistant = [&]() -> OrderedJson& {
    if (!open_assistant) {
      messages.push_back(OrderedJson{{"role", "assistant"}, {"content", ""}});
      open_assistant = messages.size() - 1;
    }
    OrderedJson& m = messages[*open_assistant];
    if (!reasoning.empty()) {
      m["reasoning_content"] = m.contains("reasoning_content") ? m["reasoning_content"].get<std::string>() + reasoning
                                                                : reasoning;
      reasoning.clear();
    }
    return m;
  };
  for (size_t k = 0; k < input.size(); ++k) {
    const std::string where = at("input", k);
    OrderedJson item = input[k];
    if (!item.is_object()) return bad(where, "must be an object");
    const OrderedJson* type = present(item, "type");
    if (type && !type->is_string()) return bad(where + ".type", "must be a string");
    const std::string t = type ? type->get<std::string>() : (item.contains("role") ? "message" : "");
    if (const OrderedJson* id = present(item, "id"); id && !id->is_string()) return bad(where + ".id", "must be a string");
    if (t == "message") {
      const OrderedJson* role = present(item, "role");
      if (!role || !role->is_string()) return bad(where + ".role", "must be a string");
      const std::string r = role->get<std::string>();
      if (r != "user" && r != "system" && r != "developer" && r != "assistant")
        return bad(where + ".role", "is '" + r + "'; expected user, system, developer or assistant");
      const OrderedJson* content = present(item, "content");
      if (!content) return bad(where + ".content", "is required");
      std::string text;
      if (auto err = content_text(*content, where + ".content", text)) return err;
      if (r == "assistant") {
        open_assistant.reset();
        OrderedJson& m = assistant();
        m["content"] = text;
        // A following function_call belongs to the same turn.
      } else {
        messages.push_back(OrderedJson{{"role", r}, {"content", text}});
        open_assistant.reset();
      }
      if (!item.contains("id")) item["id"] = new_id("msg_");
      item["type"] = "message";
      if (content->is_string()) {
        const char* part_type = r == "assistant" ? "output_text" : "input_text";
        item["content"] = OrderedJson::array({OrderedJson{{"type", part_type}, {"text", text}}});
      }
    } else if (t == "function_call") {
      for (const char* key : {"call_id", "name", "arguments"}) {
        const OrderedJson* v = present(item, key);
        if (!v || !v->is_string()) return bad(where + "." + key, "must be a string");
      }
      OrderedJson args = OrderedJson::parse(item["arguments"].get<std::string>(), nullptr, /*allow_exceptions=*/false);
      if (!args.is_object()) return bad(where + ".arguments", "must be a JSON object in a string");
      call_ids.insert(item["call_id"].get<std::string>());
      OrderedJson call = OrderedJson{{"id", item["call_id"]},
                                     {"type", "function"},
                                     {"function", OrderedJson{{"name", item["name"]}, {"arguments", item["arguments"]}}}};
      OrderedJson& m = assistant();
      if (!m.contains("tool_calls")) m["tool_calls"] = OrderedJson::array();
      m["tool_calls"].push_back(std::move(call));
      if (!item.contains("id")) item["id"] = new_id("fc_");
    } else if (t == "function_call_output") {
      const OrderedJson* call_id = present(item, "call_id");
      if (!call_id || !call_id->is_string()) return bad(where + ".call_id", "must be a string");
      if (!call_ids.count(call_id->get<std::string>()))
        return bad(where + ".call_id", "is '" + call_id->get<std::string>() +
                                           "', which no earlier function_call (here or in the previous response) has");
      const OrderedJson* output = present(item, "output");
      if (!output) return bad(where + ".output", "is required");
      std::string text;
      if (auto err = content_text(*output, where + ".output", text)) return err;
      messages.push_back(OrderedJson{{"role", "tool"}, {"tool_call_id", *call_id}, {"content", text}});
      open_assistant.reset();
      if (!item.contains("id")) item["id"] = new_id("fco_");
    } else if (t == "reasoning") {
      std::string text;
      const OrderedJson* content = present(item, "content");
      if (content && !content->empty()) {
        if (auto err = content_text(*content, where + ".content", text)) return err;
      } else if (const OrderedJson* summary = present(item, "summary")) {
        if (auto err = content_text(*summary, where + ".summary", text)) return err;
      }
      reasoning += text;
      if (!item.contains("id")) item["id"] = new_id("rs_");
    } else if (t.empty()) {
      return bad(where + ".type", "is required (or give 'role' for a message)");
    } else {
      return bad(where + ".type",
                 "is '" + t + "'; supported input items are message, function_call, function_call_output and reasoning");
    }
    items.push_back(std::move(item));
  }
  return std::nullopt;
}

// Flat Responses tools → the chat form the template renders.
std::optional<ApiError> convert_tools(const OrderedJson& tools, OrderedJson& out) {
  if (!tools.is_array()) return bad("tools", "must be an array");
  out = OrderedJson::array();
  for (size_t k = 0; k < tools.size(); ++k) {
    const std::string where = at("tools", k);
    const OrderedJson& tool = tools[k];
    if (!tool.is_object()) return bad(where, "must be an object");
    const OrderedJson* type = present(tool, "type");
    if (!type || !type->is_string()) return bad(where + ".type", "must be a string");
    if (*type != "function")
      return bad(where + ".type", "is '" + type->get<std::string>() +
                                      "': this server runs function tools only (no built-in tools such as web or file search)");
    OrderedJson fn = OrderedJson::object();
    for (const char* key : {"name", "description", "parameters"})
      if (const OrderedJson* v = present(tool, key)) fn[key] = *v;
    out.push_back(OrderedJson{{"type", "function"}, {"function", std::move(fn)}});
  }
  return std::nullopt;
}

// Chat-side field names in an error → the Responses names the client sent.
ApiError rename_fields(ApiError err) {
  static const std::pair<const char*, const char*> kNames[] = {
      {"max_tokens", "max_output_tokens"}, {"response_format", "text.format"}, {".function.", "."},
      {"messages", "input"}, {"logprobs", "top_logprobs"}};
  auto replace_all = [](std::string& s, const std::string& from, const std::string& to) {
    for (size_t p = s.find(from); p != std::string::npos; p = s.find(from, p + to.size())) s.replace(p, from.size(), to);
  };
  for (const auto& [from, to] : kNames) {
    if (std::string(from) == "logprobs" && err.param != "logprobs") continue;  // top_logprobs stays
    replace_all(err.param, from, to);
    if (std::string(from) != "messages") replace_all(err.message, std::string("'") + from, std::string("'") + to);
  }
  if (err.param.rfind("input", 0) == 0 && err.param.find('[') != std::string::npos) err.param = "input";
  return err;
}

}  // namespace

std::optional<ApiError> parse_responses_request(const OrderedJson& body, const StoredResponse* previous,
                                                const std::function<std::string(const char*)>& new_item_id,
                                                ResponsesRequest& out) {
  if (!body.is_object()) return invalid_request("the request body must be a JSON object");
  for (const char* key : {"prompt", "conversation"})
    if (present(body, key))
      return bad(key, "is not supported: send the conversation as 'input' (with 'previous_response_id' to continue one)");
  if (const OrderedJson* bg = present(body, "background"); bg && *bg != false)
    return bad("background", "is not supported: responses run while the request is open (use 'stream' for progress)");
  if (const OrderedJson* tr = present(body, "truncation"); tr && *tr != "disabled")
    return bad("truncation", "must be \"disabled\": an input longer than the context is rejected, never cut");

  OrderedJson chat = OrderedJson::object();
  for (auto it = body.begin(); it != body.end(); ++it) {
    auto is_key = [&](const char* f) { return it.key() == f; };
    if (std::any_of(std::begin(kPassThrough), std::end(kPassThrough), is_key)) chat[it.key()] = it.value();
    else if (std::none_of(std::begin(kResponsesFields), std::end(kResponsesFields), is_key))
      out.chat.common.ignored_fields.push_back(it.key());
  }
  if (const OrderedJson* m = present(body, "model")) chat["model"] = *m;

  // The conversation: a stored response's (its instructions are not carried over), then the input.
  OrderedJson conversation = previous ? previous->messages : OrderedJson::array();
  out.input_items = OrderedJson::array();
  const OrderedJson* input = present(body, "input");
  if (!input) return bad("input", "is required");
  if (auto err = convert_input(*input, new_item_id, conversation, out.input_items)) return err;
  if (conversation.empty()) return bad("input", "must contain at least one item");
  OrderedJson messages = OrderedJson::array();
  const OrderedJson* instructions = present(body, "instructions");
  if (instructions) {
    if (!instructions->is_string()) return bad("instructions", "must be a string");
    messages.push_back(OrderedJson{{"role", "system"}, {"content", *instructions}});
  }
  for (const auto& m : conversation) messages.push_back(m);
  chat["messages"] = std::move(messages);
  out.conversation = std::move(conversation);

  OrderedJson tools_echo = OrderedJson::array();
  if (const OrderedJson* tools = present(body, "tools")) {
    OrderedJson converted;
    if (auto err = convert_tools(*tools, converted)) return err;
    if (!converted.empty()) chat["tools"] = std::move(converted);
    tools_echo = *tools;
  }
  OrderedJson tool_choice_echo = "auto";
  if (const OrderedJson* tc = present(body, "tool_choice")) {
    if (tc->is_string()) {
      chat["tool_choice"] = *tc;
    } else if (tc->is_object()) {
      const OrderedJson* type = present(*tc, "type");
      const OrderedJson* name = present(*tc, "name");
      if (!type || *type != "function")
        return bad("tool_choice.type", "must be \"function\" (allowed_tools and built-in tool choices are not supported)");
      if (!name || !name->is_string()) return bad("tool_choice.name", "must be a string");
      chat["tool_choice"] = OrderedJson{{"type", "function"}, {"function", OrderedJson{{"name", *name}}}};
    } else {
      return bad("tool_choice", "must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", \"name\": ...}");
    }
    tool_choice_echo = *tc;
  }
  if (const OrderedJson* v = present(body, "max_output_tokens")) chat["max_tokens"] = *v;
  for (const char* key : {"temperature", "top_p"})
    if (const OrderedJson* v = present(body, key)) chat[key] = *v;

  // Output text logprobs: include "message.output_text.logprobs", top_logprobs alternatives.
  if (const OrderedJson* inc = present(body, "include")) {
    if (!inc->is_array()) return bad("include", "must be an array of strings");
    for (size_t k = 0; k < inc->size(); ++k) {
      if (!(*inc)[k].is_string()) return bad(at("include", k), "must be a string");
      out.output_logprobs = out.output_logprobs || (*inc)[k] == "message.output_text.logprobs";
    }
  }
  int64_t top_logprobs = 0;
  if (const OrderedJson* v = present(body, "top_logprobs")) {
    if (!v->is_number_integer()) return bad("top_logprobs", "must be an integer");
    top_logprobs = v->get<int64_t>();
    out.output_logprobs = out.output_logprobs || top_logprobs > 0;
  }
  if (out.output_logprobs) {
    chat["logprobs"] = true;
    chat["top_logprobs"] = top_logprobs;
  }

  OrderedJson text_echo = OrderedJson{{"format", OrderedJson{{"type", "text"}}}};
  if (const OrderedJson* text = present(body, "text")) {
    if (!text->is_object()) return bad("text", "must be an object");
    if (const OrderedJson* format = present(*text, "format")) {
      if (!format->is_object()) return bad("text.format", "must be an object");
      const OrderedJson* type = present(*format, "type");
      if (!type || !type->is_string()) return bad("text.format.type", "must be a string");
      if (*type == "json_object") {
        chat["response_format"] = OrderedJson{{"type", "json_object"}};
      } else if (*type == "json_schema") {
        OrderedJson js = OrderedJson::object();
        for (const char* key : {"name", "description", "schema", "strict"})
          if (const OrderedJson* v = present(*format, key)) js[key] = *v;
        if (!js.contains("schema")) return bad("text.format.schema", "is required for type json_schema");
        chat["response_format"] = OrderedJson{{"type", "json_schema"}, {"json_schema", std::move(js)}};
      } else if (*type != "text") {
        return bad("text.format.type", "must be \"text\", \"json_object\" or \"json_schema\"");
      }
    }
    text_echo = *text;
  }

  // reasoning.effort: none / minimal turn thinking off, low / medium / high / xhigh on; absent
  // leaves the template's adaptive mode. An explicit chat_template_kwargs.thinking_mode wins.
  OrderedJson reasoning_echo = OrderedJson{{"effort", nullptr}, {"summary", nullptr}};
  if (const OrderedJson* r = present(body, "reasoning")) {
    if (!r->is_object()) return bad("reasoning", "must be an object");
    if (const OrderedJson* effort = present(*r, "effort")) {
      if (!effort->is_string()) return bad("reasoning.effort", "must be a string");
      const std::string e = effort->get<std::string>();
      const char* mode = e == "none" || e == "minimal"                            ? "disabled"
                         : e == "low" || e == "medium" || e == "high" || e == "xhigh" ? "enabled"
                                                                                  : nullptr;
      if (!mode) return bad("reasoning.effort", "must be none, minimal, low, medium, high or xhigh");
      if (!chat.contains("chat_template_kwargs")) chat["chat_template_kwargs"] = OrderedJson::object();
      if (chat["chat_template_kwargs"].is_object() && !chat["chat_template_kwargs"].contains("thinking_mode") &&
          !chat["chat_template_kwargs"].contains("enable_thinking"))
        chat["chat_template_kwargs"]["thinking_mode"] = mode;
    }
    for (auto it = r->begin(); it != r->end(); ++it) reasoning_echo[it.key()] = it.value();
  }

  if (const OrderedJson* v = present(body, "stream")) {
    if (!v->is_boolean()) return bad("stream", "must be a boolean");
    out.stream = v->get<bool>();
  }
  if (const OrderedJson* v = present(body, "store")) {
    if (!v->is_boolean()) return bad("store", "must be a boolean");
    out.store = v->get<bool>();
  }
  if (const OrderedJson* v = present(body, "previous_response_id")) {
    if (!v->is_string()) return bad("previous_response_id", "must be a string");
    out.previous_response_id = v->get<std::string>();
  }
  bool parallel = true;
  if (const OrderedJson* v = present(body, "parallel_tool_calls")) {
    if (!v->is_boolean()) return bad("parallel_tool_calls", "must be a boolean");
    parallel = v->get<bool>();
    chat["parallel_tool_calls"] = parallel;
  }
  OrderedJson metadata = OrderedJson::object();
  if (const OrderedJson* v = present(body, "metadata")) {
    if (!v->is_object()) return bad("metadata", "must be an object of strings");
    for (auto it = v->begin(); it != v->end(); ++it)
      if (!it.value().is_string()) return bad("metadata." + it.key(), "must be a string");
    metadata = *v;
  }

  if (auto err = parse_chat_request(chat, out.chat)) return rename_fields(*err);

  OrderedJson& echo = out.echo;
  echo = OrderedJson::object();
  echo["instructions"] = instructions ? *instructions : OrderedJson();
  echo["max_output_tokens"] = present(body, "max_output_tokens") ? body["max_output_tokens"] : OrderedJson();
  echo["parallel_tool_calls"] = parallel;
  echo["previous_response_id"] = previous ? OrderedJson(out.previous_response_id) : OrderedJson();
  echo["reasoning"] = std::move(reasoning_echo);
  echo["store"] = out.store;
  echo["temperature"] = out.chat.common.sampling.temperature;
  echo["text"] = std::move(text_echo);
  echo["tool_choice"] = std::move(tool_choice_echo);
  echo["tools"] = std::move(tools_echo);
  echo["top_logprobs"] = top_logprobs;
  echo["top_p"] = out.chat.common.sampling.top_p;
  echo["truncation"] = "disabled";
  echo["user"] = present(body, "user") ? body["user"] : OrderedJson();
  echo["metadata"] = std::move(metadata);
  return std::nullopt;
}

std::optional<ApiError> input_items_page(const OrderedJson& items, const ItemPageQuery& query, OrderedJson& out) {
  if (query.order != "asc" && query.order != "desc") return bad("order", "must be \"asc\" or \"desc\"");
  int limit = 0;
  try {
    size_t used = 0;
    limit = std::stoi(query.limit, &used);
    if (used != query.limit.size()) limit = 0;
  } catch (const std::exception&) {
    limit = 0;
  }
  if (limit < 1 || limit > 100) return bad("limit", "must be an integer from 1 to 100");
  std::vector<const OrderedJson*> ordered;
  for (const auto& item : items) ordered.push_back(&item);
  if (query.order == "desc") std::reverse(ordered.begin(), ordered.end());
  size_t first = 0;
  if (!query.after.empty()) {
    while (first < ordered.size() && (*ordered[first])["id"] != query.after) ++first;
    if (first == ordered.size()) return bad("after", "names no input item of this response");
    ++first;
  }
  OrderedJson data = OrderedJson::array();
  for (size_t k = first; k < ordered.size() && data.size() < size_t(limit); ++k) data.push_back(*ordered[k]);
  out = OrderedJson::object();
  out["object"] = "list";
  out["first_id"] = data.empty() ? OrderedJson() : data.front()["id"];
  out["last_id"] = data.empty() ? OrderedJson() : data.back()["id"];
  out["has_more"] = first + data.size() < ordered.size();
  out["data"] = std::move(data);
  return std::nullopt;
}

OrderedJson output_as_messages(const OrderedJson& output_items) {
  OrderedJson m = OrderedJson{{"role", "assistant"}, {"content", ""}};
  bool any = false;
  for (const auto& item : output_items) {
    const std::string type = item.value("type", "");
    if (type == "reasoning") {
      std::string text;
      for (const auto& part : item.value("content", OrderedJson::array())) text += part.value("text", "");
      if (!text.empty()) m["reasoning_content"] = text;
    } else if (type == "message") {
      std::string text = m["content"].get<std::string>();
      for (const auto& part : item.value("content", OrderedJson::array())) text += part.value("text", "");
      m["content"] = text;
    } else if (type == "function_call") {
      if (!m.contains("tool_calls")) m["tool_calls"] = OrderedJson::array();
      m["tool_calls"].push_back(
          OrderedJson{{"id", item["call_id"]},
                      {"type", "function"},
                      {"function", OrderedJson{{"name", item["name"]}, {"arguments", item["arguments"]}}}});
    } else {
      continue;
    }
    any = true;
  }
  return any ? OrderedJson::array({std::move(m)}) : OrderedJson::array();
}

}  // namespace m3::server
