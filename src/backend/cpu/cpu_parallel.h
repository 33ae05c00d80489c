#pragma once
// Independent items of a CPU reference kernel spread over host threads. Each item writes only its
// own outputs and computes them exactly as it would alone, so results do not depend on the thread
// count (the GPU parity tests compare against these bits).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

namespace m3::cpu {

// Threads a call may use: set_cpu_threads's value, else M3_CPU_THREADS if set to a positive
// number, else the hardware's. set_cpu_threads(0) returns to the default (process-wide, as
// OpenBLAS's thread count).
int cpu_threads();
void set_cpu_threads(int n);

// Calls below this many inner-loop steps run on the calling thread: starting threads costs more.
constexpr int64_t kParallelMinWork = int64_t(1) << 22;

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
  auto run = [&] {
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < n; i = next.fetch_add(1, std::memory_order_relaxed)) fn(i);
  };
  std::vector<std::thread> pool;
  pool.reserve(size_t(threads - 1));
  for (int t = 1; t < threads; ++t) pool.emplace_back(run);
  run();
  for (auto& th : pool) th.join();
}

}  // namespace m3::cpu
