#include "dist/rank_threads.h"

namespace m3::dist {

RankThreads::RankThreads(int size) : size_(size < 1 ? 1 : size), errors_(size_t(size_)) {
  for (int r = 1; r < size_; ++r) threads_.emplace_back([this, r] { loop(r); });
}

RankThreads::~RankThreads() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void RankThreads::run(const std::function<void(int)>& fn) {
  if (size_ == 1) {
    fn(0);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    job_ = &fn;
    pending_ = size_ - 1;
    for (auto& e : errors_) e = nullptr;
    ++generation_;
  }
  cv_.notify_all();
  try {
    fn(0);
  } catch (...) {
    errors_[0] = std::current_exception();
  }
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [this] { return pending_ == 0; });
  job_ = nullptr;
  for (auto& e : errors_)
    if (e) std::rethrow_exception(e);
}

void RankThreads::loop(int rank) {
  uint64_t seen = 0;
  for (;;) {
    const std::function<void(int)>* job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      job = job_;
    }
    std::exception_ptr err;
    try {
      (*job)(rank);
    } catch (...) {
      err = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      errors_[size_t(rank)] = err;
      if (--pending_ == 0) done_cv_.notify_one();
    }
  }
}

}  // namespace m3::dist
