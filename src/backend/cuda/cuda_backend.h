#pragma once
// The Hopper backend's dispatch entries ("<op>.<variant>.sm90"). Each entry is eligible only
// for device tensors of the dtypes it was written for; the CPU entries stay the reference.
// With device tensors every raw pointer an op takes (ids, positions, slot mappings and all
// AttentionMetadata arrays) must be a device pointer; scalars stay host values.
#include "ops/ops.h"

namespace m3::cuda {

void register_cuda_kernels(ops::KernelTable& table);

}  // namespace m3::cuda
