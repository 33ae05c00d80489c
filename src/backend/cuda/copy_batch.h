#pragma once
// One launch for many device-to-device copies (BackendRuntime::copy_batch on CUDA).
#include <cstddef>
#include <vector>

#include <cuda_runtime_api.h>

#include "ops/runtime.h"

namespace m3::cuda {

// The piece list's pinned host copy and device copy, grown as needed (one per runtime).
struct CopyBatchBuffers {
  void* host = nullptr;
  void* device = nullptr;
  size_t capacity = 0;
};

// Queues the copies on `stream` (waits for the stream's earlier work first: the list's buffers
// are reused). Pointers are device addresses of this process (mapped IPC memory included).
void copy_pieces(const std::vector<ops::BackendRuntime::CopyPiece>& pieces, CopyBatchBuffers& buf, cudaStream_t stream);
void release_copy_batch(CopyBatchBuffers& buf);

}  // namespace m3::cuda
