// Per-request response state: routes events to choices and writes OpenAI chunks / bodies.
#include "server/generation.h"

#include <algorithm>

namespace m3::server {

Generation::Generation(const Tokenizer& tokenizer, GenerationSpec spec)
    : tokenizer_(tokenizer), spec_(std::move(spec)) {
  for (auto& opts : spec_.choices) choices_.push_back(std::make_unique<ChoiceAssembler>(tokenizer_, opts));
  done_.assign(choices_.size(), false);
  cached_tokens_.assign(choices_.size(), 0);
  text_offset_.assign(choices_.size(), 0);
  prompt_sent_.assign(choices_.size(), false);
  ids_sent_.assign(choices_.size(), false);
  remaining_ = int32_t(choices_.size());
  if (spec_.responses) writer_ = std::make_unique<ResponsesWriter>(tokenizer_, *spec_.responses);
}

void Generation::bind(const std::vector<RequestId>& ids) { ids_ = ids; }

std::vector<RequestId> Generation::unfinished_ids() const {
  std::vector<RequestId> out;
  for (size_t c = 0; c < ids_.size(); ++c)
    if (!done_[c]) out.push_back(ids_[c]);
  return out;
}

OrderedJson Generation::chunk(size_t c, const ChoiceDelta& delta, const std::string* finish_reason) {
  OrderedJson choice = OrderedJson::object();
  choice["index"] = c;
  if (spec_.chat) {
    choice["delta"] = chat_delta_json(delta.chat);
    choice["logprobs"] = delta.logprobs.empty() ? OrderedJson() : chat_logprobs_json(tokenizer_, delta.logprobs);
  } else {
    choice["text"] = delta.text;
    choice["logprobs"] =
        delta.logprobs.empty() ? OrderedJson() : completion_logprobs_json(tokenizer_, delta.logprobs, text_offset_[c]);
    text_offset_[c] += delta.text.size();
  }
  choice["finish_reason"] = finish_reason ? OrderedJson(*finish_reason) : OrderedJson();
  const ChoiceOptions& o = choices_[c]->options();
  if (o.return_token_ids) {
    // vLLM's: completions give each choice's prompt ids with its first chunk (chat: the role chunk).
    if (!spec_.chat && !ids_sent_[c]) choice["prompt_token_ids"] = o.prompt_ids;
    ids_sent_[c] = true;
    choice["token_ids"] = delta.token_ids;
  }
  return wrap_chunk(std::move(choice));
}

OrderedJson Generation::wrap_chunk(OrderedJson choice) const {
  OrderedJson out = OrderedJson::object();
  out["id"] = spec_.response_id;
  out["object"] = spec_.chat ? "chat.completion.chunk" : "text_completion";
  out["created"] = spec_.created;
  out["model"] = spec_.model;
  out["choices"] = OrderedJson::array({std::move(choice)});
  if (spec_.continuous_usage) out["usage"] = usage().to_json();
  return out;
}

std::string Generation::on_events(std::vector<RequestEvent> events, std::vector<RequestId>& to_abort) {
  std::string sse;
  for (auto& ev : events) {
    auto it = std::find(ids_.begin(), ids_.end(), ev.request_id);
    if (it == ids_.end()) continue;
    const size_t c = size_t(it - ids_.begin());
    if (done_[c]) continue;  // e.g. the abort event after a stop-string match
    cached_tokens_[c] = std::max(cached_tokens_[c], ev.num_cached_prompt_tokens);
    ChoiceAssembler& choice = *choices_[c];
    choice.push_prompt(ev.prompt_logprobs);
    // The prompt's chunk (echo, prompt_logprobs) goes first, once all of it has come: the
    // engine sends the last prompt positions with the first token.
    if (!prompt_sent_[c] && (!ev.new_tokens.empty() || ev.finished)) {
      prompt_sent_[c] = true;
      if (auto pc = prompt_chunk(c)) sse += sse_event(*pc);
    }
    ChoiceDelta delta = choice.push(ev.new_tokens);
    bool finished = ev.finished;
    FinishReason reason = ev.finish_reason;
    if (choice.stop_matched() && !finished) {
      to_abort.push_back(ev.request_id);
      finished = true;
      reason = FinishReason::kAborted;  // reported as "stop": the stop string matched
    }
    if (writer_) {
      sse += writer_->on_delta(delta);
    } else if (!delta.empty()) {
      sse += sse_event(chunk(c, delta, nullptr));
    }
    if (finished) {
      ChoiceDelta last = choice.finish(reason);
      done_[c] = true;
      --remaining_;
      if (writer_) {
        sse += writer_->on_delta(last);
        sse += writer_->finish(choice, usage());
      } else {
        sse += sse_event(chunk(c, last, &choice.finish_reason()));
      }
    }
  }
  return sse;
}

std::string Generation::stream_start() {
  if (writer_) return writer_->start();
  if (!spec_.chat) return {};
  std::string sse;
  for (size_t c = 0; c < choices_.size(); ++c) {
    OrderedJson choice = OrderedJson::object();
    choice["index"] = c;
    choice["delta"] = OrderedJson{{"role", "assistant"}, {"content", ""}};
    choice["logprobs"] = nullptr;
    choice["finish_reason"] = nullptr;
    OrderedJson out = OrderedJson::object();
    out["id"] = spec_.response_id;
    out["object"] = "chat.completion.chunk";
    out["created"] = spec_.created;
    out["model"] = spec_.model;
    out["choices"] = OrderedJson::array({std::move(choice)});
    if (spec_.continuous_usage) out["usage"] = usage().to_json();
    if (choices_[c]->options().return_token_ids) out["prompt_token_ids"] = choices_[c]->options().prompt_ids;
    sse += sse_event(out);
  }
  return sse;
}

std::optional<OrderedJson> Generation::prompt_chunk(size_t c) {
  const ChoiceAssembler& a = *choices_[c];
  const ChoiceOptions& o = a.options();
  if (!o.echo && o.prompt_logprobs < 0) return std::nullopt;
  OrderedJson choice = OrderedJson::object();
  choice["index"] = c;
  if (spec_.chat) {
    choice["delta"] = OrderedJson::object();
    choice["logprobs"] = nullptr;
  } else {
    choice["text"] = o.echo ? o.prompt_text : std::string();
    choice["logprobs"] = o.echo && o.logprobs >= 0
                             ? echo_logprobs_json(tokenizer_, o.prompt_ids, a.prompt_logprobs(), o.logprobs)
                             : OrderedJson();
    if (o.echo) text_offset_[c] += o.prompt_text.size();
  }
  choice["finish_reason"] = nullptr;
  if (o.prompt_logprobs >= 0) choice["prompt_logprobs"] = prompt_logprobs_json(tokenizer_, o.prompt_ids, a.prompt_logprobs());
  return wrap_chunk(std::move(choice));
}

Usage Generation::usage() const {
  Usage u;
  std::vector<bool> seen(spec_.prompt_tokens.size(), false);
  for (size_t c = 0; c < choices_.size(); ++c) {
    u.completion_tokens += choices_[c]->num_generated_tokens();
    const size_t p = size_t(spec_.choice_prompt[c]);
    if (!seen[p]) {  // each prompt counts once, however many choices it has
      seen[p] = true;
      u.prompt_tokens += spec_.prompt_tokens[p];
      u.cached_tokens += cached_tokens_[c];
    }
  }
  return u;
}

std::string Generation::stream_end() const {
  if (writer_) return {};  // the Responses stream ends with its terminal event
  std::string sse;
  if (spec_.include_usage) {
    OrderedJson out = OrderedJson::object();
    out["id"] = spec_.response_id;
    out["object"] = spec_.chat ? "chat.completion.chunk" : "text_completion";
    out["created"] = spec_.created;
    out["model"] = spec_.model;
    out["choices"] = OrderedJson::array();
    out["usage"] = usage().to_json();
    sse += sse_event(out);
  }
  return sse + kSseDone;
}

OrderedJson Generation::response() const {
  if (writer_) return writer_->response();
  OrderedJson choices = OrderedJson::array();
  for (size_t c = 0; c < choices_.size(); ++c) {
    const ChoiceAssembler& a = *choices_[c];
    OrderedJson choice = OrderedJson::object();
    choice["index"] = c;
    if (spec_.chat) {
      choice["message"] = chat_message_json(a.message());
      choice["logprobs"] = spec_.choices[c].logprobs >= 0 ? chat_logprobs_json(tokenizer_, a.logprobs()) : OrderedJson();
    } else {
      const ChoiceOptions& o = a.options();
      const std::string echo = o.echo ? o.prompt_text : std::string();
      choice["text"] = echo + a.text();
      if (o.logprobs < 0) {
        choice["logprobs"] = nullptr;
      } else if (o.echo) {
        OrderedJson lp = echo_logprobs_json(tokenizer_, o.prompt_ids, a.prompt_logprobs(), o.logprobs);
        append_logprobs(lp, completion_logprobs_json(tokenizer_, a.logprobs(), echo.size()));
        choice["logprobs"] = std::move(lp);
      } else {
        choice["logprobs"] = completion_logprobs_json(tokenizer_, a.logprobs(), 0);
      }
      if (o.prompt_logprobs >= 0)
        choice["prompt_logprobs"] = prompt_logprobs_json(tokenizer_, o.prompt_ids, a.prompt_logprobs());
    }
    choice["finish_reason"] = a.finish_reason();
    if (a.options().return_token_ids) {
      if (!spec_.chat) choice["prompt_token_ids"] = a.options().prompt_ids;
      choice["token_ids"] = a.token_ids();
    }
    choices.push_back(std::move(choice));
  }
  OrderedJson out = OrderedJson::object();
  out["id"] = spec_.response_id;
  out["object"] = spec_.chat ? "chat.completion" : "text_completion";
  out["created"] = spec_.created;
  out["model"] = spec_.model;
  out["choices"] = std::move(choices);
  out["usage"] = usage().to_json();
  if (spec_.chat && !choices_.empty() && choices_[0]->options().return_token_ids)
    out["prompt_token_ids"] = choices_[0]->options().prompt_ids;
  // vLLM puts a chat request's prompt logprobs beside its choices (one prompt for all of them).
  if (spec_.chat && !choices_.empty() && choices_[0]->options().prompt_logprobs >= 0) {
    const ChoiceAssembler& a = *choices_[0];
    out["prompt_logprobs"] = prompt_logprobs_json(tokenizer_, a.options().prompt_ids, a.prompt_logprobs());
  }
  return out;
}

}  // namespace m3::server
