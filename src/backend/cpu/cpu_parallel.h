#pragma once
// Independent items of a CPU reference kernel spread over host threads. Each item writes only its
// own outputs and computes them exactly as it would alone, so results do not depend on the thread
// count (the GPU parity tests compare against these bits).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>

namespace m3::cpu {

// Threads a call may use: set_cpu_threads's value, else M3_CPU_THREADS if set to a positive
// number, else the hardware's. set_cpu_threads(0) returns to the default (process-wide, as
// OpenBLAS's thread count).
int cpu_threads();
void set_cpu_threads(int n);

// Calls below this many inner-loop steps run on the calling thread: waking the pool costs more.
constexpr int64_t kParallelMinWork = int64_t(1) << 21;

// body() on `threads` threads at once (the caller's among them), returning when every one has.
// Workers are kept between calls (a decode step makes dozens of calls: starting threads for each
// cost more than the work of most). A call made while the pool serves another caller (tensor
// parallel ranks are threads of one process) or from inside a body starts threads of its own.
void run_on_threads(int threads, const std::function<void()>& body);

// fn(i) for every i in [0, n), items taken one at a time from a shared counter (causal rows
// differ in cost); `work` is the call's total inner-loop steps, roughly.
template <class F>
void parallel_for(int64_t n, int64_t work, F&& fn) {
  const int threads = int(std::min<int64_t>(n, cpu_threads()));
  if (threads <= 1 || work < kParallelMinWork) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::atomic<int64_t> next{0};
  run_on_threads(threads, [&] {
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < n; i = next.fetch_add(1, std::memory_order_relaxed)) fn(i);
  });
}

}  // namespace m3::cpu
