// The engine thread: drain commands, step while work remains, route events to channels,
// record request timings.
#include "server/async_engine.h"

#include "core/log.h"

namespace m3::server {
namespace {

double seconds(std::chrono::steady_clock::duration d) { return std::chrono::duration<double>(d).count(); }

const char* finished_label(FinishReason reason) {
  switch (reason) {
    case FinishReason::kMaxTokens: return "length";
    case FinishReason::kAborted: return "abort";
    default: return "stop";
  }
}

}  // namespace

void RequestChannel::push(RequestEvent event) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    events_.push_back(std::move(event));
  }
  cv_.notify_one();
}

std::vector<RequestEvent> RequestChannel::wait(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, timeout, [&] { return !events_.empty(); });
  std::vector<RequestEvent> out(std::make_move_iterator(events_.begin()), std::make_move_iterator(events_.end()));
  events_.clear();
  return out;
}

AsyncEngine::AsyncEngine(std::unique_ptr<Engine> engine, Metrics& metrics, AsyncEngineConfig config)
    : engine_(std::move(engine)), metrics_(metrics), config_(config),
      stats_logger_(config.log_stats_interval_s, std::chrono::steady_clock::now()), summary_(engine_->model()),
      kernel_entries_(engine_->kernel_entries()) {
  metrics_.set_cache_info(summary_);
  thread_ = std::thread([this] { run(); });
}

AsyncEngine::~AsyncEngine() { shutdown(); }

SubmitOutcome AsyncEngine::submit(std::vector<GenerationRequest> requests, std::shared_ptr<RequestChannel> channel,
                                  std::optional<KvImport> kv_import) {
  const int32_t count = int32_t(requests.size());
  // Reserve the slots up front so concurrent submitters cannot overshoot max_pending.
  int32_t before = in_flight_.fetch_add(count);
  if (before + count > config_.max_pending) {
    in_flight_.fetch_sub(count);
    SubmitOutcome out;
    out.overloaded = true;
    out.error = "the server is at capacity (" + std::to_string(config_.max_pending) +
                " requests in flight); retry later";
    return out;
  }
  std::future<SubmitOutcome> reply;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) {
      in_flight_.fetch_sub(count);
      SubmitOutcome out;
      out.overloaded = true;
      out.error = "the server is shutting down";
      return out;
    }
    submits_.push_back(
        Submit{std::move(requests), std::move(channel), {}, std::chrono::steady_clock::now(), std::move(kv_import)});
    reply = submits_.back().reply.get_future();
  }
  cv_.notify_one();
  return reply.get();
}

void AsyncEngine::abort(RequestId id) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    aborts_.push_back(id);
  }
  cv_.notify_one();
}

void AsyncEngine::shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_one();
  if (thread_.joinable()) thread_.join();
}

void AsyncEngine::handle_submit(Submit& cmd) {
  SubmitOutcome out;
  const auto arrival = cmd.arrival;
  std::vector<int32_t> max_tokens;
  for (const auto& req : cmd.requests) max_tokens.push_back(req.sampling.max_tokens);
  if (cmd.kv_import && cmd.kv_import->blocks) {
    Result<KvImportResult> imported =
        cmd.kv_import->blocks->on_device() && std::chrono::steady_clock::now() > cmd.kv_import->use_before
            ? Result<KvImportResult>(Status::error("the producer's hold on its device pages may have lapsed (fetched "
                                                   "more than half its transfer timeout ago)"))
            : engine_->import_kv(cmd.kv_import->prompt, *cmd.kv_import->blocks);
    if (imported) {
      out.kv_import = *imported;
    } else {
      out.kv_import_error = imported.error();
      if (cmd.kv_import->fail_on_error) {
        out.error = "KV transfer: " + imported.error();
        in_flight_.fetch_sub(int32_t(cmd.requests.size()));
        cmd.reply.set_value(std::move(out));
        return;
      }
    }
  }
  for (auto& req : cmd.requests) {
    auto id = engine_->submit(std::move(req));
    if (!id) {
      out.error = id.error();
      break;
    }
    out.ids.push_back(*id);
  }
  if (!out.ok()) {
    // All or none: withdraw the ones already accepted. Their abort events find no route.
    for (RequestId id : out.ids) (void)engine_->abort(id);
    in_flight_.fetch_sub(int32_t(cmd.requests.size()));
    out.ids.clear();
  } else {
    // Requests that can never run were refused above, so every accepted one will finish.
    for (size_t k = 0; k < out.ids.size(); ++k) {
      Route route;
      route.channel = cmd.channel;
      route.arrival = route.last_token = arrival;
      route.max_tokens = max_tokens[k];
      routes_[out.ids[k]] = std::move(route);
    }
  }
  cmd.reply.set_value(std::move(out));
}

void AsyncEngine::deliver(std::vector<RequestEvent> events) {
  const auto now = std::chrono::steady_clock::now();
  for (auto& ev : events) {
    auto it = routes_.find(ev.request_id);
    if (it == routes_.end()) continue;
    Route& r = it->second;
    stats_logger_.add_generated(int64_t(ev.new_tokens.size()));
    // One latency per step that gave the request tokens, as vLLM counts them: a speculative
    // step's several tokens are one inter-token latency, not one plus zeros.
    if (!ev.new_tokens.empty()) {
      if (r.num_generated == 0) {
        r.ttft_s = seconds(now - r.arrival);
        r.first_token = now;
        metrics_.observe_first_token(r.ttft_s);
      } else {
        metrics_.observe_inter_token(seconds(now - r.last_token));
      }
      r.num_generated += int32_t(ev.new_tokens.size());
      r.last_token = now;
    }
    if (ev.finished) {
      FinishedRequest f;
      f.reason = finished_label(ev.finish_reason);
      f.e2e_s = seconds(now - r.arrival);
      f.tpot_s = r.num_generated > 1 ? (f.e2e_s - r.ttft_s) / (r.num_generated - 1) : 0.0;
      f.scheduled = r.scheduled;
      // Never scheduled (aborted while waiting): all of its life was queueing.
      f.queue_s = seconds((r.scheduled ? r.scheduled_at : now) - r.arrival);
      if (r.scheduled) {
        f.inference_s = seconds(r.last_token - r.scheduled_at);
        if (r.num_generated > 0) {
          f.prefill_s = seconds(r.first_token - r.scheduled_at);
          f.decode_s = seconds(r.last_token - r.first_token);
        }
      }
      f.prompt_tokens = ev.num_prompt_tokens;
      f.generation_tokens = r.num_generated;
      f.max_tokens = r.max_tokens;
      metrics_.observe_finished(f);
      auto channel = std::move(r.channel);
      routes_.erase(it);
      in_flight_.fetch_sub(1);
      channel->push(std::move(ev));
    } else {
      r.channel->push(std::move(ev));
    }
  }
}

void AsyncEngine::mark_admitted(const std::vector<RequestId>& ids, std::chrono::steady_clock::time_point step_start) {
  for (RequestId id : ids) {
    auto it = routes_.find(id);
    if (it == routes_.end() || it->second.scheduled) continue;  // a preempted request keeps its first time
    it->second.scheduled = true;
    it->second.scheduled_at = step_start;
  }
}

void AsyncEngine::run() {
  // After the last request finishes, one more (empty) step reads the freed KV state.
  bool need_refresh = false;
  for (;;) {
    std::deque<Submit> submits;
    std::vector<RequestId> aborts;
    bool stopping = false;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] {
        return !submits_.empty() || !aborts_.empty() || stopping_ || need_refresh || engine_->has_unfinished_requests();
      });
      submits.swap(submits_);
      aborts.swap(aborts_);
      stopping = stopping_;
    }
    for (auto& cmd : submits) handle_submit(cmd);
    for (RequestId id : aborts) (void)engine_->abort(id);  // already finished: nothing to free
    const bool busy = engine_->has_unfinished_requests();
    if (!busy && stopping && routes_.empty()) break;
    // Aborts leave their final events pending inside the engine until the next step.
    if (!busy && aborts.empty() && !need_refresh) continue;
    EngineStepStats stats;
    try {
      const auto step_start = std::chrono::steady_clock::now();
      std::vector<RequestEvent> events = engine_->step(&stats);
      mark_admitted(stats.admitted, step_start);
      deliver(std::move(events));
    } catch (const std::exception& e) {
      // An engine failure is fatal for the requests in it; keep serving the rest.
      M3_LOG_ERROR(std::string("engine step failed: ") + e.what());
      for (auto& entry : routes_) (void)engine_->abort(entry.first);
      need_refresh = true;
      continue;
    }
    metrics_.observe_step(stats);
    if (auto line = stats_logger_.observe_step(stats, std::chrono::steady_clock::now())) {
      M3_LOG_INFO(*line);
      if (auto spec = stats_logger_.take_spec_line()) M3_LOG_INFO(*spec);
    }
    need_refresh = false;
    if (!engine_->has_unfinished_requests()) {
      metrics_.observe_idle();
      need_refresh = busy || !aborts.empty();
    }
  }
}

}  // namespace m3::server
