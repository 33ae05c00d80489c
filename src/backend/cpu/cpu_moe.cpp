// MoE on the CPU: sigmoid router with selection-only bias, and grouped expert GEMMs in which
// the shared expert is one more expert chosen by every token with weight 1.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/eligibility.h"

namespace m3::cpu {
namespace {

void router_f32(const TensorView& x, const TensorView& router_w, const TensorView& bias, const ops::RouterParams& params,
                const TensorView& expert_ids, const TensorView& expert_weights) {
  const int64_t tokens = x.shape[0], hidden = x.shape[1], experts = router_w.shape[0];
  std::vector<float> logits(size_t(tokens * experts));
  // Always per row: the router's choice must never depend on the batch (N is small anyway).
  sgemm_xwt(x.as<const float>(), router_w.as<const float>(), logits.data(), tokens, experts, hidden, true);
  const float* b = bias.data ? bias.as<const float>() : nullptr;
  std::vector<int32_t> order(static_cast<size_t>(experts));
  std::vector<float> prob(static_cast<size_t>(experts)), choice(static_cast<size_t>(experts));
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t e = 0; e < experts; ++e) {
      prob[size_t(e)] = 1.0f / (1.0f + std::exp(-logits[size_t(t * experts + e)]));
      choice[size_t(e)] = prob[size_t(e)] + (params.use_bias && b ? b[e] : 0.0f);
    }
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + params.top_k, order.end(), [&](int32_t a, int32_t c) {
      return choice[size_t(a)] > choice[size_t(c)] || (choice[size_t(a)] == choice[size_t(c)] && a < c);
    });
    float sum = 0.0f;
    for (int i = 0; i < params.top_k; ++i) sum += prob[size_t(order[size_t(i)])];
    for (int i = 0; i < params.top_k; ++i) {
      expert_ids.as<int32_t>()[t * params.top_k + i] = order[size_t(i)];
      expert_weights.as<float>()[t * params.top_k + i] = prob[size_t(order[size_t(i)])] / sum * params.routed_scale;
    }
  }
}

// One expert over the rows routed to it: out[row] += weight[row] * down(act(gate(x), up(x))).
void run_expert(const float* x_rows, int64_t rows, int64_t hidden, const ops::LinearWeight& gate,
                const ops::LinearWeight& up, const ops::LinearWeight& down, const ops::SwigluParams& act,
                bool invariant, std::vector<float>& scratch_g, std::vector<float>& scratch_u, std::vector<float>& y) {
  const int64_t inter = gate.out_features();
  scratch_g.resize(size_t(rows * inter));
  scratch_u.resize(size_t(rows * inter));
  y.resize(size_t(rows * hidden));
  sgemm_xwt(x_rows, gate.data.as<const float>(), scratch_g.data(), rows, inter, hidden, invariant);
  sgemm_xwt(x_rows, up.data.as<const float>(), scratch_u.data(), rows, inter, hidden, invariant);
  for (size_t i = 0; i < scratch_g.size(); ++i) scratch_g[i] = ops::swiglu_oai(scratch_g[i], scratch_u[i], act);
  sgemm_xwt(scratch_g.data(), down.data.as<const float>(), y.data(), rows, hidden, inter, invariant);
}

template <bool kInvariant>
void moe_f32(const TensorView& x, const TensorView& expert_ids, const TensorView& expert_weights,
             const ops::ExpertWeights& experts, const ops::SwigluParams& act, const TensorView& out) {
  const int64_t tokens = x.shape[0], hidden = x.shape[1], top_k = expert_ids.shape[1];
  const int total = experts.num_routed + (experts.has_shared ? 1 : 0);
  // Permute: the rows each expert sees, with their weights; the shared expert takes every row.
  std::vector<std::vector<int64_t>> rows(static_cast<size_t>(total));
  std::vector<std::vector<float>> weights(static_cast<size_t>(total));
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t i = 0; i < top_k; ++i) {
      const int32_t e = expert_ids.as<const int32_t>()[t * top_k + i];
      rows[size_t(e)].push_back(t);
      weights[size_t(e)].push_back(expert_weights.as<const float>()[t * top_k + i]);
    }
    if (experts.has_shared) {
      rows[size_t(experts.num_routed)].push_back(t);
      weights[size_t(experts.num_routed)].push_back(1.0f);
    }
  }
  float* o = out.as<float>();
  std::fill(o, o + tokens * hidden, 0.0f);
  std::vector<float> gathered, g, u, y;
  for (int e = 0; e < total; ++e) {
    const auto& r = rows[size_t(e)];
    if (r.empty()) continue;
    gathered.resize(r.size() * size_t(hidden));
    for (size_t i = 0; i < r.size(); ++i) {
      std::copy_n(x.as<const float>() + r[i] * hidden, hidden, gathered.data() + i * size_t(hidden));
    }
    run_expert(gathered.data(), int64_t(r.size()), hidden, experts.gate[e], experts.up[e], experts.down[e], act,
               kInvariant, g, u, y);
    for (size_t i = 0; i < r.size(); ++i) {  // un-permute with the routing weight
      const float w = weights[size_t(e)][i];
      float* dst = o + r[i] * hidden;
      const float* src = y.data() + i * size_t(hidden);
      for (int64_t d = 0; d < hidden; ++d) dst[d] += w * src[d];
    }
  }
}

}  // namespace

void register_moe(ops::KernelTable& table) {
  table.router.add({"moe_router.sigmoid_bias_topk.cpu", "host F32 router weight and bias", need_cpu_f32, router_f32});
  table.moe.add({"moe_experts.grouped_rowdot_invariant.cpu",
                 "host F32 expert weights, batch-invariant; shared expert as the last expert", need_cpu_f32_invariant,
                 moe_f32<true>});
  table.moe.add({"moe_experts.grouped_sgemm.cpu", "host F32 expert weights; shared expert as the last expert",
                 need_cpu_f32, moe_f32<false>});
}

}  // namespace m3::cpu
