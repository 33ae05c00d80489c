#include "kv/free_block_queue.h"

#include "core/check.h"

namespace m3 {

FreeBlockQueue::FreeBlockQueue(int32_t num_blocks)
    : prev_(num_blocks, kNoBlock), next_(num_blocks, kNoBlock), in_queue_(num_blocks, false) {
  for (BlockId b = 0; b < num_blocks; ++b) push_back(b);
}

void FreeBlockQueue::push_back(BlockId block_id) {
  M3_CHECK(!in_queue_[block_id], "block %d already free", block_id);
  prev_[block_id] = tail_;
  next_[block_id] = kNoBlock;
  if (tail_ != kNoBlock) next_[tail_] = block_id; else head_ = block_id;
  tail_ = block_id;
  in_queue_[block_id] = true;
  ++size_;
}

void FreeBlockQueue::push_front(BlockId block_id) {
  M3_CHECK(!in_queue_[block_id], "block %d already free", block_id);
  next_[block_id] = head_;
  prev_[block_id] = kNoBlock;
  if (head_ != kNoBlock) prev_[head_] = block_id; else tail_ = block_id;
  head_ = block_id;
  in_queue_[block_id] = true;
  ++size_;
}

BlockId FreeBlockQueue::pop_front() {
  if (head_ == kNoBlock) return kNoBlock;
  const BlockId b = head_;
  remove(b);
  return b;
}

void FreeBlockQueue::remove(BlockId block_id) {
  M3_CHECK(in_queue_[block_id], "block %d not free", block_id);
  const BlockId p = prev_[block_id];
  const BlockId n = next_[block_id];
  if (p != kNoBlock) next_[p] = n; else head_ = n;
  if (n != kNoBlock) prev_[n] = p; else tail_ = p;
  prev_[block_id] = next_[block_id] = kNoBlock;
  in_queue_[block_id] = false;
  --size_;
}

}  // namespace m3
