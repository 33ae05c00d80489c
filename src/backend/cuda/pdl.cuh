// Programmatic dependent launch (PDL), shared by the kernels that chain with it.
//
// A kernel launched as a programmatic dependent may start while the previous kernel in the
// stream drains: it must pdl_wait() before reading anything that kernel writes (kernels before
// that one have completed). A kernel may pdl_launch_dependents() to let its dependents be
// scheduled early. Both are no-ops when the launch was plain.
//
// What a dependent reads after pdl_wait() that the kernels before it wrote (after this kernel
// was launched) must be read coherently: never __ldg / ld.global.nc, which assumes the bytes do
// not change while the kernel runs. On the H200 the router's logits kernel, made a dependent,
// read stale x rows through __ldg after the wait (other experts chosen); plain loads or __ldcg
// are correct. Weights and anything written before the launch may still take the read-only path.
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_internal.h"

namespace m3::cuda {

__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
__device__ __forceinline__ void pdl_launch_dependents() { asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory"); }

// M3_CUDA_NO_PDL=1 in the environment launches every would-be dependent plainly (a diagnostic,
// like CUDA_LAUNCH_BLOCKING: a result that changes with it points at a read before pdl_wait()).
bool pdl_enabled();

// Launches `kernel` on current_stream(), as a programmatic dependent of the previous kernel when
// `dependent` (created streams only: the legacy stream keeps plain ordering).
template <class... Params, class... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, bool dependent, Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = current_stream();
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = (dependent && cfg.stream && pdl_enabled()) ? 1 : 0;
  M3_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
  M3_CUDA_CHECK_LAUNCH();
}

}  // namespace m3::cuda
