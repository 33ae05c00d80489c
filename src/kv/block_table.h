#pragma once
// One request's logical → physical block map. Positions are absolute and block ids are
// slot-anchored: token at position p lives in slot
//   block_ids[p / block_size] * block_size + p % block_size
// of the backend's cache tensors (MSA selection scores block b = positions [b·bs, b·bs+bs)).
#include <vector>

#include "kv/kv_types.h"

namespace m3 {

inline int64_t slot_index(const std::vector<BlockId>& block_ids, int32_t position,
                          int32_t block_size_tokens) {
  return static_cast<int64_t>(block_ids[position / block_size_tokens]) * block_size_tokens +
         position % block_size_tokens;
}

class BlockTable {
 public:
  int32_t num_blocks() const { return static_cast<int32_t>(block_ids_.size()); }
  BlockId operator[](int32_t logical_block) const { return block_ids_[logical_block]; }
  const std::vector<BlockId>& block_ids() const { return block_ids_; }
  void append(BlockId block_id) { block_ids_.push_back(block_id); }
  void clear() { block_ids_.clear(); }
  int64_t slot(int32_t position, int32_t block_size_tokens) const {
    return slot_index(block_ids_, position, block_size_tokens);
  }

 private:
  std::vector<BlockId> block_ids_;
};

}  // namespace m3
