#pragma once
// The CPU backend's roofline for the benchmarks: the measured fp32 GEMM ceiling of this machine
// and the matmul FLOPs one token costs.
#include <chrono>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "model/minimax_m3/config.h"

namespace m3::bench {

// Measured fp32 GEMM ceiling of this machine (the CPU backend's roofline).
inline double measure_sgemm_gflops() {
  const int n = 768;
  std::vector<float> a(size_t(n) * n, 1.0f), b(size_t(n) * n, 0.5f), c(size_t(n) * n);
  cpu::sgemm_xwt(a.data(), b.data(), c.data(), n, n, n);
  auto t0 = std::chrono::steady_clock::now();
  const int reps = 5;
  for (int i = 0; i < reps; ++i) cpu::sgemm_xwt(a.data(), b.data(), c.data(), n, n, n);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return 2.0 * n * n * double(n) * reps / s / 1e9;
}

// Matmul FLOPs one token costs (weights it touches: dense layers, top-k + shared experts, LM
// head), excluding attention's context-dependent part.
inline double flops_per_token(const MiniMaxM3Config& c) {
  double params = 0;
  const double h = double(c.hidden_size);
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    params += h * c.head_dim * (c.num_attention_heads * 2.0 + c.num_key_value_heads * 2.0);
    if (c.is_sparse_layer(l)) params += h * c.index_head_dim * (c.index_n_heads + 1.0);
    if (c.is_moe_layer(l)) {
      params += h * c.num_local_experts;
      params += 3.0 * h * c.intermediate_size * c.num_experts_per_tok + 3.0 * h * c.shared_intermediate_size;
    } else {
      params += 3.0 * h * c.dense_intermediate_size;
    }
  }
  params += h * double(c.vocab_size);
  return 2.0 * params;
}

}  // namespace m3::bench
