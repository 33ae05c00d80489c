#include "backend/cpu/cpu_parallel.h"

#include <cstdlib>

namespace m3::cpu {
namespace {

std::atomic<int> g_override{0};

int default_threads() {
  static const int n = [] {
    if (const char* env = std::getenv("M3_CPU_THREADS")) {
      const int v = std::atoi(env);
      if (v > 0) return v;
    }
    return std::max(1, int(std::thread::hardware_concurrency()));
  }();
  return n;
}

}  // namespace

int cpu_threads() {
  const int o = g_override.load(std::memory_order_relaxed);
  return o > 0 ? o : default_threads();
}

void set_cpu_threads(int n) { g_override.store(n > 0 ? n : 0, std::memory_order_relaxed); }

}  // namespace m3::cpu
