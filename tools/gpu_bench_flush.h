#pragma once
// How the GPU benchmarks empty L2 before each timed call.
//   read (default): a kernel reads a 256 MB buffer; L2 is left holding clean lines that the timed
//     call evicts for free, as in a serving step, where the previous kernels mostly read (weights,
//     KV pages) and wrote little.
//   memset: cudaMemsetAsync of the buffer (what nvbench and Triton's do_bench do). L2 is left
//     full of dirty lines, and a timed call that reads more than L2 holds first pays for writing
//     them back (~50 MB on an H100/H200: ~12 us at 4.2 TB/s), which no serving step does.
//   none (M3_BENCH_WARM_L2=1): no flush; a diagnostic only.
// M3_BENCH_FLUSH=read|memset picks; the benchmarks print and record the mode.
#include <cuda_runtime.h>

#include <cstddef>

namespace m3::gpu_bench {

enum class Flush { kRead, kMemset, kNone };

Flush flush_mode();  // from the environment, read once
const char* flush_name(Flush f);
// Empties L2 on `stream` by `f`, through `buf` (bytes, >= twice L2). `iter` varies the memset value.
void flush_l2(Flush f, void* buf, size_t bytes, int iter, cudaStream_t stream);

}  // namespace m3::gpu_bench
