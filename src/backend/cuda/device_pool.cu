#include <string>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_internal.h"
#include "backend/cuda/device_pool.h"

namespace m3::cuda {

DeviceArena::DeviceArena(size_t capacity_bytes) : capacity_(capacity_bytes) {
  M3_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&base_), capacity_bytes));
}

DeviceArena::~DeviceArena() {
  if (base_) cudaFree(base_);
}

void* DeviceArena::allocate(size_t size_bytes) {
  const size_t start = (used_ + 255) / 256 * 256;
  if (start + size_bytes > capacity_) {
    throw std::runtime_error("device arena full: asked " + std::to_string(size_bytes) + " bytes, " +
                             std::to_string(capacity_ - start) + " left of " + std::to_string(capacity_));
  }
  used_ = start + size_bytes;
  return base_ + start;
}

namespace {
thread_local cudaStream_t g_stream = nullptr;
}

cudaStream_t current_stream() { return g_stream; }
void set_current_stream(cudaStream_t stream) { g_stream = stream; }

Scratch::Scratch(size_t size_bytes) {
  if (size_bytes > 0) M3_CUDA_CHECK(cudaMallocAsync(&ptr_, size_bytes, current_stream()));
  owned_ = ptr_ != nullptr;
}

Scratch::Scratch(size_t size_bytes, FixedScratch& fixed) : Scratch(size_bytes <= fixed.bytes() ? 0 : size_bytes) {
  if (size_bytes > 0 && size_bytes <= fixed.bytes()) ptr_ = fixed.address();
}

Scratch::~Scratch() {
  if (owned_) cudaFreeAsync(ptr_, current_stream());  // a destructor cannot throw; the pool reports later
}

void* FixedScratch::address() {
  int dev = 0;
  M3_CUDA_CHECK(cudaGetDevice(&dev));
  void*& p = cache_[dev & 63];
  if (!p) M3_CUDA_CHECK(cudaGetSymbolAddress(&p, symbol_));
  return p;
}

int device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return count;
}

DeviceInfo device_info(int device) {
  cudaDeviceProp prop{};
  M3_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  DeviceInfo info;
  info.device = device;
  info.sm_count = prop.multiProcessorCount;
  info.cc_major = prop.major;
  info.cc_minor = prop.minor;
  info.total_memory_bytes = prop.totalGlobalMem;
  info.l2_bytes = size_t(prop.l2CacheSize);
  return info;
}

}  // namespace m3::cuda
