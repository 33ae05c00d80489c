#pragma once
// TMA tile copies (cp.async.bulk.tensor) into shared memory, completing on an mbarrier
// (mma_operands.cuh's mbar_* helpers wait on it). The tensor maps come from tensor_map.h and are
// __grid_constant__ kernel parameters. Kept C++17 (.cu only).
#include <cstdint>

namespace m3::cuda::tma {

// Arrive on `bar` and add `bytes` to the transactions its current phase waits for.
__device__ __forceinline__ void arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

// The box of `map` at the given coordinates (innermost first) into shared memory at dst (1024-byte
// aligned for the 128-byte swizzle), its bytes completing on `bar`.
__device__ __forceinline__ void load_2d(uint32_t dst, const void* map, int c0, int c1, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void load_3d(uint32_t dst, const void* map, int c0, int c1, int c2, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}

}  // namespace m3::cuda::tma
