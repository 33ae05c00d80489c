// Randomised submit / step / abort sequences against the scheduler and the KV-reading
// fake model, with the invariant checker after every step. Fixed seeds: reproducible.
#include <gtest/gtest.h>

#include <map>
#include <random>
#include <set>

#include "../../unit/sched/fake_model.h"

namespace m3 {
namespace {

constexpr int32_t kVocab = 61;

class Rng {
 public:
  explicit Rng(uint64_t seed) : engine_(seed) {}
  int32_t uniform(int32_t lo, int32_t hi) {  // inclusive; same sequence on every platform
    return lo + static_cast<int32_t>(engine_() % static_cast<uint64_t>(hi - lo + 1));
  }
  bool chance(int32_t percent) { return uniform(0, 99) < percent; }

 private:
  std::mt19937_64 engine_;
};

struct FuzzStats {
  int64_t steps = 0, finished = 0, aborted = 0, rejected = 0, preemptions = 0, hit_tokens = 0;
  int64_t draft_tokens = 0, accepted_tokens = 0, host_hit_tokens = 0, offloads = 0;
};

void fuzz_one(uint64_t seed, int32_t num_steps, FuzzStats* totals) {
  SCOPED_TRACE("seed " + std::to_string(seed));
  Rng rng(seed);
  const int32_t block_sizes[] = {1, 2, 4, 16};
  KvCacheConfig kc;
  kc.block_size_tokens = block_sizes[rng.uniform(0, 3)];
  kc.num_blocks = rng.uniform(2, 48);
  kc.enable_prefix_caching = rng.chance(75);
  kc.hash_seed = seed;
  kc.num_host_blocks = kc.enable_prefix_caching && rng.chance(50) ? rng.uniform(1, 40) : 0;
  SchedulerConfig sc;
  sc.max_num_batched_tokens = rng.uniform(1, 48);
  sc.max_num_seqs = rng.uniform(1, 8);
  sc.max_model_len = rng.uniform(8, 160);
  sc.max_chunk_tokens = rng.chance(30) ? rng.uniform(1, 16) : 0;
  const bool by_priority = rng.chance(40);
  const bool speculate = rng.chance(50);  // drafts: the true continuation, corrupted at random
  sc.policy = by_priority ? SchedulingPolicy::kPriority : SchedulingPolicy::kFcfs;
  Result<Scheduler> created = Scheduler::create(sc, kc);
  ASSERT_TRUE(created.is_ok()) << created.status().message();
  Scheduler sched = std::move(created).value();
  fake::FakeModel model(kc.num_blocks, kc.block_size_tokens, kVocab);

  // Shared stems make prefix hits (and shared blocks) common.
  std::vector<std::vector<TokenId>> stems(3);
  for (auto& stem : stems) {
    for (int i = 0; i < 40; ++i) stem.push_back(rng.uniform(0, kVocab - 1));
  }
  std::map<RequestId, RequestSpec> live;
  std::map<RequestId, std::vector<TokenId>> outputs;
  std::set<RequestId> caller_stopped;
  RequestId next_id = 1;

  auto submit_random = [&] {
    RequestSpec spec;
    spec.request_id = next_id++;
    const int32_t stem_len = rng.chance(60) ? rng.uniform(0, 40) : 0;
    const auto& stem = stems[rng.uniform(0, 2)];
    spec.prompt_token_ids.assign(stem.begin(), stem.begin() + stem_len);
    const int32_t tail = rng.uniform(0, 30);
    for (int i = 0; i < tail; ++i) spec.prompt_token_ids.push_back(rng.uniform(0, kVocab - 1));
    spec.max_tokens = rng.uniform(0, 24);
    if (rng.chance(30)) spec.stop_token_ids = {rng.uniform(0, kVocab - 1)};
    if (by_priority) spec.priority = rng.uniform(-2, 2);
    const int64_t total = static_cast<int64_t>(spec.prompt_token_ids.size()) + spec.max_tokens;
    const int64_t blocks = (total - 1 + kc.block_size_tokens - 1) / kc.block_size_tokens;
    const bool possible = !spec.prompt_token_ids.empty() && spec.max_tokens >= 1 &&
                          total <= sc.max_model_len && blocks <= kc.num_blocks;
    const Status st = sched.submit(spec);
    EXPECT_EQ(st.is_ok(), possible) << st.message();
    if (st.is_ok()) {
      live.emplace(spec.request_id, spec);
    } else {
      EXPECT_FALSE(st.message().empty());
      ++totals->rejected;
    }
  };
  auto abort_random = [&] {
    if (live.empty() || !rng.chance(50)) {
      EXPECT_FALSE(sched.abort(next_id + 1000).is_ok());
      return;
    }
    auto it = live.begin();
    std::advance(it, rng.uniform(0, static_cast<int32_t>(live.size()) - 1));
    EXPECT_TRUE(sched.abort(it->first).is_ok());
    EXPECT_EQ(sched.kv().block_table(it->first).num_blocks(), 0);
    live.erase(it);
    ++totals->aborted;
  };

  for (int32_t step = 0; step < num_steps || (!live.empty() && step < num_steps * 20); ++step) {
    const bool draining = step >= num_steps;
    if (!draining) {
      for (int k = rng.uniform(0, 2); k > 0; --k) {
        if (rng.chance(45)) submit_random();
      }
      if (rng.chance(4)) abort_random();
    }
    SchedulePlan plan = sched.schedule();
    ++totals->steps;
    totals->preemptions += plan.stats.num_preemptions;
    totals->hit_tokens += plan.stats.prefix_hit_tokens;
    totals->host_hit_tokens += plan.stats.prefix_host_hit_tokens;
    totals->offloads += plan.stats.kv_offloaded_blocks;
    if (plan.empty()) {
      EXPECT_TRUE(live.empty()) << "live requests but nothing scheduled at step " << step;
      continue;
    }
    // Plan shape.
    EXPECT_LE(plan.num_scheduled_tokens(), sc.max_num_batched_tokens);
    EXPECT_LE(static_cast<int32_t>(plan.scheduled.size()), sc.max_num_seqs);
    std::set<RequestId> ids;
    for (const ScheduledRequest& r : plan.scheduled) {
      EXPECT_TRUE(ids.insert(r.request_id).second);
      EXPECT_GT(r.end_pos, r.start_pos);
      if (sc.max_chunk_tokens > 0) {
        EXPECT_LE(r.num_scheduled_tokens(), sc.max_chunk_tokens);
      }
      EXPECT_LE(r.end_pos, sc.max_model_len);
      if (r.is_new_admission) {
        EXPECT_EQ(r.start_pos, r.num_prefix_hit_tokens);
      }
      EXPECT_EQ(r.num_prefix_hit_tokens % kc.block_size_tokens, 0);
    }
    for (RequestId id : plan.preempted) EXPECT_FALSE(ids.count(id));

    for (const ScheduledRequest& r : plan.scheduled) {
      if (r.num_spec_tokens == 0) continue;
      EXPECT_TRUE(r.samples);
      EXPECT_EQ(r.num_scheduled_tokens(), r.num_spec_tokens + 1);
      totals->draft_tokens += r.num_spec_tokens;
    }
    std::vector<SampledTokens> sampled = model.run(plan);
    for (const SampledTokens& s : sampled) totals->accepted_tokens += int64_t(s.token_ids.size()) - 1;
    if (!draining && rng.chance(3)) abort_random();  // mid-step abort
    for (SampledTokens& s : sampled) {
      if (live.count(s.request_id) && rng.chance(1)) {
        s.stop = true;
        caller_stopped.insert(s.request_id);
      }
    }
    Result<std::vector<RequestOutput>> outs = sched.update(plan, sampled);
    ASSERT_TRUE(outs.is_ok()) << outs.status().message();
    for (const RequestOutput& o : *outs) {
      ASSERT_TRUE(live.count(o.request_id)) << "output for a dead request " << o.request_id;
      auto& dst = outputs[o.request_id];
      dst.insert(dst.end(), o.new_token_ids.begin(), o.new_token_ids.end());
      if (!o.finished) {
        if (speculate && !o.new_token_ids.empty() && rng.chance(70)) {
          const std::vector<TokenId> ref = fake::reference_generate(live.at(o.request_id), kVocab);
          std::vector<TokenId> draft;
          for (int32_t n = rng.uniform(1, 6), j = 0; j < n; ++j) {
            const size_t at = dst.size() + size_t(j);
            draft.push_back(at < ref.size() && !rng.chance(20) ? ref[at] : rng.uniform(0, kVocab - 1));
          }
          EXPECT_TRUE(sched.set_spec_tokens(o.request_id, std::move(draft)).is_ok());
        }
        continue;
      }
      const std::vector<TokenId> expected = fake::reference_generate(live.at(o.request_id), kVocab);
      if (o.finish_reason == FinishReason::kCallerStop) {
        ASSERT_LE(dst.size(), expected.size());
        EXPECT_TRUE(std::equal(dst.begin(), dst.end(), expected.begin())) << "request " << o.request_id;
      } else {
        EXPECT_EQ(dst, expected) << "request " << o.request_id;
      }
      live.erase(o.request_id);
      ++totals->finished;
    }
    const Status inv = sched.check_invariants();
    ASSERT_TRUE(inv.is_ok()) << "step " << step << ": " << inv.message();
    EXPECT_EQ(sched.num_running() + sched.num_waiting(), static_cast<int32_t>(live.size()));
  }
  EXPECT_TRUE(live.empty()) << live.size() << " requests never finished";
  const KvStats kv = sched.kv().stats();
  EXPECT_EQ(kv.num_used_blocks, 0);
  EXPECT_EQ(kv.num_free_blocks, kc.num_blocks);
  EXPECT_LE(kv.prefix_hit_tokens, kv.prefix_query_tokens);
}

TEST(SchedulerFuzz, RandomWorkloadsKeepInvariantsAndOutputs) {
  FuzzStats totals;
  for (uint64_t seed = 1; seed <= 24; ++seed) {
    fuzz_one(seed, 250, &totals);
    if (::testing::Test::HasFatalFailure()) return;
  }
  std::printf("fuzz: %lld steps, %lld finished, %lld aborted, %lld rejected, %lld preemptions, "
              "%lld prefix-hit tokens (%lld from the host tier, %lld blocks offloaded), %lld draft tokens (%lld accepted)\n",
              static_cast<long long>(totals.steps), static_cast<long long>(totals.finished),
              static_cast<long long>(totals.aborted), static_cast<long long>(totals.rejected),
              static_cast<long long>(totals.preemptions), static_cast<long long>(totals.hit_tokens),
              static_cast<long long>(totals.host_hit_tokens), static_cast<long long>(totals.offloads),
              static_cast<long long>(totals.draft_tokens), static_cast<long long>(totals.accepted_tokens));
  // The workload must actually exercise the interesting paths.
  EXPECT_GT(totals.steps, 5000);
  EXPECT_GT(totals.finished, 500);
  EXPECT_GT(totals.preemptions, 20);
  EXPECT_GT(totals.hit_tokens, 500);
  EXPECT_GT(totals.aborted, 10);
  EXPECT_GT(totals.draft_tokens, 1000);
  EXPECT_GT(totals.host_hit_tokens, 100);
  EXPECT_GT(totals.offloads, 100);
  EXPECT_GT(totals.accepted_tokens, 300);
  EXPECT_LT(totals.accepted_tokens, totals.draft_tokens);
}

}  // namespace
}  // namespace m3
