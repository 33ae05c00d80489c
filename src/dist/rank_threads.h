#pragma once
// Runs one function per tensor-parallel rank at once: rank 0 on the calling thread, the others
// on threads kept for the engine's lifetime (a rank's CUDA context stays bound to its thread).
// Collectives inside the function meet across the ranks, so every rank must run it.
#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace m3::dist {

class RankThreads {
 public:
  explicit RankThreads(int size);
  ~RankThreads();
  RankThreads(const RankThreads&) = delete;
  RankThreads& operator=(const RankThreads&) = delete;

  int size() const { return size_; }
  // fn(rank) for every rank concurrently; returns when all are done and rethrows the first
  // exception a rank threw (by rank order).
  void run(const std::function<void(int rank)>& fn);

 private:
  void loop(int rank);
  int size_;
  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  const std::function<void(int)>* job_ = nullptr;
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
  std::vector<std::exception_ptr> errors_;
  std::vector<std::thread> threads_;
};

}  // namespace m3::dist
