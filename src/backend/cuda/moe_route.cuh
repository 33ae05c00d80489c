#pragma once
// The part of MoE routing the grouped-expert paths share (moe.cu, moe_mxfp8.cu, and the router's
// select kernel where it routes for the experts: moe_router.cu): from the
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

// The mma.sync W8A16 grid (items of <= 64 rows) lists the shared expert's items first: they hold
// the most rows, so a grid of a CTA per item starts the heaviest ones first (T = 128: 1959-1962 ->
// 1946-1951 us); the persistent wgmma kernels (128-row items) balance better with its heavy tiles
// among the routed ones (W8A16 wgmma T = 512: 2240-2246 -> 2282-2292 us first).
__device__ __forceinline__ bool shared_items_first(int rows_per_item) { return rows_per_item <= 64; }

// route_body's result for at most 32 assignments (decode: tokens * top_k <= 32), by one warp
// with lane a holding assignment a: no shared memory and no CTA barrier (the general path's scan,
// item pass and rank round are ~10 barriers of 1024 threads, a few microseconds on the critical
// path of every small decode step). Same perm, pos, items and meta as the general path.
__device__ __forceinline__ void route_warp(const int32_t* ids, int tokens, int top_k, int routed, int has_shared,
                                           int rows_per_item, int32_t* perm, int32_t* pos, int4* items, int* meta) {
  const int lane = int(threadIdx.x) & 31, n_assign = tokens * top_k;
  const int e0 = lane < n_assign ? ids[lane] : -1;
  const bool valid = e0 >= 0 && e0 < routed;
  const int e = valid ? e0 : -1;
  const unsigned peers = __match_any_sync(0xffffffffu, e);
  const int rank = __popc(peers & ((1u << lane) - 1u)), count = __popc(peers);
  const bool leader = valid && rank == 0;
  const int ni = leader ? (count + rows_per_item - 1) / rows_per_item : 0;  // this expert's items
  // Rows and items of the experts below e: sums over the other lanes (leaders for the items).
  int below_rows = 0, below_items = 0, n_valid = 0;
  for (int j = 0; j < 32; ++j) {
    const int ej = __shfl_sync(0xffffffffu, e, j), nij = __shfl_sync(0xffffffffu, ni, j);
    n_valid += ej >= 0;
    below_rows += (ej >= 0 && ej < e);
    below_items += (ej >= 0 && ej < e) ? nij : 0;
  }
  int routed_items = ni;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) routed_items += __shfl_xor_sync(0xffffffffu, routed_items, off);
  const int shared_items = has_shared ? (tokens + rows_per_item - 1) / rows_per_item : 0;
  const bool shared_first = shared_items_first(rows_per_item);
  if (valid) {
    const int p = below_rows + rank;
    perm[p] = lane / top_k;
    pos[lane] = p;
    if (leader) {
      const int i0 = below_items + (shared_first ? shared_items : 0);
      for (int g = 0; g < ni; ++g) {
        items[i0 + g] = expert_item(e, below_rows, count, g, rows_per_item);
      }
    }
  } else if (lane < n_assign) {
    pos[lane] = -1;
  }
  if (has_shared) {
    const int i0 = shared_first ? 0 : routed_items;
    for (int g = lane; g < shared_items; g += 32) {
      items[i0 + g] = expert_item(routed, n_valid, tokens, g, rows_per_item);
    }
    for (int t = lane; t < tokens; t += 32) perm[n_valid + t] = t;
  }
  if (lane == 0) {
    meta[0] = routed_items + shared_items;
    meta[1] = n_valid;
  }
}

}  // namespace m3::cuda
