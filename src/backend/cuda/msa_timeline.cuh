// Phase timestamps of the decode MSA kernels, for latency work on small batches (where the
// step is a chain of dependent phases and the stall samples of a profiler do not say which
// phase is long). Compiled in only with -DM3_MSA_TIMELINE (CMake option M3_MSA_TIMELINE):
// thread 0 of each of the first 1024 CTAs records %globaltimer (one clock for all SMs) and the
// SM clock at the kernel's marks (the indexer's selection steps: the first query group's CTAs
// only), and the last CTA to finish prints, per mark, the earliest and latest CTA and the
// CTAs' 10th / 50th / 90th percentiles in ns after the earliest entry, and the clock rate it
// ran at.
// Without the macro the marks are empty statements. Marks (docs/msa_kernels.md, ninth round):
//   indexer: 0 entry, 1 group range known, 2 setup done (first tiles requested, fragments;
//            exact scan: the first block's keys in shared memory), 6 first unit's MMAs (exact
//            scan: the first block's scores written), 7 candidates listed, 3 scan and exact dots
//            done, 4 last CTA arrived, 8-11 selection steps of row 0 (scores loaded, threshold,
//            list, ranked), 5 selection written;
//   attention: 0 entry, 1 Q staged, 2 past the PDL wait, 3 selection union and pages,
//            4 units done, 5 cluster barrier, 6 output written.
// linear_mma.cu uses the same tables when built with -DM3_LINEAR_TIMELINE (docs/linear_kernels.md).
#pragma once

#ifdef M3_MSA_TIMELINE
#include <cstdio>

namespace m3::cuda::msa_tl {

constexpr int kMarks = 12, kCtas = 1024;

__device__ __forceinline__ unsigned long long now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// A kernel's marks: [cta][mark], 0 = not reached.
struct Table {
  unsigned long long t[kCtas][kMarks];
  long long clk[kCtas][kMarks];  // the SM's clock at the same marks: the clock rate in the run
  unsigned done;
};

__device__ __forceinline__ void mark(Table& tb, int cta, int m) {
  if (threadIdx.x == 0 && cta >= 0 && cta < kCtas) {
    tb.clk[cta][m] = clock64();
    tb.t[cta][m] = now();
  }
}

// Called by every CTA of the group at its end; the last prints and clears the table.
__device__ __forceinline__ void finish(Table& tb, int cta, int ctas, const char* name) {
  if (threadIdx.x != 0 || cta < 0 || cta >= kCtas) return;
  __threadfence();
  if (atomicAdd(&tb.done, 1u) != unsigned(ctas) - 1) return;
  __threadfence();
  unsigned long long t0 = ~0ull;
  for (int c = 0; c < ctas && c < kCtas; ++c) t0 = tb.t[c][0] && tb.t[c][0] < t0 ? tb.t[c][0] : t0;
  int last_mark = 0;
  for (int m = 1; m < kMarks; ++m) last_mark = tb.t[cta][m] > tb.t[cta][last_mark] ? m : last_mark;
  const double ghz = last_mark > 0 ? double(tb.clk[cta][last_mark] - tb.clk[cta][0]) /
                                         double(tb.t[cta][last_mark] - tb.t[cta][0]) : 0.0;
  printf("[timeline %s] ctas %d entry %llu ns, SM clock %.2f GHz\n", name, ctas, t0, ghz);
  for (int m = 0; m < kMarks; ++m) {
    unsigned long long lo = ~0ull, hi = 0;
    int n = 0;
    for (int c = 0; c < ctas && c < kCtas; ++c) {
      const unsigned long long x = tb.t[c][m];
      if (x == 0) continue;
      lo = x < lo ? x : lo;
      hi = x > hi ? x : hi;
      ++n;
    }
    if (n == 0) continue;
    // Percentiles over the CTAs that reached the mark (insertion sort of at most kCtas values).
    unsigned long long v[kCtas];
    int k = 0;
    for (int c = 0; c < ctas && c < kCtas; ++c) {
      const unsigned long long x = tb.t[c][m];
      if (x == 0) continue;
      int j = k++;
      while (j > 0 && v[j - 1] > x) {
        v[j] = v[j - 1];
        --j;
      }
      v[j] = x;
    }
    printf("[timeline %s] mark %d: %d ctas, first %llu last %llu p10 %llu p50 %llu p90 %llu\n", name, m, n, lo - t0,
           hi - t0, v[n / 10] - t0, v[n / 2] - t0, v[(9 * n) / 10] - t0);
  }
  for (int c = 0; c < ctas && c < kCtas; ++c) {
    for (int m = 0; m < kMarks; ++m) tb.t[c][m] = 0;
  }
  tb.done = 0;
}

// One table per kernel; static: each translation unit has its own (no relocatable device code).
static __device__ Table g_indexer, g_attention;
static __device__ Table g_linear_split, g_linear_gemm;  // linear_mma.cu (CMake option M3_LINEAR_TIMELINE)

}  // namespace m3::cuda::msa_tl

#define M3_TL_MARK(kernel, cta, m) m3::cuda::msa_tl::mark(m3::cuda::msa_tl::g_##kernel, cta, m)
#define M3_TL_FINISH(kernel, cta, ctas) m3::cuda::msa_tl::finish(m3::cuda::msa_tl::g_##kernel, cta, ctas, #kernel)
#else
#define M3_TL_MARK(kernel, cta, m) ((void)0)
#define M3_TL_FINISH(kernel, cta, ctas) ((void)0)
#endif

// Phase clocks of the prefill indexer's block loop (-DM3_MSA_PHASES, CMake option
// M3_MSA_PHASES; never for serving): lane 0 of every warp adds the SM clocks it spent in each
// phase of every stage, and the launch's last CTA prints the mean per (warp, stage) and resets.
// The mean is a warp's wall time per phase (its waits for the scheduler included), so the
// phases of one stage add up to the stage's length.
#ifdef M3_MSA_PHASES
#include <cstdio>

namespace m3::cuda::msa_ph {

constexpr int kPhases = 10, kStagePhases = 8;  // phases 0-7 per stage, 8-9 per CTA
struct Table {
  unsigned long long cyc[kPhases];
  unsigned long long stages;  // (warp, stage) pairs
  unsigned long long ctas_with_work;
  unsigned done;
};
static __device__ Table g_prefill;

__device__ __forceinline__ const char* phase_name(int p) {
  switch (p) {
    case 0: return "copy wait + barrier A";
    case 1: return "next stage's copies";
    case 2: return "wgmma + gram";
    case 3: return "barrier B";
    case 4: return "max + mask";
    case 5: return "candidate list";
    case 6: return "exact dots";
    case 7: return "score writes";
    case 8: return "prologue";
    default: return "selection";
  }
}

// Per-warp accumulators in static shared memory (registers would perturb the kernel: ten 64-bit
// sums spilled), 32-bit clocks: a warp's phase sum stays far below 2^32 cycles.
struct Acc {
  unsigned* row;
  unsigned t = 0, n = 0;
  __device__ __forceinline__ void start(unsigned* base) {
    row = base + (threadIdx.x >> 5) * kPhases;
    if ((threadIdx.x & 31) == 0) {
      for (int p = 0; p < kPhases; ++p) row[p] = 0;
    }
    t = unsigned(clock());
  }
  __device__ __forceinline__ void lap(int p) {
    const unsigned x = unsigned(clock());
    if ((threadIdx.x & 31) == 0) row[p] += x - t;
    t = x;
  }
  __device__ __forceinline__ void flush(Table& tb) {
    if ((threadIdx.x & 31) != 0) return;
    for (int p = 0; p < kPhases; ++p) atomicAdd(&tb.cyc[p], (unsigned long long)row[p]);
    atomicAdd(&tb.stages, (unsigned long long)n);
    __threadfence();
  }
};

// Every CTA calls this once, at its exit; the last one prints.
__device__ __forceinline__ void exit_cta(Table& tb, bool worked) {
  __syncthreads();
  if (threadIdx.x != 0) return;
  __threadfence();
  if (worked) atomicAdd(&tb.ctas_with_work, 1ull);
  if (atomicAdd(&tb.done, 1u) != gridDim.x * gridDim.y - 1) return;
  __threadfence();
  const double n = tb.stages ? double(tb.stages) : 1.0;
  const double ctas = tb.ctas_with_work ? double(tb.ctas_with_work) : 1.0;
  printf("[phases prefill] grid %u x %u, %llu (warp, stage) pairs, %llu CTAs with blocks\n", gridDim.x, gridDim.y,
         tb.stages, tb.ctas_with_work);
  double tot = 0.0;
  for (int p = 0; p < kStagePhases; ++p) tot += double(tb.cyc[p]) / n;
  for (int p = 0; p < kPhases; ++p) {
    const double per = p < kStagePhases ? double(tb.cyc[p]) / n : double(tb.cyc[p]) / (ctas * blockDim.x / 32);
    printf("[phases prefill] %-24s %9.1f cycles per %s%s\n", phase_name(p), per, p < kStagePhases ? "warp-stage" : "warp",
           p < kStagePhases ? "" : " (whole CTA)");
  }
  printf("[phases prefill] stage total %.1f cycles\n", tot);
  for (int p = 0; p < kPhases; ++p) tb.cyc[p] = 0;
  tb.stages = tb.ctas_with_work = 0;
  tb.done = 0;
}

}  // namespace m3::cuda::msa_ph

#define M3_PH_DECL                                            \
  __shared__ unsigned ph_rows[32 * m3::cuda::msa_ph::kPhases]; \
  m3::cuda::msa_ph::Acc ph_acc
#define M3_PH_START() ph_acc.start(ph_rows)
#define M3_PH_LAP(p) ph_acc.lap(p)
#define M3_PH_STAGE() (++ph_acc.n)
#define M3_PH_FLUSH() ph_acc.flush(m3::cuda::msa_ph::g_prefill)
#define M3_PH_EXIT(worked) m3::cuda::msa_ph::exit_cta(m3::cuda::msa_ph::g_prefill, worked)
// A CTA that scanned blocks, at its exit: the selection phase (9), its sums, its exit.
#define M3_PH_DONE() \
  do {                \
    M3_PH_LAP(9);     \
    M3_PH_FLUSH();    \
    M3_PH_EXIT(true); \
  } while (0)
#else
#define M3_PH_DECL static_assert(true)
#define M3_PH_START() ((void)0)
#define M3_PH_LAP(p) ((void)0)
#define M3_PH_STAGE() ((void)0)
#define M3_PH_FLUSH() ((void)0)
#define M3_PH_EXIT(worked) ((void)0)
#define M3_PH_DONE() ((void)0)
#endif
