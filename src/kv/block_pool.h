#pragma once
// Metadata of a fixed set of KV blocks (the tensors live in the backend): reference
// counts, the free list, and the prefix-cache map from chained block hash to block id.
//
// A block whose ref count drops to 0 keeps its hash and stays findable ("cached-free")
// until a fresh block is needed and it is the least recently freed one; only then is its
// hash dropped (eviction). Blocks without a hash are handed out before any cached one.
#include <optional>
#include <unordered_map>
#include <vector>

#include "core/hash128.h"
#include "core/status.h"
#include "kv/free_block_queue.h"

namespace m3 {

class BlockPool {
 public:
  explicit BlockPool(int32_t num_blocks);

  int32_t num_blocks() const { return static_cast<int32_t>(ref_counts_.size()); }
  int32_t num_free_blocks() const { return free_queue_.size(); }  // includes cached-free
  int32_t num_used_blocks() const { return num_blocks() - num_free_blocks(); }
  int32_t num_cached_blocks() const { return static_cast<int32_t>(cached_.size()); }
  int64_t num_evictions() const { return num_evictions_; }

  int32_t ref_count(BlockId block_id) const { return ref_counts_[block_id]; }
  const std::optional<Hash128>& block_hash(BlockId block_id) const { return hashes_[block_id]; }

  // A fresh block with ref count 1, evicting the LRU cached-free block if needed (its hash
  // goes to *evicted when given); kNoBlock when every block is in use.
  BlockId allocate(std::optional<Hash128>* evicted = nullptr);

  // The cached block holding `hash`, or kNoBlock. No side effects.
  BlockId find_cached(const Hash128& hash) const;

  // Takes one more reference (a prefix hit); a cached-free block leaves the free list.
  void acquire(BlockId block_id);

  // Drops one reference; at 0 the block becomes free (cached-free if it has a hash).
  void release(BlockId block_id);

  // Publishes a full, computed block under `hash`. Returns false (and leaves the block
  // unhashed) when another block already holds that hash, e.g. two requests computed the
  // same prefix in the same step: the first one stays the canonical copy.
  bool register_hash(BlockId block_id, const Hash128& hash);

  // Free list ∩ used = ∅, every block is either free (ref 0) or used (ref > 0), and the
  // hash map and per-block hashes agree both ways.
  Status check_invariants() const;

 private:
  std::vector<int32_t> ref_counts_;
  std::vector<std::optional<Hash128>> hashes_;
  std::unordered_map<Hash128, BlockId, Hash128Hasher> cached_;
  FreeBlockQueue free_queue_;
  int64_t num_evictions_ = 0;
};

}  // namespace m3
