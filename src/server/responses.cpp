// Response assembly and the OpenAI JSON shapes.
#include "server/responses.h"

#include <algorithm>

namespace m3::server {
namespace {

void append_delta(OutputDelta& into, const OutputDelta& from) {
  into.reasoning_content += from.reasoning_content;
  into.content += from.content;
  for (const auto& call : from.tool_calls) {
    // Fragments of the same call coalesce so a chunk carries one entry per call.
    if (!into.tool_calls.empty() && into.tool_calls.back().index == call.index && call.id.empty() && call.name.empty()) {
      into.tool_calls.back().arguments += call.arguments;
    } else {
      into.tool_calls.push_back(call);
    }
  }
}

// Where a prefix of `text` may safely end without splitting a UTF-8 sequence.
size_t utf8_floor(const std::string& text, size_t pos) {
  while (pos > 0 && pos < text.size() && (static_cast<unsigned char>(text[pos]) & 0xC0) == 0x80) --pos;
  return pos;
}

OrderedJson bytes_json(std::string_view bytes) {
  OrderedJson out = OrderedJson::array();
  for (unsigned char c : bytes) out.push_back(int(c));
  return out;
}

std::string token_text(const Tokenizer& tok, int32_t id) { return tok.decode({id}, false); }

}  // namespace

ChoiceAssembler::ChoiceAssembler(const Tokenizer& tokenizer, ChoiceOptions options)
    : tokenizer_(tokenizer),
      options_(std::move(options)),
      decoder_(tokenizer, /*skip_special=*/false),
      parser_(options_.parser) {
  for (const auto& s : options_.stop) max_stop_bytes_ = std::max(max_stop_bytes_, s.size());
}

ChoiceDelta ChoiceAssembler::push(const std::vector<TokenOutput>& tokens) {
  ChoiceDelta out;
  // One token at a time: several arrive together with speculative decoding, and nothing after
  // a stop string (or a refused second tool call) may reach the text, the logprobs or the count.
  for (const auto& t : tokens) {
    if (finished_ || stop_matched_) break;
    push_one(t, out);
  }
  return out;
}

void ChoiceAssembler::push_one(const TokenOutput& t, ChoiceDelta& out) {
  ++num_tokens_;
  if (options_.return_token_ids) {
    token_ids_.push_back(t.token);
    out.token_ids.push_back(t.token);
  }
  if (options_.stop_token_ids.count(t.token)) return;  // EOS / stop ids end the text, never appear in it
  const std::string raw = decoder_.push(t.token);
  if (num_tokens_ <= options_.min_tokens) protected_ = pending_.size() + raw.size();
  if (options_.logprobs >= 0) {
    LogprobEntry e{t.token, t.logprob, t.top_logprobs};
    if (e.top.size() > size_t(options_.logprobs)) e.top.resize(size_t(options_.logprobs));
    out.logprobs.push_back(e);
    logprobs_.push_back(std::move(e));
  }
  pending_ += raw;
  const size_t match = find_stop();
  if (match != std::string::npos) {
    stop_matched_ = true;
    std::string keep = pending_.substr(0, match);
    pending_.clear();
    protected_ = 0;
    route(std::move(keep), out, false);
    return;
  }
  // Hold back what could still grow into a stop string.
  const size_t hold = max_stop_bytes_ > 0 ? max_stop_bytes_ - 1 : 0;
  const size_t release = utf8_floor(pending_, pending_.size() > hold ? pending_.size() - hold : 0);
  if (release > 0) {
    std::string head = pending_.substr(0, release);
    pending_.erase(0, release);
    protected_ -= std::min(protected_, release);
    route(std::move(head), out, false);
  }
}

size_t ChoiceAssembler::find_stop() const {
  size_t match = std::string::npos, cut = std::string::npos;
  for (const auto& s : options_.stop) {
    // The earliest occurrence that ends past the protected bytes (vLLM checks stop strings only
    // once min_tokens tokens exist, on the text they add).
    const size_t from = protected_ >= s.size() ? protected_ - s.size() + 1 : 0;
    const size_t at = pending_.find(s, from);
    if (at < match) match = at, cut = options_.include_stop_str ? at + s.size() : at;
  }
  return cut;
}

ChoiceDelta ChoiceAssembler::finish(FinishReason reason) {
  ChoiceDelta out;
  if (finished_) return out;
  finished_ = true;
  if (!stop_matched_) {
    pending_ += decoder_.flush();
    const size_t match = find_stop();
    if (match != std::string::npos) {
      stop_matched_ = true;
      pending_.resize(match);
    }
  }
  std::string rest = std::move(pending_);
  pending_.clear();
  route(std::move(rest), out, true);
  switch (reason) {
    case FinishReason::kMaxTokens: finish_reason_ = stop_matched_ ? "stop" : "length"; break;
    case FinishReason::kAborted: finish_reason_ = stop_matched_ ? "stop" : "abort"; break;
    default: finish_reason_ = "stop"; break;
  }
  if (finish_reason_ == "stop" && !message_.tool_calls.empty()) finish_reason_ = "tool_calls";
  return out;
}

void ChoiceAssembler::route(std::string raw, ChoiceDelta& out, bool final) {
  if (!options_.chat) {
    text_ += raw;
    out.text += raw;
    return;
  }
  OutputDelta d = raw.empty() ? OutputDelta{} : parser_.push(raw);
  if (final) append_delta(d, parser_.finish());
  if (options_.drop_tool_calls) d.tool_calls.clear();
  if (!options_.parallel_tool_calls) {
    auto later = std::remove_if(d.tool_calls.begin(), d.tool_calls.end(), [](const ToolCallDelta& c) { return c.index > 0; });
    if (later != d.tool_calls.end()) {
      d.tool_calls.erase(later, d.tool_calls.end());
      stop_matched_ = true;  // the caller aborts the request: nothing after the first call is wanted
    }
  }
  message_.append(d);
  append_delta(out.chat, d);
}

OrderedJson Usage::to_json() const {
  OrderedJson u = OrderedJson::object();
  u["prompt_tokens"] = prompt_tokens;
  u["completion_tokens"] = completion_tokens;
  u["total_tokens"] = prompt_tokens + completion_tokens;
  u["prompt_tokens_details"] = OrderedJson{{"cached_tokens", cached_tokens}};
  return u;
}

OrderedJson chat_logprobs_json(const Tokenizer& tok, const std::vector<LogprobEntry>& entries) {
  OrderedJson content = OrderedJson::array();
  for (const auto& e : entries) {
    OrderedJson item = OrderedJson::object();
    item["token"] = token_text(tok, e.token);
    item["logprob"] = e.logprob;
    item["bytes"] = bytes_json(tok.token_bytes(e.token));
    OrderedJson top = OrderedJson::array();
    for (const auto& t : e.top)
      top.push_back(OrderedJson{{"token", token_text(tok, t.token)}, {"logprob", t.logprob},
                                {"bytes", bytes_json(tok.token_bytes(t.token))}});
    item["top_logprobs"] = std::move(top);
    content.push_back(std::move(item));
  }
  return OrderedJson{{"content", std::move(content)}};
}

OrderedJson completion_logprobs_json(const Tokenizer& tok, const std::vector<LogprobEntry>& entries,
                                     size_t text_offset) {
  OrderedJson tokens = OrderedJson::array(), lps = OrderedJson::array(), tops = OrderedJson::array(),
              offsets = OrderedJson::array();
  for (const auto& e : entries) {
    std::string text = token_text(tok, e.token);
    tokens.push_back(text);
    lps.push_back(e.logprob);
    OrderedJson top = OrderedJson::object();
    for (const auto& t : e.top) {
      // Keyed by text: tokens that decode alike (e.g. partial UTF-8) keep the best logprob.
      const std::string key = token_text(tok, t.token);
      if (!top.contains(key)) top[key] = t.logprob;
    }
    tops.push_back(std::move(top));
    offsets.push_back(text_offset);
    text_offset += text.size();
  }
  OrderedJson out = OrderedJson::object();
  out["tokens"] = std::move(tokens);
  out["token_logprobs"] = std::move(lps);
  out["top_logprobs"] = std::move(tops);
  out["text_offset"] = std::move(offsets);
  return out;
}

void ChoiceAssembler::push_prompt(const std::vector<PromptLogprob>& entries) {
  prompt_logprobs_.insert(prompt_logprobs_.end(), entries.begin(), entries.end());
}

namespace {

// Entry of each prompt position (nullptr where none came).
std::vector<const PromptLogprob*> by_position(size_t num_prompt, const std::vector<PromptLogprob>& entries) {
  std::vector<const PromptLogprob*> at(num_prompt, nullptr);
  for (const auto& e : entries)
    if (e.position >= 0 && size_t(e.position) < num_prompt) at[size_t(e.position)] = &e;
  return at;
}

}  // namespace

OrderedJson echo_logprobs_json(const Tokenizer& tok, const std::vector<int32_t>& prompt_ids,
                               const std::vector<PromptLogprob>& entries, int top_n) {
  const auto at = by_position(prompt_ids.size(), entries);
  OrderedJson tokens = OrderedJson::array(), lps = OrderedJson::array(), tops = OrderedJson::array(),
              offsets = OrderedJson::array();
  size_t offset = 0;
  for (size_t p = 0; p < prompt_ids.size(); ++p) {
    const std::string text = token_text(tok, prompt_ids[p]);
    tokens.push_back(text);
    offsets.push_back(offset);
    offset += text.size();
    if (!at[p]) {
      lps.push_back(nullptr);
      tops.push_back(nullptr);
      continue;
    }
    lps.push_back(at[p]->logprob);
    OrderedJson top = OrderedJson::object();
    for (size_t k = 0; k < at[p]->top.size() && int(k) < top_n; ++k) {
      const std::string key = token_text(tok, at[p]->top[k].token);
      if (!top.contains(key)) top[key] = at[p]->top[k].logprob;
    }
    tops.push_back(std::move(top));
  }
  return OrderedJson{{"tokens", std::move(tokens)}, {"token_logprobs", std::move(lps)},
                     {"top_logprobs", std::move(tops)}, {"text_offset", std::move(offsets)}};
}

void append_logprobs(OrderedJson& into, const OrderedJson& more) {
  for (const char* key : {"tokens", "token_logprobs", "top_logprobs", "text_offset"})
    for (const auto& v : more[key]) into[key].push_back(v);
}

OrderedJson prompt_logprobs_json(const Tokenizer& tok, const std::vector<int32_t>& prompt_ids,
                                 const std::vector<PromptLogprob>& entries) {
  const auto at = by_position(prompt_ids.size(), entries);
  OrderedJson out = OrderedJson::array();
  for (size_t p = 0; p < prompt_ids.size(); ++p) {
    if (!at[p]) {
      out.push_back(nullptr);
      continue;
    }
    OrderedJson d = OrderedJson::object();
    auto add = [&](int32_t id, float logprob, int32_t rank) {
      const std::string key = std::to_string(id);
      if (!d.contains(key))
        d[key] = OrderedJson{{"logprob", logprob}, {"rank", rank}, {"decoded_token", token_text(tok, id)}};
    };
    add(at[p]->token, at[p]->logprob, at[p]->rank);
    for (size_t k = 0; k < at[p]->top.size(); ++k) add(at[p]->top[k].token, at[p]->top[k].logprob, int32_t(k) + 1);
    out.push_back(std::move(d));
  }
  return out;
}

OrderedJson chat_delta_json(const OutputDelta& delta) {
  OrderedJson d = OrderedJson::object();
  // Both names: vLLM's current `reasoning` and the `reasoning_content` many clients still read.
  if (!delta.reasoning_content.empty()) {
    d["reasoning"] = delta.reasoning_content;
    d["reasoning_content"] = delta.reasoning_content;
  }
  if (!delta.content.empty()) d["content"] = delta.content;
  if (!delta.tool_calls.empty()) {
    OrderedJson calls = OrderedJson::array();
    for (const auto& c : delta.tool_calls) {
      OrderedJson call = OrderedJson::object();
      call["index"] = c.index;
      OrderedJson fn = OrderedJson::object();
      if (!c.id.empty()) {
        call["id"] = c.id;
        call["type"] = "function";
      }
      if (!c.name.empty()) fn["name"] = c.name;
      fn["arguments"] = c.arguments;
      call["function"] = std::move(fn);
      calls.push_back(std::move(call));
    }
    d["tool_calls"] = std::move(calls);
  }
  return d;
}

OrderedJson chat_message_json(const ParsedOutput& message) {
  OrderedJson m = OrderedJson::object();
  m["role"] = "assistant";
  m["content"] = message.content.empty() && !message.tool_calls.empty() ? OrderedJson() : OrderedJson(message.content);
  m["reasoning"] = message.reasoning_content.empty() ? OrderedJson() : OrderedJson(message.reasoning_content);
  m["reasoning_content"] = m["reasoning"];
  if (!message.tool_calls.empty()) {
    OrderedJson calls = OrderedJson::array();
    for (const auto& c : message.tool_calls)
      calls.push_back(OrderedJson{{"id", c.id}, {"type", "function"},
                                  {"function", OrderedJson{{"name", c.name}, {"arguments", c.arguments}}}});
    m["tool_calls"] = std::move(calls);
  }
  return m;
}

std::string sse_event(const OrderedJson& chunk) { return "data: " + dump_json(chunk) + "\n\n"; }

}  // namespace m3::server
