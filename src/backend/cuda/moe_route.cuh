#pragma once
// The part of MoE routing both grouped-expert paths share (moe.cu, moe_mxfp8.cu): from the
// per-expert row counts, the expert-major row offsets and the work items (rows_per_item rows
// of one expert each). Kept C++17 (included by .cu files only).
#include <cuda_runtime.h>

#include <cstdint>

namespace m3::cuda {

// Work item g of an expert whose count rows start at row `start`: (expert, first row, end row, 0).
__device__ __forceinline__ int4 expert_item(int e, int start, int count, int g, int rows_per_item) {
  return make_int4(e, start + g * rows_per_item, start + min(count, (g + 1) * rows_per_item), 0);
}

// Called by every thread of one CTA after cnt[0, routed) holds the routed counts (the shared
// expert, index routed when has_shared, takes all `tokens` rows). Warp 0 scans; then every
// warp writes its experts' items as (expert, row_begin, row_end, 0). Rows are expert-major with
// the shared expert's last; with shared_first its items come first (they hold the most rows, so
// a grid of a CTA per item starts the heaviest ones first instead of ending on them). On return
// (after a barrier) cnt/start hold counts and first rows per expert, item_start the first items
// in expert-major order; *num_items and *shared_base (first row of the shared expert) are
// written by thread 0.
__device__ __forceinline__ void scan_and_emit_items(int* cnt, int* start, int* item_start, int routed, int has_shared,
                                                    int tokens, int rows_per_item, int4* items, int* num_items,
                                                    int* shared_base, bool shared_first) {
  const int warp = int(threadIdx.x) >> 5, lane = int(threadIdx.x) & 31, nwarps = int(blockDim.x) >> 5;
  const int total = routed + has_shared;
  if (warp == 0) {
    int carry = 0, icarry = 0;
    for (int base = 0; base < total; base += 32) {
      const int e = base + lane;
      const int c = e < routed ? cnt[e] : (e < total ? tokens : 0);
      const int ni = (c + rows_per_item - 1) / rows_per_item;
      int incl = c, iincl = ni;
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const int t = __shfl_up_sync(0xffffffffu, incl, off), it = __shfl_up_sync(0xffffffffu, iincl, off);
        if (lane >= off) {
          incl += t;
          iincl += it;
        }
      }
      if (e < total) {
        cnt[e] = c;
        start[e] = carry + incl - c;
        item_start[e] = icarry + iincl - ni;
      }
      carry += __shfl_sync(0xffffffffu, incl, 31);
      icarry += __shfl_sync(0xffffffffu, iincl, 31);
    }
    if (lane == 0) {
      *num_items = icarry;
      *shared_base = carry - (has_shared ? tokens : 0);
    }
  }
  __syncthreads();
  const int shared_items = has_shared && shared_first ? (tokens + rows_per_item - 1) / rows_per_item : 0;
  for (int e = warp; e < total; e += nwarps) {
    const int c = cnt[e], s = start[e], i0 = e < routed ? item_start[e] + shared_items : shared_first ? 0 : item_start[e];
    for (int g = lane; g * rows_per_item < c; g += 32) {
      items[i0 + g] = expert_item(e, s, c, g, rows_per_item);
    }
  }
}

// A token's rows for the combine, in the CPU reference's order: its assignments by ascending
// (expert, slot) (those with pos < 0 skipped), then the shared expert's row (shared_row >= 0)
// with weight 1. One thread; writes rows[0, n) and their weights, returns n (<= top_k + 1).
__device__ __forceinline__ int combine_rows(const int32_t* ids, const int32_t* pos, const float* w, int64_t t,
                                            int top_k, int shared_row, int* rows, float* weights) {
  const int32_t* id = ids + t * top_k;
  const int32_t* ps = pos + t * top_k;
  int prev_e = -1, prev_j = -1, n = 0;
  for (int i = 0; i < top_k; ++i) {  // the i-th is the least (expert, slot) after the (i-1)-th
    int best = -1, best_e = 0;
    for (int j = 0; j < top_k; ++j) {
      if (ps[j] < 0) continue;
      const int e = id[j];
      if (e < prev_e || (e == prev_e && j <= prev_j)) continue;
      if (best < 0 || e < best_e) {
        best = j;
        best_e = e;
      }
    }
    if (best < 0) break;
    rows[n] = ps[best];
    weights[n] = w[t * top_k + best];
    ++n;
    prev_e = best_e;
    prev_j = best;
  }
  if (shared_row >= 0) {
    rows[n] = shared_row;
    weights[n] = 1.0f;
    ++n;
  }
  return n;
}

}  // namespace m3::cuda
