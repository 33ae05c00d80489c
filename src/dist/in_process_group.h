#pragma once
// A tensor-parallel group whose ranks are threads of one process over host memory: the CPU
// backend's tensor parallelism (what CI tests TP with, and development without GPUs). Each rank's
// thread takes its own communicator; collectives meet at a barrier, so every rank must call the
// same ones in the same order.
#include <barrier>
#include <cstdint>
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

 private:
  friend class InProcessCommunicator;
  int size_;
  std::barrier<> barrier_;
  std::vector<float*> inputs_;   // each rank's tensor during a collective
  std::vector<int64_t> counts_;  // its element count (checked equal)
  std::vector<float> sum_;
};

}  // namespace m3::dist
