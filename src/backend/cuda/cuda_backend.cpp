#include "backend/cuda/cuda_backend.h"

#include "backend/cuda/cuda_internal.h"
#include "backend/cuda/moe_mxfp8.h"

namespace m3::cuda {

void register_cuda_kernels(ops::KernelTable& table) {
  register_msa(table);
  register_elementwise(table);
  register_fused_rows(table);
  register_attention(table);
  register_moe_mxfp8(table);  // before register_gemm: MXFP8 MoE entries precede the grouped row-dot
  register_gemm(table);
  register_sampling(table);
}

}  // namespace m3::cuda
