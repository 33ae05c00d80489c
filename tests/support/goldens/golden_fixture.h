#pragma once
// Shared by the CPU and GPU golden tests: opens a committed golden file and finds (or
// regenerates from its preset and seed) the checkpoint the HF oracle read.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "loader/safetensors.h"
#include "model/minimax_m3/make_model.h"

namespace m3::testing {

inline std::string env_or(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v ? v : fallback;
}

template <class T>
std::vector<T> tensor_values(const SafetensorsFile& f, const std::string& name) {
  const TensorInfo* t = f.find(name);
  if (!t) ADD_FAILURE() << "golden tensor missing: " << name;
  if (!t) return {};
  std::vector<T> out(size_t(t->shape.numel()));
  std::memcpy(out.data(), t->data, out.size() * sizeof(T));
  return out;
}

struct GoldenFixture {
  std::unique_ptr<SafetensorsFile> golden;
  std::filesystem::path model_dir;
};

// Fails the current test (returns false) when the fixture or its model cannot be had;
// `scratch` names the folder a regenerated checkpoint goes to.
inline bool open_golden(const std::string& name, const std::string& scratch, GoldenFixture& out) {
  namespace fs = std::filesystem;
  const fs::path src = fs::path(env_or("M3_SOURCE_DIR", M3_SOURCE_DIR_DEFAULT));
  const fs::path golden_path = src / "tests/fixtures/goldens" / name / "golden.safetensors";
  // Goldens are committed fixtures: their absence is a failure, not a skip.
  if (!fs::exists(golden_path)) {
    ADD_FAILURE() << "no golden file at " << golden_path << " (regenerate with tools/make_goldens.sh)";
    return false;
  }
  auto golden = SafetensorsFile::open(golden_path.string());
  if (!golden.is_ok()) {
    ADD_FAILURE() << golden.error();
    return false;
  }
  out.golden = std::move(*golden);
  const auto& meta = out.golden->metadata();
  if (meta.count("m3_model_dir")) {
    // A committed model directory (relative to the source tree), loaded as it is.
    out.model_dir = src / meta.at("m3_model_dir");
    if (!fs::exists(out.model_dir / "config.json")) {
      ADD_FAILURE() << "no committed model at " << out.model_dir;
      return false;
    }
    return true;
  }
  if (!(meta.count("m3_preset") && meta.count("m3_seed") && meta.count("m3_mxfp8"))) {
    ADD_FAILURE() << "golden metadata incomplete";
    return false;
  }
  // Regenerate the checkpoint the oracle read, from its preset and seed.
  out.model_dir = fs::path(env_or("M3_BINARY_DIR", "/tmp")) / scratch / name;
  fs::remove_all(out.model_dir);
  auto cfg = MiniMaxM3Config::preset(meta.at("m3_preset"));
  if (!cfg.is_ok()) {
    ADD_FAILURE() << cfg.error();
    return false;
  }
  MakeModelOptions opts;
  opts.config = *cfg;
  opts.out_dir = out.model_dir.string();
  opts.mxfp8 = meta.at("m3_mxfp8") == "1";
  opts.seed = std::stoull(meta.at("m3_seed"));
  Status st = make_model(opts);
  if (!st.is_ok()) {
    ADD_FAILURE() << st.message();
    return false;
  }
  return true;
}

}  // namespace m3::testing
