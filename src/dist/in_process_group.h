#pragma once
// A tensor-parallel group whose ranks are threads of one process over host memory: the CPU
// backend's tensor parallelism (what CI tests TP with, and development without GPUs). Each rank's
// thread takes its own communicator; collectives meet at a barrier, so every rank must call the
// same ones in the same order.
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <memory>
#include <vector>

#include "ops/communicator.h"

namespace m3::dist {

class InProcessGroup {
 public:
  explicit InProcessGroup(int size);
  int size() const { return size_; }
  // Rank `rank`'s handle; used by that rank's thread only.
  std::unique_ptr<ops::Communicator> communicator(int rank);
  // A rank that fails between collectives calls this: ranks waiting in a collective, and every
  // later one, throw instead of waiting forever for it. The group stays unusable.
  void abort();

 private:
  friend class InProcessCommunicator;
  // std::barrier that can be aborted: arrive_and_wait throws once abort() was called.
  void arrive_and_wait();
  int size_;
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
  uint64_t phase_ = 0;
  bool aborted_ = false;
  std::vector<float*> inputs_;   // each rank's tensor during a collective
  std::vector<int64_t> counts_;  // its element count (checked equal)
  std::vector<float> sum_;
};

}  // namespace m3::dist
