// Scheduler end to end with the KV-reading fake model, plus its edge cases.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>

#include "fake_model.h"
#include "sched/scheduler.h"

namespace m3 {
namespace {

using fake::drive;
using fake::FakeModel;
using fake::reference_generate;

constexpr int32_t kVocab = 97;

struct Knobs {
  int32_t num_blocks = 64;
  int32_t block_size = 4;
  int32_t budget = 64;
  int32_t max_seqs = 8;
  int32_t max_model_len = 512;
  bool prefix_caching = true;
  int32_t host_blocks = 0;
};

Scheduler make_scheduler_with(const Knobs& s, int32_t max_chunk_tokens) {
  SchedulerConfig c{s.budget, s.max_seqs, s.max_model_len, max_chunk_tokens};
  KvCacheConfig k;
  k.num_blocks = s.num_blocks;
  k.block_size_tokens = s.block_size;
  k.enable_prefix_caching = s.prefix_caching;
  k.hash_seed = 99;
  k.hash_extra_keys = {"model_rev=fake"};
  k.num_host_blocks = s.host_blocks;
  Result<Scheduler> r = Scheduler::create(c, k);
  EXPECT_TRUE(r.is_ok()) << r.status().message();
  return std::move(r).value();
}

Scheduler make_scheduler(const Knobs& s) { return make_scheduler_with(s, 0); }

RequestSpec make_spec(RequestId id, int32_t prompt_len, int32_t max_tokens, TokenId first = 1,
                      std::vector<TokenId> stop = {}) {
  RequestSpec spec;
  spec.request_id = id;
  for (int32_t i = 0; i < prompt_len; ++i) spec.prompt_token_ids.push_back((first + 13 * i) % kVocab);
  spec.max_tokens = max_tokens;
  spec.stop_token_ids = std::move(stop);
  return spec;
}

void expect_matches_reference(const std::vector<RequestSpec>& specs,
                              const fake::DriveResult& result) {
  for (const RequestSpec& spec : specs) {
    auto it = result.outputs.find(spec.request_id);
    ASSERT_NE(it, result.outputs.end()) << "request " << spec.request_id << " produced nothing";
    EXPECT_EQ(it->second, reference_generate(spec, kVocab)) << "request " << spec.request_id;
  }
}

TEST(RequestState, TransitionsAreCheckedInOnePlace) {
  using S = RequestState;
  const S all[] = {S::kWaiting, S::kRunning, S::kPreempted, S::kFinished};
  int num_valid = 0;
  for (S from : all) {
    for (S to : all) num_valid += is_valid_transition(from, to);
  }
  EXPECT_EQ(num_valid, 6);
  EXPECT_TRUE(is_valid_transition(S::kWaiting, S::kRunning));
  EXPECT_TRUE(is_valid_transition(S::kRunning, S::kPreempted));
  EXPECT_TRUE(is_valid_transition(S::kPreempted, S::kRunning));
  EXPECT_TRUE(is_valid_transition(S::kWaiting, S::kFinished));
  EXPECT_FALSE(is_valid_transition(S::kWaiting, S::kPreempted));
  EXPECT_FALSE(is_valid_transition(S::kFinished, S::kRunning));
  EXPECT_FALSE(is_valid_transition(S::kRunning, S::kWaiting));
}

TEST(Scheduler, ConfigValidationReportsEveryProblem) {
  KvCacheConfig k;
  k.num_blocks = 4;
  k.block_size_tokens = 4;
  Result<Scheduler> r = Scheduler::create(SchedulerConfig{}, k);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.error().find("max_num_batched_tokens"), std::string::npos);
  EXPECT_NE(r.error().find("max_num_seqs"), std::string::npos);
  EXPECT_NE(r.error().find("max_model_len"), std::string::npos);
  EXPECT_FALSE(Scheduler::create(SchedulerConfig{8, 2, 64}, KvCacheConfig{}).is_ok());
  EXPECT_FALSE(Scheduler::create(SchedulerConfig{8, 2, 64, -1}, k).is_ok());
  EXPECT_TRUE(Scheduler::create(SchedulerConfig{8, 2, 64, 4}, k).is_ok());
}

TEST(Scheduler, PlanCarriesPositionsSlotsAndTables) {
  Knobs s;
  s.budget = 6;
  Scheduler sched = make_scheduler(s);
  ASSERT_TRUE(sched.submit(make_spec(1, 10, 2)).is_ok());
  const SchedulePlan plan = sched.schedule();
  ASSERT_EQ(plan.scheduled.size(), 1u);
  const ScheduledRequest& r = plan.scheduled[0];
  EXPECT_EQ(plan.block_size_tokens, 4);
  EXPECT_EQ(r.start_pos, 0);
  EXPECT_EQ(r.end_pos, 6);
  EXPECT_FALSE(r.samples);  // a non-final chunk
  EXPECT_TRUE(r.is_new_admission);
  ASSERT_EQ(r.block_table.size(), 2u);
  EXPECT_EQ(plan.positions(), (std::vector<int32_t>{0, 1, 2, 3, 4, 5}));
  const std::vector<int64_t> slots = plan.slot_mapping();
  ASSERT_EQ(slots.size(), 6u);
  for (int32_t p = 0; p < 6; ++p) {
    EXPECT_EQ(slots[p], int64_t{r.block_table[p / 4]} * 4 + p % 4);
  }
  EXPECT_EQ(plan.query_start_offsets(), (std::vector<int32_t>{0, 6}));
  EXPECT_EQ(plan.seq_lens(), (std::vector<int32_t>{6}));
  EXPECT_TRUE(plan.sample_token_indices().empty());
  EXPECT_EQ(plan.stats.num_prefill_tokens, 6);
  EXPECT_EQ(plan.stats.num_decode_tokens, 0);
  ASSERT_TRUE(sched.update(plan, {}).is_ok());

  // Second chunk starts mid-block at absolute position 6 and reaches the end: samples.
  const SchedulePlan plan2 = sched.schedule();
  ASSERT_EQ(plan2.scheduled.size(), 1u);
  EXPECT_EQ(plan2.scheduled[0].start_pos, 6);
  EXPECT_EQ(plan2.scheduled[0].end_pos, 10);
  EXPECT_TRUE(plan2.scheduled[0].samples);
  EXPECT_FALSE(plan2.scheduled[0].is_new_admission);
  EXPECT_EQ(plan2.scheduled[0].block_table.size(), 3u);
  EXPECT_EQ(plan2.scheduled[0].block_table[0], r.block_table[0]);  // tables only grow
  ASSERT_TRUE(sched.update(plan2, std::vector<SampledTokens>{{1, {5}, false}}).is_ok());

  const SchedulePlan plan3 = sched.schedule();
  ASSERT_EQ(plan3.scheduled.size(), 1u);
  EXPECT_EQ(plan3.scheduled[0].start_pos, 10);
  EXPECT_EQ(plan3.scheduled[0].token_ids, (std::vector<TokenId>{5}));
  EXPECT_EQ(plan3.stats.num_decode_tokens, 1);
  EXPECT_EQ(plan3.stats.num_prefill_tokens, 0);
  Result<std::vector<RequestOutput>> out = sched.update(plan3, std::vector<SampledTokens>{{1, {6}, false}});
  ASSERT_TRUE(out.is_ok());
  ASSERT_EQ(out->size(), 1u);
  EXPECT_TRUE((*out)[0].finished);
  EXPECT_EQ((*out)[0].finish_reason, FinishReason::kMaxTokens);
  EXPECT_EQ(sched.kv().stats().num_used_blocks, 0);
  const SchedulePlan plan4 = sched.schedule();
  EXPECT_TRUE(plan4.empty());
  EXPECT_EQ(plan4.finished, (std::vector<RequestId>{1}));
}

TEST(Scheduler, FlatBatchHelpersFollowBatchOrder) {
  Knobs s;
  s.budget = 12;
  Scheduler sched = make_scheduler(s);
  ASSERT_TRUE(sched.submit(make_spec(1, 3, 2)).is_ok());
  ASSERT_TRUE(sched.submit(make_spec(2, 20, 2, 30)).is_ok());
  const SchedulePlan p = sched.schedule();
  ASSERT_EQ(p.scheduled.size(), 2u);
  EXPECT_EQ(p.query_start_offsets(), (std::vector<int32_t>{0, 3, 12}));
  EXPECT_EQ(p.seq_lens(), (std::vector<int32_t>{3, 9}));
  EXPECT_EQ(p.sample_token_indices(), (std::vector<int32_t>{2}));  // request 2 is mid-prompt
  const std::vector<int32_t> pos = p.positions();
  EXPECT_EQ(pos[2], 2);
  EXPECT_EQ(pos[3], 0);
  EXPECT_EQ(pos[11], 8);
}

TEST(Scheduler, ChunkCapLetsNewerRequestsDecodeDuringALongPrefill) {
  Knobs s;
  s.budget = 16;
  Scheduler sched = make_scheduler_with(s, /*max_chunk_tokens=*/5);
  FakeModel model(s.num_blocks, s.block_size, kVocab);
  std::vector<RequestSpec> specs = {make_spec(1, 2, 30), make_spec(2, 120, 3, 8)};
  for (const RequestSpec& spec : specs) ASSERT_TRUE(sched.submit(spec).is_ok());
  const fake::DriveResult r = drive(sched, model);
  int32_t steps_with_both = 0;
  for (const SchedulePlan& p : r.plans) {
    for (const ScheduledRequest& e : p.scheduled) EXPECT_LE(e.num_scheduled_tokens(), 5);
    steps_with_both += p.scheduled.size() == 2;
  }
  EXPECT_GT(steps_with_both, 20);  // request 1 decodes alongside 2's 24 chunks
  expect_matches_reference(specs, r);
}

TEST(Scheduler, ChunkedPrefillWithTinyBudgetMatchesOneAtATime) {
  const int32_t prompt_lens[] = {1, 5, 16, 17, 40, 3, 100, 9};
  std::vector<RequestSpec> specs;
  for (int i = 0; i < 8; ++i) specs.push_back(make_spec(i + 1, prompt_lens[i], 3 + i % 4, 5 * i + 1));

  Knobs tiny;
  tiny.budget = 7;
  tiny.max_seqs = 4;
  Scheduler batched = make_scheduler(tiny);
  FakeModel model_a(tiny.num_blocks, tiny.block_size, kVocab);
  for (const RequestSpec& spec : specs) ASSERT_TRUE(batched.submit(spec).is_ok());
  const fake::DriveResult a = drive(batched, model_a);

  Knobs solo;
  solo.budget = 512;
  solo.max_seqs = 1;
  Scheduler serial = make_scheduler(solo);
  FakeModel model_b(solo.num_blocks, solo.block_size, kVocab);
  for (const RequestSpec& spec : specs) ASSERT_TRUE(serial.submit(spec).is_ok());
  const fake::DriveResult b = drive(serial, model_b);

  expect_matches_reference(specs, a);
  EXPECT_EQ(a.outputs, b.outputs);
  // The tiny budget really chunked and really batched.
  bool saw_chunk = false, saw_mixed = false;
  for (const SchedulePlan& p : a.plans) {
    EXPECT_LE(p.num_scheduled_tokens(), tiny.budget);
    EXPECT_LE(static_cast<int32_t>(p.scheduled.size()), tiny.max_seqs);
    for (const ScheduledRequest& r : p.scheduled) saw_chunk = saw_chunk || !r.samples;
    saw_mixed = saw_mixed || (p.stats.num_prefill_tokens > 0 && p.stats.num_decode_tokens > 0);
  }
  EXPECT_TRUE(saw_chunk);
  EXPECT_TRUE(saw_mixed);
  EXPECT_EQ(batched.kv().stats().num_used_blocks, 0);
}

TEST(Scheduler, PrefixHitsCountFullBlocksOnlyAndComputeTheLastToken) {
  Knobs s;  // block size 4
  Scheduler sched = make_scheduler(s);
  FakeModel model(s.num_blocks, s.block_size, kVocab);
  const RequestSpec a = make_spec(1, 10, 1, 3);  // blocks [0,4) [4,8) cached after it runs
  ASSERT_TRUE(sched.submit(a).is_ok());
  fake::DriveResult first = drive(sched, model);
  EXPECT_EQ(first.plans[0].stats.prefix_query_tokens, 10);
  EXPECT_EQ(first.plans[0].stats.prefix_hit_tokens, 0);

  auto prefix_of_a = [&](RequestId id, int32_t shared, int32_t extra) {
    RequestSpec spec = make_spec(id, 0, 2);
    spec.prompt_token_ids.assign(a.prompt_token_ids.begin(), a.prompt_token_ids.begin() + shared);
    for (int32_t i = 0; i < extra; ++i) spec.prompt_token_ids.push_back(90 - i);
    return spec;
  };
  struct Case {
    RequestSpec spec;
    int32_t expected_hit;
  };
  const std::vector<Case> cases = {
      {prefix_of_a(2, 9, 3), 8},  // two full blocks shared
      {prefix_of_a(3, 6, 5), 4},  // partial second block: only the first block
      {prefix_of_a(4, 8, 0), 4},  // whole prompt cached: capped at 7, rounded down to 4
      {prefix_of_a(5, 9, 0), 8},  // whole prompt cached but the 9th token is computed
      {prefix_of_a(6, 3, 9), 0},  // less than a block
  };
  for (const Case& c : cases) {
    ASSERT_TRUE(sched.submit(c.spec).is_ok());
    const KvStats before = sched.kv().stats();
    const SchedulePlan plan = sched.schedule();
    ASSERT_EQ(plan.scheduled.size(), 1u);
    const ScheduledRequest& r = plan.scheduled[0];
    EXPECT_EQ(r.num_prefix_hit_tokens, c.expected_hit) << "request " << c.spec.request_id;
    EXPECT_EQ(sched.find_request(c.spec.request_id)->num_cached_prompt_tokens(), c.expected_hit);
    EXPECT_EQ(r.start_pos, c.expected_hit);
    EXPECT_GE(r.num_scheduled_tokens(), 1);
    EXPECT_EQ(plan.stats.prefix_hit_tokens, c.expected_hit);
    EXPECT_EQ(plan.stats.prefix_query_tokens, static_cast<int32_t>(c.spec.prompt_token_ids.size()));
    EXPECT_EQ(sched.kv().stats().prefix_hit_tokens - before.prefix_hit_tokens, c.expected_hit);
    Result<std::vector<RequestOutput>> out = sched.update(plan, model.run(plan));
    ASSERT_TRUE(out.is_ok());
    fake::DriveResult rest = drive(sched, model);
    std::vector<TokenId> tokens = (*out)[0].new_token_ids;
    tokens.insert(tokens.end(), rest.outputs[c.spec.request_id].begin(),
                  rest.outputs[c.spec.request_id].end());
    EXPECT_EQ(tokens, reference_generate(c.spec, kVocab)) << "request " << c.spec.request_id;
  }
  EXPECT_EQ(sched.kv().stats().num_used_blocks, 0);
  EXPECT_TRUE(sched.check_invariants().is_ok());
}

TEST(Scheduler, ConcurrentRequestsShareALivePrefix) {
  Knobs s;
  Scheduler sched = make_scheduler(s);
  FakeModel model(s.num_blocks, s.block_size, kVocab);
  const RequestSpec a = make_spec(1, 12, 20, 7);
  ASSERT_TRUE(sched.submit(a).is_ok());
  for (int i = 0; i < 2; ++i) {  // prefill + one decode: a's 3 blocks are published
    SchedulePlan p = sched.schedule();
    ASSERT_TRUE(sched.update(p, model.run(p)).is_ok());
  }
  RequestSpec b = a;
  b.request_id = 2;
  b.prompt_token_ids.push_back(1);
  ASSERT_TRUE(sched.submit(b).is_ok());
  const SchedulePlan p = sched.schedule();
  ASSERT_EQ(p.scheduled.size(), 2u);
  EXPECT_EQ(p.scheduled[1].num_prefix_hit_tokens, 12);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(p.scheduled[0].block_table[i], p.scheduled[1].block_table[i]);
  ASSERT_TRUE(sched.update(p, model.run(p)).is_ok());
  ASSERT_TRUE(sched.check_invariants().is_ok());
  const fake::DriveResult rest = drive(sched, model);
  EXPECT_EQ(sched.kv().stats().num_used_blocks, 0);
}

TEST(Scheduler, SiblingsWaitForTheSharedPrefixInsteadOfComputingIt) {
  Knobs s;  // 4-token blocks, budget 64: all four would fit in the first step
  Scheduler sched = make_scheduler(s);
  FakeModel model(s.num_blocks, s.block_size, kVocab);
  std::vector<RequestSpec> specs;
  for (RequestId id : {1, 2, 3}) specs.push_back(make_spec(id, 12, 3, 5));  // one prompt, n = 3
  specs.push_back(make_spec(4, 9, 3, 50));                                    // an unrelated prompt
  for (const RequestSpec& spec : specs) ASSERT_TRUE(sched.submit(spec).is_ok());
  SchedulePlan p = sched.schedule();
  std::vector<RequestId> first;
  for (const ScheduledRequest& e : p.scheduled) first.push_back(e.request_id);
  EXPECT_EQ(first, (std::vector<RequestId>{1, 4}));  // 2 and 3 wait; 4 behind them does not
  EXPECT_EQ(p.stats.num_deferred_for_prefix, 2);
  EXPECT_EQ(p.stats.num_prefill_tokens, 12 + 9);
  fake::DriveResult rest;
  std::map<RequestId, std::vector<TokenId>> produced;
  auto out = sched.update(p, model.run(p));
  ASSERT_TRUE(out.is_ok());
  for (const RequestOutput& o : *out) produced[o.request_id] = o.new_token_ids;
  p = sched.schedule();  // 1's two full prompt blocks are published: 2 and 3 hit them
  int32_t hits = 0;
  for (const ScheduledRequest& e : p.scheduled)
    if (e.is_new_admission) {
      EXPECT_TRUE(e.request_id == 2u || e.request_id == 3u);
      EXPECT_EQ(e.num_prefix_hit_tokens, 8);
      ++hits;
    }
  EXPECT_EQ(hits, 2);
  EXPECT_EQ(p.stats.num_deferred_for_prefix, 0);
  out = sched.update(p, model.run(p));
  ASSERT_TRUE(out.is_ok());
  for (const RequestOutput& o : *out)
    produced[o.request_id].insert(produced[o.request_id].end(), o.new_token_ids.begin(), o.new_token_ids.end());
  rest = drive(sched, model);
  for (auto& [id, tokens] : rest.outputs) produced[id].insert(produced[id].end(), tokens.begin(), tokens.end());
  for (const RequestSpec& spec : specs) EXPECT_EQ(produced[spec.request_id], reference_generate(spec, kVocab));

  // Without prefix caching nothing can be shared, so nothing waits.
  Knobs off = s;
  off.prefix_caching = false;
  Scheduler plain = make_scheduler(off);
  for (const RequestSpec& spec : specs) ASSERT_TRUE(plain.submit(spec).is_ok());
  p = plain.schedule();
  EXPECT_EQ(p.scheduled.size(), 4u);
  EXPECT_EQ(p.stats.num_deferred_for_prefix, 0);
}

TEST(Scheduler, TinyPoolForcesPreemptionAndEverythingStillFinishes) {
  for (bool prefix : {true, false}) {
    Knobs s;
    s.num_blocks = 8;  // 32 token slots
    s.block_size = 4;
    s.budget = 16;
    s.max_seqs = 4;
    s.prefix_caching = prefix;
    Scheduler sched = make_scheduler(s);
    FakeModel model(s.num_blocks, s.block_size, kVocab);
    std::vector<RequestSpec> specs;
    for (int i = 0; i < 5; ++i) specs.push_back(make_spec(i + 1, 6 + i, 14 - i, 11 * i + 2));
    for (const RequestSpec& spec : specs) ASSERT_TRUE(sched.submit(spec).is_ok());
    const fake::DriveResult result = drive(sched, model, 2000);
    int32_t num_preemptions = 0;
    for (const SchedulePlan& p : result.plans) {
      num_preemptions += p.stats.num_preemptions;
      EXPECT_EQ(static_cast<int32_t>(p.preempted.size()), p.stats.num_preemptions);
      for (RequestId id : p.preempted) {
        for (const ScheduledRequest& r : p.scheduled) EXPECT_NE(r.request_id, id);
      }
    }
    EXPECT_GT(num_preemptions, 0) << "prefix caching " << prefix;
    expect_matches_reference(specs, result);
    const KvStats kv = sched.kv().stats();
    EXPECT_EQ(kv.num_used_blocks, 0);
    EXPECT_EQ(kv.num_free_blocks, s.num_blocks);
  }
}

TEST(Scheduler, PreemptsTheNewestAdmittedAndRequeuesItFirst) {
  Knobs s;
  s.num_blocks = 4;
  s.block_size = 4;
  s.budget = 64;
  Scheduler sched = make_scheduler(s);
  FakeModel model(s.num_blocks, s.block_size, kVocab);
  ASSERT_TRUE(sched.submit(make_spec(1, 8, 5, 1)).is_ok());  // needs 3 blocks at its longest
  ASSERT_TRUE(sched.submit(make_spec(2, 8, 5, 40)).is_ok());
  ASSERT_TRUE(sched.submit(make_spec(3, 3, 2, 60)).is_ok());
  SchedulePlan p = sched.schedule();
  ASSERT_EQ(p.scheduled.size(), 2u);  // 1 and 2 take all 4 blocks; 3 waits
  ASSERT_TRUE(sched.update(p, model.run(p)).is_ok());
  p = sched.schedule();  // position 8 of each needs a third block: 2 (newest) goes
  EXPECT_EQ(p.preempted, (std::vector<RequestId>{2}));
  ASSERT_EQ(p.scheduled.size(), 1u);
  EXPECT_EQ(p.scheduled[0].request_id, 1u);
  EXPECT_EQ(sched.find_request(2)->state(), RequestState::kPreempted);
  EXPECT_EQ(sched.find_request(2)->num_computed_tokens(), 0);
  EXPECT_EQ(sched.num_waiting(), 2);
  ASSERT_TRUE(sched.update(p, model.run(p)).is_ok());
  p = sched.schedule();
  // No admission on a preempting step, then 2 is back before 3.
  const fake::DriveResult rest = [&] {
    EXPECT_TRUE(sched.update(p, model.run(p)).is_ok());
    return drive(sched, model);
  }();
  bool two_resumed_first = false;
  for (const SchedulePlan& q : rest.plans) {
    for (const ScheduledRequest& r : q.scheduled) {
      if (r.is_new_admission) {
        two_resumed_first = r.request_id == 2u;
        break;
      }
    }
    if (two_resumed_first) break;
  }
  EXPECT_TRUE(two_resumed_first);
  EXPECT_GE(sched.kv().stats().num_free_blocks, 4);
}

Scheduler make_priority_scheduler(const Knobs& s) {
  SchedulerConfig c{s.budget, s.max_seqs, s.max_model_len, 0, SchedulingPolicy::kPriority};
  KvCacheConfig k;
  k.num_blocks = s.num_blocks;
  k.block_size_tokens = s.block_size;
  k.enable_prefix_caching = s.prefix_caching;
  Result<Scheduler> r = Scheduler::create(c, k);
  EXPECT_TRUE(r.is_ok()) << r.status().message();
  return std::move(r).value();
}

// The order in which requests were first admitted over a drive.
std::vector<RequestId> admission_order(const fake::DriveResult& result) {
  std::vector<RequestId> order;
  for (const SchedulePlan& p : result.plans)
    for (const ScheduledRequest& r : p.scheduled)
      if (r.is_new_admission && std::find(order.begin(), order.end(), r.request_id) == order.end())
        order.push_back(r.request_id);
  return order;
}

TEST(Scheduler, PriorityPolicyAdmitsByPriorityThenArrival) {
  Knobs s;
  s.max_seqs = 1;  // one at a time: the admission order is the whole story
  std::vector<RequestSpec> specs;
  const int32_t priorities[] = {5, 1, 1, 0, -3};
  for (int i = 0; i < 5; ++i) {
    specs.push_back(make_spec(i + 1, 5, 3, 7 * i + 1));
    specs.back().priority = priorities[i];
  }
  Scheduler sched = make_priority_scheduler(s);
  FakeModel model(s.num_blocks, s.block_size, kVocab);
  for (const RequestSpec& spec : specs) ASSERT_TRUE(sched.submit(spec).is_ok());
  const fake::DriveResult result = drive(sched, model);
  EXPECT_EQ(admission_order(result), (std::vector<RequestId>{5, 4, 2, 3, 1}));
  expect_matches_reference(specs, result);
  // The same requests first come, first served.
  Scheduler fcfs = make_scheduler(s);
  for (const RequestSpec& spec : specs) ASSERT_TRUE(fcfs.submit(spec).is_ok());
  EXPECT_EQ(admission_order(drive(fcfs, model)), (std::vector<RequestId>{1, 2, 3, 4, 5}));
}

TEST(Scheduler, PriorityPolicyPreemptsTheLeastUrgent) {
  Knobs s;
  s.num_blocks = 4;
  s.block_size = 4;
  FakeModel model(s.num_blocks, s.block_size, kVocab);
  // Steps one plan by hand, keeping what it produced.
  std::map<RequestId, std::vector<TokenId>> produced;
  auto step = [&](Scheduler& sched, const SchedulePlan& p) {
    auto out = sched.update(p, model.run(p));
    ASSERT_TRUE(out.is_ok()) << out.status().message();
    for (const RequestOutput& o : *out)
      produced[o.request_id].insert(produced[o.request_id].end(), o.new_token_ids.begin(), o.new_token_ids.end());
    ASSERT_TRUE(sched.check_invariants().is_ok()) << sched.check_invariants().message();
  };
  auto finish_and_check = [&](Scheduler& sched, const std::vector<RequestSpec>& specs) {
    fake::DriveResult rest = drive(sched, model);
    for (auto& [id, tokens] : rest.outputs) produced[id].insert(produced[id].end(), tokens.begin(), tokens.end());
    for (const RequestSpec& spec : specs) EXPECT_EQ(produced[spec.request_id], reference_generate(spec, kVocab));
  };

  // The oldest request is the least urgent: the two others go first, it waits for blocks.
  Scheduler sched = make_priority_scheduler(s);
  std::vector<RequestSpec> specs = {make_spec(1, 8, 5, 1), make_spec(2, 8, 5, 40), make_spec(3, 3, 2, 60)};
  specs[0].priority = 2;
  specs[2].priority = 1;
  for (const RequestSpec& spec : specs) ASSERT_TRUE(sched.submit(spec).is_ok());
  SchedulePlan p = sched.schedule();
  ASSERT_EQ(p.scheduled.size(), 2u);
  EXPECT_EQ(p.scheduled[0].request_id, 2u);
  EXPECT_EQ(p.scheduled[1].request_id, 3u);
  step(sched, p);
  finish_and_check(sched, specs);

  // Newer and more urgent: scheduled first, and kept when blocks run out (FCFS would
  // preempt it, the newest admitted).
  Scheduler second = make_priority_scheduler(s);
  std::vector<RequestSpec> pair = {make_spec(11, 8, 5, 3), make_spec(12, 8, 5, 50)};
  pair[1].priority = -1;
  for (const RequestSpec& spec : pair) ASSERT_TRUE(second.submit(spec).is_ok());
  p = second.schedule();
  ASSERT_EQ(p.scheduled.size(), 2u);
  EXPECT_EQ(p.scheduled[0].request_id, 12u);
  step(second, p);
  p = second.schedule();  // each needs a third block: 11 (priority 0) goes
  EXPECT_EQ(p.preempted, (std::vector<RequestId>{11}));
  ASSERT_EQ(p.scheduled.size(), 1u);
  EXPECT_EQ(p.scheduled[0].request_id, 12u);
  step(second, p);
  finish_and_check(second, pair);
}

TEST(Scheduler, AbortFreesBlocksImmediatelyAndInFlightResultsAreIgnored) {
  Knobs s;
  Scheduler sched = make_scheduler(s);
  FakeModel model(s.num_blocks, s.block_size, kVocab);
  ASSERT_TRUE(sched.submit(make_spec(1, 20, 10)).is_ok());
  ASSERT_TRUE(sched.submit(make_spec(2, 9, 10, 50)).is_ok());
  ASSERT_TRUE(sched.submit(make_spec(3, 9, 10, 70)).is_ok());
  SchedulePlan p = sched.schedule();
  ASSERT_TRUE(sched.update(p, model.run(p)).is_ok());
  p = sched.schedule();
  const int32_t used_before = sched.kv().stats().num_used_blocks;
  const std::vector<SampledTokens> sampled = model.run(p);
  ASSERT_TRUE(sched.abort(1).is_ok());  // while the step is "on the GPU"
  EXPECT_EQ(sched.kv().stats().num_used_blocks, used_before - 6);  // 21 tokens in 6 blocks
  EXPECT_EQ(sched.find_request(1), nullptr);
  EXPECT_TRUE(sched.check_invariants().is_ok());
  Result<std::vector<RequestOutput>> out = sched.update(p, sampled);
  ASSERT_TRUE(out.is_ok()) << out.status().message();
  for (const RequestOutput& o : *out) EXPECT_NE(o.request_id, 1u);
  EXPECT_FALSE(sched.abort(1).is_ok());  // no longer live
  ASSERT_TRUE(sched.abort(3).is_ok());
  p = sched.schedule();
  EXPECT_EQ(p.finished, (std::vector<RequestId>{1, 3}));
  ASSERT_EQ(p.scheduled.size(), 1u);
  ASSERT_TRUE(sched.update(p, model.run(p)).is_ok());
  // Aborting a waiting request works too.
  ASSERT_TRUE(sched.submit(make_spec(4, 5, 3)).is_ok());
  ASSERT_TRUE(sched.abort(4).is_ok());
  EXPECT_TRUE(sched.check_invariants().is_ok());
  drive(sched, model);
  EXPECT_EQ(sched.kv().stats().num_used_blocks, 0);
}

TEST(Scheduler, ImpossibleRequestsAreRejectedAtSubmit) {
  Knobs s;
  s.num_blocks = 4;  // 16 slots
  s.block_size = 4;
  s.max_model_len = 40;
  Scheduler sched = make_scheduler(s);
  Status st = sched.submit(make_spec(1, 30, 11));
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("max_model_len"), std::string::npos) << st.message();
  st = sched.submit(make_spec(2, 10, 8));  // 17 tokens of KV > 16 slots
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("KV blocks"), std::string::npos) << st.message();
  EXPECT_FALSE(sched.submit(make_spec(3, 0, 4)).is_ok());
  EXPECT_FALSE(sched.submit(make_spec(4, 4, 0)).is_ok());
  EXPECT_FALSE(sched.has_unfinished_requests());

  // Exactly the whole pool: the last sampled token needs no KV, so 10 + 7 fits 16 slots.
  const RequestSpec fits = make_spec(5, 10, 7);
  ASSERT_TRUE(sched.submit(fits).is_ok());
  EXPECT_FALSE(sched.submit(make_spec(5, 3, 3)).is_ok());  // duplicate live id
  FakeModel model(s.num_blocks, s.block_size, kVocab);
  const fake::DriveResult r = drive(sched, model);
  expect_matches_reference({fits}, r);
}

TEST(Scheduler, StopTokenAndCallerStopFinishRequests) {
  Knobs s;
  Scheduler sched = make_scheduler(s);
  FakeModel model(s.num_blocks, s.block_size, kVocab);
  // Find the token the fake model emits third for this prompt and make it a stop token.
  RequestSpec probe = make_spec(1, 6, 5, 9);
  const std::vector<TokenId> full = reference_generate(probe, kVocab);
  RequestSpec stopping = probe;
  stopping.stop_token_ids = {full[2]};
  ASSERT_TRUE(sched.submit(stopping).is_ok());
  const fake::DriveResult r = drive(sched, model);
  const std::vector<TokenId> expected = reference_generate(stopping, kVocab);
  EXPECT_LE(expected.size(), 3u);
  EXPECT_EQ(r.outputs.at(1), expected);
  EXPECT_EQ(r.reasons.at(1), FinishReason::kStopToken);

  ASSERT_TRUE(sched.submit(make_spec(2, 6, 50)).is_ok());
  SchedulePlan p = sched.schedule();
  std::vector<SampledTokens> sampled = model.run(p);
  ASSERT_EQ(sampled.size(), 1u);
  sampled[0].stop = true;
  Result<std::vector<RequestOutput>> out = sched.update(p, sampled);
  ASSERT_TRUE(out.is_ok());
  EXPECT_TRUE((*out)[0].finished);
  EXPECT_EQ((*out)[0].finish_reason, FinishReason::kCallerStop);
  EXPECT_EQ((*out)[0].new_token_ids.size(), 1u);
  EXPECT_EQ(sched.kv().stats().num_used_blocks, 0);
}

TEST(Scheduler, UpdateRejectsMismatchedResultsWithoutChangingState) {
  Knobs s;
  Scheduler sched = make_scheduler(s);
  FakeModel model(s.num_blocks, s.block_size, kVocab);
  ASSERT_TRUE(sched.submit(make_spec(1, 5, 4)).is_ok());
  const SchedulePlan p = sched.schedule();
  EXPECT_FALSE(sched.update(p, {}).is_ok());  // missing sample
  EXPECT_FALSE(sched.update(p, std::vector<SampledTokens>{{7, {1}, false}}).is_ok());  // stranger
  EXPECT_FALSE(sched.update(p, std::vector<SampledTokens>{{1, {}, false}}).is_ok());   // empty
  EXPECT_FALSE(sched.update(p, std::vector<SampledTokens>{{1, {1}, false}, {1, {2}, false}}).is_ok());
  SchedulePlan stale = p;
  stale.step_id += 1;
  EXPECT_FALSE(sched.update(stale, model.run(p)).is_ok());
  EXPECT_EQ(sched.find_request(1)->num_computed_tokens(), 0);
  ASSERT_TRUE(sched.update(p, model.run(p)).is_ok());
  EXPECT_EQ(sched.find_request(1)->num_computed_tokens(), 5);
  EXPECT_FALSE(sched.update(p, model.run(p)).is_ok());  // applied twice
}

TEST(Scheduler, SamePlansForSameInputs) {
  auto run_once = [] {
    Knobs s;
    s.num_blocks = 12;
    s.budget = 9;
    s.max_seqs = 3;
    Scheduler sched = make_scheduler(s);
    FakeModel model(s.num_blocks, s.block_size, kVocab);
    for (int i = 0; i < 6; ++i) EXPECT_TRUE(sched.submit(make_spec(100 + i, 3 + 4 * i, 8, i)).is_ok());
    const fake::DriveResult r = drive(sched, model);
    std::vector<std::tuple<RequestId, int32_t, int32_t, std::vector<BlockId>>> trace;
    for (const SchedulePlan& p : r.plans) {
      for (const ScheduledRequest& e : p.scheduled) trace.emplace_back(e.request_id, e.start_pos, e.end_pos, e.block_table);
    }
    return trace;
  };
  EXPECT_EQ(run_once(), run_once());
}


// Speculative decoding: an oracle drafter proposes the reference continuation with every third
// draft corrupted, so steps accept some drafts and reject the rest. The outputs must equal
// direct generation (a rejected draft's KV slot is never read as context: the fake model reads
// tokens back through the block table), in fewer steps, with the draft tokens counted.
fake::Drafter oracle_drafter(const std::map<RequestId, std::vector<TokenId>>& refs, int32_t length, int32_t* counter) {
  return [&refs, length, counter](const Request& r) {
    const std::vector<TokenId>& ref = refs.at(r.id());
    std::vector<TokenId> d;
    for (int32_t j = 0; j < length && r.num_output_tokens() + j < int32_t(ref.size()); ++j) {
      TokenId t = ref[size_t(r.num_output_tokens() + j)];
      if (++*counter % 3 == 0) t = (t + 1) % kVocab;
      d.push_back(t);
    }
    return d;
  };
}

TEST(Scheduler, SpeculativeDraftsKeepOutputsAndSaveSteps) {
  Knobs s;
  s.num_blocks = 96;
  s.budget = 32;
  s.max_seqs = 4;
  std::vector<RequestSpec> specs;
  std::map<RequestId, std::vector<TokenId>> refs;
  for (int i = 0; i < 6; ++i) {
    specs.push_back(make_spec(10 + i, 3 + 5 * i, 20 + i, TokenId(i + 1)));
    refs[specs.back().request_id] = reference_generate(specs.back(), kVocab);
  }
  auto run = [&](bool speculate) {
    Scheduler sched = make_scheduler(s);
    FakeModel model(s.num_blocks, s.block_size, kVocab);
    for (const auto& spec : specs) EXPECT_TRUE(sched.submit(spec).is_ok());
    int32_t counter = 0;
    return drive(sched, model, 100000, speculate ? oracle_drafter(refs, 4, &counter) : fake::Drafter{});
  };
  const fake::DriveResult plain = run(false), spec = run(true);
  expect_matches_reference(specs, spec);
  int32_t drafted = 0, max_rows = 0;
  for (const SchedulePlan& p : spec.plans) {
    drafted += p.stats.num_spec_tokens;
    int32_t rows = 0;
    for (const ScheduledRequest& e : p.scheduled) {
      EXPECT_LE(e.num_spec_tokens, 4);
      if (e.num_spec_tokens > 0) {
        EXPECT_TRUE(e.samples);
        EXPECT_EQ(e.num_scheduled_tokens(), e.num_spec_tokens + 1);
      }
      rows += e.samples ? e.num_spec_tokens + 1 : 0;
    }
    EXPECT_EQ(int32_t(p.sample_token_indices().size()), rows);
    EXPECT_LE(p.num_scheduled_tokens(), s.budget);
    max_rows = std::max(max_rows, rows);
  }
  EXPECT_GT(drafted, 100);
  EXPECT_GT(max_rows, s.max_seqs);
  EXPECT_LT(spec.num_steps * 3, plain.num_steps * 2) << spec.num_steps << " vs " << plain.num_steps;
}

// Drafts never make a request exceed max_tokens, and a stop token among the accepted drafts
// ends it there.
TEST(Scheduler, SpeculativeDraftsRespectMaxTokensAndStopTokens) {
  Knobs s;
  RequestSpec a = make_spec(1, 5, 6, 3);
  std::vector<TokenId> ref_a = reference_generate(a, kVocab);
  RequestSpec b = make_spec(2, 7, 30, 5);
  const std::vector<TokenId> full_b = reference_generate(b, kVocab);
  b.stop_token_ids = {full_b[9]};  // the 10th token ends it
  std::map<RequestId, std::vector<TokenId>> refs{{1, ref_a}, {2, full_b}};
  Scheduler sched = make_scheduler(s);
  FakeModel model(s.num_blocks, s.block_size, kVocab);
  ASSERT_TRUE(sched.submit(a).is_ok());
  ASSERT_TRUE(sched.submit(b).is_ok());
  // Always the exact continuation, 16 long: as much as the rules allow is accepted.
  auto exact = [&](const Request& r) {
    const auto& ref = refs.at(r.id());
    std::vector<TokenId> d;
    for (int32_t j = r.num_output_tokens(); j < int32_t(ref.size()) && d.size() < 16; ++j) d.push_back(ref[size_t(j)]);
    return d;
  };
  const fake::DriveResult r = drive(sched, model, 1000, exact);
  EXPECT_EQ(r.outputs.at(1), ref_a);
  EXPECT_EQ(r.reasons.at(1), FinishReason::kMaxTokens);
  EXPECT_EQ(r.outputs.at(2), std::vector<TokenId>(full_b.begin(), full_b.begin() + 10));
  EXPECT_EQ(r.reasons.at(2), FinishReason::kStopToken);
  for (const SchedulePlan& p : r.plans)
    for (const ScheduledRequest& e : p.scheduled)
      if (e.request_id == 1) {
        EXPECT_LE(e.end_pos, 5 + 6 - 1);  // the last token is never fed back
      }
}

// Drafts take only free blocks and spare budget: with the pool one block short they are dropped,
// nobody is preempted for them, and a set draft is used by the next plan only.
TEST(Scheduler, SpeculativeDraftsNeverPreemptAndAreSingleUse) {
  Knobs s;
  s.num_blocks = 4;  // 16 tokens
  s.block_size = 4;
  s.budget = 64;
  Scheduler sched = make_scheduler(s);
  FakeModel model(s.num_blocks, s.block_size, kVocab);
  ASSERT_TRUE(sched.submit(make_spec(1, 6, 2)).is_ok());  // 2 blocks
  ASSERT_TRUE(sched.submit(make_spec(2, 6, 2, 7)).is_ok());  // 2 blocks: the pool is full
  SchedulePlan p = sched.schedule();
  ASSERT_EQ(p.scheduled.size(), 2u);
  auto outs = sched.update(p, model.run(p));
  ASSERT_TRUE(outs.is_ok()) << outs.status().message();
  // Request 1 sits at 7 tokens (8 would fill its second block); 4 drafts need a third block.
  ASSERT_TRUE(sched.set_spec_tokens(1, {1, 2, 3, 4}).is_ok());
  p = sched.schedule();
  EXPECT_EQ(p.stats.num_preemptions, 0);
  EXPECT_EQ(p.stats.num_spec_tokens, 0);
  for (const ScheduledRequest& e : p.scheduled) EXPECT_EQ(e.num_spec_tokens, 0);
  ASSERT_TRUE(sched.update(p, model.run(p)).is_ok());
  EXPECT_FALSE(sched.has_unfinished_requests());
  // Not running: refused.
  EXPECT_FALSE(sched.set_spec_tokens(1, {1}).is_ok());
  ASSERT_TRUE(sched.submit(make_spec(3, 2, 9)).is_ok());
  EXPECT_FALSE(sched.set_spec_tokens(3, {1}).is_ok());  // waiting
  p = sched.schedule();
  ASSERT_TRUE(sched.update(p, model.run(p)).is_ok());
  ASSERT_TRUE(sched.set_spec_tokens(3, {5, 6}).is_ok());
  p = sched.schedule();
  ASSERT_EQ(p.scheduled.size(), 1u);
  EXPECT_EQ(p.scheduled[0].num_spec_tokens, 2);
  EXPECT_EQ(p.scheduled[0].token_ids, (std::vector<TokenId>{p.scheduled[0].token_ids[0], 5, 6}));
  ASSERT_TRUE(sched.update(p, model.run(p)).is_ok());
  p = sched.schedule();  // no new draft: one token
  ASSERT_EQ(p.scheduled.size(), 1u);
  EXPECT_EQ(p.scheduled[0].num_spec_tokens, 0);
  ASSERT_TRUE(sched.update(p, model.run(p)).is_ok());
}

// The runner must return accepted drafts then one sample; anything else is refused unchanged.
TEST(Scheduler, SpeculativeUpdateRejectsTokensThatAreNotAcceptedDrafts) {
  Knobs s;
  Scheduler sched = make_scheduler(s);
  FakeModel model(s.num_blocks, s.block_size, kVocab);
  ASSERT_TRUE(sched.submit(make_spec(1, 5, 20)).is_ok());
  SchedulePlan p = sched.schedule();
  ASSERT_TRUE(sched.update(p, model.run(p)).is_ok());
  ASSERT_TRUE(sched.set_spec_tokens(1, {11, 12, 13}).is_ok());
  p = sched.schedule();
  ASSERT_EQ(p.scheduled.at(0).num_spec_tokens, 3);
  const int32_t computed = sched.find_request(1)->num_computed_tokens();
  for (std::vector<TokenId> bad : {std::vector<TokenId>{12, 40}, std::vector<TokenId>{11, 12, 13, 14, 15},
                                   std::vector<TokenId>{11, 13, 40}}) {
    std::vector<SampledTokens> sampled{SampledTokens{1, bad, false}};
    auto r = sched.update(p, sampled);
    ASSERT_FALSE(r.is_ok());
    EXPECT_NE(r.status().message().find("accepted drafts"), std::string::npos) << r.status().message();
    EXPECT_EQ(sched.find_request(1)->num_computed_tokens(), computed);
  }
  std::vector<SampledTokens> good{SampledTokens{1, {11, 12, 40}, false}};  // two accepted, then a sample
  auto r = sched.update(p, good);
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  EXPECT_EQ(r->at(0).new_token_ids, (std::vector<TokenId>{11, 12, 40}));
  EXPECT_EQ(sched.find_request(1)->num_computed_tokens(), computed + 3);  // last token + 2 drafts
  EXPECT_TRUE(sched.check_invariants().is_ok());
}


// Host KV tier: blocks evicted from the pool are copied to host slots and loaded back into fresh
// blocks when their prefix comes again; the fake model reads context only through the slots, so
// a wrong copy (or a load from a slot reused since) changes the tokens.
TEST(Scheduler, HostTierRestoresEvictedPrefixes) {
  auto run = [](int32_t host_blocks, int64_t* host_hits, int64_t* loads) {
    Knobs s;
    s.num_blocks = 12;  // 48 tokens
    s.block_size = 4;
    s.host_blocks = host_blocks;
    Scheduler sched = make_scheduler(s);
    FakeModel model(s.num_blocks, s.block_size, kVocab);
    std::vector<RequestSpec> specs{make_spec(1, 21, 3, 5)};
    for (const auto& sp : specs) EXPECT_TRUE(sched.submit(sp).is_ok());
    drive(sched, model);
    // Two others take the whole pool: request 1's cached blocks are evicted.
    std::vector<RequestSpec> others{make_spec(2, 21, 2, 40), make_spec(3, 22, 2, 70)};
    for (const auto& sp : others) EXPECT_TRUE(sched.submit(sp).is_ok());
    fake::DriveResult r2 = drive(sched, model);
    expect_matches_reference(others, r2);
    RequestSpec again = make_spec(4, 21, 6, 5);  // request 1's prompt again
    EXPECT_TRUE(sched.submit(again).is_ok());
    fake::DriveResult r3 = drive(sched, model);
    expect_matches_reference({again}, r3);
    for (const SchedulePlan& p : r3.plans) {
      *host_hits += p.stats.prefix_host_hit_tokens;
      *loads += p.stats.kv_loaded_blocks;
      EXPECT_EQ(p.stats.kv_loaded_blocks, int32_t(p.kv_loads.size()));
    }
    EXPECT_EQ(model.num_loads_, *loads);
    EXPECT_TRUE(sched.check_invariants().is_ok());
    return sched.kv().stats();
  };
  int64_t hits_off = 0, loads_off = 0, hits_on = 0, loads_on = 0;
  const KvStats off = run(0, &hits_off, &loads_off);
  const KvStats on = run(16, &hits_on, &loads_on);
  EXPECT_EQ(hits_off, 0);
  EXPECT_EQ(off.num_offloaded_blocks, 0);
  EXPECT_EQ(hits_on, 20);  // five full blocks of 4 (the last prompt token is always computed)
  EXPECT_EQ(loads_on, 5);
  EXPECT_GE(on.num_offloaded_blocks, 5);
  EXPECT_EQ(on.num_host_blocks, 16);
  EXPECT_GT(on.num_host_used_blocks, 0);
}

// A host tier smaller than what is evicted keeps the most recently evicted blocks and never
// reuses a slot a pending load reads; invariants hold throughout.
TEST(Scheduler, SmallHostTierCyclesWithoutCorruption) {
  Knobs s;
  s.num_blocks = 10;
  s.block_size = 2;
  s.budget = 16;
  s.max_seqs = 3;
  s.host_blocks = 3;
  Scheduler sched = make_scheduler(s);
  FakeModel model(s.num_blocks, s.block_size, kVocab);
  std::vector<RequestSpec> specs;
  for (int round = 0; round < 6; ++round)
    for (int i = 0; i < 3; ++i) specs.push_back(make_spec(RequestId(100 + round * 10 + i), 7 + i, 3, TokenId(1 + i)));
  for (const auto& sp : specs) ASSERT_TRUE(sched.submit(sp).is_ok());
  const fake::DriveResult r = drive(sched, model);
  expect_matches_reference(specs, r);
  EXPECT_GT(model.num_offloads_, 0);
}

}  // namespace
}  // namespace m3
