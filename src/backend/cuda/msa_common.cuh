#pragma once
// Device helpers shared by the tuned MSA kernels (msa_indexer.cu, msa_decode.cu): batch
// bookkeeping, order-preserving score keys, cp.async, and the arrival counters that let the
// last CTA of a group finish the work (selection, split merge) without a second launch.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace m3::cuda::msa {

// The sequence owning batch token t: the last s with query_start[s] <= t (empty sequences
// share their start with the next one, so the last is the right one).
__device__ __forceinline__ int seq_of_token(const int32_t* query_start, int num_seqs, int t) {
  int lo = 0, hi = num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (query_start[mid] <= t) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// fp32 -> uint32 with the same order. -0 and +0 get one key: the CPU reference compares
// floats, for which they are equal (a tie, broken by block id).
__device__ __forceinline__ uint32_t order_key(float f) {
  uint32_t u = __float_as_uint(f);
  if (u == 0x80000000u) u = 0;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

// 16-byte global -> shared copy, bypassing L1 (streamed once). pred false: zero-filled.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool pred) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(pred ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Programmatic dependent launch: a kernel launched with programmatic stream serialization
// may start while the previous kernel in the stream finishes; it must wait here before
// reading anything that kernel writes (kernels before it have completed). The previous
// kernel may signal early that its dependents can be scheduled. Both are no-ops otherwise.
__device__ __forceinline__ void wait_previous_kernel() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
__device__ __forceinline__ void allow_next_kernel() { asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory"); }

// Arrival of one CTA of a group of `expected`; true for the last one, which also re-arms the
// counter for the next launch. Every CTA's global writes before this call are visible to the
// last one (fence before arriving, fence after learning it is last).
__device__ __forceinline__ bool arrive_last(unsigned* counter, unsigned expected, int* flag_smem) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned prev = atomicAdd(counter, 1u);
    const bool last = prev == expected - 1;
    if (last) *counter = 0;
    *flag_smem = last;
  }
  __syncthreads();
  const bool last = *flag_smem != 0;
  if (last) __threadfence();
  return last;
}

// Counters live in a static device array (zero at module load, re-armed by each group's last
// CTA), so no memset node is needed per launch. Consequence: launches of one kernel must not
// overlap in time on one device (the engine drives one stream per device).
constexpr int kMaxCounters = 1 << 16;

}  // namespace m3::cuda::msa
