#include <cstdlib>
#include <cstring>

#include "backend/cuda/pdl.cuh"

namespace m3::cuda {

bool pdl_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("M3_CUDA_NO_PDL");
    return !(v && *v && std::strcmp(v, "0") != 0);
  }();
  return on;
}

}  // namespace m3::cuda
