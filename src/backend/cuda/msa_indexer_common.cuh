#pragma once
// Pieces shared by the two MSA indexer kernels (msa_indexer.cu: prefill tiles;
// msa_indexer_decode.cu: decode and speculative verification): the index-key traits, the
// reference's exact dot, sigma, the warp top-k selection, the launch arguments, and the
// selection that the last CTA of a query group runs.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <climits>
#include <cstdint>

#include "backend/cuda/mma_operands.cuh"
#include "backend/cuda/msa_common.cuh"
#include "backend/cuda/msa_timeline.cuh"

namespace m3::cuda::msa_index {

// Two e4m3 of the low / high half of a word (low byte first) -> f16x2, exact (every e4m3 value
// is an f16 normal); the half is the conversion's operand selector, no shift.
using mma_ops::e4m3x2_hi_f16x2;
using mma_ops::e4m3x2_lo_f16x2;

using msa::cp_async16;
using msa::cp_async_commit;
using msa::cp_async_wait;
using msa::kKeyMinusInf;
using msa::order_key;
using msa::smem_u32;

constexpr int kDim = 128;    // index head dim
constexpr int kMaxTopK = 64;
constexpr int kMinBs = 8;    // a block covers whole 8-key n-tiles

template <class IK> struct IkTraits;
template <> struct IkTraits<__nv_bfloat16> {
  static constexpr int kRowBytes = 256;
  static constexpr int kPerChunk = 8;  // elements per 16-byte chunk
  static constexpr int kSigmaExp = 32;  // max |q sigma| in [2^32, 2^33)
  static constexpr float kErr = 0.0078125f;  // 2^-7
  static constexpr float kZeroTerm = 7.52316385e-37f;  // 2^-120: elements below 2^-126 zeroed
  // Elements of one chunk in order (exact conversion).
  static __device__ __forceinline__ void unpack(const uint4& r, float (&f)[8]) {
    const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[2 * i] = __uint_as_float(w[i] << 16);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  }
  // A operand pair (element 0 low); magnitudes below bf16's normal range are zeroed.
  static __device__ __forceinline__ uint32_t pack(float x, float y) {
    if (!(fabsf(x) >= 1.17549435e-38f)) x = fabsf(x) >= 0.0f ? 0.0f : x;  // keeps NaN
    if (!(fabsf(y) >= 1.17549435e-38f)) y = fabsf(y) >= 0.0f ? 0.0f : y;
    return msa::bf16x2_bits(__floats2bfloat162_rn(x, y));
  }
  static __device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    msa::mma_bf16(c, a, b0, b1);
  }
};
template <> struct IkTraits<__nv_fp8_e4m3> {
  static constexpr int kRowBytes = 128;
  static constexpr int kPerChunk = 16;
  static constexpr int kSigmaExp = 14;  // max |q sigma| in [2^14, 2^15): f16 range
  static constexpr float kErr = 0.0009765625f;  // 2^-10
  static constexpr float kZeroTerm = 0.0009765625f;  // elements below 2^-14 zeroed: 2^-14 sqrt(128) < 2^-10
  static __device__ __forceinline__ void unpack(const uint4& r, float (&f)[16]) {
    const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t lo = e4m3x2_lo_f16x2(w[i]), hi = e4m3x2_hi_f16x2(w[i]);
      const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&lo));
      const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&hi));
      f[4 * i] = a.x;
      f[4 * i + 1] = a.y;
      f[4 * i + 2] = b.x;
      f[4 * i + 3] = b.y;
    }
  }
  static __device__ __forceinline__ uint32_t pack(float x, float y) {
    if (!(fabsf(x) >= 6.10351562e-05f)) x = fabsf(x) >= 0.0f ? 0.0f : x;
    if (!(fabsf(y) >= 6.10351562e-05f)) y = fabsf(y) >= 0.0f ? 0.0f : y;
    const __half2 h = __floats2half2_rn(x, y);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
  static __device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    msa::mma_f16(c, a, b0, b1);
  }
};

// FP8 keys as the prefill indexer computes with them: converted to f16 in shared memory (exact:
// every e4m3 value is an f16 normal or zero), in the BF16 keys' stage layout, so that the
// approximate dots run on f16 wgmma; Q sigma rounded to f16 as for FP8 keys, hence their bound.
template <> struct IkTraits<__half> {
  static constexpr int kRowBytes = 256;
  static constexpr int kPerChunk = 8;
  static constexpr int kSigmaExp = IkTraits<__nv_fp8_e4m3>::kSigmaExp;
  static constexpr float kErr = IkTraits<__nv_fp8_e4m3>::kErr;
  static constexpr float kZeroTerm = IkTraits<__nv_fp8_e4m3>::kZeroTerm;
  static __device__ __forceinline__ void unpack(const uint4& r, float (&f)[8]) {
    const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 v = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
      f[2 * i] = v.x;
      f[2 * i + 1] = v.y;
    }
  }
  static __device__ __forceinline__ uint32_t pack(float x, float y) { return IkTraits<__nv_fp8_e4m3>::pack(x, y); }
  static __device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    msa::mma_f16(c, a, b0, b1);
  }
};

struct IndexerArgs {
  const float* q;       // [tokens, heads, 128]
  const void* keys;     // [slots, 128] BF16 or FP8
  int32_t* selected;    // [heads, tokens, top_k]
  uint32_t* scores;     // scratch [tokens of the slice (+ a group), heads, max_blocks]: order keys
  const int32_t* query_start;
  const int32_t* positions;
  const int32_t* block_tables;
  unsigned* counters;
  // Decode kernel: per query group (indexed like counters) the next unit of its blocks a warp
  // may take, used where a warp's fixed share would be at least dyn_min_units units. Null: each
  // warp streams a fixed share of its CTA's chunk.
  unsigned* unit_counters;
  int dyn_min_units;
  int num_seqs, num_tokens, max_blocks, bs, bs_shift, heads, top_k, group_tokens, chunks, tok_begin, tok_end;
  int defer;  // exact dots listed and run in batches (key ids < 2^24, rows < 256)
  // Decode kernel: a CTA whose chunk holds at most this many (row, block) pairs scans them with
  // exact dots (msa_indexer_exact.cuh) instead of the approximate MMA pass.
  int exact_max;
  // Decode kernel: a query group whose rows take all their blocks lets the dependent launch
  // start before selecting (kEarlyUnitsMaxSeqs in msa.h).
  int early_dependents;
};

// Byte offset of 16-byte chunk ch within key `key`'s row of a swizzled shared-memory stage:
// chunk ch ^ (key & 7) of the row (kHalfStride 0), or the key as two 128-byte halves, chunks 0-7
// then 8-15 kHalfStride bytes on, each swizzled like a 128-byte row (the wgmma B layout).
template <int kHalfStride>
__device__ __forceinline__ int stage_chunk_off(int key, int ch) {
  if constexpr (kHalfStride > 0) return (ch >> 3) * kHalfStride + (((ch & 7) ^ (key & 7)) << 4);
  else return (ch ^ (key & 7)) << 4;
}

// The reference's dot of one query row (fp32, global) with one key row: a sequential fp32 sum
// over d of separately rounded products (no FMA contraction, no reassociation). The row is a
// swizzled shared-memory stage row (kGlobal false) or the cache's row in global memory.
// kQShared: q is a shared-memory row (plain loads instead of the read-only global path).
// kHalfStride: the stage's layout, as in stage_chunk_off.
template <class IK, bool kGlobal = false, bool kQShared = false, int kHalfStride = 0>
__device__ __forceinline__ float exact_dot(const float* q, const unsigned char* row, int key) {
  using Tr = IkTraits<IK>;
  constexpr int kE = Tr::kPerChunk, kChunks = kDim / kE;
  auto step = [&](float s, const uint4& raw, int ch) {
    float kf[kE];
    Tr::unpack(raw, kf);
#pragma unroll
    for (int e = 0; e < kE; e += 4) {
      const float4* qp = reinterpret_cast<const float4*>(q + ch * kE + e);
      const float4 x = kQShared ? *qp : __ldg(qp);
      s = __fadd_rn(s, __fmul_rn(x.x, kf[e]));
      s = __fadd_rn(s, __fmul_rn(x.y, kf[e + 1]));
      s = __fadd_rn(s, __fmul_rn(x.z, kf[e + 2]));
      s = __fadd_rn(s, __fmul_rn(x.w, kf[e + 3]));
    }
    return s;
  };
  float s = 0.0f;
  if constexpr (kGlobal) {  // every chunk requested before the chain starts: one L2 round trip
    uint4 raw[kChunks];
#pragma unroll
    for (int ch = 0; ch < kChunks; ++ch) raw[ch] = __ldg(reinterpret_cast<const uint4*>(row) + ch);
#pragma unroll
    for (int ch = 0; ch < kChunks; ++ch) s = step(s, raw[ch], ch);
  } else {
#pragma unroll 4
    for (int ch = 0; ch < kChunks; ++ch) {
      s = step(s, *reinterpret_cast<const uint4*>(row + stage_chunk_off<kHalfStride>(key, ch)), ch);
    }
  }
  return s;
}

// exact_dot for kR query rows at once (shared-memory rows q[r]) against one swizzled
// shared-memory key row: each row's chain is the reference's, the key's chunks are read and
// converted once for all rows.
template <class IK, int kR>
__device__ __forceinline__ void exact_dots(const float* const (&q)[kR], const unsigned char* row, int key,
                                           float (&s)[kR]) {
  using Tr = IkTraits<IK>;
  constexpr int kE = Tr::kPerChunk, kChunks = kDim / kE;
#pragma unroll
  for (int r = 0; r < kR; ++r) s[r] = 0.0f;
#pragma unroll 4
  for (int ch = 0; ch < kChunks; ++ch) {
    float kf[kE];
    Tr::unpack(*reinterpret_cast<const uint4*>(row + stage_chunk_off<0>(key, ch)), kf);
#pragma unroll
    for (int e = 0; e < kE; e += 4) {
#pragma unroll
      for (int r = 0; r < kR; ++r) {
        const float4 x = *reinterpret_cast<const float4*>(q[r] + ch * kE + e);
        s[r] = __fadd_rn(s[r], __fmul_rn(x.x, kf[e]));
        s[r] = __fadd_rn(s[r], __fmul_rn(x.y, kf[e + 1]));
        s[r] = __fadd_rn(s[r], __fmul_rn(x.z, kf[e + 2]));
        s[r] = __fadd_rn(s[r], __fmul_rn(x.w, kf[e + 3]));
      }
    }
  }
}

// Power of two sigma putting max |q| in [2^e, 2^(e+1)) (clamped to the normal range).
__device__ __forceinline__ float sigma_for(float mx, int e) {
  if (!(mx > 0.0f) || !(mx <= 3.402823466e38f)) return 1.0f;
  const int ex = int((__float_as_uint(mx) >> 23) & 0xffu) - 127;  // subnormal: -127
  const int k = min(127, max(-126, e - ex));
  return __uint_as_float(uint32_t(k + 127) << 23);
}

// sigma of a query row held by a warp (lane l: elements 4l..4l+3), for exponent e.
__device__ __forceinline__ float warp_row_sigma(const float4& v, int e) {
  float mx = fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  return sigma_for(mx, e);
}

// A query row held by a warp (lane l: elements 4l..4l+3): sigma and |q sigma| rounded up (an
// upper bound of the scaled row's norm).
template <class IK>
__device__ __forceinline__ void warp_row_scale(const float4& v, float& sig, float& nq) {
  sig = warp_row_sigma(v, IkTraits<IK>::kSigmaExp);
  const float x0 = v.x * sig, x1 = v.y * sig, x2 = v.z * sig, x3 = v.w * sig;
  float ss = x0 * x0 + x1 * x1 + x2 * x2 + x3 * x3;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
  nq = __fmul_ru(sqrtf(ss), 1.001f);
}

// A fragments (m16n8k16, rows g and g + 8 of an m-tile: qa, qb scaled by sa, sb) of Q sigma in
// the key layout's k order: 2-byte keys (bf16, or f16 converted in shared memory), dims (16 ks +
// 2 c, +1) and (+8, +9); FP8 keys converted per fragment, dims 16 ks + 4 c + 0..3.
template <class IK>
__device__ __forceinline__ void q_frags(const float* qa, const float* qb, float sa, float sb, int cq,
                                        uint32_t (&af)[8][4]) {
  using Tr = IkTraits<IK>;
#pragma unroll
  for (int ks = 0; ks < 8; ++ks) {
    const int d0 = sizeof(IK) == 2 ? 16 * ks + 2 * cq : 16 * ks + 4 * cq;
    const int d1 = sizeof(IK) == 2 ? d0 + 8 : d0 + 2;
    const float2 x0 = *reinterpret_cast<const float2*>(qa + d0), x1 = *reinterpret_cast<const float2*>(qa + d1);
    const float2 y0 = *reinterpret_cast<const float2*>(qb + d0), y1 = *reinterpret_cast<const float2*>(qb + d1);
    af[ks][0] = Tr::pack(x0.x * sa, x0.y * sa);
    af[ks][1] = Tr::pack(y0.x * sb, y0.y * sb);
    af[ks][2] = Tr::pack(x1.x * sa, x1.y * sa);
    af[ks][3] = Tr::pack(y1.x * sb, y1.y * sb);
  }
}

// Ranks of a warp's first m <= 64 values, two per lane (lane l: positions l and l + 32, values
// xa and xb), by (value desc, position asc): one shuffle per value. kUnroll: the loop's unroll
// (4 for a list of m, 8 for the threshold's 64: the code measured in the ninth round).
template <int kUnroll>
__device__ __forceinline__ void pair_ranks(uint32_t xa, uint32_t xb, int m, int& ra, int& rb) {
  const int lane = threadIdx.x & 31;
  ra = rb = 0;
#pragma unroll kUnroll
  for (int j = 0; j < m; ++j) {
    const uint32_t o = __shfl_sync(0xffffffffu, j < 32 ? xa : xb, j & 31);
    ra += (o > xa || (o == xa && j < lane)) ? 1 : 0;
    rb += (o > xb || (o == xb && j < lane + 32)) ? 1 : 0;
  }
}

// The k best of m <= 64 keys (k <= m) by (key desc, id asc), as ascending ids into dst[0, k):
// lane l holds keys l and l + 32 of a list in id order (xa, xb; ids ia, ib).
__device__ __forceinline__ void rank_select64(uint32_t xa, uint32_t xb, int32_t ia, int32_t ib, int m, int k,
                                              int32_t* dst) {
  const int lane = threadIdx.x & 31;
  const unsigned lt = (1u << lane) - 1u;
  int ra, rb;
  pair_ranks<4>(xa, xb, m, ra, rb);
  const bool ta = lane < m && ra < k, tb = lane + 32 < m && rb < k;
  const unsigned ba = __ballot_sync(0xffffffffu, ta), bb = __ballot_sync(0xffffffffu, tb);
  if (ta) dst[__popc(ba & lt)] = ia;
  if (tb) dst[__popc(ba) + __popc(bb & lt)] = ib;
  __syncwarp();
}

// The k best of keys[0, n) by (key desc, id asc) when few keys can be among them, as ascending
// ids into dst[0, k); false (nothing written) when more than 64 can. t1 >= t2 are the lane's
// two largest keys over ids lane, lane + 32, ... (0 where it has none; every key is > 0).
// Threshold: the k-th largest of these 64. At least k keys reach it (the k largest of the 64
// are different keys), so the k best all do; the keys that reach it (a little over k for
// scores of one distribution; twice as many when every score is repeated in a lane) are listed
// in id order into hist[0, 64) (keys) and hist[64, 128) (ids) and ranked against each other.
// (The radix passes below cost one serialized shared atomic per key in their first, crowded
// digits: the whole selection of 1023 blocks took 27 us with them, 6-7 us with this.)
template <class KeyAt>
__device__ __forceinline__ bool warp_select_few(KeyAt key_at, int n, int k, uint32_t t1, uint32_t t2, unsigned* hist,
                                                int32_t* dst) {
  const int lane = threadIdx.x & 31;
  const unsigned lt = (1u << lane) - 1u;
  int r1, r2;  // ranks among the 64
  pair_ranks<8>(t1, t2, 64, r1, r2);
  const unsigned w1 = __ballot_sync(0xffffffffu, r1 == k - 1), w2 = __ballot_sync(0xffffffffu, r2 == k - 1);
  const uint32_t thr = w1 ? __shfl_sync(0xffffffffu, t1, __ffs(w1) - 1) : __shfl_sync(0xffffffffu, t2, __ffs(w2) - 1);
  M3_TL_MARK(indexer, blockIdx.x == 0 ? int(blockIdx.y) : -1, 9);
  int m = 0;  // listed so far (warp-uniform)
  constexpr int kBatch = 8;  // keys per lane requested together (one round trip when not cached)
  for (int b0 = 0; b0 < n && m <= 64; b0 += 32 * kBatch) {
    uint32_t x[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int b = b0 + 32 * j + lane;
      x[j] = b < n ? key_at(b) : 0u;
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int b = b0 + 32 * j + lane;
      const bool c = b < n && x[j] >= thr;
      const unsigned bal = __ballot_sync(0xffffffffu, c);
      const int pos = m + __popc(bal & lt);
      if (c && pos < 64) {
        hist[pos] = x[j];
        hist[64 + pos] = unsigned(b);
      }
      m += __popc(bal);
    }
  }
  __syncwarp();
  M3_TL_MARK(indexer, blockIdx.x == 0 ? int(blockIdx.y) : -1, 10);
  if (m > 64) return false;
  rank_select64(lane < m ? hist[lane] : 0u, lane + 32 < m ? hist[lane + 32] : 0u, int32_t(hist[64 + lane]),
                int32_t(hist[96 + lane]), m, k, dst);
  M3_TL_MARK(indexer, blockIdx.x == 0 ? int(blockIdx.y) : -1, 11);
  return true;
}

// Exact top-k of one warp: the k best of keys[0, n) by (score desc, id asc), as ascending ids
// into dst[0, k) (k <= 64). Up to 64 keys are ranked directly; with few keys near the top,
// warp_select_few; otherwise a radix select on the 32-bit keys (four 8-bit digit passes) finds
// the k-th key T; all keys above T are taken, and the lowest ids among those equal to T.
inline __device__ void warp_select(const uint32_t* keys, int n, int k, uint32_t* cache, int cap, unsigned* hist,
                            int32_t* dst) {
  const int lane = threadIdx.x & 31;
  if (n <= 64) {  // every key ranked directly
    const uint32_t xa = lane < n ? __ldcg(keys + lane) : 0u, xb = lane + 32 < n ? __ldcg(keys + lane + 32) : 0u;
    rank_select64(xa, xb, lane, lane + 32, n, k, dst);
    M3_TL_MARK(indexer, blockIdx.x == 0 ? int(blockIdx.y) : -1, 11);
    return;
  }
  const bool cached = n <= cap;
  uint32_t t1 = 0, t2 = 0;  // the lane's two largest keys
  constexpr int kBatch = 16;  // keys per lane requested together
  for (int b0 = 0; b0 < n; b0 += 32 * kBatch) {
    uint32_t x[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int b = b0 + 32 * j + lane;
      x[j] = b < n ? __ldcg(keys + b) : 0u;
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int b = b0 + 32 * j + lane;
      t2 = max(t2, min(t1, x[j]));
      t1 = max(t1, x[j]);
      if (cached && b < n) cache[b] = x[j];
    }
  }
  __syncwarp();
  M3_TL_MARK(indexer, blockIdx.x == 0 ? int(blockIdx.y) : -1, 8);
  // The listing reads a row's keys from one place: the choice is made once, not per key (a
  // per-key choice compiled to a branch and a reconvergence point around every load).
  const bool few = cached ? warp_select_few([&](int i) { return cache[i]; }, n, k, t1, t2, hist, dst)
                          : warp_select_few([&](int i) { return __ldcg(keys + i); }, n, k, t1, t2, hist, dst);
  if (few) return;
  auto key_at = [&](int i) { return cached ? cache[i] : __ldcg(keys + i); };
  uint32_t prefix = 0, mask = 0;
  int need = k;
#pragma unroll 1
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = lane; b < 256; b += 32) hist[b] = 0;
    __syncwarp();
    for (int i = lane; i < n; i += 32) {
      const uint32_t x = key_at(i);
      if ((x & mask) == prefix) atomicAdd(&hist[(x >> shift) & 255u], 1u);
    }
    __syncwarp();
    // Lane l owns bins 255 - 8l - j (j = 0..7): descending digits across lanes.
    int cnt[8], sum = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      cnt[j] = int(hist[255 - 8 * lane - j]);
      sum += cnt[j];
    }
    const int incl = msa::warp_inclusive_scan(sum), excl = incl - sum;
    const bool mine = excl < need && need <= incl;
    const unsigned who = __ballot_sync(0xffffffffu, mine);
    int digit = 0, above = 0;
    if (mine) {
      int acc = excl;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        if (acc + cnt[j] >= need) {
          digit = 255 - 8 * lane - j;
          above = acc;
          break;
        }
        acc += cnt[j];
      }
    }
    const int src = __ffs(who) - 1;
    digit = __shfl_sync(0xffffffffu, digit, src);
    above = __shfl_sync(0xffffffffu, above, src);
    need -= above;
    prefix |= uint32_t(digit) << shift;
    mask |= 255u << shift;
    __syncwarp();
  }
  // Gather in id order: lane l scans ids [l * per, (l + 1) * per).
  const uint32_t thr = prefix;
  const int per = (n + 31) / 32, lo = min(n, lane * per), hi = min(n, lo + per);
  int gt = 0, eq = 0;
  for (int i = lo; i < hi; ++i) {
    const uint32_t x = key_at(i);
    gt += x > thr ? 1 : 0;
    eq += x == thr ? 1 : 0;
  }
  const int eq_excl = msa::warp_inclusive_scan(eq) - eq;
  const int take_eq = max(0, min(eq, need - eq_excl));
  const int cnt = gt + take_eq;
  int pos = msa::warp_inclusive_scan(cnt) - cnt;
  int taken_eq = 0;
  for (int i = lo; i < hi; ++i) {
    const uint32_t x = key_at(i);
    bool take = x > thr;
    if (x == thr && taken_eq < take_eq) {
      take = true;
      ++taken_eq;
    }
    if (take) dst[pos++] = i;
  }
  __syncwarp();
}

// What a CTA of query group (t0, T tokens at positions s_pos) scans: nb = the blocks to score
// (those before the local block of any token with more than top_k), this chunk's [b0, b1).
struct GroupScan {
  int nb, b0, b1;
};
__device__ __forceinline__ GroupScan group_scan(const IndexerArgs& a, int T, const int* s_pos) {
  int nb = 0;
  for (int tt = 0; tt < T; ++tt) {
    const int local = s_pos[tt] >> a.bs_shift;
    if (local + 1 > a.top_k) nb = max(nb, local);
  }
  const int c = int(blockIdx.y);
  return {nb, int(int64_t(c) * nb / a.chunks), int(int64_t(c + 1) * nb / a.chunks)};
}
// Index-q row r (= token * heads + head) of the group starting at token t0.
__device__ __forceinline__ const float* group_q_row(const IndexerArgs& a, int t0, int r) {
  return a.q + (int64_t(t0 + r / a.heads) * a.heads + r % a.heads) * kDim;
}

// Row p of a group whose context has at most top_k blocks takes them all: ids 0..local, then -1
// (one warp).
__device__ __forceinline__ void write_all_blocks(const IndexerArgs& a, int t0, int p, int local) {
  int32_t* dst = a.selected + (int64_t(p % a.heads) * a.num_tokens + t0 + p / a.heads) * a.top_k;
  for (int i = threadIdx.x & 31; i < a.top_k; i += 32) dst[i] = i <= local ? i : -1;
}

// The last CTA of a query group: one warp per (token, head) row selects the top_k - 1 best
// earlier blocks from the group's block scores (rows whose context has at most top_k blocks
// take them all) and writes ascending ids, then the local block. `cache` is the warp's
// `cap` words of scratch, `hist` its 256.
inline __device__ void select_group(const IndexerArgs& a, int t0, int P, const int* s_pos, uint32_t* cache, int cap,
                                    unsigned* hist) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  const int H = a.heads, top_k = a.top_k, k = top_k - 1;
  for (int p = warp; p < P; p += warps) {
    const int local = s_pos[p / H] >> a.bs_shift;
    const int t = t0 + p / H, h = p % H;
    int32_t* dst = a.selected + (int64_t(h) * a.num_tokens + t) * top_k;
    if (local + 1 <= top_k) {
      write_all_blocks(a, t0, p, local);
      continue;
    }
    if (k > 0) warp_select(a.scores + (int64_t(t - a.tok_begin) * H + h) * a.max_blocks, local, k, cache, cap, hist, dst);
    if (lane == 0) dst[k] = local;  // the local block has the highest id
  }
}

// The decode layout's kernel (msa_indexer_decode.cu), for a slice [a.tok_begin, a.tok_end):
// at most rows_max (token, head) rows per query group (<= 16), one or two CTAs per SM (decode_ctas_per_sm).
// `dependent`: launched as the previous kernel's programmatic dependent, with its page ids and
// first key tiles requested before its wait (pure decode only: MsaIndexerPlan::keys_before_wait).
void launch_indexer_decode(const IndexerArgs& a, bool fp8, int rows_max, bool dependent);
// Whether it takes the shape: block size 16..128 (a 16-key tile lies in one block), contexts
// below 2^24 keys (candidate key ids are 24 bits).
bool decode_kernel_takes(int bs, int max_blocks);
// CTAs of the warp-streamed kernel resident per SM for this key type and group width.
int decode_ctas_per_sm(bool fp8, int rows_max);

// The prefill kernel (msa_indexer_prefill.cu): 256-row groups, a warp per 16 rows and whole
// 128-key blocks, for prefills with blocks of 128 keys and at most 16 index heads.
bool prefill_kernel_takes(int bs, int heads);
int prefill_group_tokens(int heads);
// key_slots: rows of the index-key cache (BF16 keys arrive by TMA, whose tensor map spans them).
void launch_indexer_prefill(const IndexerArgs& a, bool fp8, int64_t key_slots);

}  // namespace m3::cuda::msa_index
