// When each CTA of the MoE block's kernels entered, got past its wait and left, for latency
// work on small token counts (where the block is a chain of launches and a profiler, which
// serialises the kernels, cannot show how they overlap). Compiled in only with
// -DM3_MOE_TIMELINE (CMake option M3_MOE_TIMELINE, moe_router.cu and moe_mxfp8.cu); never for
// serving. Thread 0 of each CTA stores %globaltimer (one clock for every SM) at its marks into
// a per-file table that the next launch of the same kernel overwrites, so after a graph replay
// the tables hold that replay; moe_bench (M3_BENCH_MOE_TIMELINE=1) prints them after its block
// rows. Without the macro the marks are empty and report() says so.
#pragma once

#include <cstdint>
#include <string>

namespace m3::cuda::moe_tl {

enum Kernel : int { kLogits = 0, kSelect, kRoute, kGateUp, kDown, kCombine, kKernels };
enum Mark : int { kEntry = 0, kWaited, kMid, kExit, kMarks };  // kMid: a kernel's own inner step
constexpr int kCtas = 16384;  // CTAs recorded per launch (the rest are not; the report says so)

struct Rec {
  unsigned long long t[kMarks];
  int item;  // blockIdx.x (the W8A16 kernels: the item)
  int sm;
};

// Host side: zero both files' tables (before the replay to look at), and a text report of the
// last replay's marks (per kernel, and per item for the two projections), in µs after the
// first CTA's entry. Both say when the build has no timeline.
bool enabled();
void reset();
std::string report();

// Per file (the report reads both): copy out / clear this file's table.
void read_router(Rec* host);   // moe_router.cu: kLogits, kSelect
void clear_router();
void read_experts(Rec* host);  // moe_mxfp8.cu: the rest
void clear_experts();

}  // namespace m3::cuda::moe_tl

#if defined(M3_MOE_TIMELINE) && defined(__CUDACC__)
namespace m3::cuda::moe_tl {

// One table per file (static: no relocatable device code); kernels of the other file stay 0.
static __device__ Rec g_tab[kKernels][kCtas];

__device__ __forceinline__ void mark(int k, int m) {
  if (threadIdx.x != 0 || threadIdx.y != 0) return;
  const int cta = int(blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z));
  if (cta >= kCtas) return;
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  Rec& r = g_tab[k][cta];
  r.t[m] = t;
  if (m == kEntry) {
    unsigned sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    r.sm = int(sm);
    r.item = int(blockIdx.x);
  }
}

// Marks the exit on every return path.
struct ExitMark {
  int k;
  __device__ explicit ExitMark(int kernel) : k(kernel) { mark(kernel, kEntry); }
  __device__ ~ExitMark() { mark(k, kExit); }
};

}  // namespace m3::cuda::moe_tl
#define M3_MOE_TL_SCOPE(kernel) const m3::cuda::moe_tl::ExitMark moe_tl_exit_mark_(kernel)
#define M3_MOE_TL_WAITED(kernel) m3::cuda::moe_tl::mark(kernel, m3::cuda::moe_tl::kWaited)
#define M3_MOE_TL_MID(kernel) m3::cuda::moe_tl::mark(kernel, m3::cuda::moe_tl::kMid)
#define M3_MOE_TL_DEFINE_HOST(name)                                                                         \
  void m3::cuda::moe_tl::read_##name(Rec* host) {                                                           \
    M3_CUDA_CHECK(cudaMemcpyFromSymbol(host, g_tab, sizeof(g_tab)));                                        \
  }                                                                                                         \
  void m3::cuda::moe_tl::clear_##name() {                                                                   \
    void* p = nullptr;                                                                                      \
    M3_CUDA_CHECK(cudaGetSymbolAddress(&p, g_tab));                                                         \
    M3_CUDA_CHECK(cudaMemset(p, 0, sizeof(g_tab)));                                                         \
  }
#else
#define M3_MOE_TL_SCOPE(kernel) static_assert(true)
#define M3_MOE_TL_WAITED(kernel) ((void)0)
#define M3_MOE_TL_MID(kernel) ((void)0)
#define M3_MOE_TL_DEFINE_HOST(name)                          \
  void m3::cuda::moe_tl::read_##name(Rec* host) { (void)host; } \
  void m3::cuda::moe_tl::clear_##name() {}
#endif
