#pragma once
// The BF16 tensor-core ceiling the GPU benchmarks report against (msa_bench, linear_bench):
// cuBLAS BF16 x BF16 -> F32 GEMM (fp32 accumulation), m = n = k = 8192, best of 5 after a warm-up.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <functional>

#include "gpu_bench_common.h"

namespace m3::gpu_bench {

// fill(p, count, seed) writes `count` BF16 operand values at p (the caller's generator).
inline double bf16_gemm_tflops(cudaStream_t stream, const std::function<void(void*, size_t, unsigned)>& fill) {
  const int n = 8192;
  Dev a(size_t(n) * n * 2), b(size_t(n) * n * 2), c(size_t(n) * n * 4);
  fill(a.as<void>(), size_t(n) * n, 11);
  fill(b.as<void>(), size_t(n) * n, 12);
  cublasHandle_t h = nullptr;
  if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) return 0;
  cublasSetStream(h, stream);
  const float alpha = 1.0f, beta = 0.0f;
  const double ms = best_ms(stream, 6, 1, [&] {
    return cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, n, n, n, &alpha, a.as<void>(), CUDA_R_16BF, n, b.as<void>(),
                        CUDA_R_16BF, n, &beta, c.as<void>(), CUDA_R_32F, n, CUBLAS_COMPUTE_32F,
                        CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS;
  });
  cublasDestroy(h);
  return ms > 0 ? 2.0 * n * double(n) * n / (ms * 1e-3) / 1e12 : 0.0;
}

}  // namespace m3::gpu_bench
