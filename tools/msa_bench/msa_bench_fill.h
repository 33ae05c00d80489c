#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace msa_bench {

enum class Elem { kF32, kBF16, kFP8 };

// n elements of pseudo-random values in [-2, 2) (rounded to the element type), on `stream`.
void fill_random(void* p, uint64_t n, Elem elem, uint32_t seed, cudaStream_t stream);

// Reads `bytes` (a multiple of 16) at p, on `stream`, so that they are in L2 (a diagnostic's warm-up).
void touch(const void* p, uint64_t bytes, cudaStream_t stream);

}  // namespace msa_bench
