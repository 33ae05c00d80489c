// GEMMs through OpenBLAS (fp32 accumulate), plus the dense SwiGLU-OAI MLP built on them.
#include <cblas.h>

#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/eligibility.h"

namespace m3::cpu {

void sgemm_xwt(const float* x, const float* w, float* y, int64_t m, int64_t n, int64_t k) {
  if (m == 0 || n == 0) return;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(m), int(n), int(k), 1.0f, x, int(k), w, int(k), 0.0f, y,
              int(n));
}

namespace {

void linear_f32(const TensorView& x, const ops::LinearWeight& w, const TensorView& y) {
  sgemm_xwt(x.as<const float>(), w.data.as<const float>(), y.as<float>(), x.shape[0], w.out_features(),
            w.in_features());
}

void dense_mlp_f32(const TensorView& x, const ops::LinearWeight& gate, const ops::LinearWeight& up,
                   const ops::LinearWeight& down, const ops::SwigluParams& act, const TensorView& out) {
  const int64_t m = x.shape[0], inter = gate.out_features(), hidden = x.shape[1];
  std::vector<float> g(size_t(m * inter)), u(size_t(m * inter));
  sgemm_xwt(x.as<const float>(), gate.data.as<const float>(), g.data(), m, inter, hidden);
  sgemm_xwt(x.as<const float>(), up.data.as<const float>(), u.data(), m, inter, hidden);
  for (size_t i = 0; i < g.size(); ++i) g[i] = ops::swiglu_oai(g[i], u[i], act);
  sgemm_xwt(g.data(), down.data.as<const float>(), out.as<float>(), m, down.out_features(), inter);
}

}  // namespace

void register_linear(ops::KernelTable& table) {
  table.linear.add({"linear.sgemm.cpu", "host F32 weight (BLAS sgemm, fp32 accumulate)", need_cpu_f32, linear_f32});
  table.mlp.add({"dense_mlp.sgemm_swiglu_oai.cpu", "host F32 weights", need_cpu_f32, dense_mlp_f32});
}

}  // namespace m3::cpu
