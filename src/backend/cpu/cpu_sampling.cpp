// On-device sampling's reference: greedy or Gumbel-max temperature sampling per row, the
// chosen token's logprob and the top-N logprobs (ops/sample_gumbel.h defines the randomness
// and the ordering; the CUDA entry follows the same definition).
//
// logprob(v) = (logit[v] - max) - log(sum_u exp(logit[u] - max)): the differences in fp32;
// here the log-sum-exp term is accumulated in double and rounded to float once (the GPU does
// it in fp32), so the reference is the more accurate side.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/eligibility.h"
#include "ops/sample_gumbel.h"

namespace m3::cpu {
namespace {

void sample_f32(const TensorView& logits, const TensorView& params, const TensorView& tokens,
                const TensorView& logprobs, const TensorView& top_ids, const TensorView& top_logprobs) {
  const std::string bad = ops::sample_check_views(logits, params, tokens, logprobs, top_ids, top_logprobs, Device::kCpu);
  if (!bad.empty()) throw std::invalid_argument(bad);
  const int64_t rows = logits.shape[0], vocab = logits.shape[1];
  std::vector<ops::SampleRowParams> rp(static_cast<size_t>(rows));
  if (rows > 0) std::memcpy(rp.data(), params.data, size_t(rows) * sizeof(ops::SampleRowParams));
  for (int64_t r = 0; r < rows; ++r) {
    const auto& p = rp[size_t(r)];
    if (p.top_n < 0 || p.top_n > ops::kMaxTopLogprobs)
      throw std::invalid_argument("sample: row " + std::to_string(r) + " asks top_n " + std::to_string(p.top_n) +
                                  ", allowed 0.." + std::to_string(ops::kMaxTopLogprobs));
    if (!(p.temperature >= 0.0f) || !std::isfinite(p.temperature))
      throw std::invalid_argument("sample: row " + std::to_string(r) + " has temperature " +
                                  std::to_string(p.temperature) + ", must be finite and >= 0");
  }

  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  constexpr int32_t kNone = std::numeric_limits<int32_t>::max();
  std::vector<int32_t> order;
  for (int64_t r = 0; r < rows; ++r) {
    const ops::SampleRowParams& p = rp[size_t(r)];
    const float* x = logits.as<const float>() + r * vocab;

    // Greedy argmax of the raw logits (also the max for the log-sum-exp).
    float best_v = kNegInf;
    int32_t best_id = kNone;
    for (int32_t v = 0; v < int32_t(vocab); ++v) {
      if (ops::sample_before(x[v], v, best_v, best_id)) best_v = x[v], best_id = v;
    }
    const float m = best_v;
    double sum = 0.0;
    for (int64_t v = 0; v < vocab; ++v) sum += std::exp(double(x[v] - m));
    const float log_sum = float(std::log(sum));
    auto logprob = [&](int32_t v) { return (x[v] - m) - log_sum; };

    int32_t token = best_id;
    if (p.temperature > 0.0f) {
      const uint64_t key = ops::sample_row_key(p.seed, p.step);
      float sv = kNegInf;
      int32_t sid = kNone;
      for (int32_t v = 0; v < int32_t(vocab); ++v) {
        const float s = x[v] / p.temperature + ops::sample_gumbel(key, uint32_t(v));
        if (ops::sample_before(s, v, sv, sid)) sv = s, sid = v;
      }
      token = sid;
    }
    if (token == kNone) token = 0;  // every logit NaN
    tokens.as<int32_t>()[r] = token;
    logprobs.as<float>()[r] = logprob(token);

    // Top-N by raw logit (descending, ties to the lower id; NaN never listed).
    int32_t* ids_out = top_ids.as<int32_t>() + r * ops::kMaxTopLogprobs;
    float* lp_out = top_logprobs.as<float>() + r * ops::kMaxTopLogprobs;
    int n = 0;
    if (p.top_n > 0) {
      order.clear();
      for (int32_t v = 0; v < int32_t(vocab); ++v) {
        if (!std::isnan(x[v])) order.push_back(v);
      }
      n = int(std::min<size_t>(size_t(p.top_n), order.size()));
      std::partial_sort(order.begin(), order.begin() + n, order.end(),
                        [&](int32_t a, int32_t b) { return ops::sample_before(x[a], a, x[b], b); });
    }
    for (int k = 0; k < ops::kMaxTopLogprobs; ++k) {
      ids_out[k] = k < n ? order[size_t(k)] : -1;
      lp_out[k] = k < n ? logprob(order[size_t(k)]) : kNegInf;
    }
  }
}

}  // namespace

void register_sampling(ops::KernelTable& table) {
  table.sample.add({"sample.gumbel_argmax.cpu",
                    "host F32 logits and params; greedy or Gumbel-max over the (seed, step, id) hash; "
                    "log-sum-exp accumulated in double; top_n <= 20 checked per row",
                    need_cpu_f32, sample_f32});
}

}  // namespace m3::cpu
