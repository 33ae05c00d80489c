#pragma once
// Doubly linked list of free block ids threaded through per-block arrays: O(1) push at
// either end, pop from the front, and removal from the middle (a cached block that is hit
// again leaves the free list without a search).
#include <vector>

#include "kv/kv_types.h"

namespace m3 {

class FreeBlockQueue {
 public:
  explicit FreeBlockQueue(int32_t num_blocks);  // starts holding 0..num_blocks-1 in order

  int32_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  bool contains(BlockId block_id) const { return in_queue_[block_id]; }
  BlockId front() const { return head_; }  // kNoBlock when empty
  BlockId next(BlockId block_id) const { return next_[block_id]; }

  void push_back(BlockId block_id);   // most recently freed: evicted last
  void push_front(BlockId block_id);  // worthless (no cached content): evicted first
  BlockId pop_front();                // kNoBlock when empty
  void remove(BlockId block_id);

 private:
  std::vector<BlockId> prev_;
  std::vector<BlockId> next_;
  std::vector<bool> in_queue_;
  BlockId head_ = kNoBlock;
  BlockId tail_ = kNoBlock;
  int32_t size_ = 0;
};

}  // namespace m3
