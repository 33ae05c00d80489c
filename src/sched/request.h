#pragma once
// A request as the scheduler sees it: known tokens (prompt + generated), how many of them
// have KV computed, and a lifecycle state whose transitions are checked in one place.
#include <string_view>
#include <vector>

#include "kv/kv_types.h"

namespace m3 {

enum class RequestState {
  kWaiting,    // submitted, never admitted
  kRunning,    // admitted: holds KV blocks, scheduled every step while budget lasts
  kPreempted,  // blocks freed for recompute; queued at the front of waiting
  kFinished,   // terminal; see FinishReason
};

enum class FinishReason { kNone, kStopToken, kMaxTokens, kCallerStop, kAborted };

std::string_view to_string(RequestState state);
std::string_view to_string(FinishReason reason);

// The only legal moves: waiting→running, running→preempted, preempted→running, and any
// non-terminal state→finished (abort reaches waiting/preempted requests too).
bool is_valid_transition(RequestState from, RequestState to);

// What the engine submits.
struct RequestSpec {
  RequestId request_id = 0;
  std::vector<TokenId> prompt_token_ids;
  int32_t max_tokens = 0;               // generated tokens, ≥ 1
  std::vector<TokenId> stop_token_ids;  // finishing on one keeps it as the last output token
  // Computes every prompt position, never reading the prefix cache (prompt logprobs need the
  // logits of each position); its blocks are still published for other requests.
  bool skip_prefix_cache = false;
  // Under the priority policy: lower values are admitted first and preempted last (vLLM's).
  int32_t priority = 0;
};

class Request {
 public:
  explicit Request(RequestSpec spec);

  RequestId id() const { return spec_.request_id; }
  RequestState state() const { return state_; }
  FinishReason finish_reason() const { return finish_reason_; }
  const std::vector<TokenId>& token_ids() const { return token_ids_; }  // prompt + output
  int32_t num_tokens() const { return static_cast<int32_t>(token_ids_.size()); }
  int32_t num_prompt_tokens() const { return static_cast<int32_t>(spec_.prompt_token_ids.size()); }
  int32_t num_output_tokens() const { return num_tokens() - num_prompt_tokens(); }
  int32_t max_tokens() const { return spec_.max_tokens; }
  bool skip_prefix_cache() const { return spec_.skip_prefix_cache; }
  int32_t num_computed_tokens() const { return num_computed_tokens_; }
  int32_t num_preemptions() const { return num_preemptions_; }
  uint64_t admission_seq() const { return admission_seq_; }
  int32_t priority() const { return spec_.priority; }
  uint64_t arrival_seq() const { return arrival_seq_; }  // submission order
  void set_arrival_seq(uint64_t seq) { arrival_seq_ = seq; }
  // Prompt tokens served from the prefix cache at the first admission (usage reporting).
  int32_t num_cached_prompt_tokens() const { return num_cached_prompt_tokens_; }

  // Aborts (internal invariant) on an illegal transition.
  void transition(RequestState to, FinishReason reason = FinishReason::kNone);
  void set_num_computed_tokens(int32_t value);
  void set_admission_seq(uint64_t seq) { admission_seq_ = seq; }
  void count_preemption() { ++num_preemptions_; }
  void set_num_cached_prompt_tokens(int32_t value) { num_cached_prompt_tokens_ = value; }

  // Appends one generated token; returns the reason it finishes the request, or kNone.
  FinishReason append_output_token(TokenId token);

  // Speculative draft for the tokens after the last known one (the engine's proposer), used
  // by the next schedule() only; output tokens the request may still produce cap what is used.
  const std::vector<TokenId>& spec_token_ids() const { return spec_token_ids_; }
  void set_spec_token_ids(std::vector<TokenId> ids) { spec_token_ids_ = std::move(ids); }
  void clear_spec_token_ids() { spec_token_ids_.clear(); }

 private:
  RequestSpec spec_;
  std::vector<TokenId> token_ids_;
  std::vector<TokenId> spec_token_ids_;
  RequestState state_ = RequestState::kWaiting;
  FinishReason finish_reason_ = FinishReason::kNone;
  int32_t num_computed_tokens_ = 0;
  int32_t num_preemptions_ = 0;
  int32_t num_cached_prompt_tokens_ = 0;
  uint64_t admission_seq_ = 0;
  uint64_t arrival_seq_ = 0;
};

}  // namespace m3
