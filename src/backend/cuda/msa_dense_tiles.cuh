#pragma once
// The tiling both dense prefill kernels share (msa_dense_prefill.cu, canonical; msa_dense_fa.cu,
// fast): a CTA owns 128 rows of one (sequence, KV group), the group's G query heads of 128 / G
// consecutive tokens, and reads the 128-key K/V units of their causal prefix. Kept C++17 (.cu only).
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "backend/cuda/cuda_internal.h"
#include "backend/cuda/msa.h"
#include "backend/cuda/msa_common.cuh"
#include "backend/cuda/tensor_map.h"

namespace m3::cuda::msa {

constexpr int kDenseRows = 128;  // (token, head) rows of a CTA

// Byte offset of 16-byte chunk ch (0..15) of row r in a [dim half][row][128 B] tile of `rows` rows
// with the 128-byte swizzle (chunk c of row r at c ^ (r & 7)): the Q, K and V tiles' layout.
__device__ __forceinline__ uint32_t sw128_off(int r, int ch, int rows) {
  return uint32_t((ch >> 3) * rows * 128 + r * 128 + (((ch & 7) ^ (r & 7)) << 4));
}

struct DenseArgs {
  const float* q;  // [tokens, q_heads, 128]
  float* out;      // [tokens, q_heads, 128]
  const __nv_bfloat16* k;  // [slots, kv_heads, 128]
  const __nv_bfloat16* v;
  const int32_t* query_start;
  const int32_t* positions;
  const int32_t* block_tables;
  int num_seqs, max_blocks, bs_shift, q_heads, kv_heads, group, tile_tokens;
  float scale_log2;
};

// Whether a dense prefill kernel runs this call: not for zero tokens, and shapes they do not take
// (msa_dense_prefill_refusal) are launched on the query-major kernel here.
inline bool dense_prefill_takes(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                                const ops::AttentionMetadata& meta, const TensorView& out) {
  if (q.shape[0] == 0) return false;
  if (msa_dense_prefill_refusal(msa_attn_shape(q, k_cache, v_cache, meta, {}, 0)).empty()) return true;
  launch_msa_attention(q, k_cache, v_cache, meta, {}, 0, out);
  return false;
}

// The launch's arguments; the shape already passed msa_dense_prefill_refusal.
inline DenseArgs dense_args(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                            const ops::AttentionMetadata& meta, const TensorView& out) {
  DenseArgs a{};
  a.q = q.as<const float>();
  a.out = out.as<float>();
  a.k = k_cache.as<const __nv_bfloat16>();
  a.v = v_cache.as<const __nv_bfloat16>();
  a.query_start = meta.query_start;
  a.positions = meta.positions;
  a.block_tables = meta.block_tables;
  a.num_seqs = meta.num_seqs;
  a.max_blocks = std::max(1, meta.max_blocks_per_seq);
  a.bs_shift = 0;
  while ((1 << a.bs_shift) < meta.block_size) ++a.bs_shift;
  a.q_heads = int(q.shape[1]);
  a.kv_heads = int(k_cache.shape[1]);
  a.group = a.q_heads / a.kv_heads;
  a.tile_tokens = kDenseRows / a.group;
  a.scale_log2 = float(1.4426950408889634 / std::sqrt(double(kHeadDim)));
  return a;
}

// The kernels' parameter: the tiling arguments and, for pages of >= 128 keys, the K and V caches
// as TMA tensors ([slots][kv_heads][128] bf16 as (dims, head, slot), boxes of 64 dims x 1 head x
// 128 keys, 128-byte swizzled: the tiles' layout), for the units that lie whole in the causal prefix.
struct DenseTmaArgs {
  CUtensorMap map_k, map_v;
  DenseArgs d;
};

inline DenseTmaArgs dense_tma_args(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                                   const ops::AttentionMetadata& meta, const TensorView& out) {
  DenseTmaArgs t{};
  t.d = dense_args(q, k_cache, v_cache, meta, out);
  if (meta.block_size >= kUnitKeys) {
    t.map_k = bf16_map_3d(k_cache.data, kHeadDim, uint64_t(k_cache.shape[1]), uint64_t(k_cache.shape[0]), 64, kUnitKeys);
    t.map_v = bf16_map_3d(v_cache.data, kHeadDim, uint64_t(v_cache.shape[1]), uint64_t(v_cache.shape[0]), 64, kUnitKeys);
  }
  return t;
}

// CTAs to launch: tiles at most (every sequence's last run may be partial) x KV groups.
inline unsigned dense_ctas(const DenseArgs& a, int64_t tokens) {
  return unsigned(((tokens + a.tile_tokens - 1) / a.tile_tokens + a.num_seqs) * a.kv_heads);
}

// The CTA's tile: tiles are the sequences' runs of tile_tokens tokens, numbered from the end
// (the longest causal prefixes first); x = the tile number in that order. Warp 0 counts the
// tiles of 32 sequences per step and writes tile = (sequence, first token, tokens).
__device__ __forceinline__ bool find_dense_tile(const DenseArgs& a, int x, int* tile) {
  const int lane = threadIdx.x & 31;
  int total = 0;
  for (int s0 = 0; s0 < a.num_seqs; s0 += 32) {
    const int s = s0 + lane;
    const int n = s < a.num_seqs ? (a.query_start[s + 1] - a.query_start[s] + a.tile_tokens - 1) / a.tile_tokens : 0;
    total += __reduce_add_sync(0xffffffffu, n);
  }
  if (x >= total) return false;
  const int want = total - 1 - x;  // tile index in sequence order
  int before = 0;
  for (int s0 = 0; s0 < a.num_seqs; s0 += 32) {
    const int s = s0 + lane;
    const int n = s < a.num_seqs ? (a.query_start[s + 1] - a.query_start[s] + a.tile_tokens - 1) / a.tile_tokens : 0;
    const int incl = warp_inclusive_scan(n);
    const bool mine = s < a.num_seqs && before + incl - n <= want && want < before + incl;
    if (__ballot_sync(0xffffffffu, mine) != 0) {
      if (mine) {
        const int q0 = a.query_start[s] + (want - (before + incl - n)) * a.tile_tokens;
        tile[0] = s;
        tile[1] = q0;
        tile[2] = min(a.tile_tokens, a.query_start[s + 1] - q0);
      }
      return true;
    }
    before += __shfl_sync(0xffffffffu, incl, 31);
  }
  return false;
}

}  // namespace m3::cuda::msa
