#pragma once
// The Hopper backend's dispatch entries ("<op>.<variant>.sm90"). Each entry is eligible only
// for device tensors of the dtypes it was written for; the CPU entries stay the reference.
// With device tensors every raw pointer an op takes (ids, positions, slot mappings and all
// AttentionMetadata arrays) must be a device pointer; scalars stay host values.
#include <memory>

#include "ops/ops.h"
#include "ops/runtime.h"

namespace m3::cuda {

void register_cuda_kernels(ops::KernelTable& table);

// Number of CUDA devices (0 when there is no driver or GPU: never throws).
int device_count();

// Device memory (plain cudaMalloc), pinned staging, one non-blocking stream every kernel of
// the activating thread launches on, and CUDA graphs captured on that stream. Throws with
// the CUDA error when the device cannot be used.
std::unique_ptr<ops::BackendRuntime> make_cuda_runtime(int device);

}  // namespace m3::cuda
