#pragma once
// Tensor-parallel ranks on the CUDA devices of this process (ADR 0005): one NCCL communicator per
// rank, made together (ncclCommInitAll). NCCL is loaded at run time (libnccl.so.2), so the binary
// needs it only for tensor parallelism on GPUs. Each rank's collectives go on its thread's stream
// (cuda::current_stream()), so a captured decode step holds them.
#include <memory>
#include <vector>

#include "core/status.h"
#include "ops/communicator.h"

namespace m3::cuda {

class NcclGroup {
 public:
  // Communicators for one rank per device of `devices` (distinct). The error names what is
  // missing (the library, a device) or NCCL's reason.
  static Result<std::unique_ptr<NcclGroup>> create(const std::vector<int>& devices);
  ~NcclGroup();
  int size() const;
  // Rank `rank`'s handle, for the thread that runs that rank (its device and stream current).
  // batch_invariant: every element is summed in rank order whatever the message size (NCCL's
  // own all-reduce is used where that holds anyway: two ranks, or invariance not asked for);
  // otherwise NCCL's all-reduce, whose summation order follows its algorithm and the message size.
  std::unique_ptr<ops::Communicator> communicator(int rank, bool batch_invariant);
  // A rank failed (Communicator::abort): ncclCommAbort on every communicator, so ranks blocked in a
  // collective return (with errors) instead of waiting for it. The group stays unusable.
  void abort();

 private:
  struct Impl;
  explicit NcclGroup(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace m3::cuda
