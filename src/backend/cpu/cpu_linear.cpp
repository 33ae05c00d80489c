// GEMMs through OpenBLAS (fp32 accumulate), plus the dense SwiGLU-OAI MLP built on them.
#include <cblas.h>

#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/eligibility.h"

namespace m3::cpu {

void sgemm_xwt(const float* x, const float* w, float* y, int64_t m, int64_t n, int64_t k, bool batch_invariant) {
  if (m == 0 || n == 0) return;
  if (batch_invariant) {
    for (int64_t r = 0; r < m; ++r)
      cblas_sgemv(CblasRowMajor, CblasNoTrans, int(n), int(k), 1.0f, w, int(k), x + r * k, 1, 0.0f, y + r * n, 1);
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
  table.linear.add({"linear.sgemv_rows.cpu", "host F32 weight, batch-invariant (one BLAS sgemv per row)",
                    need_cpu_f32_invariant, linear_f32<true>});
  table.linear.add({"linear.sgemm.cpu", "host F32 weight (BLAS sgemm over the batch, fp32 accumulate)",
                    need_cpu_f32, linear_f32<false>});
  table.mlp.add({"dense_mlp.sgemv_rows_swiglu_oai.cpu", "host F32 weights, batch-invariant", need_cpu_f32_invariant,
                 dense_mlp_f32<true>});
  table.mlp.add({"dense_mlp.sgemm_swiglu_oai.cpu", "host F32 weights", need_cpu_f32, dense_mlp_f32<false>});
}

}  // namespace m3::cpu
