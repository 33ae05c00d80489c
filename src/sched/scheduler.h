#pragma once
// Pure, deterministic continuous-batching scheduler (no phases: every running request's
// computed-token count catches up to its known-token count under one token budget).
//
// Step loop driven by the engine:
//   plan = schedule();                    // a value; empty() → nothing to run
//   run the model on plan; sample one token for every entry with samples == true
//   outputs = update(plan, sampled);      // appends tokens, publishes prefix blocks, finishes
// update() must follow every non-empty plan before the next schedule(). abort() may be
// called at any time; an aborted request's entry in an in-flight plan is then ignored.
// Not thread-safe: one engine thread owns it.
//
// Policy, in order, each step:
//  1. Running requests, oldest admission first, each get min(remaining, budget,
//     max_chunk_tokens) tokens; a decoding request with draft tokens (set_spec_tokens) gets
//     them too when budget and free blocks allow.
//     If the pool cannot hold them, the newest-admitted running request is preempted
//     (blocks freed, num_computed reset to 0, queued at the front of waiting) until it
//     fits; when the request itself is the newest, it is the one preempted.
//  2. If nothing was preempted, waiting requests are admitted FCFS while budget, seats
//     (max_num_seqs) and blocks last: prefix-cache hit first, then a prefill chunk. A waiting
//     request whose next uncached block is one a running request is computing (the same
//     prompt: n > 1 choices, fanned-out agents) is passed over until that block is published,
//     so it hits instead of computing it again; the requests behind it may go first.
// Under SchedulingPolicy::kPriority (vLLM's --scheduling-policy priority) both queues are kept
// in (priority, arrival) order instead: the most urgent running request is scheduled first,
// the least urgent (latest arrival among equals) is the one preempted, and a preempted request
// waits at its key's place rather than at the front.
// Submit rejects what could never run (prompt + max_tokens beyond max_model_len or
// beyond the whole pool), so a lone oldest request always fits and steps never hang.
#include <algorithm>
#include <deque>
#include <memory>
#include <span>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "core/status.h"
#include "kv/kv_cache_manager.h"
#include "sched/request.h"
#include "sched/schedule_plan.h"

namespace m3 {

enum class SchedulingPolicy { kFcfs, kPriority };

struct SchedulerConfig {
  int32_t max_num_batched_tokens = 0;  // token budget per step
  int32_t max_num_seqs = 0;            // running requests at most
  int32_t max_model_len = 0;           // prompt + max_tokens at most
  // Longest chunk one request gets per step (0: the whole budget). Bounds how long an
  // old, long prefill can hold the budget while newer requests wait to decode.
  int32_t max_chunk_tokens = 0;
  SchedulingPolicy policy = SchedulingPolicy::kFcfs;
  Status validate() const;             // every problem, in one message
};

// What the runner sampled for one scheduled request with samples == true.
struct SampledTokens {
  RequestId request_id = 0;
  // One token; with drafts, the accepted drafts (a prefix of them) and then one sampled token,
  // at most num_spec_tokens + 1. Tokens after a finishing one are dropped.
  std::vector<TokenId> token_ids;
  bool stop = false;               // the caller finishes it (e.g. a stop string matched)
};

struct RequestOutput {
  RequestId request_id = 0;
  std::vector<TokenId> new_token_ids;  // appended by this update
  bool finished = false;
  FinishReason finish_reason = FinishReason::kNone;
};

class Scheduler {
 public:
  static Result<Scheduler> create(const SchedulerConfig& config, const KvCacheConfig& kv_config);

  // Rejects an empty prompt, max_tokens < 1, a live duplicate id, prompt + max_tokens >
  // max_model_len, or a request whose KV could never fit the whole pool.
  Status submit(RequestSpec spec);

  SchedulePlan schedule();

  // Applies the model's results for `plan` (the latest one). Fails without changing
  // anything on a stale plan, a missing sample, or a sample nobody asked for.
  Result<std::vector<RequestOutput>> update(const SchedulePlan& plan,
                                            std::span<const SampledTokens> sampled);

  // Finishes a live request now and frees its blocks; error if unknown.
  Status abort(RequestId request_id);

  // Speculative decoding: draft tokens to verify after the request's last token in the next
  // schedule() (only there; a later plan needs new ones). Used only while the request decodes,
  // trimmed to the budget and to the tokens it may still produce, and dropped rather than
  // preempting anyone when the pool cannot hold them. Error unless the request is running.
  Status set_spec_tokens(RequestId request_id, std::vector<TokenId> draft);

  bool has_unfinished_requests() const { return !requests_.empty(); }
  int32_t num_running() const { return static_cast<int32_t>(running_.size()); }
  int32_t num_waiting() const { return static_cast<int32_t>(waiting_.size()); }
  const Request* find_request(RequestId request_id) const;  // live requests only
  const SchedulerConfig& config() const { return config_; }
  const KvCacheManager& kv() const { return kv_; }
  // KV transfer in, between steps (KvCacheManager::store_host_block).
  KvCacheManager::HostStore store_host_block(const Hash128& hash) { return kv_.store_host_block(hash); }
  // KV transfer in, into the KV cache (KvCacheManager::adopt_blocks), and the host-tier copies
  // its allocations queued, to run before the adopted blocks are written.
  KvCacheManager::Adoption adopt_blocks(std::span<const Hash128> hashes) { return kv_.adopt_blocks(hashes); }
  std::vector<KvTransfer> take_offloads() {
    std::vector<KvTransfer> offloads, loads;
    kv_.take_transfers(&offloads, &loads);
    return offloads;
  }

  // Request states agree with the queues, running requests' tables cover their computed
  // tokens, waiting ones hold nothing, plus KvCacheManager::check_invariants().
  Status check_invariants() const;

 private:
  Scheduler(const SchedulerConfig& config, KvCacheManager kv);

  void schedule_running(SchedulePlan* plan, int32_t* budget);
  void admit_waiting(SchedulePlan* plan, int32_t* budget);
  void preempt(Request* request, SchedulePlan* plan);
  void add_entry(const Request& request, int32_t num_new_tokens, bool is_new_admission,
                 int32_t num_prefix_hit_tokens, SchedulePlan* plan, int32_t num_spec = 0) const;
  // Drafts of a decoding request that fit `budget` and its remaining output; 0 if none.
  int32_t usable_spec_tokens(const Request& request, int32_t budget) const;
  void finish(Request* request, FinishReason reason);
  // Priority policy: `request` goes into `queue` before the first request it outranks.
  template <typename Queue>
  static void insert_by_priority(Queue& queue, Request* request);
  int32_t chunk_limit(int32_t budget) const {
    return config_.max_chunk_tokens > 0 ? std::min(budget, config_.max_chunk_tokens) : budget;
  }

  SchedulerConfig config_;
  KvCacheManager kv_;
  std::unordered_map<RequestId, std::unique_ptr<Request>> requests_;  // live requests
  std::vector<Request*> running_;  // admission order: back() is the newest (priority: by key)
  std::deque<Request*> waiting_;   // preempted ones go to the front (priority: by key)
  std::vector<RequestId> finished_since_last_plan_;
  uint64_t next_step_id_ = 1;
  uint64_t next_admission_seq_ = 1;
  uint64_t next_arrival_seq_ = 1;
  uint64_t outstanding_step_id_ = 0;  // non-empty plan awaiting update(), 0 if none
};

}  // namespace m3
