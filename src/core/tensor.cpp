#include "core/tensor.h"

#include <cstdlib>
#include <cstring>
#include <new>

namespace m3 {

std::string Shape::str() const {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

void HostBuffer::Free::operator()(void* p) const { std::free(p); }

HostBuffer::HostBuffer(size_t size_bytes) : size_bytes_(size_bytes) {
  size_t rounded = (size_bytes + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, rounded ? rounded : 64);
  if (!p) throw std::bad_alloc();
  std::memset(p, 0, rounded ? rounded : 64);
  ptr_.reset(p);
}

HostTensor HostTensor::empty(DType dtype, Shape shape) {
  HostTensor t;
  t.buffer = HostBuffer(size_t(shape.numel()) * dtype_size_bytes(dtype));
  t.view = TensorView{t.buffer.data(), dtype, std::move(shape), Device::kCpu};
  return t;
}

}  // namespace m3
