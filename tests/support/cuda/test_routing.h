// Test support: synthetic MoE routing for the expert parity tests.
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

namespace m3::cuda_test {

// top_k distinct experts per token drawn with weight 1 / (e + 1)^skew (skew 0 = uniform; large
// skew: expert 0 takes most tokens and high ids none), weights uniform in [0.05, 1); `dup`: every
// third token names its first expert twice (the CPU adds such pairs in slot order).
inline void make_routing(int tokens, int routed, int top_k, double skew, bool dup, std::mt19937& rng,
                         std::vector<int32_t>& ids, std::vector<float>& wts) {
  std::vector<double> p(static_cast<size_t>(routed));
  for (int e = 0; e < routed; ++e) p[size_t(e)] = 1.0 / std::pow(double(e + 1), skew);
  std::uniform_real_distribution<float> uw(0.05f, 1.0f);
  ids.assign(size_t(tokens) * top_k, 0);
  wts.assign(ids.size(), 0.0f);
  for (int t = 0; t < tokens; ++t) {
    std::vector<double> left = p;
    for (int j = 0; j < top_k; ++j) {
      std::discrete_distribution<int> dd(left.begin(), left.end());
      const int e = dd(rng);
      ids[size_t(t) * top_k + j] = e;
      left[size_t(e)] = 0.0;
      wts[size_t(t) * top_k + j] = uw(rng);
    }
    if (dup && top_k > 1 && t % 3 == 1) ids[size_t(t) * top_k + top_k - 1] = ids[size_t(t) * top_k];
  }
}

}  // namespace m3::cuda_test
