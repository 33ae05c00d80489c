#pragma once
// TMA tensor maps (CUtensorMap) of device tensors, for kernels that copy tiles with
// cp.async.bulk.tensor (mma_operands.cuh: tma_load_2d / tma_load_3d). Encoded on the host at each
// launch (microseconds; a map holds the tensor's address) through the driver entry point the
// runtime looks up, so the project does not link libcuda.
#include <cuda.h>

#include <cstdint>

namespace m3::cuda {

// A row-major tensor of `rows` rows of `cols` bf16 (row pitch `pitch_bytes`) as a 2-D map with
// boxes of box_cols x box_rows, 128-byte swizzled (box_cols * 2 must be 128: the swizzle span).
CUtensorMap bf16_map_2d(const void* base, uint64_t cols, uint64_t rows, uint64_t pitch_bytes, uint32_t box_cols,
                        uint32_t box_rows);

// A paged KV cache [slots, heads, dim] bf16 as a 3-D map (dim, head, slot) with boxes of box_dim x
// 1 head x box_slots, 128-byte swizzled (box_dim * 2 must be 128).
CUtensorMap bf16_map_3d(const void* base, uint64_t dim, uint64_t heads, uint64_t slots, uint32_t box_dim, uint32_t box_slots);

}  // namespace m3::cuda
