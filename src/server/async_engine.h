#pragma once
// The Engine is synchronous and not thread-safe, so one engine thread owns it and runs the
// step loop (sleeping on a condition variable when idle). HTTP threads submit and abort
// through a locked command queue and receive RequestEvents through per-HTTP-request
// channels (one channel may carry several engine requests, e.g. n > 1).
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "m3serve/engine.h"
#include "server/metrics.h"
#include "server/stats_logger.h"

namespace m3::server {

class RequestChannel {
 public:
  void push(RequestEvent event);
  // Everything queued, waiting up to `timeout` for the first event.
  std::vector<RequestEvent> wait(std::chrono::milliseconds timeout);

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<RequestEvent> events_;
};

struct AsyncEngineConfig {
  int32_t max_pending = 1024;  // engine requests in flight (waiting + running) before 503
  double log_stats_interval_s = 0.0;  // vLLM's periodic stats line (0: none)
};

// KV blocks another engine prefilled (disaggregated prefill), written into the host KV tier just
// before the requests are submitted, on the engine thread (no step between the two).
struct KvImport {
  std::vector<int32_t> prompt;
  std::shared_ptr<const KvBlocks> blocks;
  bool fail_on_error = false;  // kv_load_failure_policy "fail": refuse the requests; else compute the prompt
  // Pages in the producer's device memory are copied only before this: the producer holds them
  // at least its transfer timeout after the fetch (KvTransferStore::get), and this is half of it.
  std::chrono::steady_clock::time_point use_before = std::chrono::steady_clock::time_point::max();
};

struct SubmitOutcome {
  std::vector<RequestId> ids;  // one per GenerationRequest, on success
  std::string error;           // engine rejection (400) or overload (503)
  bool overloaded = false;
  std::optional<KvImportResult> kv_import;  // what the import did
  std::string kv_import_error;              // why it was refused (the requests run without it)
  bool ok() const { return error.empty(); }
};

class AsyncEngine {
 public:
  AsyncEngine(std::unique_ptr<Engine> engine, Metrics& metrics, AsyncEngineConfig config);
  ~AsyncEngine();  // shutdown() + join
  AsyncEngine(const AsyncEngine&) = delete;
  AsyncEngine& operator=(const AsyncEngine&) = delete;

  // Submits all requests or none; events for them arrive on `channel`. Blocks until the
  // engine thread has accepted or rejected them.
  SubmitOutcome submit(std::vector<GenerationRequest> requests, std::shared_ptr<RequestChannel> channel,
                       std::optional<KvImport> kv_import = std::nullopt);
  // Frees the request's KV blocks; its final (kAborted) event still reaches the channel.
  void abort(RequestId id);
  // Disaggregated prefill: frees an export's device slots (the engine's method is thread-safe).
  void release_kv_export(const std::vector<int32_t>& device_slots) { engine_->release_kv_export(device_slots); }
  // Engine requests submitted and not yet finished.
  int32_t num_in_flight() const { return in_flight_.load(); }
  // Finishes every in-flight request, then stops the engine thread. New submits are refused.
  void shutdown();

  const ModelSummary& model() const { return summary_; }
  // DispatchStats locks internally, so HTTP threads may read it while the engine runs.
  const ops::DispatchStats& dispatch_stats() const { return engine_->dispatch_stats(); }
  // Immutable after construction, so read without the engine thread.
  const std::vector<ops::EntryInfo>& kernel_entries() const { return kernel_entries_; }

 private:
  struct Submit {
    std::vector<GenerationRequest> requests;
    std::shared_ptr<RequestChannel> channel;
    std::promise<SubmitOutcome> reply;
    // When the HTTP thread handed the request over: TTFT and E2E count the time it waits
    // for the engine thread to finish its current step (as vLLM counts from arrival).
    std::chrono::steady_clock::time_point arrival;
    std::optional<KvImport> kv_import;
  };
  struct Route {
    std::shared_ptr<RequestChannel> channel;
    std::chrono::steady_clock::time_point arrival, last_token;
    int32_t num_generated = 0;
    double ttft_s = 0.0;
    int32_t max_tokens = 0;
    bool scheduled = false;  // first admitted (at the start of the step that admitted it)
    std::chrono::steady_clock::time_point scheduled_at, first_token;
  };
  void run();
  void handle_submit(Submit& cmd);
  void deliver(std::vector<RequestEvent> events);
  void mark_admitted(const std::vector<RequestId>& ids, std::chrono::steady_clock::time_point step_start);

  std::unique_ptr<Engine> engine_;
  Metrics& metrics_;
  AsyncEngineConfig config_;
  StatsLogger stats_logger_;
  ModelSummary summary_;
  std::vector<ops::EntryInfo> kernel_entries_;
  std::atomic<int32_t> in_flight_{0};

  std::mutex mu_;  // guards the command queues and stopping_
  std::condition_variable cv_;
  std::deque<Submit> submits_;
  std::vector<RequestId> aborts_;
  bool stopping_ = false;

  std::map<RequestId, Route> routes_;  // engine thread only
  std::thread thread_;
};

}  // namespace m3::server
