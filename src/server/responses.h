#pragma once
// Response assembly: engine tokens → text (StreamDecoder) → stop strings → OutputParser →
// deltas, and the OpenAI JSON for complete responses and SSE chunks. Pure functions of the
// token stream, so the server's streaming behaviour is unit-tested with scripted tokens.
#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "chat/output_parser.h"
#include "m3serve/engine.h"
#include "server/openai_protocol.h"
#include "tokenizer/tokenizer.h"

namespace m3::server {

struct ChoiceOptions {
  std::vector<std::string> stop;    // stop strings, matched on the raw decoded text
  std::set<int32_t> stop_token_ids;  // EOS ids and the request's stop_token_ids: never decoded
  bool chat = false;                 // run the reasoning / tool-call parser
  bool drop_tool_calls = false;      // tool_choice "none": calls are parsed and dropped
  bool parallel_tool_calls = true;   // false: a second call ends the choice (as a stop string would), unseen
  OutputParserOptions parser;
  int logprobs = -1;                 // -1: none; N: the sampled token plus the top N
  int min_tokens = 0;                // stop strings inside the text of the first min_tokens tokens do not count
  bool include_stop_str = false;     // a matched stop string stays at the end of the text
  // Prompt-side outputs (completions' echo, vLLM's prompt_logprobs): the prompt's ids and text.
  bool echo = false;
  int prompt_logprobs = -1;          // -1: not reported; N: the prompt_logprobs field with the top N
  bool return_token_ids = false;     // vLLM's: token ids beside the text (prompt and generated)
  std::vector<int32_t> prompt_ids;
  std::string prompt_text;
};

struct LogprobEntry {
  int32_t token = 0;
  float logprob = 0.0f;
  std::vector<TokenLogprob> top;
};

// What one push produced for one choice.
struct ChoiceDelta {
  std::string text;  // completions: the raw text; chat: unused
  OutputDelta chat;  // chat: reasoning / content / tool-call fragments
  std::vector<LogprobEntry> logprobs;
  std::vector<int32_t> token_ids;  // the tokens of this push, as sampled (EOS included)
  bool empty() const { return text.empty() && chat.empty() && logprobs.empty() && token_ids.empty(); }
};

class ChoiceAssembler {
 public:
  ChoiceAssembler(const Tokenizer& tokenizer, ChoiceOptions options);

  // Feeds the engine's new tokens. When a stop string matches, stop_matched() becomes true
  // and the text is cut before it; the caller aborts the engine request.
  ChoiceDelta push(const std::vector<TokenOutput>& tokens);
  // Ends the choice: releases held-back text and closes the parser.
  ChoiceDelta finish(FinishReason reason);
  // The engine's prompt logprobs (positions ascending, each once).
  void push_prompt(const std::vector<PromptLogprob>& entries);
  const std::vector<PromptLogprob>& prompt_logprobs() const { return prompt_logprobs_; }
  const ChoiceOptions& options() const { return options_; }

  bool stop_matched() const { return stop_matched_; }
  bool finished() const { return finished_; }
  // "stop" | "length" | "tool_calls" | "abort" (after finish()).
  const std::string& finish_reason() const { return finish_reason_; }
  int32_t num_generated_tokens() const { return num_tokens_; }
  // Everything emitted so far, folded.
  const std::string& text() const { return text_; }
  const ParsedOutput& message() const { return message_; }
  const std::vector<LogprobEntry>& logprobs() const { return logprobs_; }
  const std::vector<int32_t>& token_ids() const { return token_ids_; }  // every token sampled (return_token_ids)

 private:
  void push_one(const TokenOutput& token, ChoiceDelta& out);
  void route(std::string raw, ChoiceDelta& out, bool final);
  // Where the text ends at the first stop string match in pending_ that ends past its protected
  // bytes (before the string, or after it with include_stop_str), or npos.
  size_t find_stop() const;

  const Tokenizer& tokenizer_;
  ChoiceOptions options_;
  StreamDecoder decoder_;
  OutputParser parser_;
  std::string pending_;  // decoded, not yet released (may be the start of a stop string)
  size_t protected_ = 0;  // bytes at pending_'s front from the first min_tokens tokens
  size_t max_stop_bytes_ = 0;
  bool stop_matched_ = false;
  bool finished_ = false;
  std::string finish_reason_;
  int32_t num_tokens_ = 0;
  std::string text_;
  ParsedOutput message_;
  std::vector<LogprobEntry> logprobs_;
  std::vector<int32_t> token_ids_;
  std::vector<PromptLogprob> prompt_logprobs_;
};

struct Usage {
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;
  int64_t cached_tokens = 0;
  OrderedJson to_json() const;
};

// Logprob JSON in the two OpenAI shapes. `text_offset` is where the choice's text stood
// before these tokens (completions only).
OrderedJson chat_logprobs_json(const Tokenizer& tok, const std::vector<LogprobEntry>& entries);
OrderedJson completion_logprobs_json(const Tokenizer& tok, const std::vector<LogprobEntry>& entries, size_t text_offset);

// The prompt in the completions logprobs shape (echo): its tokens, null for the first one (and any
// position without an entry), `top_n` alternatives each.
OrderedJson echo_logprobs_json(const Tokenizer& tok, const std::vector<int32_t>& prompt_ids,
                               const std::vector<PromptLogprob>& entries, int top_n);
// Appends one completions logprobs object's arrays to another's.
void append_logprobs(OrderedJson& into, const OrderedJson& more);
// vLLM's prompt_logprobs: [null, {"<id>": {"logprob", "rank", "decoded_token"}, ...}, ...], each
// position's own token first, then its top alternatives.
OrderedJson prompt_logprobs_json(const Tokenizer& tok, const std::vector<int32_t>& prompt_ids,
                                 const std::vector<PromptLogprob>& entries);

// The JSON of a delta: {"reasoning"? and "reasoning_content"? (the same text), "content"?, "tool_calls"?}.
OrderedJson chat_delta_json(const OutputDelta& delta);
// A finished chat choice's message.
OrderedJson chat_message_json(const ParsedOutput& message);

// "data: {...}\n\n"
std::string sse_event(const OrderedJson& chunk);
inline constexpr const char* kSseDone = "data: [DONE]\n\n";

}  // namespace m3::server
