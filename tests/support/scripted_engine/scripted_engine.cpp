// Fixed-script engine (see the header for why it exists).
#include "scripted_engine.h"

#include <algorithm>
#include <chrono>
#include <thread>

namespace m3::server {
namespace {

class ScriptedEngine final : public Engine {
 public:
  explicit ScriptedEngine(ScriptedEngineConfig config) : config_(std::move(config)) {
    summary_.vocab_size = config_.vocab_size;
    summary_.max_model_len = config_.max_model_len;
    summary_.block_size = 16;
    summary_.num_kv_blocks = (config_.max_model_len + 15) / 16;
    summary_.eos_token_ids = {config_.eos_token_id};
  }

  Result<RequestId> submit(GenerationRequest request) override {
    auto problems = request.sampling.validate();
    if (!problems.empty()) return Status::error(problems[0]);
    if (request.prompt_token_ids.empty()) return Status::error("prompt must contain at least one token");
    for (int32_t id : request.prompt_token_ids)
      if (id < 0 || id >= summary_.vocab_size)
        return Status::error("prompt token id " + std::to_string(id) + " is outside the vocabulary");
    const RequestId id = next_id_++;
    active_[id] = Active{int32_t(request.prompt_token_ids.size()), request.sampling.max_tokens, 0};
    return id;
  }

  Status abort(RequestId request_id) override {
    auto it = active_.find(request_id);
    if (it == active_.end()) return Status::error("unknown request " + std::to_string(request_id));
    RequestEvent ev;
    ev.request_id = request_id;
    ev.finished = true;
    ev.finish_reason = FinishReason::kAborted;
    ev.num_prompt_tokens = it->second.num_prompt;
    pending_.push_back(std::move(ev));
    active_.erase(it);
    return Status::ok();
  }

  std::vector<RequestEvent> step(EngineStepStats* stats) override {
    if (config_.step_delay_ms > 0 && !active_.empty())
      std::this_thread::sleep_for(std::chrono::milliseconds(config_.step_delay_ms));
    std::vector<RequestEvent> events = std::move(pending_);
    pending_.clear();
    EngineStepStats st;
    st.scheduler.num_running = int32_t(active_.size());
    st.scheduler.kv_blocks_free = summary_.num_kv_blocks;
    for (auto it = active_.begin(); it != active_.end();) {
      Active& a = it->second;
      RequestEvent ev;
      ev.request_id = it->first;
      ev.num_prompt_tokens = a.num_prompt;
      const bool script_done = size_t(a.num_generated) >= config_.script.size();
      const int32_t token = script_done ? config_.eos_token_id : config_.script[size_t(a.num_generated)];
      ev.new_tokens.push_back(TokenOutput{token, 0.0f, {{token, 0.0f}}});
      ++a.num_generated;
      st.scheduler.num_decode_tokens += 1;
      if (script_done || a.num_generated >= a.max_tokens) {
        ev.finished = true;
        ev.finish_reason = script_done ? FinishReason::kStopToken : FinishReason::kMaxTokens;
        it = active_.erase(it);
      } else {
        ++it;
      }
      events.push_back(std::move(ev));
    }
    if (stats) *stats = st;
    return events;
  }

  bool has_unfinished_requests() const override { return !active_.empty(); }
  const ModelSummary& model() const override { return summary_; }
  const ops::DispatchStats& dispatch_stats() const override { return dispatch_; }
  Status check_invariants() const override { return Status::ok(); }

 private:
  struct Active {
    int32_t num_prompt = 0;
    int32_t max_tokens = 0;
    int32_t num_generated = 0;
  };
  ScriptedEngineConfig config_;
  ModelSummary summary_;
  ops::DispatchStats dispatch_;
  std::map<RequestId, Active> active_;
  std::vector<RequestEvent> pending_;
  RequestId next_id_ = 1;
};

}  // namespace

std::unique_ptr<Engine> make_scripted_engine(ScriptedEngineConfig config) {
  return std::make_unique<ScriptedEngine>(std::move(config));
}

}  // namespace m3::server
