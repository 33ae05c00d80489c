#pragma once
// What a backend gives the model and the engine besides kernels: memory in its own address
// space, ordered copies, and (where the backend has them) graphs of recorded work. The model
// allocates weights, KV and activations only through this, so it never names a backend.
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace m3::ops {

class BackendRuntime {
 public:
  virtual ~BackendRuntime() = default;
  virtual Device device() const = 0;
  virtual std::string describe() const = 0;  // "cpu", "cuda:0 NVIDIA H200 (132 SMs, 139.8 GiB)"
  // Binds the calling thread to this runtime (device and stream), so kernels the ops launch
  // from it go where this runtime's copies and graphs go. Call it on the thread that steps.
  virtual void activate() {}

  // Zero-filled backend memory; throws std::runtime_error naming the size when it cannot.
  virtual void* allocate(size_t bytes) = 0;
  virtual void release(void* p) = 0;
  // Page-locked host memory for staging copies (plain memory on the CPU).
  virtual void* allocate_host(size_t bytes) = 0;
  virtual void release_host(void* p) = 0;

  // Ordered after earlier work; `src` must stay valid until the next synchronize().
  virtual void upload(void* dst, const void* src, size_t bytes) = 0;
  // Returns when the bytes are on the host.
  virtual void download(void* dst, const void* src, size_t bytes) = 0;
  // Queued after earlier work; the bytes are on the host after the next synchronize().
  virtual void download_async(void* dst, const void* src, size_t bytes) = 0;
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;  // backend to backend
  // Many backend-to-backend copies at once (a KV transfer's pages: one per block and tensor),
  // queued like copy(). Backends may issue them as one launch.
  // A piece is `rows` runs of `bytes`, the runs `dst_pitch` / `src_pitch` bytes apart (one run:
  // a plain copy; several: a slice of each row, e.g. some heads of every token of a KV page).
  struct CopyPiece {
    void* dst;
    const void* src;
    size_t bytes;
    size_t rows = 1;
    size_t dst_pitch = 0, src_pitch = 0;
  };
  virtual void copy_batch(const std::vector<CopyPiece>& pieces) {
    for (const CopyPiece& p : pieces)
      for (size_t r = 0; r < p.rows; ++r)
        copy(static_cast<char*>(p.dst) + r * p.dst_pitch, static_cast<const char*>(p.src) + r * p.src_pitch, p.bytes);
  }

  // Memory another engine on this host may read (KV transfers between processes): a handle to
  // the allocation `base` (allocate()'s pointer) that import_memory() maps, in this process or
  // another one. The handle names the process; a backend maps only what it can reach (the CPU:
  // its own process). On failure "" / nullptr and the reason in *error.
  virtual std::string export_memory(void* base, std::string* error);
  virtual void* import_memory(const std::string& handle, std::string* error);
  virtual void synchronize() = 0;
  // Free and total backend memory in bytes (the KV pool is sized from it).
  virtual size_t free_memory_bytes() const = 0;
  virtual size_t total_memory_bytes() const = 0;

  // Graphs: record the work `fn` issues (nothing runs), replay it later with the same
  // pointers. Backends without graphs return -1 from capture.
  virtual bool supports_graphs() const { return false; }
  virtual int capture(const std::function<void()>& fn) {
    (void)fn;
    return -1;
  }
  virtual void replay(int graph) { (void)graph; }

  // Timing marks queued in order with the work (host clock on the CPU): record_event()
  // returns an id; elapsed_ms(a, b) waits for b and returns the time between them.
  virtual int record_event() = 0;
  virtual double elapsed_ms(int from, int to) = 0;
  virtual void clear_events() = 0;
};

// An owning allocation in a runtime's memory, with a typed view.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(BackendRuntime* rt, size_t bytes) : rt_(rt), bytes_(bytes) {
    if (bytes > 0) ptr_ = rt->allocate(bytes);
  }
  ~DeviceBuffer() { reset(); }
  DeviceBuffer(DeviceBuffer&& o) noexcept : rt_(o.rt_), ptr_(o.ptr_), bytes_(o.bytes_) { o.ptr_ = nullptr; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      reset();
      rt_ = o.rt_;
      ptr_ = o.ptr_;
      bytes_ = o.bytes_;
      o.ptr_ = nullptr;
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void reset() {
    if (ptr_) rt_->release(ptr_);
    ptr_ = nullptr;
  }
  void* data() const { return ptr_; }
  template <class T> T* as() const { return static_cast<T*>(ptr_); }
  size_t size_bytes() const { return bytes_; }
  TensorView view(DType dtype, Shape shape) const { return TensorView{ptr_, dtype, std::move(shape), rt_->device()}; }

 private:
  BackendRuntime* rt_ = nullptr;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// Page-locked host staging memory.
class HostStaging {
 public:
  HostStaging() = default;
  HostStaging(BackendRuntime* rt, size_t bytes) : rt_(rt), bytes_(bytes) {
    if (bytes > 0) ptr_ = rt->allocate_host(bytes);
  }
  ~HostStaging() {
    if (ptr_) rt_->release_host(ptr_);
  }
  HostStaging(HostStaging&& o) noexcept : rt_(o.rt_), ptr_(o.ptr_), bytes_(o.bytes_) { o.ptr_ = nullptr; }
  HostStaging& operator=(HostStaging&& o) noexcept {
    if (this != &o) {
      if (ptr_) rt_->release_host(ptr_);
      rt_ = o.rt_;
      ptr_ = o.ptr_;
      bytes_ = o.bytes_;
      o.ptr_ = nullptr;
    }
    return *this;
  }
  HostStaging(const HostStaging&) = delete;
  HostStaging& operator=(const HostStaging&) = delete;
  template <class T> T* as() const { return static_cast<T*>(ptr_); }
  size_t size_bytes() const { return bytes_; }

 private:
  BackendRuntime* rt_ = nullptr;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace m3::ops
