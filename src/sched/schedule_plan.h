#pragma once
// The value one Scheduler::schedule() call returns: everything the runner needs to build
// attention metadata for one forward pass, and nothing it must look up elsewhere.
#include <vector>

#include "kv/block_table.h"
#include "kv/host_block_tier.h"
#include "kv/kv_types.h"

namespace m3 {

struct ScheduledRequest {
  RequestId request_id = 0;
  // Absolute positions computed this step: [start_pos, end_pos). start_pos is the number
  // of tokens whose KV is already cached (computed earlier or prefix hit); the chunk
  // need not start or end on a block boundary.
  int32_t start_pos = 0;
  int32_t end_pos = 0;
  std::vector<TokenId> token_ids;  // the input tokens at [start_pos, end_pos)
  // True when end_pos reaches the end of the known tokens (drafts included): sample one token
  // from the logits at position end_pos - 1. False for a non-final prefill chunk.
  bool samples = false;
  // Speculative decoding: the last num_spec_tokens of token_ids are draft tokens after the last
  // known one. The runner samples at each of the num_spec_tokens + 1 last positions and keeps
  // the drafts up to the first one its sample disagrees with, plus that sample.
  int32_t num_spec_tokens = 0;
  // First step since (re)admission: drop any per-request state kept from before.
  bool is_new_admission = false;
  int32_t num_prefix_hit_tokens = 0;  // tokens reused from the prefix cache at admission
  // Physical block of each logical block covering [0, end_pos): attention reads keys
  // [0, end_pos) through it; the tokens computed here are written to slot(p).
  std::vector<BlockId> block_table;

  int32_t num_scheduled_tokens() const { return end_pos - start_pos; }
  int64_t slot(int32_t position, int32_t block_size_tokens) const {
    return slot_index(block_table, position, block_size_tokens);
  }
};

struct StepStats {
  int32_t num_scheduled_requests = 0;
  int32_t num_prefill_tokens = 0;  // prompt chunks and recomputation after preemption
  int32_t num_decode_tokens = 0;   // single generated tokens fed back
  int32_t num_running = 0;         // after this step's admissions and preemptions
  int32_t num_waiting = 0;         // waiting + preempted
  int32_t num_preemptions = 0;
  int32_t kv_blocks_used = 0;
  int32_t kv_blocks_free = 0;      // cached-free included
  int32_t kv_blocks_cached = 0;
  int32_t prefix_query_tokens = 0;  // this step's admissions
  int32_t prefix_hit_tokens = 0;
  int32_t num_deferred_for_prefix = 0;  // waiting requests held back for a prefix a running one computes
  int32_t num_spec_tokens = 0;          // draft tokens scheduled for verification (in num_decode_tokens)
  int32_t prefix_host_hit_tokens = 0;   // of prefix_hit_tokens: loaded from the host KV tier
  int32_t kv_offloaded_blocks = 0;      // evicted blocks copied to the host tier this step
  int32_t kv_loaded_blocks = 0;         // host-tier blocks copied back for this step's hits
  int32_t kv_host_blocks_used = 0;      // host tier slots holding a block
};

struct SchedulePlan {
  uint64_t step_id = 0;
  int32_t block_size_tokens = 0;
  std::vector<ScheduledRequest> scheduled;  // batch order: running first, then admissions
  std::vector<RequestId> preempted;         // lost their blocks this step; not scheduled
  std::vector<RequestId> finished;          // finished or aborted since the previous plan
  // Host KV tier copies to run before the forward: offloads (an evicted block's KV, still intact,
  // to a host slot) first, then loads (a host slot into a block of this step's prefix hits).
  std::vector<KvTransfer> kv_offloads, kv_loads;
  StepStats stats;

  bool empty() const { return scheduled.empty(); }
  int32_t num_scheduled_tokens() const;
  // Flattened in batch order (what the runner uploads): absolute position and cache slot
  // of every scheduled token, and each request's token offset into that flat batch.
  std::vector<int32_t> positions() const;
  std::vector<int64_t> slot_mapping() const;
  std::vector<int32_t> query_start_offsets() const;  // size scheduled.size() + 1
  std::vector<int32_t> seq_lens() const;  // end_pos per request: keys attention may read
  // Flat indices (into positions()) of the tokens whose logits are sampled, in batch order
  // (num_spec_tokens + 1 per speculating request).
  std::vector<int32_t> sample_token_indices() const;
};

}  // namespace m3
