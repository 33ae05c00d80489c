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
  cudaEvent_t e0, e1;
  M3_CUDA_CHECK(cudaEventCreate(&e0));
  M3_CUDA_CHECK(cudaEventCreate(&e1));
  double best = 0;
  for (int i = 0; i < 6; ++i) {
    M3_CUDA_CHECK(cudaEventRecord(e0, stream));
    const cublasStatus_t st = cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, n, n, n, &alpha, a.as<void>(), CUDA_R_16BF, n,
                                           b.as<void>(), CUDA_R_16BF, n, &beta, c.as<void>(), CUDA_R_32F, n,
                                           CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    M3_CUDA_CHECK(cudaEventRecord(e1, stream));
    M3_CUDA_CHECK(cudaEventSynchronize(e1));
    if (st != CUBLAS_STATUS_SUCCESS) break;
    float ms = 0;
    M3_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    if (i > 0) best = std::max(best, 2.0 * n * double(n) * n / (double(ms) * 1e-3) / 1e12);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cublasDestroy(h);
  return best;
}

}  // namespace m3::gpu_bench
