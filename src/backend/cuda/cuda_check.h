#pragma once
// Checked CUDA runtime calls: every failure carries the call, file and line.
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace m3::cuda {

inline void check(cudaError_t err, const char* what, const char* file, int line) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("CUDA error in ") + what + " at " + file + ":" + std::to_string(line) + ": " +
                             cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
  }
}

}  // namespace m3::cuda

#define M3_CUDA_CHECK(call) ::m3::cuda::check((call), #call, __FILE__, __LINE__)
// After a kernel launch: launch-configuration errors surface here, not at the next sync.
#define M3_CUDA_CHECK_LAUNCH() ::m3::cuda::check(cudaGetLastError(), "kernel launch", __FILE__, __LINE__)
