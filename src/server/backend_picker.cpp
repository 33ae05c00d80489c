#include "server/backend_picker.h"

namespace m3::server {

BackendPicker::BackendPicker(std::vector<std::string> urls) : urls_(std::move(urls)), in_flight_(urls_.size(), 0) {}

BackendPicker::Lease BackendPicker::pick() {
  std::lock_guard<std::mutex> lock(mu_);
  size_t best = next_ % urls_.size();
  for (size_t k = 1; k < urls_.size(); ++k) {
    const size_t i = (next_ + k) % urls_.size();
    if (in_flight_[i] < in_flight_[best]) best = i;
  }
  next_ = best + 1;
  ++in_flight_[best];
  return Lease(this, best);
}

int64_t BackendPicker::in_flight(size_t index) const {
  std::lock_guard<std::mutex> lock(mu_);
  return in_flight_[index];
}

BackendPicker::Lease::~Lease() {
  if (!owner_) return;
  std::lock_guard<std::mutex> lock(owner_->mu_);
  --owner_->in_flight_[index_];
}

}  // namespace m3::server
