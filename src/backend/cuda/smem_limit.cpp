// allow_dynamic_smem (cuda_internal.h): the per-(kernel, device) dynamic shared-memory limit; and
// the per-device attribute cache beside it.
#include <atomic>
#include <map>
#include <mutex>
#include <utility>

#include <cuda_runtime_api.h>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_internal.h"

namespace m3::cuda {

int allow_dynamic_smem(const void* kernel, size_t bytes) {
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, int> done;  // -> SM count
  int device = 0;
  M3_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mu);
  auto it = done.find({kernel, device});
  if (it != done.end()) return it->second;
  int sms = 0;
  M3_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  if (bytes > 48 * 1024) {
    M3_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
  }
  done[{kernel, device}] = sms;
  return sms;
}

// Lock-free: it sits on launch paths (every linear launch, every MSA plan). A slot holds the
// value + 1 once read (0: not yet); racing first reads store the same value.
int current_device_attribute(cudaDeviceAttr attr) {
  constexpr int kDevices = 64, kAttrs = 256;
  static std::atomic<int> cache[kDevices][kAttrs];
  int device = 0;
  M3_CUDA_CHECK(cudaGetDevice(&device));
  const int a = int(attr);
  const bool cached = device >= 0 && device < kDevices && a >= 0 && a < kAttrs;
  if (cached) {
    const int v = cache[device][a].load(std::memory_order_relaxed);
    if (v != 0) return v - 1;
  }
  int v = 0;
  M3_CUDA_CHECK(cudaDeviceGetAttribute(&v, attr, device));
  if (cached) cache[device][a].store(v + 1, std::memory_order_relaxed);
  return v;
}

}  // namespace m3::cuda
