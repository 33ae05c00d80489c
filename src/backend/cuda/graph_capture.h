#pragma once
// Stream capture into an instantiated graph. When the recorded work throws, the capture is
// ended and discarded so the stream stays usable. Used by the runtime, GPU tests and benches.
// Kept C++17 (included by .cu files).
#include <cuda_runtime.h>

#include <functional>

#include "backend/cuda/cuda_check.h"

namespace m3::cuda {

// The caller owns the result (cudaGraphExecDestroy); the graph is freed once instantiated.
inline cudaGraphExec_t capture_graph(cudaStream_t stream, const std::function<void()>& record) {
  cudaGraph_t graph = nullptr;
  M3_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  try {
    record();
  } catch (...) {
    cudaStreamEndCapture(stream, &graph);
    if (graph) cudaGraphDestroy(graph);
    cudaGetLastError();
    throw;
  }
  M3_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec = nullptr;
  const cudaError_t err = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  M3_CUDA_CHECK(err);
  return exec;
}

}  // namespace m3::cuda
