#pragma once
// A deterministic stand-in for the model that, like real attention, reads its context
// only through the KV cache: each step writes every scheduled token (and its position)
// into its slot, and a sampled token is a hash of the context read back through the
// request's block table. A wrong block table, slot mapping, prefix hit or recompute
// therefore changes the generated tokens, which tests compare with direct generation.
#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <span>
#include <vector>

#include "sched/scheduler.h"

namespace m3::fake {

inline TokenId fake_next_token(std::span<const TokenId> context, int32_t vocab_size) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (TokenId t : context) {
    h ^= static_cast<uint32_t>(t);
    h *= 0x100000001b3ull;
  }
  h ^= h >> 29;
  return static_cast<TokenId>(h % static_cast<uint64_t>(vocab_size));
}

// What an unbatched, uncached model would generate.
inline std::vector<TokenId> reference_generate(const RequestSpec& spec, int32_t vocab_size) {
  std::vector<TokenId> context = spec.prompt_token_ids;
  std::vector<TokenId> out;
  while (static_cast<int32_t>(out.size()) < spec.max_tokens) {
    const TokenId t = fake_next_token(context, vocab_size);
    out.push_back(t);
    context.push_back(t);
    bool stop = false;
    for (TokenId s : spec.stop_token_ids) stop = stop || s == t;
    if (stop) break;
  }
  return out;
}

class FakeModel {
 public:
  FakeModel(int32_t num_blocks, int32_t block_size_tokens, int32_t vocab_size)
      : slots_(static_cast<size_t>(num_blocks) * block_size_tokens), vocab_size_(vocab_size) {}

  std::vector<SampledTokens> run(const SchedulePlan& plan) {
    const std::vector<int64_t> slot_map = plan.slot_mapping();
    const std::vector<int32_t> positions = plan.positions();
    const std::vector<int32_t> offsets = plan.query_start_offsets();
    // The host KV tier's copies: offloads, then loads, before the step writes anything.
    const size_t bs = static_cast<size_t>(plan.block_size_tokens);
    for (const KvTransfer& t : plan.kv_offloads) {
      auto first = slots_.begin() + std::ptrdiff_t(size_t(t.device_block) * bs);
      host_[t.host_slot].assign(first, first + std::ptrdiff_t(bs));
      ++num_offloads_;
    }
    for (const KvTransfer& t : plan.kv_loads) {
      auto it = host_.find(t.host_slot);
      EXPECT_NE(it, host_.end()) << "load from host slot " << t.host_slot << " that was never written";
      if (it == host_.end()) continue;
      std::copy(it->second.begin(), it->second.end(), slots_.begin() + std::ptrdiff_t(size_t(t.device_block) * bs));
      ++num_loads_;
    }
    // Writes first (a forward pass writes all KV of a layer before attending).
    for (size_t i = 0; i < plan.scheduled.size(); ++i) {
      const ScheduledRequest& r = plan.scheduled[i];
      EXPECT_EQ(static_cast<int32_t>(r.token_ids.size()), r.num_scheduled_tokens());
      EXPECT_GE(static_cast<int32_t>(r.block_table.size()) * plan.block_size_tokens, r.end_pos);
      for (int32_t k = 0; k < r.num_scheduled_tokens(); ++k) {
        const int32_t flat = offsets[i] + k;
        EXPECT_EQ(positions[flat], r.start_pos + k);
        Slot& s = slots_.at(static_cast<size_t>(slot_map[flat]));
        s.token = r.token_ids[k];
        s.position = r.start_pos + k;
      }
    }
    std::vector<SampledTokens> sampled;
    for (const ScheduledRequest& r : plan.scheduled) {
      if (!r.samples) continue;
      // With drafts: sample after each of the last num_spec_tokens + 1 positions, keeping the
      // drafts while the sample agrees (the engine's acceptance rule).
      const int32_t first = r.end_pos - r.num_spec_tokens;
      std::vector<TokenId> context;
      for (int32_t p = 0; p < first; ++p) {
        const Slot& s = slots_.at(static_cast<size_t>(r.slot(p, plan.block_size_tokens)));
        EXPECT_EQ(s.position, p) << "request " << r.request_id << " reads a foreign slot";
        context.push_back(s.token);
      }
      SampledTokens out{r.request_id, {}, false};
      for (int32_t j = 0; j <= r.num_spec_tokens; ++j) {
        out.token_ids.push_back(fake_next_token(context, vocab_size_));
        if (j == r.num_spec_tokens) break;
        const int32_t p = first + j;
        const Slot& s = slots_.at(static_cast<size_t>(r.slot(p, plan.block_size_tokens)));
        EXPECT_EQ(s.position, p);
        if (s.token != out.token_ids.back()) break;  // the draft at p disagrees
        context.push_back(s.token);
      }
      sampled.push_back(std::move(out));
    }
    return sampled;
  }

 private:
  struct Slot {
    TokenId token = -1;
    int32_t position = -1;
  };
  std::vector<Slot> slots_;
  std::map<int32_t, std::vector<Slot>> host_;  // host tier slot -> one block's slots
  int32_t vocab_size_;

 public:
  int64_t num_offloads_ = 0, num_loads_ = 0;
};

// Drives schedule → run → update until nothing is left (or max_steps), checking the
// invariants after every step; returns every request's generated tokens.
struct DriveResult {
  std::map<RequestId, std::vector<TokenId>> outputs;
  std::map<RequestId, FinishReason> reasons;
  std::vector<SchedulePlan> plans;
  int32_t num_steps = 0;
};

// Proposes the draft for a running request after a step that gave it tokens (empty: none).
using Drafter = std::function<std::vector<TokenId>(const Request&)>;

inline DriveResult drive(Scheduler& scheduler, FakeModel& model, int32_t max_steps = 100000,
                         const Drafter& drafter = {}) {
  DriveResult result;
  while (scheduler.has_unfinished_requests() && result.num_steps < max_steps) {
    SchedulePlan plan = scheduler.schedule();
    ++result.num_steps;
    EXPECT_FALSE(plan.empty()) << "no progress at step " << plan.step_id;
    if (plan.empty()) break;
    const std::vector<SampledTokens> sampled = model.run(plan);
    Result<std::vector<RequestOutput>> outs = scheduler.update(plan, sampled);
    EXPECT_TRUE(outs.is_ok()) << outs.status().message();
    if (!outs) break;
    for (const RequestOutput& o : outs.value()) {
      auto& dst = result.outputs[o.request_id];
      dst.insert(dst.end(), o.new_token_ids.begin(), o.new_token_ids.end());
      if (o.finished) result.reasons[o.request_id] = o.finish_reason;
      if (drafter && !o.finished && !o.new_token_ids.empty()) {
        std::vector<TokenId> draft = drafter(*scheduler.find_request(o.request_id));
        if (!draft.empty()) {
          EXPECT_TRUE(scheduler.set_spec_tokens(o.request_id, std::move(draft)).is_ok());
        }
      }
    }
    const Status inv = scheduler.check_invariants();
    EXPECT_TRUE(inv.is_ok()) << "after step " << plan.step_id << ": " << inv.message();
    if (!inv.is_ok()) break;
    result.plans.push_back(std::move(plan));
  }
  EXPECT_FALSE(scheduler.has_unfinished_requests()) << "did not finish in " << max_steps << " steps";
  return result;
}

}  // namespace m3::fake
