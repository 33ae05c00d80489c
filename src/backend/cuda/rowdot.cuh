#pragma once
// Batch-invariant tiled row-dot: y[r, n] = sum_k x[r, k] * W[n, k], x F32 (rows optionally
// gathered through an int32 index), W F32, BF16 or MXFP8 (F8E4M3 [N, K] + e8m0 U8 [N, K/32],
// W = e4m3(q) * 2^(s - 127), dequantised exactly in registers: "W8A32").
//
// Work split: one warp owns two weight rows (plain: output columns n and n+1; fused SwiGLU:
// gate row n and up row n, written as swiglu_oai(gate, up)). Lane `l` reads the 16-byte chunks
// starting at element l*V + j*32*V (V = 4 F32, 8 BF16, 16 FP8 elements), up to 4 chunks in
// flight per weight row (fewer when R * V > 32), and reuses each dequantised chunk for a tile
// of R rows (R = 8, 4, 2, 1 as the rows run out; MXFP8 4, 2, 1, which keeps the K loops free
// of spills at 128 registers). Each (row, column) accumulator receives its lane's elements in
// ascending order with fmaf, then the K % V tail (one element per lane), then a fixed xor
// shuffle tree. Nothing in that order depends on R, the row count, the other rows, which CTA
// ran the row, or whether the loads were vector or scalar (the scalar-load instantiation, used
// when pointers or strides are not 16-byte aligned, assembles the same chunks), so every
// output is bit-identical whatever the batch. A fixed split of K (a function of N, K and the
// weight type only, never of the rows) adds its partials in ascending split order.
//
// Kept C++17 (included by .cu files only).
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "ops/ops.h"

namespace m3::cuda {
namespace rowdot {

enum class WType { kF32, kBF16, kFP8 };

constexpr int kWarps = 8;            // warps per CTA
constexpr int kThreads = kWarps * 32;
constexpr int kRowsPerItem = 32;     // rows one CTA runs (a direct row group or a MoE work item)
constexpr int kDepthMax = 4;         // 16-byte chunks in flight per lane and weight row (small tiles)
constexpr int kMaxExperts = 256;     // experts (routed + shared) one grouped launch can address
constexpr int kMaxTopK = 64;

template <WType WT> struct Traits;
template <> struct Traits<WType::kF32> { static constexpr int V = 4, kBytes = 4; };
template <> struct Traits<WType::kBF16> { static constexpr int V = 8, kBytes = 2; };
template <> struct Traits<WType::kFP8> { static constexpr int V = 16, kBytes = 1; };

struct Act {
  float alpha, limit, beta;
};

// One weight matrix: row-major [n, k] data and, for MXFP8, the e8m0 scales [n, k / 32].
struct Mat {
  const void* w;
  const uint8_t* s;
};

// ---------------------------------------------------------------------------------------------
// Device helpers.

// ops::swiglu_oai on device.
__device__ __forceinline__ float swiglu(float g, float u, const Act& p) {
  const float gc = fminf(g, p.limit);
  const float uc = fminf(fmaxf(u, -p.limit), p.limit);
  return (uc + p.beta) * gc * (1.0f / (1.0f + expf(-p.alpha * gc)));
}

// e8m0 -> 2^(s - 127): s = 0 is the subnormal 2^-127, 255 is NaN (as core::e8m0_to_f32).
__device__ __forceinline__ float e8m0_to_float(uint32_t s) {
  const uint32_t bits = s == 0u ? 0x00400000u : (s == 255u ? 0x7fffffffu : (s << 23));
  return __uint_as_float(bits);
}

// Streaming 16-byte weight load: read-only path, not kept in L1 (x is what L1 is for).
__device__ __forceinline__ uint4 ld_weight16(const void* p) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p));
  return r;
}

__device__ __forceinline__ uint32_t word_of(const uint4& q, int i) {
  return i == 0 ? q.x : i == 1 ? q.y : i == 2 ? q.z : q.w;
}

// Two e4m3 bytes (low byte = lower element) -> exact floats (e4m3 -> f16 is exact).
__device__ __forceinline__ void fp8x2_to_float(uint32_t two, float& lo, float& hi) {
  const unsigned short in = static_cast<unsigned short>(two & 0xffffu);
  uint32_t h2;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(in));
  lo = __half2float(__ushort_as_half(static_cast<unsigned short>(h2 & 0xffffu)));
  hi = __half2float(__ushort_as_half(static_cast<unsigned short>(h2 >> 16)));
}

// The 16-byte chunk of a weight row starting at element e (vector load or the same bytes
// assembled from scalar loads).
template <WType WT, bool kVec>
__device__ __forceinline__ uint4 load_chunk(const void* row, int e) {
  if constexpr (kVec) {
    return ld_weight16(static_cast<const char*>(row) + int64_t(e) * Traits<WT>::kBytes);
  } else if constexpr (WT == WType::kF32) {
    const float* p = static_cast<const float*>(row) + e;
    return make_uint4(__float_as_uint(__ldg(p)), __float_as_uint(__ldg(p + 1)), __float_as_uint(__ldg(p + 2)),
                      __float_as_uint(__ldg(p + 3)));
  } else if constexpr (WT == WType::kBF16) {
    const unsigned short* p = static_cast<const unsigned short*>(row) + e;
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = uint32_t(__ldg(p + 2 * i)) | (uint32_t(__ldg(p + 2 * i + 1)) << 16);
    return make_uint4(w[0], w[1], w[2], w[3]);
  } else {
    const unsigned char* p = static_cast<const unsigned char*>(row) + e;
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      w[i] = uint32_t(__ldg(p + 4 * i)) | (uint32_t(__ldg(p + 4 * i + 1)) << 8) |
             (uint32_t(__ldg(p + 4 * i + 2)) << 16) | (uint32_t(__ldg(p + 4 * i + 3)) << 24);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// Elements [4*sub, 4*sub + 4) of a chunk as floats (MXFP8: times the block scale, exact).
template <WType WT>
__device__ __forceinline__ void decode4(const uint4& q, int sub, float s, float (&w)[4]) {
  if constexpr (WT == WType::kF32) {
    (void)sub;
    (void)s;
    w[0] = __uint_as_float(q.x);
    w[1] = __uint_as_float(q.y);
    w[2] = __uint_as_float(q.z);
    w[3] = __uint_as_float(q.w);
  } else if constexpr (WT == WType::kBF16) {
    (void)s;
    const uint32_t a = word_of(q, 2 * sub), b = word_of(q, 2 * sub + 1);
    w[0] = __uint_as_float(a << 16);
    w[1] = __uint_as_float(a & 0xffff0000u);
    w[2] = __uint_as_float(b << 16);
    w[3] = __uint_as_float(b & 0xffff0000u);
  } else {
    const uint32_t a = word_of(q, sub);
    float f[4];
    fp8x2_to_float(a, f[0], f[1]);
    fp8x2_to_float(a >> 16, f[2], f[3]);
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = __fmul_rn(f[i], s);
  }
}

// One element (the K % V tail; never used for MXFP8, whose K is a multiple of 32).
template <WType WT>
__device__ __forceinline__ float load_elem(const void* row, const uint8_t* srow, int i) {
  if constexpr (WT == WType::kF32) {
    (void)srow;
    return __ldg(static_cast<const float*>(row) + i);
  } else if constexpr (WT == WType::kBF16) {
    (void)srow;
    return __uint_as_float(uint32_t(__ldg(static_cast<const unsigned short*>(row) + i)) << 16);
  } else {
    float lo, hi;
    fp8x2_to_float(uint32_t(__ldg(static_cast<const unsigned char*>(row) + i)), lo, hi);
    (void)hi;
    return __fmul_rn(lo, e8m0_to_float(__ldg(srow + (i >> 5))));
  }
}

template <bool kVec>
__device__ __forceinline__ float4 load_x4(const float* p) {
  if constexpr (kVec) return __ldg(reinterpret_cast<const float4*>(p));
  else return make_float4(__ldg(p), __ldg(p + 1), __ldg(p + 2), __ldg(p + 3));
}

// The two weight rows a warp owns.
struct WarpRows {
  const void* r0;
  const void* r1;
  const uint8_t* s0;  // MXFP8 scale rows (else unused)
  const uint8_t* s1;
};

template <WType WT, bool kVec, int R>
__device__ __forceinline__ void fma_chunk(const uint4& q0, float s0, const uint4& q1, float s1,
                                          const float* const (&xr)[R], int e, float (&acc)[R][2]) {
  constexpr int V = Traits<WT>::V;
#pragma unroll
  for (int sub = 0; sub < V / 4; ++sub) {
    float w0[4], w1[4];
    decode4<WT>(q0, sub, s0, w0);
    decode4<WT>(q1, sub, s1, w1);
#pragma unroll
    for (int rr = 0; rr < R; ++rr) {
      const float4 xv = load_x4<kVec>(xr[rr] + e + 4 * sub);
      acc[rr][0] = fmaf(xv.x, w0[0], acc[rr][0]);
      acc[rr][0] = fmaf(xv.y, w0[1], acc[rr][0]);
      acc[rr][0] = fmaf(xv.z, w0[2], acc[rr][0]);
      acc[rr][0] = fmaf(xv.w, w0[3], acc[rr][0]);
      acc[rr][1] = fmaf(xv.x, w1[0], acc[rr][1]);
      acc[rr][1] = fmaf(xv.y, w1[1], acc[rr][1]);
      acc[rr][1] = fmaf(xv.z, w1[2], acc[rr][1]);
      acc[rr][1] = fmaf(xv.w, w1[3], acc[rr][1]);
    }
  }
}

// Partial dots over elements [k0, k1) of both weight rows for R rows of x (this lane's share;
// the caller reduces across the warp). k0 is a multiple of 32 * V.
template <WType WT, bool kVec, int R>
__device__ __forceinline__ void tile_dot(const WarpRows& w, const float* const (&xr)[R], int k0, int k1, int lane,
                                         float (&acc)[R][2]) {
  constexpr int V = Traits<WT>::V, kStep = 32 * V;
  // Bigger tiles have more math per chunk to hide latency behind, and need the registers.
  constexpr int kDepth = R * V <= 32 ? kDepthMax : R * V <= 64 ? kDepthMax / 2 : 1;
#pragma unroll
  for (int rr = 0; rr < R; ++rr) acc[rr][0] = acc[rr][1] = 0.0f;
  for (int e = k0 + lane * V; e + V <= k1; e += kDepth * kStep) {
    uint4 q0[kDepth], q1[kDepth];
    float s0[kDepth], s1[kDepth];
#pragma unroll
    for (int d = 0; d < kDepth; ++d) {
      const int ed = e + d * kStep;
      q0[d] = q1[d] = make_uint4(0u, 0u, 0u, 0u);
      s0[d] = s1[d] = 0.0f;
      if (ed + V <= k1) {
        q0[d] = load_chunk<WT, kVec>(w.r0, ed);
        q1[d] = load_chunk<WT, kVec>(w.r1, ed);
        if constexpr (WT == WType::kFP8) {
          s0[d] = e8m0_to_float(__ldg(w.s0 + (ed >> 5)));
          s1[d] = e8m0_to_float(__ldg(w.s1 + (ed >> 5)));
        }
      }
    }
#pragma unroll
    for (int d = 0; d < kDepth; ++d) {
      const int ed = e + d * kStep;
      if (ed + V <= k1) fma_chunk<WT, kVec, R>(q0[d], s0[d], q1[d], s1[d], xr, ed, acc);
    }
  }
  // K % V tail: at most V - 1 < 32 elements, one per lane, after the lane's chunks.
  const int i = k0 + (k1 - k0) / V * V + lane;
  if (i < k1) {
    const float w0 = load_elem<WT>(w.r0, w.s0, i), w1 = load_elem<WT>(w.r1, w.s1, i);
#pragma unroll
    for (int rr = 0; rr < R; ++rr) {
      const float xv = __ldg(xr[rr] + i);
      acc[rr][0] = fmaf(xv, w0, acc[rr][0]);
      acc[rr][1] = fmaf(xv, w1, acc[rr][1]);
    }
  }
}

// Where a warp's results go. swiglu: out0 = swiglu(a0, a1); else out0 = a0 and (out1 != null)
// out1 = a1. Row r lands at out[r * ld].
struct WarpOut {
  float* out0;
  float* out1;
  int64_t ld;
  bool swiglu;
};

struct WarpJob {
  const float* x;
  const int32_t* gather;  // x row of row r = gather ? gather[r] : r
  int64_t ldx;
  int row_begin, row_end;
  int k0, k1;
};

template <WType WT, bool kVec, int R>
__device__ __forceinline__ void run_tile(const WarpJob& j, const WarpRows& w, const WarpOut& o, const Act& act, int r,
                                         int lane) {
  const float* xr[R];
#pragma unroll
  for (int rr = 0; rr < R; ++rr) {
    const int64_t src = j.gather ? int64_t(__ldg(j.gather + r + rr)) : int64_t(r + rr);
    xr[rr] = j.x + src * j.ldx;
  }
  float acc[R][2];
  tile_dot<WT, kVec, R>(w, xr, j.k0, j.k1, lane, acc);
#pragma unroll
  for (int rr = 0; rr < R; ++rr) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) acc[rr][c] += __shfl_xor_sync(0xffffffffu, acc[rr][c], off);
    }
  }
  // Every lane holds every sum (the xor tree adds the same pairs in every lane); lane rr stores row rr.
#pragma unroll
  for (int rr = 0; rr < R; ++rr) {
    if (lane == rr) {
      const int64_t at = int64_t(r + rr) * o.ld;
      if (o.swiglu) {
        o.out0[at] = swiglu(acc[rr][0], acc[rr][1], act);
      } else {
        o.out0[at] = acc[rr][0];
        if (o.out1) o.out1[at] = acc[rr][1];
      }
    }
  }
}

template <WType WT, bool kVec>
__device__ __forceinline__ void run_warp(const WarpJob& j, const WarpRows& w, const WarpOut& o, const Act& act,
                                         int lane) {
  int r = j.row_begin;
  if constexpr (kVec) {
    if constexpr (WT != WType::kFP8) {  // MXFP8: 8-row tiles would spill (16 dequantised weights per chunk)
      for (; r + 8 <= j.row_end; r += 8) run_tile<WT, kVec, 8>(j, w, o, act, r, lane);
    }
    for (; r + 4 <= j.row_end; r += 4) run_tile<WT, kVec, 4>(j, w, o, act, r, lane);
    if (r + 2 <= j.row_end) {
      run_tile<WT, kVec, 2>(j, w, o, act, r, lane);
      r += 2;
    }
  }
  for (; r < j.row_end; ++r) run_tile<WT, kVec, 1>(j, w, o, act, r, lane);
}

template <WType WT>
__device__ __forceinline__ const void* row_ptr(const void* base, int64_t row, int k) {
  return static_cast<const char*>(base) + row * int64_t(k) * Traits<WT>::kBytes;
}

// The warp's two weight rows: fused = (gate row col, up row col); plain = (col, col + 1), the
// second clamped to the last row (its result is then dropped).
template <WType WT, bool kFused>
__device__ __forceinline__ WarpRows warp_rows(const Mat& m0, const Mat& m1, int col, int n, int k) {
  const int c1 = kFused ? col : min(col + 1, n - 1);
  const Mat& b = kFused ? m1 : m0;
  WarpRows w;
  w.r0 = row_ptr<WT>(m0.w, col, k);
  w.r1 = row_ptr<WT>(b.w, c1, k);
  w.s0 = w.s1 = nullptr;
  if constexpr (WT == WType::kFP8) {
    w.s0 = m0.s + int64_t(col) * (k / 32);
    w.s1 = b.s + int64_t(c1) * (k / 32);
  }
  return w;
}

// ---------------------------------------------------------------------------------------------
// Direct problem: rows [0, rows) of x (row stride ldx), one weight set. grid = (row groups of
// kRowsPerItem, column tiles, K splits). With `partial`, split z writes its partial sums to
// partial[z][row][pw] (plain: column c; fused: gate at c, up at n + c) for splitk_reduce.
struct DirectArgs {
  const float* x;
  int64_t ldx;
  float* y;
  int64_t ldy;
  Mat m0, m1;
  int n, k, rows, kseg;
  float* partial;
  Act act;
};

template <WType WT, bool kFused, bool kVec>
__global__ void __launch_bounds__(kThreads, 2) rowdot_direct_kernel(const DirectArgs a) {
  const int warp = int(threadIdx.x) >> 5, lane = int(threadIdx.x) & 31;
  const int col = (int(blockIdx.y) * kWarps + warp) * (kFused ? 1 : 2);
  if (col >= a.n) return;  // whole warp
  WarpJob j;
  j.x = a.x;
  j.gather = nullptr;
  j.ldx = a.ldx;
  j.row_begin = int(blockIdx.x) * kRowsPerItem;
  j.row_end = min(a.rows, j.row_begin + kRowsPerItem);
  j.k0 = int(blockIdx.z) * a.kseg;
  j.k1 = min(a.k, j.k0 + a.kseg);
  const WarpRows w = warp_rows<WT, kFused>(a.m0, a.m1, col, a.n, a.k);
  WarpOut o;
  if (a.partial) {
    const int pw = kFused ? 2 * a.n : a.n;
    float* base = a.partial + int64_t(blockIdx.z) * a.rows * pw;
    o.out0 = base + col;
    o.out1 = kFused ? base + a.n + col : (col + 1 < a.n ? base + col + 1 : nullptr);
    o.ld = pw;
    o.swiglu = false;
  } else {
    o.out0 = a.y + col;
    o.out1 = !kFused && col + 1 < a.n ? a.y + col + 1 : nullptr;
    o.ld = a.ldy;
    o.swiglu = kFused;
  }
  run_warp<WT, kVec>(j, w, o, a.act, lane);
}

// ---------------------------------------------------------------------------------------------
// Grouped problem (MoE): work items (expert, row_begin, row_end) built on the device; per
// expert weights, out features n and in features k passed by value (kernel parameters may
// reach 32 KB since CUDA 12.1, so no device pointer table and no host->device copy).
// grid = (item bound, column tiles); CTAs past *num_items or past their expert's n return.
struct GroupTable {
  Mat m0[kMaxExperts];
  Mat m1[kMaxExperts];
  int n[kMaxExperts];
  int k[kMaxExperts];
};

struct GroupArgs {
  const float* x;
  const int32_t* gather;
  int64_t ldx;
  float* y;
  int64_t ldy;
  const int4* items;
  const int* num_items;
  Act act;
  GroupTable t;
};

template <WType WT, bool kFused, bool kVec>
__global__ void __launch_bounds__(kThreads, 2) rowdot_grouped_kernel(const __grid_constant__ GroupArgs a) {
  if (int(blockIdx.x) >= __ldg(a.num_items)) return;
  const int4 item = a.items[blockIdx.x];
  const int e = item.x;
  const int n = a.t.n[e], k = a.t.k[e];
  const int warp = int(threadIdx.x) >> 5, lane = int(threadIdx.x) & 31;
  const int col = (int(blockIdx.y) * kWarps + warp) * (kFused ? 1 : 2);
  if (col >= n) return;  // whole warp
  WarpJob j;
  j.x = a.x;
  j.gather = a.gather;
  j.ldx = a.ldx;
  j.row_begin = item.y;
  j.row_end = item.z;
  j.k0 = 0;
  j.k1 = k;
  const WarpRows w = warp_rows<WT, kFused>(a.t.m0[e], a.t.m1[e], col, n, k);
  WarpOut o;
  o.out0 = a.y + col;
  o.out1 = !kFused && col + 1 < n ? a.y + col + 1 : nullptr;
  o.ld = a.ldy;
  o.swiglu = kFused;
  run_warp<WT, kVec>(j, w, o, a.act, lane);
}

}  // namespace rowdot

// ---------------------------------------------------------------------------------------------
// Host side (gemm.cu / moe.cu).

// "" when `w` is a device weight the row-dot kernels read: F32, BF16, or F8E4M3 with a U8
// scale [out, in / 32] and in % 32 == 0.
inline std::string rowdot_weight_problem(const ops::LinearWeight& w) {
  if (!w.data.data || w.data.shape.rank() != 2) return "weight must be a non-empty 2-D device tensor";
  if (w.data.dtype == DType::kF32 || w.data.dtype == DType::kBF16) return "";
  if (w.data.dtype != DType::kF8E4M3) {
    return "weight dtype must be F32, BF16 or F8E4M3 (MXFP8), got " + std::string(dtype_name(w.data.dtype));
  }
  if (w.in_features() % 32 != 0) return "MXFP8 weight needs in_features % 32 == 0";
  if (!w.scale.data || w.scale.dtype != DType::kU8 || w.scale.shape.rank() != 2 ||
      w.scale.shape[0] != w.out_features() || w.scale.shape[1] != w.in_features() / 32) {
    return "MXFP8 weight needs a U8 e8m0 scale [out, in / 32]";
  }
  if (!w.scale_max_fits()) return "MXFP8 weight's scale_max must be U8 [out]";
  return "";
}

inline rowdot::WType rowdot_wtype(DType dt) {
  return dt == DType::kF32 ? rowdot::WType::kF32 : dt == DType::kBF16 ? rowdot::WType::kBF16 : rowdot::WType::kFP8;
}

inline rowdot::Act rowdot_act(const ops::SwigluParams& p) { return rowdot::Act{p.alpha, p.limit, p.beta}; }

// Batch-invariant y[r, :] = x[r, :] W^T for r < m (row strides ldx, ldy; F32 x and y), any
// weight rowdot_weight_problem accepts. On current_stream(); no host synchronisation.
void rowdot_linear(const float* x, int64_t ldx, int64_t m, const ops::LinearWeight& w, float* y, int64_t ldy);
// Batch-invariant h[r, c] = swiglu_oai(x[r] . gate[c], x[r] . up[c]); gate and up of one dtype and shape.
void rowdot_swiglu(const float* x, int64_t ldx, int64_t m, const ops::LinearWeight& gate, const ops::LinearWeight& up,
                   const ops::SwigluParams& act, float* h, int64_t ldh);

// moe_router and moe_experts entries (moe.cu); called by register_gemm.
void register_moe(ops::KernelTable& table);

}  // namespace m3::cuda
