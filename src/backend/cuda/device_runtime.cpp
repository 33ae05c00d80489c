// The CUDA runtime behind ops::BackendRuntime: memory, ordered copies and graphs, all on one
// stream that activate() makes the thread's current stream for every kernel entry.
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/copy_batch.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_internal.h"
#include "backend/cuda/device_pool.h"
#include "backend/cuda/graph_capture.h"

namespace m3::cuda {
namespace {

class CudaRuntime final : public ops::BackendRuntime {
 public:
  explicit CudaRuntime(int device) : device_(device) {
    M3_CUDA_CHECK(cudaSetDevice(device));
    info_ = device_info(device);
    cudaDeviceProp prop{};
    M3_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
    name_ = prop.name;
    M3_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    activate();
  }
  ~CudaRuntime() override {
    clear_events();
    for (auto& [handle, p] : imported_) cudaIpcCloseMemHandle(p);
    release_copy_batch(copy_batch_);
    for (cudaGraphExec_t g : graphs_) cudaGraphExecDestroy(g);
    if (stream_) {
      cudaStreamSynchronize(stream_);
      if (current_stream() == stream_) set_current_stream(nullptr);
      cudaStreamDestroy(stream_);
    }
  }

  Device device() const override { return Device::kCuda; }
  std::string describe() const override {
    char buf[160];
    std::snprintf(buf, sizeof buf, "cuda:%d %s (sm_%d%d, %d SMs, %.1f GiB)", device_, name_.c_str(), info_.cc_major,
                  info_.cc_minor, info_.sm_count, double(info_.total_memory_bytes) / double(1ull << 30));
    return buf;
  }
  void activate() override {
    M3_CUDA_CHECK(cudaSetDevice(device_));
    set_current_stream(stream_);
  }

  void* allocate(size_t bytes) override {
    void* p = nullptr;
    if (bytes == 0) return nullptr;
    const cudaError_t err = cudaMalloc(&p, bytes);
    if (err != cudaSuccess) {
      cudaGetLastError();
      size_t free_b = 0, total_b = 0;
      cudaMemGetInfo(&free_b, &total_b);
      throw std::runtime_error("cudaMalloc of " + std::to_string(bytes) + " bytes failed (" + cudaGetErrorString(err) +
                               "); " + std::to_string(free_b) + " of " + std::to_string(total_b) + " bytes free");
    }
    M3_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, stream_));
    return p;
  }
  void release(void* p) override {
    if (!p) return;
    cudaStreamSynchronize(stream_);  // no kernel may still be using it
    cudaFree(p);
  }
  void* allocate_host(size_t bytes) override {
    void* p = nullptr;
    if (bytes == 0) return nullptr;
    M3_CUDA_CHECK(cudaMallocHost(&p, bytes));
    return p;
  }
  void release_host(void* p) override {
    if (p) cudaFreeHost(p);
  }
  void upload(void* dst, const void* src, size_t bytes) override {
    if (bytes) M3_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_));
  }
  void download(void* dst, const void* src, size_t bytes) override {
    if (bytes) M3_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_));
    M3_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  void download_async(void* dst, const void* src, size_t bytes) override {
    if (bytes) M3_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_));
  }
  void copy(void* dst, const void* src, size_t bytes) override {
    if (bytes) M3_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_));
  }
  void copy_batch(const std::vector<CopyPiece>& pieces) override {
    activate();
    copy_pieces(pieces, copy_batch_, stream_);
  }
  void synchronize() override { M3_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

  // CUDA IPC: the base handle (process, pointer) plus the allocation's cudaIpcMemHandle; another
  // process on the host opens it (peer access enabled where the devices differ), this process
  // takes the pointer itself.
  std::string export_memory(void* base, std::string* error) override {
    std::string h = BackendRuntime::export_memory(base, error);
    if (h.empty()) return h;
    cudaIpcMemHandle_t ipc{};
    const cudaError_t err = cudaIpcGetMemHandle(&ipc, base);
    if (err != cudaSuccess) {
      cudaGetLastError();
      *error = std::string("cudaIpcGetMemHandle: ") + cudaGetErrorString(err);
      return "";
    }
    static const char* const kHex = "0123456789abcdef";
    h += " cuda=";
    for (size_t i = 0; i < sizeof ipc.reserved; ++i) {
      const auto b = uint8_t(ipc.reserved[i]);
      h += kHex[b >> 4];
      h += kHex[b & 15];
    }
    return h;
  }
  void* import_memory(const std::string& handle, std::string* error) override {
    std::string local;
    if (void* p = BackendRuntime::import_memory(handle, &local)) return p;  // this process's own
    auto it = imported_.find(handle);
    if (it != imported_.end()) return it->second;
    const size_t at = handle.find(" cuda=");
    cudaIpcMemHandle_t ipc{};
    if (at == std::string::npos || handle.size() - at - 6 != 2 * sizeof ipc.reserved) {
      *error = local + "; and it carries no CUDA IPC handle";
      return nullptr;
    }
    for (size_t i = 0; i < sizeof ipc.reserved; ++i) {
      auto nib = [](char c) { return c <= '9' ? c - '0' : c - 'a' + 10; };
      ipc.reserved[i] = char(nib(handle[at + 6 + 2 * i]) << 4 | nib(handle[at + 7 + 2 * i]));
    }
    activate();
    void* p = nullptr;
    const cudaError_t err = cudaIpcOpenMemHandle(&p, ipc, cudaIpcMemLazyEnablePeerAccess);
    if (err != cudaSuccess) {
      cudaGetLastError();
      *error = std::string("cudaIpcOpenMemHandle: ") + cudaGetErrorString(err);
      return nullptr;
    }
    imported_[handle] = p;
    return p;
  }
  size_t free_memory_bytes() const override {
    size_t free_b = 0, total_b = 0;
    M3_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    return free_b;
  }
  size_t total_memory_bytes() const override { return info_.total_memory_bytes; }

  bool supports_graphs() const override { return true; }
  int capture(const std::function<void()>& fn) override {
    activate();
    graphs_.push_back(capture_graph(stream_, fn));
    return int(graphs_.size()) - 1;
  }
  void replay(int graph) override {
    if (graph < 0 || size_t(graph) >= graphs_.size()) throw std::runtime_error("replay of unknown graph " + std::to_string(graph));
    M3_CUDA_CHECK(cudaGraphLaunch(graphs_[size_t(graph)], stream_));
  }
  int record_event() override {
    cudaEvent_t e = nullptr;
    M3_CUDA_CHECK(cudaEventCreate(&e));
    M3_CUDA_CHECK(cudaEventRecord(e, stream_));
    events_.push_back(e);
    return int(events_.size()) - 1;
  }
  double elapsed_ms(int from, int to) override {
    M3_CUDA_CHECK(cudaEventSynchronize(events_.at(size_t(to))));
    float ms = 0.0f;
    M3_CUDA_CHECK(cudaEventElapsedTime(&ms, events_.at(size_t(from)), events_.at(size_t(to))));
    return double(ms);
  }
  void clear_events() override {
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
    events_.clear();
  }

 private:
  std::vector<cudaEvent_t> events_;
  int device_ = 0;
  DeviceInfo info_;
  std::string name_;
  cudaStream_t stream_ = nullptr;
  std::vector<cudaGraphExec_t> graphs_;
  std::map<std::string, void*> imported_;  // other processes' memory, mapped once
  CopyBatchBuffers copy_batch_;
};

}  // namespace

std::unique_ptr<ops::BackendRuntime> make_cuda_runtime(int device) {
  const int n = device_count();
  if (device < 0 || device >= n) {
    throw std::runtime_error("CUDA device " + std::to_string(device) + " requested, " + std::to_string(n) +
                             " present");
  }
  return std::make_unique<CudaRuntime>(device);
}

}  // namespace m3::cuda
