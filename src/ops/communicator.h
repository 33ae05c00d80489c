#pragma once
// A tensor-parallel group as the forward pass sees it: every rank calls the same collectives in
// the same order. Implementations live above ops (dist/: ranks as threads of one process over
// host memory; NCCL on GPUs); the model reaches them only through ops::all_reduce.
#include <string>

#include "core/tensor.h"

namespace m3::ops {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int size() const = 0;
  virtual int rank() const = 0;
  // The dispatch trace's entry for a collective ("all_reduce", "all_gather"), e.g.
  // "all_reduce.in_process.cpu".
  virtual std::string entry_name(const std::string& collective) const = 0;
  // x (F32, in the rank's runtime memory) becomes the sum of every rank's x. Each element is
  // summed in rank order (x0 + x1 + ...), so every rank holds the same bits and an element's sum
  // does not depend on the batch around it (batch invariance survives tensor parallelism).
  virtual void all_reduce_sum(const TensorView& x) = 0;
  // out [rows, size * cols] (F32, the rank's memory) = every rank's local [rows, cols], rank r's
  // in columns [r * cols, (r + 1) * cols): a vocab-parallel LM head's logits, whole on every rank.
  virtual void all_gather_cols(const TensorView& local, const TensorView& out) = 0;
  // This rank failed between collectives: every rank of the group leaves the collective it waits
  // in, and any later one, with an error instead of waiting for it. The group stays unusable.
  virtual void abort() = 0;
};

}  // namespace m3::ops
