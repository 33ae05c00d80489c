#include "kv/block_pool.h"

#include <string>

#include "core/check.h"

namespace m3 {

BlockPool::BlockPool(int32_t num_blocks)
    : ref_counts_(num_blocks, 0), hashes_(num_blocks), free_queue_(num_blocks) {
  M3_CHECK(num_blocks > 0, "num_blocks %d", num_blocks);
}

BlockId BlockPool::allocate(std::optional<Hash128>* evicted) {
  const BlockId b = free_queue_.pop_front();
  if (b == kNoBlock) return kNoBlock;
  if (hashes_[b]) {
    if (evicted) *evicted = hashes_[b];
    cached_.erase(*hashes_[b]);
    hashes_[b].reset();
    ++num_evictions_;
  }
  ref_counts_[b] = 1;
  return b;
}

BlockId BlockPool::find_cached(const Hash128& hash) const {
  auto it = cached_.find(hash);
  return it == cached_.end() ? kNoBlock : it->second;
}

void BlockPool::acquire(BlockId block_id) {
  if (ref_counts_[block_id] == 0) free_queue_.remove(block_id);
  ++ref_counts_[block_id];
}

void BlockPool::release(BlockId block_id) {
  M3_CHECK(ref_counts_[block_id] > 0, "release of free block %d", block_id);
  if (--ref_counts_[block_id] > 0) return;
  if (hashes_[block_id]) {
    free_queue_.push_back(block_id);
  } else {
    free_queue_.push_front(block_id);
  }
}

bool BlockPool::register_hash(BlockId block_id, const Hash128& hash) {
  M3_CHECK(ref_counts_[block_id] > 0, "registering free block %d", block_id);
  if (hashes_[block_id]) return *hashes_[block_id] == hash;
  if (!cached_.emplace(hash, block_id).second) return false;
  hashes_[block_id] = hash;
  return true;
}

Status BlockPool::check_invariants() const {
  const int32_t n = num_blocks();
  int32_t num_free_seen = 0;
  for (BlockId b = free_queue_.front(); b != kNoBlock; b = free_queue_.next(b)) {
    if (++num_free_seen > n) return Status::error("free list has a cycle");
    if (ref_counts_[b] != 0) {
      return Status::error("block " + std::to_string(b) + " is on the free list with ref " +
                           std::to_string(ref_counts_[b]));
    }
  }
  if (num_free_seen != free_queue_.size()) return Status::error("free list size mismatch");
  int32_t num_hashed = 0;
  for (BlockId b = 0; b < n; ++b) {
    if (ref_counts_[b] < 0) return Status::error("negative ref count on block " + std::to_string(b));
    if ((ref_counts_[b] == 0) != free_queue_.contains(b)) {
      return Status::error("block " + std::to_string(b) + " is neither used nor free (ref " +
                           std::to_string(ref_counts_[b]) + ")");
    }
    if (hashes_[b]) {
      ++num_hashed;
      auto it = cached_.find(*hashes_[b]);
      if (it == cached_.end() || it->second != b) {
        return Status::error("block " + std::to_string(b) + " hash not mapped to it");
      }
    }
  }
  if (num_hashed != static_cast<int32_t>(cached_.size())) {
    return Status::error("hash map has entries for blocks that do not carry that hash");
  }
  return Status::ok();
}

}  // namespace m3
