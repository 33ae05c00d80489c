// GEMMs through OpenBLAS (fp32 accumulate), plus the dense SwiGLU-OAI MLP built on them.
#include <cblas.h>

#include <algorithm>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/cpu_parallel.h"
#include "backend/cpu/eligibility.h"

namespace m3::cpu {

namespace {

// dot(x, w) over k with 8 lane accumulators and a fixed final reduction: the same operation
// sequence for a given (x, w) no matter how many rows are in the call.
inline float dot_fixed_order(const float* x, const float* w, int64_t k) {
  float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= k; i += 8)
    for (int j = 0; j < 8; ++j) lane[j] += x[i + j] * w[i + j];
  float tail = 0.0f;
  for (; i < k; ++i) tail += x[i] * w[i];
  return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7])) + tail;
}

// Batch-invariant GEMM: blocked for cache reuse (a tile of weight rows is streamed against
// every activation row), while each output element is one dot_fixed_order call. The weight tiles
// are independent items over the host's threads (each output is the same dot at any count).
void sgemm_xwt_invariant(const float* x, const float* w, float* y, int64_t m, int64_t n, int64_t k) {
  const int64_t tile_n = std::max<int64_t>(1, (int64_t(32) << 10) / std::max<int64_t>(1, k * 4));  // ~32 KiB of W
  parallel_for((n + tile_n - 1) / tile_n, m * n * k, [&](int64_t tile) {
    const int64_t n0 = tile * tile_n, n1 = std::min(n, n0 + tile_n);
    for (int64_t r = 0; r < m; ++r) {
      const float* xr = x + r * k;
      float* yr = y + r * n;
      for (int64_t c = n0; c < n1; ++c) yr[c] = dot_fixed_order(xr, w + c * k, k);
    }
  });
}

}  // namespace

void sgemm_xwt(const float* x, const float* w, float* y, int64_t m, int64_t n, int64_t k, bool batch_invariant) {
  if (m == 0 || n == 0) return;
  if (batch_invariant) {
    sgemm_xwt_invariant(x, w, y, m, n, k);
    return;
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(m), int(n), int(k), 1.0f, x, int(k), w, int(k), 0.0f, y,
              int(n));
}

namespace {

template <bool kInvariant>
void linear_f32(const TensorView& x, const ops::LinearWeight& w, const TensorView& y) {
  sgemm_xwt(x.as<const float>(), w.data.as<const float>(), y.as<float>(), x.shape[0], w.out_features(),
            w.in_features(), kInvariant);
}

template <bool kInvariant>
void dense_mlp_f32(const TensorView& x, const ops::LinearWeight& gate, const ops::LinearWeight& up,
                   const ops::LinearWeight& down, const ops::SwigluParams& act, const TensorView& out) {
  const int64_t m = x.shape[0], inter = gate.out_features(), hidden = x.shape[1];
  std::vector<float> g(size_t(m * inter)), u(size_t(m * inter));
  sgemm_xwt(x.as<const float>(), gate.data.as<const float>(), g.data(), m, inter, hidden, kInvariant);
  sgemm_xwt(x.as<const float>(), up.data.as<const float>(), u.data(), m, inter, hidden, kInvariant);
  for (size_t i = 0; i < g.size(); ++i) g[i] = ops::swiglu_oai(g[i], u[i], act);
  sgemm_xwt(g.data(), down.data.as<const float>(), out.as<float>(), m, down.out_features(), inter, kInvariant);
}

}  // namespace

void register_linear(ops::KernelTable& table) {
  table.linear.add({"linear.rowdot_invariant.cpu", "host F32 weight, batch-invariant (fixed-order dot per output; BLAS is not row-invariant)",
                    need_cpu_f32_invariant, linear_f32<true>});
  table.linear.add({"linear.sgemm.cpu", "host F32 weight (BLAS sgemm over the batch, fp32 accumulate)",
                    need_cpu_f32, linear_f32<false>});
  table.mlp.add({"dense_mlp.rowdot_invariant_swiglu_oai.cpu", "host F32 weights, batch-invariant", need_cpu_f32_invariant,
                 dense_mlp_f32<true>});
  table.mlp.add({"dense_mlp.sgemm_swiglu_oai.cpu", "host F32 weights", need_cpu_f32, dense_mlp_f32<false>});
}

}  // namespace m3::cpu
