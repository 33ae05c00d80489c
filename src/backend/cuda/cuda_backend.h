#pragma once
// The Hopper backend's dispatch entries. Each entry is eligible only for device tensors of
// the dtypes it was written for; the CPU entries stay the reference.
#include "ops/ops.h"

namespace m3::cuda {

void register_cuda_kernels(ops::KernelTable& table);

}  // namespace m3::cuda
