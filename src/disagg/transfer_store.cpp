#include "disagg/transfer_store.h"

#include <random>

#include "core/hash128.h"

namespace m3 {

KvTransferStore::KvTransferStore(size_t max_bytes, std::chrono::milliseconds ttl, Clock clock)
    : max_bytes_(max_bytes), ttl_(ttl), clock_(clock ? std::move(clock) : [] { return std::chrono::steady_clock::now(); }) {
  std::random_device rd;
  salt_ = (uint64_t(rd()) << 32) ^ rd();
}

std::string KvTransferStore::put(std::shared_ptr<const std::string> blob, std::function<void()> on_drop) {
  const size_t n = blob ? blob->size() : 0;
  if (!blob || n > max_bytes_) {
    if (on_drop) on_drop();
    return "";
  }
  Drops drops;
  std::unique_lock<std::mutex> lock(mu_);
  expire_locked(clock_(), drops);
  while (stats_.bytes + n > max_bytes_ && !order_.empty()) {
    ++stats_.evicted;
    drop_locked(entries_.find(order_.front()), drops);
  }
  // Ids are not guessable from each other (a consumer can only fetch what it was told about).
  Hasher128 h(salt_);
  h.update_u64(++counter_);
  const std::string id = h.finish().to_hex();
  order_.push_back(id);
  entries_[id] = Entry{std::move(blob), clock_() + ttl_, std::prev(order_.end()), std::move(on_drop)};
  stats_.bytes += n;
  ++stats_.entries;
  ++stats_.stored;
  lock.unlock();
  run(drops);
  return id;
}

std::shared_ptr<const std::string> KvTransferStore::get(const std::string& id) {
  Drops drops;
  std::shared_ptr<const std::string> out;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const auto now = clock_();
    expire_locked(now, drops);
    auto it = entries_.find(id);
    if (it != entries_.end()) {
      it->second.expires = now + ttl_;
      order_.splice(order_.end(), order_, it->second.order);  // order_ stays sorted by deadline
      out = it->second.blob;
    }
  }
  run(drops);
  return out;
}

bool KvTransferStore::acknowledge(const std::string& id) {
  Drops drops;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(id);
    if (it == entries_.end()) return false;
    ++stats_.acknowledged;
    drop_locked(it, drops);
  }
  run(drops);
  return true;
}

KvTransferStoreStats KvTransferStore::stats() {
  Drops drops;
  KvTransferStoreStats s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    expire_locked(clock_(), drops);
    s = stats_;
  }
  run(drops);
  return s;
}

void KvTransferStore::expire_locked(std::chrono::steady_clock::time_point now, Drops& drops) {
  // `order_` is by deadline (one ttl for all; a fetch moves its entry to the end).
  while (!order_.empty()) {
    auto it = entries_.find(order_.front());
    if (it->second.expires > now) break;
    ++stats_.expired;
    drop_locked(it, drops);
  }
}

void KvTransferStore::drop_locked(std::unordered_map<std::string, Entry>::iterator it, Drops& drops) {
  stats_.bytes -= it->second.blob->size();
  --stats_.entries;
  if (it->second.on_drop) drops.push_back(std::move(it->second.on_drop));
  order_.erase(it->second.order);
  entries_.erase(it);
}

void KvTransferStore::run(Drops& drops) {
  for (auto& f : drops) f();
}

}  // namespace m3
