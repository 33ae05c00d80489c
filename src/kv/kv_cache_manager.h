#pragma once
// Per-request KV block tables over one BlockPool, with prefix caching.
//
// Protocol per request (the scheduler drives it):
//   find_cached_prefix(id, tokens)       → longest cached run of full blocks (≤ len-1 tokens)
//   allocate_slots(id, tokens, computed, new, &hit)  → all-or-nothing, no side effect on failure
//   mark_computed(id, tokens, computed)  → publishes newly full, computed blocks' hashes
//   free(id)                             → refs dropped, blocks become (cached-)free
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/status.h"
#include "kv/block_pool.h"
#include "kv/block_table.h"
#include "kv/host_block_tier.h"
#include "kv/prefix_hash.h"

namespace m3 {

struct KvCacheConfig {
  int32_t num_blocks = 0;
  int32_t block_size_tokens = 0;  // = the model's MSA block: 128 for M3, 16 for tiny models
  bool enable_prefix_caching = true;
  uint64_t hash_seed = 0;                    // same on every node that shares KV
  std::vector<std::string> hash_extra_keys;  // e.g. "model_rev=<sha>", "kv_dtype=bf16"
  // Host-memory tier (KV offloading): evicted hashed blocks are kept in this many host slots
  // and loaded back on a prefix hit. 0 = off. Needs prefix caching.
  int32_t num_host_blocks = 0;
  Status validate() const;                   // every problem, in one message
};

struct PrefixMatch {
  std::vector<BlockId> block_ids;  // physical blocks of logical blocks 0..n-1
  // Host-tier slots of the logical blocks after those (n..n+m-1): loaded into fresh device
  // blocks when the match is allocated.
  std::vector<int32_t> host_slots;
  int32_t num_tokens = 0;          // (block_ids.size() + host_slots.size()) * block_size
  int32_t num_blocks() const { return int32_t(block_ids.size() + host_slots.size()); }
};

struct KvStats {
  int32_t num_blocks = 0;
  int32_t num_used_blocks = 0;    // ref > 0
  int32_t num_free_blocks = 0;    // ref == 0, cached-free included
  int32_t num_cached_blocks = 0;  // carrying a prefix hash (used or free)
  int64_t num_evictions = 0;
  int64_t prefix_query_tokens = 0;  // cumulative, see record_prefix_query
  int64_t prefix_hit_tokens = 0;
  int32_t num_host_blocks = 0;       // host tier slots (0: no tier)
  int32_t num_host_used_blocks = 0;
  int64_t num_offloaded_blocks = 0;  // cumulative, device -> host
  int64_t num_loaded_blocks = 0;     // cumulative, host -> device
  int64_t num_imported_blocks = 0;   // cumulative, written into host slots by KV transfers
};

class KvCacheManager {
 public:
  static Result<KvCacheManager> create(const KvCacheConfig& config);

  const KvCacheConfig& config() const { return config_; }
  int32_t block_size() const { return config_.block_size_tokens; }
  int32_t num_blocks() const { return config_.num_blocks; }
  int32_t num_free_blocks() const { return pool_.num_free_blocks(); }
  int32_t blocks_for_tokens(int64_t num_tokens) const {
    return static_cast<int32_t>((num_tokens + block_size() - 1) / block_size());
  }

  // Longest prefix of `tokens` made of cached full blocks, capped at tokens.size()-1 tokens
  // (rounded down to whole blocks) so the last token is always computed and can be sampled.
  // Takes no references; pass the result to allocate_slots in the same step.
  PrefixMatch find_cached_prefix(RequestId request_id, std::span<const TokenId> tokens);
  // Same lookup for a token sequence no request owns (e.g. routing, hit-rate estimates).
  PrefixMatch find_cached_prefix(std::span<const TokenId> tokens) const;

  // Makes room for positions [0, num_computed_tokens + num_new_tokens). num_computed_tokens
  // includes `hit` tokens; `hit` may only be given while the request holds no blocks.
  // All-or-nothing: returns false with nothing changed when the pool is short.
  bool allocate_slots(RequestId request_id, int32_t num_computed_tokens, int32_t num_new_tokens,
                      const PrefixMatch* hit = nullptr);

  // Tokens [0, num_computed_tokens) now hold valid KV: their full blocks become hits for
  // later requests.
  void mark_computed(RequestId request_id, std::span<const TokenId> tokens,
                     int32_t num_computed_tokens);

  // Hashes of the request's full blocks of `tokens` (capped as a hit is) whose KV is not computed
  // yet, appended to `out`: what a request with the same prefix would hit once they are.
  void unpublished_hashes(RequestId request_id, std::span<const TokenId> tokens, std::vector<Hash128>* out);
  // After find_cached_prefix(request_id, ...): the hash of the first block the hit left out, if
  // the request has such a block.
  std::optional<Hash128> first_missed_hash(RequestId request_id, const PrefixMatch& hit) const;

  // Drops the request's references (tail blocks first, so they are evicted first).
  void free(RequestId request_id);

  // KV transfer (disaggregated prefill): the chained hashes of the full blocks of `tokens` a
  // prefix hit may cover (capped as find_cached_prefix caps it).
  std::vector<Hash128> prefix_block_hashes(std::span<const TokenId> tokens) const;
  // A host-tier slot to receive block `hash`'s pages from another engine: slot >= 0 to write
  // (it is most recently used and finds as a hit from now on), or present (the tier holds the
  // hash already), or neither (no tier, or every slot pinned by this step's loads).
  struct HostStore {
    int32_t slot = -1;
    bool present = false;
  };
  HostStore store_host_block(const Hash128& hash);
  // KV transfer in, straight into the KV cache: for the chain `hashes` (blocks 0..n-1 of a
  // prompt), the blocks after its leading run already cached get fresh blocks published under
  // their hashes, in order, stopping where the pool has no block left. Returned as (index in
  // `hashes`, block). They end cached-free (ref 0), released after the chain's cached blocks were
  // pinned through the allocation, so no adoption evicts the chain it extends. The caller writes
  // their KV before the next step, after the offloads the allocations queued (take_transfers: the
  // evicted blocks' KV, still intact, to the host tier).
  struct Adoption {
    std::vector<std::pair<int32_t, BlockId>> blocks;  // (index in the chain, fresh block) to write
    int32_t chain = 0;                                // leading blocks of the chain now cached
  };
  Adoption adopt_blocks(std::span<const Hash128> hashes);

  // Host tier: the copies the allocations since the last take_transfers() need, offloads
  // (evicted blocks' KV to host slots) to run before loads (host slots into blocks of prefix
  // hits), both before the step's forward. begin_step() releases the slots the last step's
  // loads pinned.
  void begin_step();
  void take_transfers(std::vector<KvTransfer>* offloads, std::vector<KvTransfer>* loads);

  bool holds_blocks(RequestId request_id) const;
  const BlockTable& block_table(RequestId request_id) const;  // empty table if unknown

  // Prefix-cache accounting, called once per admission by the scheduler.
  void record_prefix_query(int32_t num_query_tokens, int32_t num_hit_tokens);

  KvStats stats() const;

  // Pool invariants plus: each block's ref count equals the number of tables holding it,
  // and a table never holds a block twice.
  Status check_invariants() const;

 private:
  struct RequestBlocks {
    BlockTable table;
    std::vector<Hash128> block_hashes;  // chained hashes of the request's full blocks
    int32_t num_published_blocks = 0;   // leading blocks whose hash is registered or known
  };

  explicit KvCacheManager(const KvCacheConfig& config);
  PrefixMatch match_hashes(std::span<const Hash128> hashes) const;
  // pool_.allocate(), queueing the evicted block's copy to the host tier when there is one.
  BlockId allocate_block();
  int32_t max_hit_blocks(size_t num_tokens) const {
    return num_tokens == 0 ? 0 : static_cast<int32_t>((num_tokens - 1) / block_size());
  }

  KvCacheConfig config_;
  PrefixHasher hasher_;
  BlockPool pool_;
  std::unordered_map<RequestId, RequestBlocks> requests_;
  int64_t prefix_query_tokens_ = 0;
  int64_t prefix_hit_tokens_ = 0;
  std::optional<HostBlockTier> host_;
  std::vector<KvTransfer> offloads_, loads_;  // pending for the plan being built
  int64_t num_offloaded_ = 0, num_loaded_ = 0, num_imported_ = 0;
};

}  // namespace m3
