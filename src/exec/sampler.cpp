#include "exec/sampler.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <limits>
#include <numeric>
#include <unordered_map>

namespace m3 {

std::vector<std::string> SamplingParams::validate(int64_t vocab_size) const {
  std::vector<std::string> p;
  if (!(temperature >= 0.0f) || !std::isfinite(temperature)) p.push_back("temperature must be a finite number >= 0");
  if (!(top_p > 0.0f && top_p <= 1.0f)) p.push_back("top_p must be in (0, 1]");
  if (top_k < -1) p.push_back("top_k must be -1, 0 (off) or a positive integer");
  if (!(min_p >= 0.0f && min_p <= 1.0f)) p.push_back("min_p must be in [0, 1]");
  if (!(repetition_penalty > 0.0f) || !std::isfinite(repetition_penalty)) p.push_back("repetition_penalty must be > 0");
  if (!(presence_penalty >= -2.0f && presence_penalty <= 2.0f)) p.push_back("presence_penalty must be in [-2, 2]");
  if (!(frequency_penalty >= -2.0f && frequency_penalty <= 2.0f)) p.push_back("frequency_penalty must be in [-2, 2]");
  if (max_tokens < 1) p.push_back("max_tokens must be >= 1");
  if (min_tokens < 0 || min_tokens > max_tokens) p.push_back("min_tokens must be in [0, max_tokens]");
  if (logprobs > 20) p.push_back("logprobs must be <= 20");
  if (prompt_logprobs > 20) p.push_back("prompt_logprobs must be <= 20");
  if (logit_bias.size() > size_t(kMaxLogitBias))
    p.push_back("logit_bias may hold at most " + std::to_string(kMaxLogitBias) + " tokens");
  const int64_t id_end = vocab_size > 0 ? vocab_size : int64_t(INT32_MAX) + 1;
  const std::string ids = vocab_size > 0 ? "in the vocabulary [0, " + std::to_string(vocab_size) + ")" : ">= 0";
  bool bad_id = false, bad_bias = false, bad_allowed = false;
  for (const auto& [token, bias] : logit_bias) {
    bad_id = bad_id || token < 0 || token >= id_end;
    bad_bias = bad_bias || !(bias >= -100.0f && bias <= 100.0f);
  }
  for (int32_t t : allowed_token_ids) bad_allowed = bad_allowed || t < 0 || t >= id_end;
  bool bad_word = false;
  for (const auto& w : bad_words) {
    bad_word = bad_word || w.empty();
    for (int32_t t : w) bad_word = bad_word || t < 0 || t >= id_end;
  }
  if (bad_word) p.push_back("bad_words must tokenize to token ids " + ids);
  if (bad_id) p.push_back("logit_bias token ids must be " + ids);
  if (bad_allowed) p.push_back("allowed_token_ids must be " + ids);
  if (bad_bias) p.push_back("logit_bias values must be in [-100, 100]");
  return p;
}

Sampler::Sampler(const SamplingParams& params, std::vector<int32_t> stop_ids)
    : params_(params),
      stop_ids_(std::move(stop_ids)),
      rng_(params.seed >= 0 ? uint64_t(params.seed) : std::random_device{}()) {}

bool Sampler::is_stop(int32_t token) const {
  return std::find(stop_ids_.begin(), stop_ids_.end(), token) != stop_ids_.end();
}

void log_softmax(const float* logits, int64_t vocab, std::vector<float>& out) {
  out.resize(size_t(vocab));
  const float max_v = *std::max_element(logits, logits + vocab);
  double sum = 0.0;
  for (int64_t i = 0; i < vocab; ++i) sum += std::exp(double(logits[i] - max_v));
  const float log_z = max_v + float(std::log(sum));
  for (int64_t i = 0; i < vocab; ++i) out[size_t(i)] = logits[i] - log_z;
}

std::vector<TokenLogprob> top_logprobs(const std::vector<float>& logp, int n) {
  std::vector<int32_t> idx(logp.size());
  std::iota(idx.begin(), idx.end(), 0);
  const size_t k = std::min(idx.size(), size_t(std::max(0, n)));
  std::partial_sort(idx.begin(), idx.begin() + std::ptrdiff_t(k), idx.end(), [&](int32_t a, int32_t b) {
    return logp[size_t(a)] > logp[size_t(b)] || (logp[size_t(a)] == logp[size_t(b)] && a < b);
  });
  std::vector<TokenLogprob> out;
  out.reserve(k);
  for (size_t i = 0; i < k; ++i) out.push_back({idx[i], logp[size_t(idx[i])]});
  return out;
}

SampleResult Sampler::sample(float* logits, int64_t vocab, const std::vector<int32_t>& prompt_ids,
                             const std::vector<int32_t>& output_ids) {
  SampleResult result;
  std::vector<float> logp;
  if (params_.logprobs >= 0) log_softmax(logits, vocab, logp);

  // The constraint, allowed ids, bad words, min_tokens, logit_bias, then the penalties (vLLM's order):
  // repetition over prompt + output; presence/frequency over output.
  if (params_.constraint) params_.constraint->apply(output_ids, logits, vocab);
  if (!params_.allowed_token_ids.empty()) {
    std::vector<char> allowed(size_t(vocab), 0);
    for (int32_t t : params_.allowed_token_ids) {
      if (t >= 0 && t < vocab) allowed[size_t(t)] = 1;
    }
    for (int64_t i = 0; i < vocab; ++i) {
      if (!allowed[size_t(i)]) logits[i] = -std::numeric_limits<float>::infinity();
    }
  }
  for (const auto& w : params_.bad_words) {
    const size_t prefix = w.size() - 1;
    if (w.empty() || output_ids.size() < prefix) continue;
    if (std::equal(w.begin(), w.begin() + std::ptrdiff_t(prefix), output_ids.end() - std::ptrdiff_t(prefix)) &&
        w.back() >= 0 && w.back() < vocab)
      logits[w.back()] = -std::numeric_limits<float>::infinity();
  }
  if (int64_t(output_ids.size()) < params_.min_tokens) {
    for (int32_t t : stop_ids_) {
      if (t >= 0 && t < vocab) logits[t] = -std::numeric_limits<float>::infinity();
    }
  }
  for (const auto& [token, bias] : params_.logit_bias) {
    if (token >= 0 && token < vocab) logits[token] += bias;
  }
  if (params_.repetition_penalty != 1.0f) {
    std::vector<char> seen(size_t(vocab), 0);
    for (int32_t t : prompt_ids) if (t >= 0 && t < vocab) seen[size_t(t)] = 1;
    for (int32_t t : output_ids) if (t >= 0 && t < vocab) seen[size_t(t)] = 1;
    for (int64_t i = 0; i < vocab; ++i) {
      if (!seen[size_t(i)]) continue;
      logits[i] = logits[i] > 0 ? logits[i] / params_.repetition_penalty : logits[i] * params_.repetition_penalty;
    }
  }
  if (params_.presence_penalty != 0.0f || params_.frequency_penalty != 0.0f) {
    std::unordered_map<int32_t, int> counts;
    for (int32_t t : output_ids) counts[t]++;
    for (auto [t, n] : counts) {
      if (t < 0 || t >= vocab) continue;
      logits[t] -= params_.frequency_penalty * float(n) + params_.presence_penalty;
    }
  }

  int32_t chosen = 0;
  if (params_.temperature == 0.0f) {
    chosen = int32_t(std::max_element(logits, logits + vocab) - logits);  // first max: lowest id
  } else {
    // Candidates sorted by logit (desc, id asc), then top-k, then top-p / min-p on the
    // temperature-scaled distribution.
    std::vector<int32_t> order(static_cast<size_t>(vocab));
    std::iota(order.begin(), order.end(), 0);
    size_t keep = size_t(vocab);
    if (params_.top_k > 0) keep = std::min(keep, size_t(params_.top_k));
    auto cmp = [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
    if (keep < order.size()) {
      std::partial_sort(order.begin(), order.begin() + std::ptrdiff_t(keep), order.end(), cmp);
      order.resize(keep);
    } else {
      std::sort(order.begin(), order.end(), cmp);
    }
    std::vector<double> prob(order.size());
    const double max_v = logits[order[0]];
    double sum = 0.0;
    for (size_t i = 0; i < order.size(); ++i) {
      prob[i] = std::exp((double(logits[order[i]]) - max_v) / params_.temperature);
      sum += prob[i];
    }
    for (double& p : prob) p /= sum;
    size_t cut = order.size();
    if (params_.top_p < 1.0f) {
      double acc = 0.0;
      for (size_t i = 0; i < order.size(); ++i) {
        acc += prob[i];
        if (acc >= params_.top_p) { cut = i + 1; break; }
      }
    }
    if (params_.min_p > 0.0f) {
      const double floor_p = params_.min_p * prob[0];
      size_t n = 0;
      while (n < cut && prob[n] >= floor_p) ++n;
      cut = std::max<size_t>(1, n);
    }
    double total = 0.0;
    for (size_t i = 0; i < cut; ++i) total += prob[i];
    std::uniform_real_distribution<double> uni(0.0, total);
    double r = uni(rng_), acc = 0.0;
    chosen = order[cut - 1];
    for (size_t i = 0; i < cut; ++i) {
      acc += prob[i];
      if (r < acc) { chosen = order[i]; break; }
    }
  }
  result.token = chosen;
  if (params_.logprobs >= 0) {
    result.logprob = logp[size_t(chosen)];
    result.top = top_logprobs(logp, params_.logprobs);
  }
  return result;
}

}  // namespace m3
