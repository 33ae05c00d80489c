#include "disagg/transfer_store.h"

#include <random>

#include "core/hash128.h"

namespace m3 {

KvTransferStore::KvTransferStore(size_t max_bytes, std::chrono::milliseconds ttl, Clock clock)
    : max_bytes_(max_bytes), ttl_(ttl), clock_(clock ? std::move(clock) : [] { return std::chrono::steady_clock::now(); }) {
  std::random_device rd;
  salt_ = (uint64_t(rd()) << 32) ^ rd();
}

std::string KvTransferStore::put(std::shared_ptr<const std::string> blob) {
  const size_t n = blob ? blob->size() : 0;
  if (!blob || n > max_bytes_) return "";
  std::lock_guard<std::mutex> lock(mu_);
  expire_locked(clock_());
  while (stats_.bytes + n > max_bytes_ && !order_.empty()) {
    ++stats_.evicted;
    drop_locked(entries_.find(order_.front()));
  }
  // Ids are not guessable from each other (a consumer can only fetch what it was told about).
  Hasher128 h(salt_);
  h.update_u64(++counter_);
  const std::string id = h.finish().to_hex();
  order_.push_back(id);
  entries_[id] = Entry{std::move(blob), clock_() + ttl_, std::prev(order_.end())};
  stats_.bytes += n;
  ++stats_.entries;
  ++stats_.stored;
  return id;
}

std::shared_ptr<const std::string> KvTransferStore::get(const std::string& id) {
  std::lock_guard<std::mutex> lock(mu_);
  expire_locked(clock_());
  auto it = entries_.find(id);
  return it == entries_.end() ? nullptr : it->second.blob;
}

bool KvTransferStore::acknowledge(const std::string& id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(id);
  if (it == entries_.end()) return false;
  ++stats_.acknowledged;
  drop_locked(it);
  return true;
}

KvTransferStoreStats KvTransferStore::stats() {
  std::lock_guard<std::mutex> lock(mu_);
  expire_locked(clock_());
  return stats_;
}

void KvTransferStore::expire_locked(std::chrono::steady_clock::time_point now) {
  // Entries expire in insertion order (one ttl for all).
  while (!order_.empty()) {
    auto it = entries_.find(order_.front());
    if (it->second.expires > now) break;
    ++stats_.expired;
    drop_locked(it);
  }
}

void KvTransferStore::drop_locked(std::unordered_map<std::string, Entry>::iterator it) {
  stats_.bytes -= it->second.blob->size();
  --stats_.entries;
  order_.erase(it->second.order);
  entries_.erase(it);
}

}  // namespace m3
