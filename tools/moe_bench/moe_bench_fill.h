#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace moe_bench {

// Pseudo-random e4m3 bytes (never the NaN codes 0x7f / 0xff), on `stream`.
void fill_e4m3(uint8_t* p, size_t n, uint32_t seed, cudaStream_t stream);
// Pseudo-random bytes in [lo, hi] (e8m0 scales), on `stream`.
void fill_bytes(uint8_t* p, size_t n, int lo, int hi, uint32_t seed, cudaStream_t stream);
// Pseudo-random floats in [-scale, scale), on `stream`.
void fill_f32(float* p, size_t n, float scale, uint32_t seed, cudaStream_t stream);
// out[r] = the largest of scale row r's `cols` bytes (LinearWeight::scale_max, as the loader
// computes it on the host), on `stream`.
void row_max_bytes(const uint8_t* scale, int64_t rows, int64_t cols, uint8_t* out, cudaStream_t stream);

}  // namespace moe_bench
