#include "sched/scheduler.h"

#include <algorithm>
#include <string>
#include <unordered_set>

#include "core/check.h"

namespace m3 {

Status SchedulerConfig::validate() const {
  std::string problems;
  auto need_positive = [&](const char* name, int32_t value) {
    if (value <= 0) problems += std::string(name) + " must be > 0 (got " + std::to_string(value) + "); ";
  };
  need_positive("max_num_batched_tokens", max_num_batched_tokens);
  need_positive("max_num_seqs", max_num_seqs);
  need_positive("max_model_len", max_model_len);
  if (max_chunk_tokens < 0) {
    problems += "max_chunk_tokens must be >= 0 (got " + std::to_string(max_chunk_tokens) + "); ";
  }
  if (problems.empty()) return Status::ok();
  problems.resize(problems.size() - 2);
  return Status::error("SchedulerConfig: " + problems);
}

Result<Scheduler> Scheduler::create(const SchedulerConfig& config, const KvCacheConfig& kv_config) {
  M3_RETURN_IF_ERROR(config.validate());
  Result<KvCacheManager> kv = KvCacheManager::create(kv_config);
  if (!kv) return kv.status();
  return Scheduler(config, std::move(kv).value());
}

Scheduler::Scheduler(const SchedulerConfig& config, KvCacheManager kv)
    : config_(config), kv_(std::move(kv)) {}

Status Scheduler::submit(RequestSpec spec) {
  const std::string who = "request " + std::to_string(spec.request_id) + ": ";
  const int64_t num_prompt = static_cast<int64_t>(spec.prompt_token_ids.size());
  if (num_prompt == 0) return Status::error(who + "empty prompt");
  if (spec.max_tokens < 1) {
    return Status::error(who + "max_tokens must be >= 1 (got " + std::to_string(spec.max_tokens) + ")");
  }
  if (requests_.count(spec.request_id)) return Status::error(who + "id already in use");
  const int64_t num_total = num_prompt + spec.max_tokens;
  if (num_total > config_.max_model_len) {
    return Status::error(who + "prompt (" + std::to_string(num_prompt) + " tokens) + max_tokens (" +
                         std::to_string(spec.max_tokens) + ") exceeds max_model_len " +
                         std::to_string(config_.max_model_len));
  }
  // The last sampled token is never fed back, so its KV is never needed.
  const int32_t num_blocks_needed = kv_.blocks_for_tokens(num_total - 1);
  if (num_blocks_needed > kv_.num_blocks()) {
    return Status::error(who + "needs " + std::to_string(num_blocks_needed) +
                         " KV blocks at its longest but the pool has " +
                         std::to_string(kv_.num_blocks()) + " (" + std::to_string(num_prompt) +
                         " prompt tokens + " + std::to_string(spec.max_tokens) + " max_tokens, " +
                         std::to_string(kv_.block_size()) + " tokens per block)");
  }
  auto request = std::make_unique<Request>(std::move(spec));
  request->set_arrival_seq(next_arrival_seq_++);
  if (config_.policy == SchedulingPolicy::kPriority) insert_by_priority(waiting_, request.get());
  else waiting_.push_back(request.get());
  requests_.emplace(request->id(), std::move(request));
  return Status::ok();
}

void Scheduler::add_entry(const Request& request, int32_t num_new_tokens, bool is_new_admission,
                          int32_t num_prefix_hit_tokens, SchedulePlan* plan, int32_t num_spec) const {
  ScheduledRequest e;
  e.request_id = request.id();
  e.start_pos = request.num_computed_tokens();
  e.end_pos = e.start_pos + num_new_tokens + num_spec;
  e.token_ids.assign(request.token_ids().begin() + e.start_pos,
                     request.token_ids().begin() + e.start_pos + num_new_tokens);
  e.token_ids.insert(e.token_ids.end(), request.spec_token_ids().begin(),
                     request.spec_token_ids().begin() + num_spec);
  e.samples = e.start_pos + num_new_tokens == request.num_tokens();
  e.num_spec_tokens = num_spec;
  e.is_new_admission = is_new_admission;
  e.num_prefix_hit_tokens = num_prefix_hit_tokens;
  e.block_table = kv_.block_table(request.id()).block_ids();
  const bool is_decode = num_new_tokens == 1 && e.samples && e.start_pos >= request.num_prompt_tokens();
  (is_decode ? plan->stats.num_decode_tokens : plan->stats.num_prefill_tokens) += num_new_tokens + num_spec;
  plan->stats.num_spec_tokens += num_spec;
  plan->scheduled.push_back(std::move(e));
}

int32_t Scheduler::usable_spec_tokens(const Request& r, int32_t budget) const {
  if (r.spec_token_ids().empty() || r.num_tokens() - r.num_computed_tokens() != 1 ||
      r.num_computed_tokens() < r.num_prompt_tokens())
    return 0;
  // Verifying k drafts yields up to k + 1 tokens: never more than max_tokens allows, which also
  // keeps every draft position inside the blocks submit() checked the pool for.
  const int32_t room = r.max_tokens() - r.num_output_tokens() - 1;
  return std::max(0, std::min({int32_t(r.spec_token_ids().size()), chunk_limit(budget) - 1, room}));
}

namespace {

// Priority order: lower priority value first, then earlier arrival.
bool more_urgent(const Request* a, const Request* b) {
  return a->priority() != b->priority() ? a->priority() < b->priority() : a->arrival_seq() < b->arrival_seq();
}

}  // namespace

template <typename Queue>
void Scheduler::insert_by_priority(Queue& queue, Request* request) {
  queue.insert(std::upper_bound(queue.begin(), queue.end(), request, more_urgent), request);
}

void Scheduler::preempt(Request* request, SchedulePlan* plan) {
  kv_.free(request->id());
  request->clear_spec_token_ids();
  request->set_num_computed_tokens(0);
  request->transition(RequestState::kPreempted);
  request->count_preemption();
  if (config_.policy == SchedulingPolicy::kPriority) insert_by_priority(waiting_, request);
  else waiting_.push_front(request);
  plan->preempted.push_back(request->id());
  ++plan->stats.num_preemptions;
}

void Scheduler::schedule_running(SchedulePlan* plan, int32_t* budget) {
  size_t i = 0;
  while (i < running_.size() && *budget > 0) {
    Request* r = running_[i];
    const int32_t remaining = r->num_tokens() - r->num_computed_tokens();
    M3_CHECK(remaining > 0, "running request %llu has nothing to compute",
             static_cast<unsigned long long>(r->id()));
    const int32_t num_new = std::min(remaining, chunk_limit(*budget));
    // Drafts only take free blocks: a request is never preempted to verify guesses.
    int32_t num_spec = usable_spec_tokens(*r, *budget);
    if (num_spec > 0 && !kv_.allocate_slots(r->id(), r->num_computed_tokens(), num_new + num_spec)) num_spec = 0;
    if (num_spec > 0) {
      add_entry(*r, num_new, /*is_new_admission=*/false, 0, plan, num_spec);  // copies the draft
      *budget -= num_new + num_spec;
      ++i;
      continue;
    }
    bool self_preempted = false;
    while (!kv_.allocate_slots(r->id(), r->num_computed_tokens(), num_new)) {
      // Requests after i are unscheduled this step, so taking the newest (priority: the
      // least urgent, running_ being in key order) never has to undo an entry in the plan.
      Request* victim = running_.back();
      running_.pop_back();
      preempt(victim, plan);
      if (victim == r) {
        self_preempted = true;
        break;
      }
    }
    if (self_preempted) break;
    add_entry(*r, num_new, /*is_new_admission=*/false, 0, plan);
    *budget -= num_new;
    ++i;
  }
}

void Scheduler::admit_waiting(SchedulePlan* plan, int32_t* budget) {
  if (waiting_.empty()) return;  // nothing to admit: no pending-block set to build
  // Prompt blocks that running requests (those admitted below included) will compute: a waiting
  // request whose next block is among them waits for it rather than computing it a second time
  // (n > 1 choices, agents fanning out one context).
  std::unordered_set<Hash128, Hash128Hasher> pending;
  std::vector<Hash128> hashes;
  auto add_pending = [&](Request* r) {
    hashes.clear();
    kv_.unpublished_hashes(r->id(), r->token_ids(), &hashes);
    pending.insert(hashes.begin(), hashes.end());
  };
  if (kv_.config().enable_prefix_caching)
    for (Request* r : running_) add_pending(r);
  size_t w = 0;
  while (w < waiting_.size() && *budget > 0 && static_cast<int32_t>(running_.size()) < config_.max_num_seqs) {
    Request* r = waiting_[w];
    const PrefixMatch hit = r->skip_prefix_cache() ? PrefixMatch{} : kv_.find_cached_prefix(r->id(), r->token_ids());
    if (!pending.empty() && !r->skip_prefix_cache()) {
      const std::optional<Hash128> next = kv_.first_missed_hash(r->id(), hit);
      if (next && pending.count(*next)) {
        ++plan->stats.num_deferred_for_prefix;
        ++w;  // keeps its place; the next request may still be admitted
        continue;
      }
    }
    const int32_t num_new = std::min(r->num_tokens() - hit.num_tokens, chunk_limit(*budget));
    if (!kv_.allocate_slots(r->id(), hit.num_tokens, num_new, &hit)) break;  // FCFS: no skipping for blocks
    waiting_.erase(waiting_.begin() + std::ptrdiff_t(w));
    if (!r->skip_prefix_cache()) {  // a lookup not made is no query of the hit rate
      kv_.record_prefix_query(r->num_tokens(), hit.num_tokens);
      plan->stats.prefix_query_tokens += r->num_tokens();
      plan->stats.prefix_hit_tokens += hit.num_tokens;
      plan->stats.prefix_host_hit_tokens += static_cast<int32_t>(hit.host_slots.size()) * kv_.block_size();
    }
    r->set_num_computed_tokens(hit.num_tokens);
    if (r->state() == RequestState::kWaiting) r->set_num_cached_prompt_tokens(hit.num_tokens);
    r->transition(RequestState::kRunning);
    r->set_admission_seq(next_admission_seq_++);
    if (config_.policy == SchedulingPolicy::kPriority) insert_by_priority(running_, r);
    else running_.push_back(r);
    add_entry(*r, num_new, /*is_new_admission=*/true, hit.num_tokens, plan);
    *budget -= num_new;
    if (kv_.config().enable_prefix_caching) add_pending(r);
  }
}

SchedulePlan Scheduler::schedule() {
  M3_CHECK(outstanding_step_id_ == 0, "schedule() called before update() of step %llu",
           static_cast<unsigned long long>(outstanding_step_id_));
  SchedulePlan plan;
  plan.step_id = next_step_id_++;
  plan.block_size_tokens = kv_.block_size();
  plan.finished = std::move(finished_since_last_plan_);
  finished_since_last_plan_.clear();

  kv_.begin_step();
  int32_t budget = config_.max_num_batched_tokens;
  schedule_running(&plan, &budget);
  for (Request* r : running_) r->clear_spec_token_ids();  // single use: the plan holds its copies
  // After a preemption the pool is known to be short: admitting now would only thrash.
  if (plan.preempted.empty()) admit_waiting(&plan, &budget);

  const KvStats kv = kv_.stats();
  plan.stats.num_scheduled_requests = static_cast<int32_t>(plan.scheduled.size());
  plan.stats.num_running = num_running();
  plan.stats.num_waiting = num_waiting();
  plan.stats.kv_blocks_used = kv.num_used_blocks;
  plan.stats.kv_blocks_free = kv.num_free_blocks;
  plan.stats.kv_blocks_cached = kv.num_cached_blocks;
  kv_.take_transfers(&plan.kv_offloads, &plan.kv_loads);
  plan.stats.kv_offloaded_blocks = static_cast<int32_t>(plan.kv_offloads.size());
  plan.stats.kv_loaded_blocks = static_cast<int32_t>(plan.kv_loads.size());
  plan.stats.kv_host_blocks_used = kv.num_host_used_blocks;
  if (!plan.empty()) outstanding_step_id_ = plan.step_id;
  return plan;
}

void Scheduler::finish(Request* request, FinishReason reason) {
  kv_.free(request->id());
  if (request->state() == RequestState::kRunning) {
    running_.erase(std::find(running_.begin(), running_.end(), request));
  } else {
    waiting_.erase(std::find(waiting_.begin(), waiting_.end(), request));
  }
  request->transition(RequestState::kFinished, reason);
  finished_since_last_plan_.push_back(request->id());
  requests_.erase(request->id());  // destroys *request
}

Result<std::vector<RequestOutput>> Scheduler::update(const SchedulePlan& plan,
                                                     std::span<const SampledTokens> sampled) {
  if (plan.empty()) {
    if (!sampled.empty()) return Status::error("update: samples given for an empty plan");
    return std::vector<RequestOutput>{};
  }
  if (plan.step_id != outstanding_step_id_) {
    return Status::error("update: plan of step " + std::to_string(plan.step_id) +
                         " is not the one awaiting results (" +
                         std::to_string(outstanding_step_id_) + ")");
  }
  // Validate everything before changing anything.
  std::unordered_map<RequestId, const ScheduledRequest*> entries;
  for (const ScheduledRequest& e : plan.scheduled) entries.emplace(e.request_id, &e);
  std::unordered_map<RequestId, const SampledTokens*> samples;
  for (const SampledTokens& s : sampled) {
    auto it = entries.find(s.request_id);
    if (it == entries.end() || !it->second->samples) {
      return Status::error("update: request " + std::to_string(s.request_id) +
                           " was not scheduled to sample in step " + std::to_string(plan.step_id));
    }
    if (s.token_ids.empty()) {
      return Status::error("update: no token for request " + std::to_string(s.request_id));
    }
    if (!samples.emplace(s.request_id, &s).second) {
      return Status::error("update: request " + std::to_string(s.request_id) + " sampled twice");
    }
    // Every token but the last must be an accepted draft: their KV is what this step computed.
    const ScheduledRequest& e = *it->second;
    const size_t first_draft = e.token_ids.size() - size_t(e.num_spec_tokens);
    if (s.token_ids.size() > size_t(e.num_spec_tokens) + 1 ||
        !std::equal(s.token_ids.begin(), s.token_ids.end() - 1, e.token_ids.begin() + std::ptrdiff_t(first_draft))) {
      return Status::error("update: request " + std::to_string(s.request_id) + " returned " +
                           std::to_string(s.token_ids.size()) + " tokens that are not its accepted drafts (" +
                           std::to_string(e.num_spec_tokens) + " drafted) and one sample");
    }
  }
  for (const ScheduledRequest& e : plan.scheduled) {
    auto it = requests_.find(e.request_id);
    const bool live = it != requests_.end() && it->second->state() == RequestState::kRunning;
    if (live && e.samples && !samples.count(e.request_id)) {
      return Status::error("update: missing sampled token for request " +
                           std::to_string(e.request_id));
    }
  }

  outstanding_step_id_ = 0;
  std::vector<RequestOutput> outputs;
  for (const ScheduledRequest& e : plan.scheduled) {
    auto it = requests_.find(e.request_id);
    // Aborted while the step ran (any later request with this id cannot be running yet).
    if (it == requests_.end() || it->second->state() != RequestState::kRunning) continue;
    Request* r = it->second.get();
    M3_CHECK(r->num_computed_tokens() == e.start_pos, "plan and request disagree on progress");
    if (!e.samples) {
      r->set_num_computed_tokens(e.end_pos);
      kv_.mark_computed(r->id(), r->token_ids(), e.end_pos);
      continue;
    }
    const SampledTokens& s = *samples.at(e.request_id);
    // The KV of rejected drafts is dead: computed stops after the last accepted one (later
    // steps overwrite those slots), and only blocks of real tokens are published.
    const int32_t computed = e.end_pos - e.num_spec_tokens + int32_t(s.token_ids.size()) - 1;
    RequestOutput out;
    out.request_id = r->id();
    for (TokenId t : s.token_ids) {
      out.new_token_ids.push_back(t);
      out.finish_reason = r->append_output_token(t);
      if (out.finish_reason != FinishReason::kNone) break;
    }
    r->set_num_computed_tokens(std::min(computed, r->num_tokens() - 1));
    kv_.mark_computed(r->id(), r->token_ids(), r->num_computed_tokens());
    if (out.finish_reason == FinishReason::kNone && s.stop) out.finish_reason = FinishReason::kCallerStop;
    out.finished = out.finish_reason != FinishReason::kNone;
    if (out.finished) finish(r, out.finish_reason);
    outputs.push_back(std::move(out));
  }
  return outputs;
}

Status Scheduler::set_spec_tokens(RequestId request_id, std::vector<TokenId> draft) {
  auto it = requests_.find(request_id);
  if (it == requests_.end() || it->second->state() != RequestState::kRunning)
    return Status::error("set_spec_tokens: request " + std::to_string(request_id) + " is not running");
  it->second->set_spec_token_ids(std::move(draft));
  return Status::ok();
}

Status Scheduler::abort(RequestId request_id) {
  auto it = requests_.find(request_id);
  if (it == requests_.end()) {
    return Status::error("abort: request " + std::to_string(request_id) + " is not live");
  }
  finish(it->second.get(), FinishReason::kAborted);
  return Status::ok();
}

const Request* Scheduler::find_request(RequestId request_id) const {
  auto it = requests_.find(request_id);
  return it == requests_.end() ? nullptr : it->second.get();
}

Status Scheduler::check_invariants() const {
  M3_RETURN_IF_ERROR(kv_.check_invariants());
  if (running_.size() + waiting_.size() != requests_.size()) {
    return Status::error("queues hold " + std::to_string(running_.size() + waiting_.size()) +
                         " requests but " + std::to_string(requests_.size()) + " are live");
  }
  if (static_cast<int32_t>(running_.size()) > config_.max_num_seqs) {
    return Status::error("more running requests than max_num_seqs");
  }
  std::unordered_set<const Request*> seen;
  const bool by_priority = config_.policy == SchedulingPolicy::kPriority;
  uint64_t prev_seq = 0;
  const Request* prev = nullptr;
  for (const Request* r : running_) {
    const std::string who = "running request " + std::to_string(r->id());
    if (!seen.insert(r).second) return Status::error(who + " queued twice");
    if (r->state() != RequestState::kRunning) return Status::error(who + " in state " + std::string(to_string(r->state())));
    if (by_priority ? prev && more_urgent(r, prev) : r->admission_seq() <= prev_seq)
      return Status::error(who + (by_priority ? " out of priority order" : " out of admission order"));
    prev_seq = r->admission_seq();
    prev = r;
    if (r->num_computed_tokens() >= r->num_tokens()) return Status::error(who + " has nothing to compute");
    if (kv_.block_table(r->id()).num_blocks() < kv_.blocks_for_tokens(r->num_computed_tokens())) {
      return Status::error(who + " computed tokens beyond its blocks");
    }
  }
  prev = nullptr;
  for (const Request* r : waiting_) {
    const std::string who = "waiting request " + std::to_string(r->id());
    if (!seen.insert(r).second) return Status::error(who + " queued twice");
    if (by_priority && prev && more_urgent(r, prev)) return Status::error(who + " out of priority order");
    prev = r;
    if (r->state() != RequestState::kWaiting && r->state() != RequestState::kPreempted) {
      return Status::error(who + " in state " + std::string(to_string(r->state())));
    }
    if (r->num_computed_tokens() != 0) return Status::error(who + " has computed tokens");
    if (kv_.holds_blocks(r->id())) return Status::error(who + " holds KV blocks");
  }
  return Status::ok();
}

}  // namespace m3
