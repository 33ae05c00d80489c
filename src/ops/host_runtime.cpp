#include "ops/host_runtime.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <unordered_map>
#include <vector>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>
#include <thread>

#include <sys/mman.h>
#include <unistd.h>

namespace m3::ops {

namespace {

class HostRuntime final : public BackendRuntime {
 public:
  Device device() const override { return Device::kCpu; }
  std::string describe() const override {
    return "cpu (" + std::to_string(std::thread::hardware_concurrency()) + " threads)";
  }
  // Zeroed memory. Large buffers are anonymous mappings: the kernel's zero pages, touched only where
  // written, so a KV cache of a GB costs nothing until its pages are used (a memset of it was
  // 2.3 s of page faults at every CPU engine start).
  void* allocate(size_t bytes) override {
    if (bytes >= kMappedBytes) {
      void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) throw std::runtime_error("host allocation of " + std::to_string(bytes) + " bytes failed");
      std::lock_guard<std::mutex> lock(mu_);
      mapped_.emplace(p, bytes);
      return p;
    }
    void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!p) throw std::runtime_error("host allocation of " + std::to_string(bytes) + " bytes failed");
    std::memset(p, 0, bytes);
    return p;
  }
  void release(void* p) override {
    if (p == nullptr) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      const auto it = mapped_.find(p);
      if (it != mapped_.end()) {
        munmap(p, it->second);
        mapped_.erase(it);
        return;
      }
    }
    std::free(p);
  }
  void* allocate_host(size_t bytes) override { return allocate(bytes); }
  void release_host(void* p) override { release(p); }
  void upload(void* dst, const void* src, size_t bytes) override {
    if (bytes) std::memmove(dst, src, bytes);
  }
  void download(void* dst, const void* src, size_t bytes) override {
    if (bytes) std::memmove(dst, src, bytes);
  }
  void download_async(void* dst, const void* src, size_t bytes) override {
    if (bytes) std::memmove(dst, src, bytes);
  }
  void copy(void* dst, const void* src, size_t bytes) override {
    if (bytes) std::memmove(dst, src, bytes);
  }
  void synchronize() override {}
  int record_event() override {
    std::lock_guard<std::mutex> lock(mu_);
    events_.push_back(std::chrono::steady_clock::now());
    return int(events_.size()) - 1;
  }
  double elapsed_ms(int from, int to) override {
    std::lock_guard<std::mutex> lock(mu_);
    return std::chrono::duration<double, std::milli>(events_.at(size_t(to)) - events_.at(size_t(from))).count();
  }
  void clear_events() override {
    std::lock_guard<std::mutex> lock(mu_);
    events_.clear();
  }
  // The kernel's estimate of what can be allocated without swapping (MemAvailable: free pages and
  // reclaimable caches); free pages alone where /proc/meminfo lacks it.
  size_t free_memory_bytes() const override {
    if (FILE* f = std::fopen("/proc/meminfo", "r")) {
      char line[256];
      unsigned long long kb = 0;
      bool found = false;
      while (!found && std::fgets(line, sizeof line, f)) found = std::sscanf(line, "MemAvailable: %llu kB", &kb) == 1;
      std::fclose(f);
      if (found) return size_t(kb) * 1024;
    }
    return size_t(sysconf(_SC_AVPHYS_PAGES)) * size_t(sysconf(_SC_PAGESIZE));
  }
  size_t total_memory_bytes() const override { return size_t(sysconf(_SC_PHYS_PAGES)) * size_t(sysconf(_SC_PAGESIZE)); }

 private:
  static constexpr size_t kMappedBytes = size_t(1) << 20;
  std::mutex mu_;
  std::vector<std::chrono::steady_clock::time_point> events_;
  std::unordered_map<void*, size_t> mapped_;  // mapped allocations and their sizes
};

}  // namespace

BackendRuntime* host_runtime() {
  static HostRuntime runtime;
  return &runtime;
}

}  // namespace m3::ops
