#pragma once
// One HTTP generation request (all its choices): engine events in, SSE chunks or the final
// OpenAI response body out. No I/O and no engine access, so it is tested with scripted events.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "server/responses.h"
#include "server/responses_output.h"

namespace m3::server {

struct GenerationSpec {
  bool chat = false;
  bool include_usage = false;
  bool continuous_usage = false;  // every chunk carries the usage so far
  std::string response_id;  // "chatcmpl-..." / "cmpl-..."
  int64_t created = 0;      // unix seconds
  std::string model;
  std::vector<ChoiceOptions> choices;       // one per choice, in choice-index order
  std::vector<int32_t> choice_prompt;       // prompt index of each choice
  std::vector<int32_t> prompt_tokens;       // token count of each prompt
  // Set: the Responses API (one chat choice) writes the events and the body instead.
  std::optional<ResponsesShape> responses;
};

class Generation {
 public:
  Generation(const Tokenizer& tokenizer, GenerationSpec spec);

  // The engine ids, in choice order.
  void bind(const std::vector<RequestId>& ids);
  // Folds events in; returns the SSE text they produce. Requests whose stop string matched
  // are finished here and appended to `to_abort` (the caller aborts them in the engine).
  std::string on_events(std::vector<RequestEvent> events, std::vector<RequestId>& to_abort);
  std::string stream_start();        // chat: a role chunk per choice; responses: created, in_progress
  std::string stream_end() const;    // the usage chunk when asked, then [DONE] (responses: nothing)
  bool done() const { return remaining_ == 0; }
  std::vector<RequestId> unfinished_ids() const;
  OrderedJson response() const;  // the non-streaming body (after done())
  const ResponsesWriter* responses_writer() const { return writer_.get(); }
  Usage usage() const;

 private:
  OrderedJson chunk(size_t choice, const ChoiceDelta& delta, const std::string* finish_reason);
  OrderedJson wrap_chunk(OrderedJson choice) const;  // {id, object, created, model, choices: [choice]}
  // The chunk that streams the prompt side of a choice (echo text and logprobs, prompt_logprobs).
  std::optional<OrderedJson> prompt_chunk(size_t choice);

  const Tokenizer& tokenizer_;
  GenerationSpec spec_;
  std::vector<std::unique_ptr<ChoiceAssembler>> choices_;
  std::vector<RequestId> ids_;
  std::vector<bool> done_;
  std::vector<int32_t> cached_tokens_;  // per choice, from the engine's events
  std::vector<size_t> text_offset_;     // per choice: bytes of text already streamed
  std::vector<bool> prompt_sent_;       // per choice: its prompt chunk is out (or had nothing to say)
  std::vector<bool> ids_sent_;          // per choice: return_token_ids' prompt ids are out
  int32_t remaining_ = 0;
  std::unique_ptr<ResponsesWriter> writer_;
};

}  // namespace m3::server
