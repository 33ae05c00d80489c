#pragma once
// Model tests' fixtures: a fresh random checkpoint of the "tiny" preset under the build dir
// (M3_BINARY_DIR), and random prompts over its vocabulary.
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "model/minimax_m3/make_model.h"

namespace m3::test {

inline std::string make_tiny_model(const std::string& name, uint64_t seed) {
  const char* b = std::getenv("M3_BINARY_DIR");
  const std::filesystem::path p = std::filesystem::path(b ? b : "/tmp") / name;
  std::filesystem::remove_all(p);
  MakeModelOptions o;
  o.config = *MiniMaxM3Config::preset("tiny");
  o.out_dir = p.string();
  o.seed = seed;
  if (!make_model(o).is_ok()) std::abort();
  return p.string();
}

// `len` ids in [3, 503), from `seed`.
inline std::vector<int32_t> random_prompt(int len, int seed) {
  std::mt19937 rng{uint32_t(seed)};
  std::vector<int32_t> p;
  for (int i = 0; i < len; ++i) p.push_back(3 + int32_t(rng() % 500));
  return p;
}

}  // namespace m3::test
