#pragma once
// Device memory for weights, KV cache and activations: plain cudaMalloc (never managed
// memory), one arena per purpose, bump allocation, freed as a whole.
#include <cstddef>
#include <vector>

namespace m3::cuda {

class DeviceArena {
 public:
  explicit DeviceArena(size_t capacity_bytes);
  ~DeviceArena();
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;

  // 256-byte aligned; throws std::runtime_error naming the request when the arena is full.
  void* allocate(size_t size_bytes);
  void reset() { used_ = 0; }
  size_t used_bytes() const { return used_; }
  size_t capacity_bytes() const { return capacity_; }

 private:
  char* base_ = nullptr;
  size_t capacity_ = 0;
  size_t used_ = 0;
};

struct DeviceInfo {
  int device = 0;
  int sm_count = 0;
  int cc_major = 0, cc_minor = 0;
  size_t total_memory_bytes = 0;
  size_t l2_bytes = 0;
};

// Number of CUDA devices (0 when there is no driver or GPU: never throws).
int device_count();
DeviceInfo device_info(int device);

}  // namespace m3::cuda
