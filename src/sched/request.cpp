#include "sched/request.h"

#include <algorithm>
#include <string>

#include "core/check.h"

namespace m3 {

std::string_view to_string(RequestState state) {
  switch (state) {
    case RequestState::kWaiting: return "waiting";
    case RequestState::kRunning: return "running";
    case RequestState::kPreempted: return "preempted";
    case RequestState::kFinished: return "finished";
  }
  return "?";
}

std::string_view to_string(FinishReason reason) {
  switch (reason) {
    case FinishReason::kNone: return "none";
    case FinishReason::kStopToken: return "stop_token";
    case FinishReason::kMaxTokens: return "max_tokens";
    case FinishReason::kCallerStop: return "caller_stop";
    case FinishReason::kAborted: return "aborted";
  }
  return "?";
}

bool is_valid_transition(RequestState from, RequestState to) {
  switch (from) {
    case RequestState::kWaiting:
      return to == RequestState::kRunning || to == RequestState::kFinished;
    case RequestState::kRunning:
      return to == RequestState::kPreempted || to == RequestState::kFinished;
    case RequestState::kPreempted:
      return to == RequestState::kRunning || to == RequestState::kFinished;
    case RequestState::kFinished:
      return false;
  }
  return false;
}

Request::Request(RequestSpec spec) : spec_(std::move(spec)), token_ids_(spec_.prompt_token_ids) {}

void Request::transition(RequestState to, FinishReason reason) {
  M3_CHECK(is_valid_transition(state_, to), "request %llu: illegal %s -> %s",
           static_cast<unsigned long long>(id()), std::string(to_string(state_)).c_str(),
           std::string(to_string(to)).c_str());
  M3_CHECK((to == RequestState::kFinished) == (reason != FinishReason::kNone),
           "finish reason must accompany exactly the finished state");
  state_ = to;
  finish_reason_ = reason;
}

void Request::set_num_computed_tokens(int32_t value) {
  M3_CHECK(value >= 0 && value <= num_tokens(), "computed %d of %d tokens", value, num_tokens());
  num_computed_tokens_ = value;
}

FinishReason Request::append_output_token(TokenId token) {
  token_ids_.push_back(token);
  if (std::find(spec_.stop_token_ids.begin(), spec_.stop_token_ids.end(), token) !=
      spec_.stop_token_ids.end()) {
    return FinishReason::kStopToken;
  }
  if (num_output_tokens() >= spec_.max_tokens) return FinishReason::kMaxTokens;
  return FinishReason::kNone;
}

}  // namespace m3
