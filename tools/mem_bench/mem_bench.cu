// Read-bandwidth ceilings on the GPU the benchmarks run on: how fast can one kernel launch read
// N bytes, by load method and pattern, against the device-to-device copy bandwidth the MoE and
// MSA benchmarks use as their yardstick? The weight stream of a decode MoE block (a few hundred
// MB, one or two launches) ramps up and drains; a copy of gigabytes does not.
//   ldg        plain 16-byte loads, grid-stride over contiguous memory, 8 in flight per thread
//   cp.async   the W8A16 decode pattern: a CTA owns 128 rows of [rows, 6144] bytes and reads
//              128 bytes of each row per stage through a 4-stage ring (2 CTAs per SM)
//              (also 6 stages, 2 CTAs per SM, and 12 stages, 1 CTA per SM: bytes in flight per SM)
//   bulk rows  the same tiles by one-dimensional cp.async.bulk copies, one per 128-byte row (no
//              tensor map), 5 stages x 2 CTAs or 10 stages x 1 CTA per SM
//   tma        the same 128 x 128-byte tiles by cp.async.bulk.tensor (mbarrier ring, 1 CTA/SM)
//   cp.async rows R x B   one CTA per block of R rows streaming along K in R x B-byte stages (16 KB),
//              2 CTAs per SM: the invariant linear's LM-head pattern (128 x 128) and longer runs per row;
//              "frag": 128 x 128 with the W8A16 kernel's per-lane chunks (64 bytes of 8 rows per copy)
//   ldg rows   the same row blocks read into registers the way MMA fragments are (a warp per 16 rows,
//              32 bytes of two rows per lane and 128-byte window, 4 windows in flight)
//   kv gather  the sparse decode attention's K/V reads at B = 64 (random pages, one KV head's 256 bytes
//              per key) in the cache's layout and head-major by cp.async, and by TMA (--no-gather skips)
//   balance    the largest size streamed by one CTA per SM, split evenly or in 256 KB pieces taken
//              from a counter, with each CTA's end time: how unequally the SMs share the bandwidth
//   key pages  the decode indexer's scan without its arithmetic: pages of 128 index keys (16 KB
//              FP8, 32 KB BF16) in shuffled or sequential order, each warp taking the next page
//              from a counter and streaming it through its own cp.async ring of 16-key tiles, at
//              the indexer's rings and CTAs per SM (2150 MB BF16 / 1075 MB FP8: 128K, B = 64)
// Each: one launch timed by events with L2 flushed before it (as the benchmarks do), median of
// 30; an empty kernel gives the launch floor. Prints a table, writes JSON.
//   mem_bench [--mb 189,292,1752] [--no-gather] [--no-key-pages] [--json F]
// (copy bandwidth: gpu_bench::copy_bandwidth, as the other benches)
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "gpu_bench_common.h"

namespace {

using m3::gpu_bench::Dev;

constexpr int kK = 6144, kTileRows = 128, kTileK = 128, kTile = kTileRows * kTileK;

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

__global__ void empty_kernel() {}

__global__ void __launch_bounds__(256) ldg_kernel(const uint4* w, size_t n16, unsigned* sink) {
  unsigned acc = 0;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + 7 * stride < n16; i += 8 * stride) {
    uint4 v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = __ldg(w + i + j * stride);
#pragma unroll
    for (int j = 0; j < 8; ++j) acc ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
  }
  for (; i < n16; i += stride) {
    const uint4 v = __ldg(w + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) *sink = acc;  // keeps the loads
}

// A 4-stage cp.async ring over n 16 KB tiles: each thread copies chunks chunk(0..3) (16 bytes
// each, 1024 per tile) of tile i from src(i, c), then reads the same chunks back (XOR-folded).
template <int kStages = 4, class Chunk, class Src>
__device__ __forceinline__ unsigned ring_stream(uint8_t* ring, int n, Chunk chunk, Src src) {
  auto load = [&](int i) {
    const uint32_t d = smem_u32(ring + (i % kStages) * kTile);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int c = chunk(j);
      asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;\n" ::"r"(d + c * 16), "l"(src(i, c)) : "memory");
    }
  };
  unsigned acc = 0;
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < n) load(s);
    asm volatile("cp.async.commit_group;\n" ::: "memory");
  }
  for (int i = 0; i < n; ++i) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kStages - 2) : "memory");
    __syncthreads();
    if (i + kStages - 1 < n) load(i + kStages - 1);
    asm volatile("cp.async.commit_group;\n" ::: "memory");
    const uint4* p = reinterpret_cast<const uint4*>(ring + (i % kStages) * kTile);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint4 v = p[chunk(j)];
      acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
  }
  return acc;
}

// Tiles (row block rb, k stage ks) of a [rows, kK] byte matrix, split evenly over the CTAs.
template <int kStages = 4>
__global__ void __launch_bounds__(256, 2) cpasync_kernel(const uint8_t* w, int tiles, unsigned* sink) {
  constexpr int kKs = kK / kTileK;
  extern __shared__ __align__(128) uint8_t ring[];
  const int tid = int(threadIdx.x);
  const int t0 = int(int64_t(blockIdx.x) * tiles / gridDim.x), t1 = int(int64_t(blockIdx.x + 1) * tiles / gridDim.x);
  const unsigned acc = ring_stream<kStages>(
      ring, t1 - t0, [&](int j) { return tid * 4 + j; },
      [&](int i, int c) {
        const int t = t0 + i, rb = t / kKs, ks = t % kKs;
        return w + size_t(rb * kTileRows + c / 8) * kK + ks * kTileK + (c % 8) * 16;
      });
  if (acc == 0x9e3779b9u) *sink = acc;  // keeps the loads
}

// Row blocks streamed along K, one CTA per block of kRows rows (as the invariant linear's LM head:
// 1 563 CTAs, 2 resident per SM): stages of kRows x kBytes (16 KB) through the same ring.
// How long a row's run per stage is (128 vs 256 vs 512 bytes) at the same bytes per stage.
// kFrag: each thread copies the chunks the W8A16 kernel's lane (g, tig) of warp w owns (bytes
// [16 tig, +16) and [64 + 16 tig, +16) of rows 16 w + g and 16 w + g + 8: 64 contiguous bytes of 8
// rows per instruction) instead of whole 128-byte lines per 8 lanes.
template <int kRows, int kBytes, bool kFrag = false>
__global__ void __launch_bounds__(256, 2) cprows_kernel(const uint8_t* w, unsigned* sink) {
  constexpr int kRowChunks = kBytes / 16;
  static_assert(kRows * kBytes == kTile, "16 KB stages");
  static_assert(!kFrag || kRowChunks == 8, "fragment mapping: 128-byte rows");
  extern __shared__ __align__(128) uint8_t ring_r[];
  const int tid = int(threadIdx.x);
  const int fw = tid >> 5, fg = (tid & 31) >> 2, ft = tid & 3;
  const uint8_t* base = w + size_t(blockIdx.x) * kRows * kK;
  const unsigned acc = ring_stream(
      ring_r, kK / kBytes,
      [&](int j) { return kFrag ? (16 * fw + fg + 8 * (j >> 1)) * 8 + 4 * (j & 1) + ft : tid + j * 256; },
      [&](int ks, int c) { return base + size_t(c / kRowChunks) * kK + ks * kBytes + (c % kRowChunks) * 16; });
  if (acc == 0x9e3779b9u) *sink = acc;
}

// The same row blocks read straight into registers as MMA fragments would be: a warp owns 16 rows,
// lane (g, t) reads bytes [32 t, 32 t + 32) of rows g and g + 8 of each 128-byte window, 4 windows in
// flight; 4 warps (64 rows) per CTA.
__global__ void __launch_bounds__(128) ldgrows_kernel(const uint8_t* w, unsigned* sink) {
  constexpr int kD = 4, kKs = kK / 128;
  const int lane = int(threadIdx.x) & 31, g = lane >> 2, t = lane & 3;
  const uint8_t* r0 = w + (size_t(blockIdx.x) * 64 + (threadIdx.x >> 5) * 16 + g) * kK + 32 * t;
  const uint8_t* r1 = r0 + 8 * size_t(kK);
  uint4 b[kD][4];
  auto load = [&](int ks, uint4 (&q)[4]) {
    q[0] = __ldg(reinterpret_cast<const uint4*>(r0 + ks * 128));
    q[1] = __ldg(reinterpret_cast<const uint4*>(r0 + ks * 128 + 16));
    q[2] = __ldg(reinterpret_cast<const uint4*>(r1 + ks * 128));
    q[3] = __ldg(reinterpret_cast<const uint4*>(r1 + ks * 128 + 16));
  };
#pragma unroll
  for (int d = 0; d < kD; ++d) load(d, b[d]);
  unsigned acc = 0;
  for (int s = 0; s < kKs; s += kD) {
#pragma unroll
    for (int d = 0; d < kD; ++d) {
#pragma unroll
      for (int j = 0; j < 4; ++j) acc ^= b[d][j].x ^ b[d][j].y ^ b[d][j].z ^ b[d][j].w;
      if (s + d + kD < kKs) load(s + d + kD, b[d]);
    }
  }
  if (acc == 0x9e3779b9u) *sink = acc;
}

// The mbarrier pairs of a kStages ring (full: one arrival plus the stage's transaction bytes;
// empty: all 256 threads), set by thread 0 before a CTA barrier; and the wait on one.
template <int kStages>
__device__ __forceinline__ void init_ring(uint64_t (&full)[kStages], uint64_t (&empty)[kStages]) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      asm volatile("mbarrier.init.shared.b64 [%0], 1;\n" ::"r"(smem_u32(&full[s])));
      asm volatile("mbarrier.init.shared.b64 [%0], 256;\n" ::"r"(smem_u32(&empty[s])));
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
}
__device__ __forceinline__ void ring_wait(uint64_t* b, uint32_t parity) {
  asm volatile("{\n .reg .pred p;\n W: mbarrier.try_wait.parity.shared.b64 p, [%0], %1;\n @!p bra W;\n}\n" ::"r"(
                   smem_u32(b)),
               "r"(parity)
               : "memory");
}

// The same tiles by one-dimensional bulk copies, one per 128-byte row (no tensor map: a row's
// bytes are contiguous whatever the matrix), issued by warp 0 (4 rows per lane), rows padded to
// 144 bytes in shared memory; an mbarrier pair per stage, kStages deep.
template <int kStages>
__global__ void __launch_bounds__(256) bulk_kernel(const uint8_t* w, int tiles, unsigned* sink) {
  constexpr int kKs = kK / kTileK, kRowPitch = 144, kStageBytes = kTileRows * kRowPitch;
  extern __shared__ __align__(128) uint8_t ring_b[];
  __shared__ __align__(8) uint64_t full[kStages], empty[kStages];
  const int tid = int(threadIdx.x), lane = tid & 31;
  const int t0 = int(int64_t(blockIdx.x) * tiles / gridDim.x);
  const int n = int(int64_t(blockIdx.x + 1) * tiles / gridDim.x) - t0;
  init_ring(full, empty);
  auto issue = [&](int i) {  // warp 0
    const int t = t0 + i, s = i % kStages;
    const uint32_t bar = smem_u32(&full[s]);
    if (lane == 0) {
      asm volatile("mbarrier.arrive.expect_tx.shared.b64 _, [%0], %1;\n" ::"r"(bar), "r"(kTile) : "memory");
    }
    __syncwarp();
    const uint8_t* src = w + size_t((t / kKs) * kTileRows) * kK + (t % kKs) * kTileK;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int r = lane + 32 * j;
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                       smem_u32(ring_b + s * kStageBytes + r * kRowPitch)),
                   "l"(src + size_t(r) * kK), "r"(kTileK), "r"(bar)
                   : "memory");
    }
  };
  if (tid < 32) {
    for (int i = 0; i < kStages && i < n; ++i) issue(i);
  }
  unsigned acc = 0;
  for (int i = 0; i < n; ++i) {
    const int s = i % kStages;
    ring_wait(&full[s], uint32_t((i / kStages) & 1));
#pragma unroll
    for (int j = 0; j < 4; ++j) {  // thread reads 16 bytes of rows tid / 8 + 32 j
      const uint4 v = *reinterpret_cast<const uint4*>(ring_b + s * kStageBytes + (tid / 8 + 32 * j) * kRowPitch + (tid % 8) * 16);
      acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    asm volatile("mbarrier.arrive.shared.b64 _, [%0];\n" ::"r"(smem_u32(&empty[s])) : "memory");
    if (tid < 32 && i + kStages < n) {
      ring_wait(&empty[s], uint32_t((i / kStages) & 1));
      issue(i + kStages);
    }
  }
  if (acc == 0x9e3779b9u) *sink = acc;
}

// The same tiles by TMA: thread 0 issues, everyone consumes, an mbarrier pair per stage.
__global__ void __launch_bounds__(256, 1) tma_kernel(const __grid_constant__ CUtensorMap map, int tiles, unsigned* sink) {
  constexpr int kStages = 8, kKs = kK / kTileK;
  extern __shared__ __align__(128) uint8_t ring_t[];
  __shared__ __align__(8) uint64_t full[kStages], empty[kStages];
  const int tid = int(threadIdx.x);
  const int t0 = int(int64_t(blockIdx.x) * tiles / gridDim.x);
  const int n = int(int64_t(blockIdx.x + 1) * tiles / gridDim.x) - t0;
  init_ring(full, empty);
  auto issue = [&](int i) {
    const int t = t0 + i, s = i % kStages;
    const uint32_t bar = smem_u32(&full[s]);
    asm volatile("mbarrier.arrive.expect_tx.shared.b64 _, [%0], %1;\n" ::"r"(bar), "r"(kTile) : "memory");
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
            smem_u32(ring_t + s * kTile)),
        "l"(&map), "r"((t % kKs) * kTileK), "r"((t / kKs) * kTileRows), "r"(bar)
        : "memory");
  };
  if (tid == 0) {
    for (int i = 0; i < kStages && i < n; ++i) issue(i);
  }
  unsigned acc = 0;
  for (int i = 0; i < n; ++i) {
    const int s = i % kStages;
    ring_wait(&full[s], uint32_t((i / kStages) & 1));
    const uint4* p = reinterpret_cast<const uint4*>(ring_t + s * kTile);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint4 v = p[tid * 4 + j];
      acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    asm volatile("mbarrier.arrive.shared.b64 _, [%0];\n" ::"r"(smem_u32(&empty[s])) : "memory");
    if (tid == 0 && i + kStages < n) {
      ring_wait(&empty[s], uint32_t((i / kStages) & 1));
      issue(i + kStages);
    }
  }
  if (acc == 0x9e3779b9u) *sink = acc;
}

// The sparse decode attention's K/V gather (msa_decode.cu at B = 64, 128K context, M3 shapes):
// 256 CTAs (64 sequences x 4 KV groups, 2 per SM), each reading the K and then the V tile of 16
// random pages (128 keys x 256 bytes of its group's head: 32 KB per tile) through a 3-slot ring,
// two tiles in flight. kHeadMajor == false is the cache's [slot, kv_head, 128] layout (a key's
// 256 bytes every 1 KB); true the same bytes with each page's head contiguous (32 KB runs).
// What the attention kernel's 80 % of the copy bandwidth is measured against.
constexpr int kGatherSeqs = 64, kGatherGroups = 4, kGatherTopK = 16, kGatherSeqPages = 1024;
constexpr int kGatherTile = 128 * 256;
template <bool kHeadMajor>
__global__ void __launch_bounds__(256, 2) kvgather_kernel(const uint8_t* k, const uint8_t* v, const int* pages,
                                                           unsigned* sink) {
  extern __shared__ __align__(128) uint8_t ring_g[];
  const int tid = int(threadIdx.x), g = int(blockIdx.x) % kGatherGroups;
  const int* my = pages + blockIdx.x * kGatherTopK;
  constexpr int kTiles = 2 * kGatherTopK;
  auto issue = [&](int t) {
    const size_t page = size_t(my[t / 2]);
    const uint8_t* src = (t & 1) ? v : k;
    const uint32_t d = smem_u32(ring_g + (t % 3) * kGatherTile);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int c = tid + 256 * j, row = c / 16, ch = c % 16;
      const size_t off = kHeadMajor ? ((page * kGatherGroups + g) * 128 + row) * 256 + ch * 16
                                    : ((page * 128 + row) * kGatherGroups + g) * 256 + ch * 16;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d + c * 16), "l"(src + off) : "memory");
    }
  };
  issue(0);
  asm volatile("cp.async.commit_group;\n" ::: "memory");
  issue(1);
  asm volatile("cp.async.commit_group;\n" ::: "memory");
  unsigned acc = 0;
  for (int t = 0; t < kTiles; ++t) {
    asm volatile("cp.async.wait_group 1;\n" ::: "memory");
    __syncthreads();
    if (t + 2 < kTiles) issue(t + 2);
    asm volatile("cp.async.commit_group;\n" ::: "memory");
    const uint4* p = reinterpret_cast<const uint4*>(ring_g + (t % 3) * kGatherTile);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const uint4 x = p[tid + 256 * j];
      acc ^= x.x ^ x.y ^ x.z ^ x.w;
    }
  }
  if (acc == 0x9e3779b9u) *sink = acc;
}

// The same gather by TMA (the cache's layout only): boxes of 64 dims x 1 head x kRows slots,
// 128-byte swizzled, both halves of a key row in consecutive boxes; thread 0 issues, a full
// mbarrier per slot, two tiles in flight as above.
template <int kRows>
__global__ void __launch_bounds__(256, 2) kvgather_tma_kernel(const __grid_constant__ CUtensorMap kmap,
                                                               const __grid_constant__ CUtensorMap vmap, const int* pages,
                                                               unsigned* sink) {
  extern __shared__ __align__(1024) uint8_t ring_h[];
  __shared__ __align__(8) uint64_t full[3];
  const int tid = int(threadIdx.x), g = int(blockIdx.x) % kGatherGroups;
  const int* my = pages + blockIdx.x * kGatherTopK;
  constexpr int kTiles = 2 * kGatherTopK;
  if (tid == 0) {
    for (int s = 0; s < 3; ++s) asm volatile("mbarrier.init.shared.b64 [%0], 1;\n" ::"r"(smem_u32(&full[s])));
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  auto issue = [&](int t) {
    const int slot0 = my[t / 2] * 128;
    const uint32_t bar = smem_u32(&full[t % 3]), d = smem_u32(ring_h + (t % 3) * kGatherTile);
    const CUtensorMap* map = (t & 1) ? &vmap : &kmap;
    asm volatile("mbarrier.arrive.expect_tx.shared.b64 _, [%0], %1;\n" ::"r"(bar), "r"(kGatherTile) : "memory");
    for (int q = 0; q < 128 / kRows; ++q) {
      for (int h = 0; h < 2; ++h) {
        asm volatile(
            "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(
                d + h * 16384 + q * kRows * 128),
            "l"(reinterpret_cast<uint64_t>(map)), "r"(h * 64), "r"(g), "r"(slot0 + q * kRows), "r"(bar)
            : "memory");
      }
    }
  };
  if (tid == 0) {
    issue(0);
    issue(1);
  }
  unsigned acc = 0;
  for (int t = 0; t < kTiles; ++t) {
    ring_wait(&full[t % 3], uint32_t((t / 3) & 1));
    const uint4* p = reinterpret_cast<const uint4*>(ring_h + (t % 3) * kGatherTile);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const uint4 x = p[tid + 256 * j];
      acc ^= x.x ^ x.y ^ x.z ^ x.w;
    }
    __syncthreads();
    if (tid == 0 && t + 2 < kTiles) issue(t + 2);
  }
  if (acc == 0x9e3779b9u) *sink = acc;
}

// The decode indexer's key stream (msa_indexer_decode.cu) without its arithmetic: 8 warps per
// CTA, each claiming whole pages from a counter (lane 0's atomicAdd, a page ahead of its loads'
// need, as the indexer's units) and copying them kTile bytes at a time through its own kSlots-deep
// cp.async ring, reading each tile back. `order` lists the pages (shuffled: msa_bench's tables).
template <int kTile, int kSlots, int kCtas>
__global__ void __launch_bounds__(256, kCtas) keypages_kernel(const uint8_t* base, const int* order, int n_pages,
                                                                int page_bytes, unsigned* counter, unsigned* sink) {
  extern __shared__ __align__(128) uint8_t ring_k[];
  const int warp = int(threadIdx.x) >> 5, lane = int(threadIdx.x) & 31;
  uint8_t* const ring = ring_k + warp * kSlots * kTile;
  const int tiles_per_page = page_bytes / kTile;
  auto claim = [&]() {
    unsigned v = 0;
    if (lane == 0) v = atomicAdd(counter, 1u);
    return int(__shfl_sync(0xffffffffu, v, 0));
  };
  int pg = claim(), next = claim(), t_in = 0, loaded = 0, used = 0;
  auto issue = [&]() {  // the next tile of the warp's pages into slot loaded % kSlots (if any)
    if (pg < n_pages) {
      const uint8_t* src = base + size_t(order[pg]) * page_bytes + size_t(t_in) * kTile;
      const uint32_t d = smem_u32(ring + (loaded % kSlots) * kTile);
#pragma unroll
      for (int j = 0; j < kTile / 512; ++j) {
        const int c = lane + 32 * j;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d + c * 16), "l"(src + c * 16) : "memory");
      }
      ++loaded;
      if (++t_in == tiles_per_page) {
        t_in = 0;
        pg = next;
        next = next < n_pages ? claim() : next;
      }
    }
    asm volatile("cp.async.commit_group;\n" ::: "memory");
  };
  for (int s = 0; s < kSlots - 1; ++s) issue();
  unsigned acc = 0;
  while (used < loaded) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kSlots - 2) : "memory");
    __syncwarp();
    const uint4* p = reinterpret_cast<const uint4*>(ring + (used % kSlots) * kTile);
#pragma unroll
    for (int j = 0; j < kTile / 512; ++j) {
      const uint4 x = p[lane + 32 * j];
      acc ^= x.x ^ x.y ^ x.z ^ x.w;
    }
    ++used;
    __syncwarp();
    issue();
  }
  if (acc == 0x9e3779b9u) *sink = acc;
}

// A keypages_kernel shape: bytes per tile, ring slots per warp, CTAs per SM.
template <int Tile, int Slots, int Ctas>
struct KeyPages {
  static constexpr int kTile = Tile, kSlots = Slots, kCtas = Ctas;
};

// Per-SM balance of a pure stream: one CTA of 1024 threads per SM (128 KB in flight) reads `bytes`
// split evenly (static) or in 256 KB pieces taken from an atomic counter (dynamic); each CTA
// records its start and end (%globaltimer). How unequal the SMs' shares of the bandwidth are
// decides what a static split of a stream over the SMs (the decode indexer's chunks) leaves idle
// at its end.
constexpr size_t kPiece16 = (size_t(256) << 10) / 16;
template <bool kDynamic>
__global__ void __launch_bounds__(1024, 1) balance_kernel(const uint4* w, size_t n16, unsigned* counter,
                                                        unsigned long long* times, unsigned* sink) {
  __shared__ unsigned s_piece;
  unsigned long long t0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  unsigned acc = 0;
  auto stream = [&](size_t b, size_t e) {
    size_t i = b + threadIdx.x;
    for (; i + 7 * 1024 < e; i += 8 * 1024) {
      uint4 v[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = __ldcs(w + i + j * 1024);
#pragma unroll
      for (int j = 0; j < 8; ++j) acc ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
    }
    for (; i < e; i += 1024) {
      const uint4 v = __ldcs(w + i);
      acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
  };
  if (kDynamic) {
    const unsigned pieces = unsigned((n16 + kPiece16 - 1) / kPiece16);
    for (;;) {
      __syncthreads();
      if (threadIdx.x == 0) s_piece = atomicAdd(counter, 1u);
      __syncthreads();
      const unsigned p = s_piece;
      if (p >= pieces) break;
      stream(size_t(p) * kPiece16, min(n16, size_t(p + 1) * kPiece16));
    }
  } else {
    const size_t per = (n16 + gridDim.x - 1) / gridDim.x;
    stream(min(n16, blockIdx.x * per), min(n16, (blockIdx.x + 1) * per));
  }
  __syncthreads();
  unsigned long long t1;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
  if (threadIdx.x == 0) {
    times[2 * blockIdx.x] = t0;
    times[2 * blockIdx.x + 1] = t1;
  }
  if (acc == 0x9e3779b9u) *sink = acc;
}

// cuTensorMapEncodeTiled through the runtime's driver entry point (no link against libcuda).
using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
EncodeTiled encode_tiled() {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q{};
  if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q) != cudaSuccess ||
      q != cudaDriverEntryPointSuccess) {
    return nullptr;
  }
  return reinterpret_cast<EncodeTiled>(fn);
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> sizes_mb = {189, 292, 1752};  // gate+up of 5 experts; T = 1 and T = 8 MoE weight bytes
  std::string json_path;
  bool gather = true, key_pages = true;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "--mb" && i + 1 < argc) sizes_mb = m3::gpu_bench::parse_list(argv[++i]);
    else if (k == "--no-gather") gather = false;
    else if (k == "--no-key-pages") key_pages = false;
    else if (k == "--json" && i + 1 < argc) json_path = argv[++i];
    else {
      std::fprintf(stderr, "usage: mem_bench [--mb 189,292,1752] [--no-gather] [--no-key-pages] [--json F]\n");
      return 2;
    }
  }
  cudaDeviceProp prop{};
  M3_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  const int max_mb = *std::max_element(sizes_mb.begin(), sizes_mb.end());
  const size_t max_rows = (size_t(max_mb) * 1000000 / kK + kTileRows - 1) / kTileRows * kTileRows;
  const Dev wbuf(max_rows * kK), sink_buf(4), flush(size_t(256) << 20);
  uint8_t* const w = wbuf.as<uint8_t>();
  unsigned* const sink = sink_buf.as<unsigned>();
  M3_CUDA_CHECK(cudaMemset(w, 1, max_rows * kK));
  cudaEvent_t e0, e1;
  M3_CUDA_CHECK(cudaEventCreate(&e0));
  M3_CUDA_CHECK(cudaEventCreate(&e1));
  // One launch (not a graph replay: the kernel alone), L2 flushed before it, median of 30.
  const m3::gpu_bench::Flush l2_mode = m3::gpu_bench::flush_mode();
  auto time_us = [&](auto&& launch) {
    std::vector<float> ts;
    for (int it = 0; it < 30; ++it) {
      m3::gpu_bench::flush_l2(l2_mode, flush.as<void>(), flush.bytes(), it, nullptr);
      M3_CUDA_CHECK(cudaEventRecord(e0));
      launch();
      M3_CUDA_CHECK(cudaEventRecord(e1));
      M3_CUDA_CHECK(cudaEventSynchronize(e1));
      float ms = 0;
      M3_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
      ts.push_back(ms * 1000.0f);
    }
    M3_CUDA_CHECK_LAUNCH();
    std::sort(ts.begin(), ts.end());
    return double(ts[ts.size() / 2]);
  };
  const double copy_bw = m3::gpu_bench::copy_bandwidth(nullptr);  // the yardstick of moe_bench and msa_bench
  const double floor_us = time_us([&] { empty_kernel<<<1, 32>>>(); });
  std::printf("device %s, %d SMs; copy bandwidth %.0f GB/s (read + write); empty kernel %.1f us; L2 flush: %s\n\n", prop.name,
              sms, copy_bw / 1e9, floor_us, m3::gpu_bench::flush_name(l2_mode));
  std::printf("%8s %-24s | %9s %8s %7s\n", "MB", "method", "us", "GB/s", "%copy");
  const EncodeTiled encode = encode_tiled();
  constexpr size_t kCpSmem = 4 * size_t(kTile), kTmaSmem = 8 * size_t(kTile);
  M3_CUDA_CHECK(cudaFuncSetAttribute(cpasync_kernel<4>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kCpSmem)));
  M3_CUDA_CHECK(cudaFuncSetAttribute(cpasync_kernel<6>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(6 * kTile)));
  M3_CUDA_CHECK(cudaFuncSetAttribute(cpasync_kernel<12>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(12 * kTile)));
  constexpr int kBulkStage = kTileRows * 144;
  M3_CUDA_CHECK(cudaFuncSetAttribute(bulk_kernel<5>, cudaFuncAttributeMaxDynamicSharedMemorySize, 5 * kBulkStage));
  M3_CUDA_CHECK(cudaFuncSetAttribute(bulk_kernel<10>, cudaFuncAttributeMaxDynamicSharedMemorySize, 10 * kBulkStage));
  M3_CUDA_CHECK(cudaFuncSetAttribute(tma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kTmaSmem)));
  M3_CUDA_CHECK(cudaFuncSetAttribute(balance_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, 120 << 10));
  M3_CUDA_CHECK(cudaFuncSetAttribute(balance_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, 120 << 10));
  // 83 KB: two CTAs per SM, as the LM head's 8-token BF16 tile.
  constexpr size_t kRowsSmem = 83 * 1024;
  M3_CUDA_CHECK(cudaFuncSetAttribute(cprows_kernel<128, 128>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kRowsSmem)));
  M3_CUDA_CHECK(cudaFuncSetAttribute(cprows_kernel<128, 128, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kRowsSmem)));
  M3_CUDA_CHECK(cudaFuncSetAttribute(cprows_kernel<64, 256>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kRowsSmem)));
  M3_CUDA_CHECK(cudaFuncSetAttribute(cprows_kernel<32, 512>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kRowsSmem)));
  std::string json = "{\"device\": \"" + std::string(prop.name) + "\", \"l2_flush\": \"" +
                     m3::gpu_bench::flush_name(l2_mode) + "\", \"copy_gbps\": " + std::to_string(copy_bw / 1e9) +
                     ", \"empty_kernel_us\": " + std::to_string(floor_us) + ", \"rows\": [";
  bool first = true;
  // One table row and its JSON object: `bytes` read in `us` (extra: appended to the line; extra_json:
  // more fields of the object).
  auto emit_row = [&](double bytes, const char* method, double us, const std::string& extra = "",
                      const std::string& extra_json = "") {
    const double gbps = bytes / (us * 1e-6) / 1e9;
    std::printf("%8.0f %-24s | %9.1f %8.0f %6.1f%%%s\n", bytes / 1e6, method, us, gbps, 100.0 * gbps * 1e9 / copy_bw,
                extra.c_str());
    json += std::string(first ? "" : ", ") + "{\"mb\": " + std::to_string(bytes / 1e6) + ", \"method\": \"" + method +
            "\", \"us\": " + std::to_string(us) + ", \"gbps\": " + std::to_string(gbps) +
            ", \"copy_ratio\": " + std::to_string(gbps * 1e9 / copy_bw) + extra_json + "}";
    first = false;
  };
  for (const int mb : sizes_mb) {
    const size_t rows = (size_t(mb) * 1000000 / kK + kTileRows - 1) / kTileRows * kTileRows;
    const size_t bytes = rows * kK;
    const int tiles = int(rows / kTileRows) * (kK / kTileK);
    auto emit = [&](const char* method, double us) { emit_row(double(bytes), method, us); };
    emit("ldg grid-stride", time_us([&] { ldg_kernel<<<16 * sms, 256>>>(reinterpret_cast<const uint4*>(w), bytes / 16, sink); }));
    emit("cp.async W8A16 tiles", time_us([&] { cpasync_kernel<4><<<2 * sms, 256, kCpSmem>>>(w, tiles, sink); }));
    emit("cp.async 6 stages x2", time_us([&] { cpasync_kernel<6><<<2 * sms, 256, 6 * kTile>>>(w, tiles, sink); }));
    emit("cp.async 12 stages x1", time_us([&] { cpasync_kernel<12><<<sms, 256, 12 * kTile>>>(w, tiles, sink); }));
    emit("bulk rows 5 stages x2", time_us([&] { bulk_kernel<5><<<2 * sms, 256, 5 * kBulkStage>>>(w, tiles, sink); }));
    emit("bulk rows 10 stages x1", time_us([&] { bulk_kernel<10><<<sms, 256, 10 * kBulkStage>>>(w, tiles, sink); }));
    const unsigned blocks128 = unsigned(rows / 128);
    emit("cp.async rows 128x128B", time_us([&] { cprows_kernel<128, 128><<<blocks128, 256, kRowsSmem>>>(w, sink); }));
    emit("cp.async rows 128x128B frag", time_us([&] { cprows_kernel<128, 128, true><<<blocks128, 256, kRowsSmem>>>(w, sink); }));
    emit("cp.async rows 64x256B", time_us([&] { cprows_kernel<64, 256><<<2 * blocks128, 256, kRowsSmem>>>(w, sink); }));
    emit("cp.async rows 32x512B", time_us([&] { cprows_kernel<32, 512><<<4 * blocks128, 256, kRowsSmem>>>(w, sink); }));
    emit("ldg rows 64 (fragments)", time_us([&] { ldgrows_kernel<<<2 * blocks128, 128>>>(w, sink); }));
    if (encode) {
      CUtensorMap map;
      const cuuint64_t dims[2] = {cuuint64_t(kK), cuuint64_t(rows)}, strides[1] = {cuuint64_t(kK)};
      const cuuint32_t box[2] = {kTileK, kTileRows}, estr[2] = {1, 1};
      if (encode(&map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, w, dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
                 CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                 CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS) {
        emit("tma W8A16 tiles", time_us([&] { tma_kernel<<<sms, 256, kTmaSmem>>>(map, tiles, sink); }));
      }
    }
  }
  if (gather) {
    // The decode attention's gather (kvgather_kernel): B = 64 x 4 groups x 16 pages, K and V.
    const size_t pool_pages = size_t(kGatherSeqs) * kGatherSeqPages, pool_bytes = pool_pages * 128 * kGatherGroups * 256;
    const Dev kbuf(pool_bytes), vbuf(pool_bytes);
    std::vector<int> perm(pool_pages), sel(size_t(kGatherSeqs) * kGatherGroups * kGatherTopK);
    uint32_t st = 12345u;
    auto rnd = [&] { return st = st * 1664525u + 1013904223u; };
    for (size_t i = 0; i < pool_pages; ++i) perm[i] = int(i);
    for (size_t i = pool_pages - 1; i > 0; --i) std::swap(perm[i], perm[rnd() % (i + 1)]);
    for (int s = 0; s < kGatherSeqs; ++s) {
      for (int g = 0; g < kGatherGroups; ++g) {
        std::vector<int> blocks;
        while (int(blocks.size()) < kGatherTopK) {
          const int b = int(rnd() % kGatherSeqPages);
          if (std::find(blocks.begin(), blocks.end(), b) == blocks.end()) blocks.push_back(b);
        }
        std::sort(blocks.begin(), blocks.end());
        for (int i = 0; i < kGatherTopK; ++i) {
          sel[(size_t(s) * kGatherGroups + g) * kGatherTopK + i] = perm[size_t(s) * kGatherSeqPages + blocks[i]];
        }
      }
    }
    const Dev dsel(sel.size() * 4);
    M3_CUDA_CHECK(cudaMemcpy(dsel.as<void>(), sel.data(), sel.size() * 4, cudaMemcpyHostToDevice));
    constexpr int kGatherSmem = 3 * kGatherTile;
    M3_CUDA_CHECK(cudaFuncSetAttribute(kvgather_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, kGatherSmem));
    M3_CUDA_CHECK(cudaFuncSetAttribute(kvgather_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, kGatherSmem));
    const double bytes = double(kGatherSeqs) * kGatherGroups * kGatherTopK * 2 * kGatherTile;
    const unsigned ctas = kGatherSeqs * kGatherGroups;
    std::printf("\ndecode attention K/V gather (64 sequences x 4 groups x 16 pages of 128 keys, K and V: %.0f MB)\n",
                bytes / 1e6);
    auto emit_g = [&](const char* method, double us) { emit_row(bytes, method, us); };
    const uint8_t *kp = kbuf.as<uint8_t>(), *vp = vbuf.as<uint8_t>();
    const int* sp = dsel.as<int>();
    emit_g("kv gather [slot,head]", time_us([&] { kvgather_kernel<false><<<ctas, 256, kGatherSmem>>>(kp, vp, sp, sink); }));
    emit_g("kv gather head-major", time_us([&] { kvgather_kernel<true><<<ctas, 256, kGatherSmem>>>(kp, vp, sp, sink); }));
    const EncodeTiled enc = encode_tiled();
    auto kv_map = [&](CUtensorMap& m, const uint8_t* base, int rows) {
      const cuuint64_t dims[3] = {128, cuuint64_t(kGatherGroups), cuuint64_t(pool_pages) * 128};
      const cuuint64_t strides[2] = {256, cuuint64_t(kGatherGroups) * 256};
      const cuuint32_t box[3] = {64, 1, cuuint32_t(rows)}, es[3] = {1, 1, 1};
      return enc && enc(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<uint8_t*>(base), dims, strides, box, es,
                        CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
    };
    CUtensorMap km128, vm128, km32, vm32;
    if (kv_map(km128, kp, 128) && kv_map(vm128, vp, 128) && kv_map(km32, kp, 32) && kv_map(vm32, vp, 32)) {
      M3_CUDA_CHECK(cudaFuncSetAttribute(kvgather_tma_kernel<128>, cudaFuncAttributeMaxDynamicSharedMemorySize, kGatherSmem));
      M3_CUDA_CHECK(cudaFuncSetAttribute(kvgather_tma_kernel<32>, cudaFuncAttributeMaxDynamicSharedMemorySize, kGatherSmem));
      emit_g("kv gather tma 128-row", time_us([&] { kvgather_tma_kernel<128><<<ctas, 256, kGatherSmem>>>(km128, vm128, sp, sink); }));
      emit_g("kv gather tma 32-row", time_us([&] { kvgather_tma_kernel<32><<<ctas, 256, kGatherSmem>>>(km32, vm32, sp, sink); }));
    }
  }
  if (key_pages) {
    // The decode indexer's scan at 128K, B = 64 (keypages_kernel): 64 x 1023 pages of 128 keys.
    constexpr int kPages = 64 * 1023;
    const Dev keys(size_t(kPages) * 32768), counter_buf(4);
    M3_CUDA_CHECK(cudaMemset(keys.as<void>(), 1, size_t(kPages) * 32768));
    std::vector<int> order(kPages);
    for (int i = 0; i < kPages; ++i) order[i] = i;
    const Dev seq_order(size_t(kPages) * 4), shuffled(size_t(kPages) * 4);
    M3_CUDA_CHECK(cudaMemcpy(seq_order.as<void>(), order.data(), order.size() * 4, cudaMemcpyHostToDevice));
    uint32_t st = 777u;
    for (int i = kPages - 1; i > 0; --i) {
      st = st * 1664525u + 1013904223u;
      std::swap(order[i], order[st % uint32_t(i + 1)]);
    }
    M3_CUDA_CHECK(cudaMemcpy(shuffled.as<void>(), order.data(), order.size() * 4, cudaMemcpyHostToDevice));
    auto* counter = counter_buf.as<unsigned>();
    std::printf("\ndecode indexer key pages (64 x 1023 pages of 128 keys: 128K, B = 64), warps taking pages from a counter\n");
    // cfg: KeyPages<tile, slots, CTAs per SM>, whose kernel and shared memory follow from them.
    auto run = [&](auto cfg, int page_bytes, const Dev& ord, const char* name) {
      using C = decltype(cfg);
      const auto kernel = keypages_kernel<C::kTile, C::kSlots, C::kCtas>;
      constexpr int smem = 8 * C::kSlots * C::kTile;
      M3_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      const double us = time_us([&] {
        M3_CUDA_CHECK(cudaMemsetAsync(counter, 0, 4));
        kernel<<<C::kCtas * sms, 256, smem>>>(keys.as<uint8_t>(), ord.as<int>(), kPages, page_bytes, counter, sink);
      });
      emit_row(double(kPages) * page_bytes, name, us);
    };
    run(KeyPages<4096, 6, 1>{}, 32768, shuffled, "key pages BF16 shuffled");
    run(KeyPages<4096, 6, 1>{}, 32768, seq_order, "key pages BF16 in order");
    run(KeyPages<2048, 5, 2>{}, 16384, shuffled, "key pages FP8 shuffled");
    run(KeyPages<2048, 5, 2>{}, 16384, seq_order, "key pages FP8 in order");
    run(KeyPages<2048, 10, 1>{}, 16384, shuffled, "key pages FP8 1 CTA x10");
    run(KeyPages<4096, 3, 2>{}, 16384, shuffled, "key pages FP8 4KB tiles");
  }
  {
    // Per-SM balance (balance_kernel) over the largest size: static split vs 256 KB pieces.
    const size_t bytes = (size_t(max_mb) * 1000000 / 16) * 16, n16 = bytes / 16;
    const Dev times_buf(size_t(sms) * 16), counter_buf(4);
    auto* times = times_buf.as<unsigned long long>();
    auto* counter = counter_buf.as<unsigned>();
    std::printf("\nper-SM balance of a %.0f MB stream, one CTA per SM (durations: min / median / max)\n", bytes / 1e6);
    for (const bool dyn : {false, true}) {
      const double us = time_us([&] {
        M3_CUDA_CHECK(cudaMemsetAsync(counter, 0, 4));
        if (dyn) balance_kernel<true><<<sms, 1024, 120 << 10>>>(reinterpret_cast<const uint4*>(w), n16, counter, times, sink);
        else balance_kernel<false><<<sms, 1024, 120 << 10>>>(reinterpret_cast<const uint4*>(w), n16, counter, times, sink);
      });
      std::vector<unsigned long long> t(size_t(2) * sms);
      M3_CUDA_CHECK(cudaMemcpy(t.data(), times, t.size() * 8, cudaMemcpyDeviceToHost));
      std::vector<double> d;
      unsigned long long start = ~0ull;
      for (int c = 0; c < sms; ++c) start = std::min(start, t[2 * size_t(c)]);
      for (int c = 0; c < sms; ++c) d.push_back((t[2 * size_t(c) + 1] - start) / 1e3);
      std::sort(d.begin(), d.end());
      char line[96];
      std::snprintf(line, sizeof line, " | CTA end %.1f / %.1f / %.1f us", d.front(), d[d.size() / 2], d.back());
      emit_row(double(bytes), dyn ? "balance dynamic 256 KB" : "balance static split", us, line,
               ", \"cta_end_min_us\": " + std::to_string(d.front()) + ", \"cta_end_max_us\": " + std::to_string(d.back()));
    }
  }
  json += "]}\n";
  if (!json_path.empty()) {
    std::ofstream(json_path) << json;
    std::printf("wrote %s\n", json_path.c_str());
  }
  return 0;
}
