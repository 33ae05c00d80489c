#pragma once
// Metadata of the host-memory KV tier (vLLM's --kv-offloading-size): a fixed number of host
// slots, each holding one evicted block's KV under its prefix hash, least recently used first out.
// A device block whose hash is evicted from the pool is copied to a slot before it is reused; a
// later prefix lookup that misses on the device but finds the hash here loads the slot into a
// fresh device block instead of recomputing it. The bytes live in the engine; this is pure.
#include <list>
#include <optional>
#include <unordered_map>
#include <vector>

#include "core/hash128.h"
#include "core/status.h"
#include "kv/kv_types.h"

namespace m3 {

// One block copy the runner performs before the step's forward: offloads (device -> host)
// first, then loads (host -> device).
struct KvTransfer {
  BlockId device_block = kNoBlock;
  int32_t host_slot = -1;
  bool operator==(const KvTransfer&) const = default;
};

class HostBlockTier {
 public:
  explicit HostBlockTier(int32_t num_slots);

  int32_t num_slots() const { return int32_t(slot_hash_.size()); }
  int32_t num_used_slots() const { return int32_t(by_hash_.size()); }

  // The slot holding `hash`, or nullopt. No side effects.
  std::optional<int32_t> find(const Hash128& hash) const;
  // A slot to receive `hash`'s block (the hash must not be stored): a free one, else the least
  // recently used one that is not pinned (its hash is dropped). nullopt when every slot is pinned.
  std::optional<int32_t> store(const Hash128& hash);
  // Marks the slot most recently used and keeps it from being reused until unpin_all(): a load
  // from it is pending.
  void pin(int32_t slot);
  void unpin_all() { pinned_.assign(pinned_.size(), 0); }

  // The hash map, the per-slot hashes and the LRU list agree.
  Status check_invariants() const;

 private:
  std::vector<std::optional<Hash128>> slot_hash_;
  std::unordered_map<Hash128, int32_t, Hash128Hasher> by_hash_;
  std::list<int32_t> lru_;  // used slots, least recently used first
  std::vector<std::list<int32_t>::iterator> lru_pos_;
  std::vector<int32_t> free_slots_;
  std::vector<char> pinned_;
};

}  // namespace m3
