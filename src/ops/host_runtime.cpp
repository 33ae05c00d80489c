#include "ops/host_runtime.h"

#include <chrono>
#include <cstdlib>
#include <mutex>
#include <vector>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>
#include <thread>

#include <unistd.h>

namespace m3::ops {

namespace {

class HostRuntime final : public BackendRuntime {
 public:
  Device device() const override { return Device::kCpu; }
  std::string describe() const override {
    return "cpu (" + std::to_string(std::thread::hardware_concurrency()) + " threads)";
  }
  void* allocate(size_t bytes) override {
    void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!p) throw std::runtime_error("host allocation of " + std::to_string(bytes) + " bytes failed");
    std::memset(p, 0, bytes);
    return p;
  }
  void release(void* p) override { std::free(p); }
  void* allocate_host(size_t bytes) override { return allocate(bytes); }
  void release_host(void* p) override { std::free(p); }
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
  size_t free_memory_bytes() const override {
    return size_t(sysconf(_SC_AVPHYS_PAGES)) * size_t(sysconf(_SC_PAGESIZE));
  }
  size_t total_memory_bytes() const override { return size_t(sysconf(_SC_PHYS_PAGES)) * size_t(sysconf(_SC_PAGESIZE)); }

 private:
  std::mutex mu_;
  std::vector<std::chrono::steady_clock::time_point> events_;
};

}  // namespace

BackendRuntime* host_runtime() {
  static HostRuntime runtime;
  return &runtime;
}

}  // namespace m3::ops
