#pragma once
// Non-owning tensor views and a small owning host buffer. Device memory is the backend's;
// a view only says where the bytes are and how to read them.
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "core/dtype.h"

namespace m3 {

enum class Device { kCpu, kCuda };

struct Shape {
  std::vector<int64_t> dims;
  Shape() = default;
  Shape(std::initializer_list<int64_t> d) : dims(d) {}
  explicit Shape(std::vector<int64_t> d) : dims(std::move(d)) {}
  int rank() const { return int(dims.size()); }
  int64_t operator[](int i) const { return dims[size_t(i)]; }
  int64_t numel() const {
    return std::accumulate(dims.begin(), dims.end(), int64_t{1}, std::multiplies<int64_t>());
  }
  bool operator==(const Shape& other) const { return dims == other.dims; }
  std::string str() const;
};

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kF32;
  Shape shape;
  Device device = Device::kCpu;

  int64_t numel() const { return shape.numel(); }
  size_t size_bytes() const { return size_t(numel()) * dtype_size_bytes(dtype); }
  template <class T> T* as() const { return static_cast<T*>(data); }
};

// Owning, 64-byte aligned host buffer; the CPU backend's storage.
class HostBuffer {
 public:
  HostBuffer() = default;
  explicit HostBuffer(size_t size_bytes);
  void* data() const { return ptr_.get(); }
  size_t size_bytes() const { return size_bytes_; }

 private:
  struct Free { void operator()(void* p) const; };
  std::unique_ptr<void, Free> ptr_;
  size_t size_bytes_ = 0;
};

// A host tensor that owns its bytes.
struct HostTensor {
  HostBuffer buffer;
  TensorView view;
  static HostTensor empty(DType dtype, Shape shape);
  template <class T> T* as() const { return view.as<T>(); }
  int64_t numel() const { return view.numel(); }
};

}  // namespace m3
