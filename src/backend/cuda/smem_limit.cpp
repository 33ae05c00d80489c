// allow_dynamic_smem (cuda_internal.h): the per-(kernel, device) dynamic shared-memory limit; and
// the per-device attribute cache beside it.
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

int current_device_attribute(cudaDeviceAttr attr) {
  static std::mutex mu;
  static std::map<std::pair<int, int>, int> values;  // (attribute, device) -> value
  int device = 0;
  M3_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mu);
  auto it = values.find({int(attr), device});
  if (it != values.end()) return it->second;
  int v = 0;
  M3_CUDA_CHECK(cudaDeviceGetAttribute(&v, attr, device));
  values[{int(attr), device}] = v;
  return v;
}

}  // namespace m3::cuda
