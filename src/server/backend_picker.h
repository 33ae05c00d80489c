#pragma once
// disagg-proxy's choice of server: the one with the fewest requests the proxy has in flight on
// it, ties taken in turn (so an idle pool is used round-robin). A Lease counts the request until
// it is answered. Thread-safe.
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace m3::server {

class BackendPicker {
 public:
  explicit BackendPicker(std::vector<std::string> urls);

  class Lease {
   public:
    Lease(BackendPicker* owner, size_t index) : owner_(owner), index_(index) {}
    ~Lease();
    Lease(Lease&& o) noexcept : owner_(o.owner_), index_(o.index_) { o.owner_ = nullptr; }
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    Lease& operator=(Lease&&) = delete;
    const std::string& url() const { return owner_->urls_[index_]; }
    size_t index() const { return index_; }

   private:
    BackendPicker* owner_;
    size_t index_;
  };

  Lease pick();
  int64_t in_flight(size_t index) const;

 private:
  std::vector<std::string> urls_;
  mutable std::mutex mu_;
  std::vector<int64_t> in_flight_;
  size_t next_ = 0;  // where the next tie search starts
};

}  // namespace m3::server
