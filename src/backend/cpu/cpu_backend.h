#pragma once
// The CPU reference backend: fp32 activations and accumulation, exact semantics, BLAS GEMMs.
// Every other backend's kernels are checked against these.
#include "ops/ops.h"

namespace m3::cpu {

void register_cpu_kernels(ops::KernelTable& table);

// Building blocks shared by the CPU kernels (and by tests as loop references).
// y[M,N] = x[M,K] * w[N,K]^T, fp32. batch_invariant: each output is one fixed-order dot
// product, so a row's result does not depend on M or its position (OpenBLAS micro-kernels
// round M-tails differently); otherwise one BLAS sgemm over all rows.
void sgemm_xwt(const float* x, const float* w, float* y, int64_t m, int64_t n, int64_t k, bool batch_invariant = false);

}  // namespace m3::cpu
