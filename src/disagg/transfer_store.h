#pragma once
// The producer's side of a KV transfer: serialized KV blocks of finished prefills, held in host
// memory under a random id until the consumer fetches and acknowledges them (DELETE), or until
// they expire. Bounded: past max_bytes the oldest entries go first. Thread-safe (HTTP threads
// put, fetch and acknowledge at once).
#include <chrono>
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace m3 {

struct KvTransferStoreStats {
  size_t entries = 0;
  size_t bytes = 0;
  int64_t stored = 0;        // cumulative
  int64_t acknowledged = 0;  // taken back by the consumer
  int64_t expired = 0;       // dropped unacknowledged after the time limit
  int64_t evicted = 0;       // dropped unacknowledged for room
};

class KvTransferStore {
 public:
  using Clock = std::function<std::chrono::steady_clock::time_point()>;
  KvTransferStore(size_t max_bytes, std::chrono::milliseconds ttl, Clock clock = nullptr);

  // Holds `blob` and returns its id, or "" when it alone exceeds max_bytes. `on_drop` runs once
  // when the entry goes (acknowledged, expired or evicted; outside the store's lock): what frees
  // whatever the blob refers to (device slots).
  std::string put(std::shared_ptr<const std::string> blob, std::function<void()> on_drop = nullptr);
  // The blob, or null when unknown, expired or evicted. A fetch holds the entry at least ttl
  // longer: a consumer reading what it refers to has that long before it may be reused.
  std::shared_ptr<const std::string> get(const std::string& id);
  // The consumer's acknowledgement: drops the blob. False when it was not held.
  bool acknowledge(const std::string& id);
  KvTransferStoreStats stats();

 private:
  struct Entry {
    std::shared_ptr<const std::string> blob;
    std::chrono::steady_clock::time_point expires;
    std::list<std::string>::iterator order;
    std::function<void()> on_drop;
  };
  using Drops = std::vector<std::function<void()>>;
  void expire_locked(std::chrono::steady_clock::time_point now, Drops& drops);
  void drop_locked(std::unordered_map<std::string, Entry>::iterator it, Drops& drops);
  static void run(Drops& drops);

  size_t max_bytes_;
  std::chrono::milliseconds ttl_;
  Clock clock_;
  std::mutex mu_;
  std::unordered_map<std::string, Entry> entries_;
  std::list<std::string> order_;  // oldest first
  KvTransferStoreStats stats_;
  uint64_t counter_ = 0;
  uint64_t salt_ = 0;
};

}  // namespace m3
