#include "kv/host_block_tier.h"

#include <string>

#include "core/check.h"

namespace m3 {

HostBlockTier::HostBlockTier(int32_t num_slots)
    : slot_hash_(size_t(num_slots)), lru_pos_(size_t(num_slots)), pinned_(size_t(num_slots), 0) {
  for (int32_t s = num_slots - 1; s >= 0; --s) free_slots_.push_back(s);
}

std::optional<int32_t> HostBlockTier::find(const Hash128& hash) const {
  auto it = by_hash_.find(hash);
  if (it == by_hash_.end()) return std::nullopt;
  return it->second;
}

std::optional<int32_t> HostBlockTier::store(const Hash128& hash) {
  M3_CHECK(!by_hash_.count(hash), "host tier stores a hash twice");
  int32_t slot = -1;
  if (!free_slots_.empty()) {
    slot = free_slots_.back();
    free_slots_.pop_back();
  } else {
    for (auto it = lru_.begin(); it != lru_.end(); ++it) {
      if (pinned_[size_t(*it)]) continue;
      slot = *it;
      lru_.erase(it);
      by_hash_.erase(*slot_hash_[size_t(slot)]);
      break;
    }
    if (slot < 0) return std::nullopt;
  }
  slot_hash_[size_t(slot)] = hash;
  by_hash_.emplace(hash, slot);
  lru_pos_[size_t(slot)] = lru_.insert(lru_.end(), slot);
  return slot;
}

void HostBlockTier::pin(int32_t slot) {
  M3_CHECK(slot_hash_[size_t(slot)].has_value(), "pinning an empty host slot %d", slot);
  lru_.splice(lru_.end(), lru_, lru_pos_[size_t(slot)]);
  pinned_[size_t(slot)] = 1;
}

Status HostBlockTier::check_invariants() const {
  size_t used = 0;
  for (size_t s = 0; s < slot_hash_.size(); ++s) {
    if (!slot_hash_[s]) continue;
    ++used;
    auto it = by_hash_.find(*slot_hash_[s]);
    if (it == by_hash_.end() || it->second != int32_t(s))
      return Status::error("host slot " + std::to_string(s) + " hash not mapped to it");
  }
  if (used != by_hash_.size() || used != lru_.size() || used + free_slots_.size() != slot_hash_.size())
    return Status::error("host tier counts disagree: " + std::to_string(used) + " used, " +
                         std::to_string(by_hash_.size()) + " mapped, " + std::to_string(lru_.size()) + " in LRU, " +
                         std::to_string(free_slots_.size()) + " free");
  return Status::ok();
}

}  // namespace m3
