#include "backend/cuda/cuda_backend.h"

#include "backend/cuda/cuda_internal.h"

namespace m3::cuda {

void register_cuda_kernels(ops::KernelTable& table) {
  register_msa(table);
  register_elementwise(table);
  register_attention(table);
  register_gemm(table);
  register_sampling(table);
}

}  // namespace m3::cuda
