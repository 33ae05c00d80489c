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
// Each: one launch timed by events with L2 flushed before it (as the benchmarks do), median of
// 30; an empty kernel gives the launch floor. Prints a table, writes JSON.
//   mem_bench [--mb 189,292,1752] [--json F]   (copy bandwidth: gpu_bench::copy_bandwidth, as the other benches)
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
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "--mb" && i + 1 < argc) sizes_mb = m3::gpu_bench::parse_list(argv[++i]);
    else if (k == "--json" && i + 1 < argc) json_path = argv[++i];
    else {
      std::fprintf(stderr, "usage: mem_bench [--mb 189,292,1752] [--json F]\n");
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
  for (const int mb : sizes_mb) {
    const size_t rows = (size_t(mb) * 1000000 / kK + kTileRows - 1) / kTileRows * kTileRows;
    const size_t bytes = rows * kK;
    const int tiles = int(rows / kTileRows) * (kK / kTileK);
    auto emit = [&](const char* method, double us) {
      const double gbps = bytes / (us * 1e-6) / 1e9;
      std::printf("%8.0f %-24s | %9.1f %8.0f %6.1f%%\n", bytes / 1e6, method, us, gbps, 100.0 * gbps * 1e9 / copy_bw);
      json += std::string(first ? "" : ", ") + "{\"mb\": " + std::to_string(bytes / 1e6) + ", \"method\": \"" + method +
              "\", \"us\": " + std::to_string(us) + ", \"gbps\": " + std::to_string(gbps) +
              ", \"copy_ratio\": " + std::to_string(gbps * 1e9 / copy_bw) + "}";
      first = false;
    };
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
  json += "]}\n";
  if (!json_path.empty()) {
    std::ofstream(json_path) << json;
    std::printf("wrote %s\n", json_path.c_str());
  }
  return 0;
}
