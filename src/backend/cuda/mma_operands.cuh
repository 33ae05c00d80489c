#pragma once
// Operand staging for the mma.sync kernels (the MoE W8A16/W8A8 kernels in moe_mxfp8.cu, the
// invariant linear in linear_mma.cu): cp.async copies into shared memory, fragment words, and
// the exact MXFP8 -> f16 conversion with the block scale folded in. Kept C++17 (.cu files only).
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace m3::cuda::mma_ops {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte copy global -> shared; src_bytes 0 writes zeros (rows past the end).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
// Weight bytes: a row is read 64-128 bytes per stage, in order; the L2::256B hint has L2 fetch the
// next stage's bytes of the row with them (fewer, longer DRAM bursts: 2-8 % faster W8A16 GEMMs
// at T = 1..128 on the H200).
__device__ __forceinline__ void cp_async16_w(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async8(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src) : "memory");
}
// MXFP8 scale words of 2^lg consecutive 128-K stages of one weight row (4 << lg bytes, lg 0..2)
// in one copy, and the widest lg that K and the scale arrays' address bits allow.
__device__ __forceinline__ void cp_async_words(uint32_t dst, const void* src, int lg) {
  if (lg == 2) cp_async16(dst, src, 16u);
  else if (lg == 1) cp_async8(dst, src);
  else cp_async4(dst, src);
}
__host__ __device__ constexpr int scale_copy_log(uintptr_t addr_bits, int k) {
  return addr_bits % 16 == 0 && k % 512 == 0 ? 2 : addr_bits % 8 == 0 && k % 256 == 0 ? 1 : 0;
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ uint32_t word_of(const uint4& q, int i) {
  return i == 0 ? q.x : i == 1 ? q.y : i == 2 ? q.z : q.w;
}

// Largest byte of a 32-bit word.
__device__ __forceinline__ int max_byte(uint32_t v) {
  v = __vmaxu4(v, v >> 16);
  v = __vmaxu4(v, v >> 8);
  return int(v & 0xffu);
}

// Largest e8m0 byte of each of R scale rows (`words` 32-bit words each), the 4 lanes of a quad
// (t = lane & 3) splitting a row's words and all getting its maximum. A round's kBatch loads per
// row are all issued before the first max, so a row of up to 4 * kBatch words costs one memory
// round trip (a loop of dependent maxima took ~6 for K = 6144: 23 % of a one-token projection).
template <int R, int kBatch>
__device__ __forceinline__ void rows_max_byte(const uint32_t* const (&rows)[R], int words, int t, int (&out)[R]) {
  uint32_t v[R];
#pragma unroll
  for (int r = 0; r < R; ++r) v[r] = 0;
  for (int j0 = t; j0 < words; j0 += 4 * kBatch) {
    uint32_t w[R][kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b)
#pragma unroll
      for (int r = 0; r < R; ++r) w[r][b] = j0 + 4 * b < words ? __ldg(rows[r] + j0 + 4 * b) : 0u;
#pragma unroll
    for (int b = 0; b < kBatch; ++b)
#pragma unroll
      for (int r = 0; r < R; ++r) v[r] = __vmaxu4(v[r], w[r][b]);
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
    int m = max_byte(v[r]);
    m = max(m, __shfl_xor_sync(0xffffffffu, m, 1));
    out[r] = max(m, __shfl_xor_sync(0xffffffffu, m, 2));
  }
}

// Largest |x| of a row read by the whole CTA: each thread passes its own maximum, all get the
// row's (warps: the CTA's warp count, at most 32). For the per-row power-of-two activation scales.
__device__ __forceinline__ float cta_amax(float amax, int warps) {
  __shared__ float red[32];
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = amax;
  __syncthreads();
  amax = red[0];
  for (int w = 1; w < warps; ++w) amax = fmaxf(amax, red[w]);
  return amax;
}

// Two e4m3 of one half of a word (low byte first) -> f16x2, exact. The half is the
// conversion's operand selector (F2FP ... R.H1): a C++ `w >> 16` before the conversion costs a
// shift per pair, which ptxas does not fold.
__device__ __forceinline__ uint32_t e4m3x2_lo_f16x2(uint32_t w) {
  uint32_t h;
  asm("{\n .reg .b16 l, u;\n mov.b32 {l, u}, %1;\n cvt.rn.f16x2.e4m3x2 %0, l;\n}" : "=r"(h) : "r"(w));
  return h;
}
__device__ __forceinline__ uint32_t e4m3x2_hi_f16x2(uint32_t w) {
  uint32_t h;
  asm("{\n .reg .b16 l, u;\n mov.b32 {l, u}, %1;\n cvt.rn.f16x2.e4m3x2 %0, u;\n}" : "=r"(h) : "r"(w));
  return h;
}

// Two e4m3 (the low or high half of `w`) -> f16x2 (exact), times m (a power of two <= 1).
template <bool kHigh = false>
__device__ __forceinline__ uint32_t e4m3x2_scaled(uint32_t w, __half2 m) {
  uint32_t h = kHigh ? e4m3x2_hi_f16x2(w) : e4m3x2_lo_f16x2(w);
  __half2 v = __hmul2(*reinterpret_cast<const __half2*>(&h), m);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// 2^d (d <= 0) as f16x2; 0 below 2^-24 (round to nearest even of 2^-25 is 0).
__device__ __forceinline__ __half2 pow2_h2(int d) {
  d = max(d, -25);
  return __float2half2_rn(__uint_as_float(uint32_t(d + 127) << 23));
}

// Where column c of an f16 operand row sits for the wgmma kernels that keep an mma.sync
// kernel's bits (the MoE W8A16, the invariant linear): inside each 64-wide chunk, MMA step s (of
// 4) must see its 16 k in the order the mma.sync fragments pair them (lane tig reads bytes
// [16 tig, +16) of the chunk, step s its bytes 4s..4s+3), so that both kernels sum the same
// products in the same order. Real k = 16p + 4s + 2h + e goes to 16s + 8h + 2p + e; pairs (e)
// stay adjacent.
__host__ __device__ constexpr int wg_col(int c) {
  return (c & ~63) | (((c >> 2) & 3) << 4) | (((c >> 1) & 1) << 3) | (((c >> 4) & 3) << 1) | (c & 1);
}

// mbarriers of a producer/consumer ring in shared memory (the wgmma kernels).
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// kCluster: the transactions may come from other CTAs of the cluster (st.async into this CTA's
// shared memory): acquire at cluster scope, so their bytes are visible after the wait.
template <bool kCluster = false>
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    if constexpr (kCluster) {
      asm volatile(
          "{\n.reg .pred p;\nmbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
          : "=r"(done)
          : "r"(bar), "r"(parity)
          : "memory");
    } else {
      asm volatile(
          "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
          : "=r"(done)
          : "r"(bar), "r"(parity)
          : "memory");
    }
  } while (!done);
}
// Arrive on `bar` when this thread's earlier cp.async copies have landed (counts as one of the
// barrier's expected arrivals).
__device__ __forceinline__ void cp_async_arrive_noinc(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

}  // namespace m3::cuda::mma_ops
