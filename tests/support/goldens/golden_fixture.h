#pragma once
// Shared by the CPU and GPU golden tests: opens a committed golden file and finds (or
// regenerates from its preset and seed) the checkpoint the HF oracle read.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "loader/safetensors.h"
#include "model/minimax_m3/make_model.h"
#include "model/minimax_m3/model.h"

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

// One prompt of a golden file: ids, reference logits (of `rows` only), MSA selections
// [sparse layers, T, G, K], experts [MoE layers, T, E] ascending, greedy continuation.
struct GoldenPrompt {
  std::vector<int32_t> ids, selected, experts, greedy, rows;
  std::vector<float> logits;
};

// False when the golden has no prompt p.
inline bool read_prompt(const SafetensorsFile& golden, int p, GoldenPrompt& out) {
  const std::string pre = "prompt." + std::to_string(p) + ".";
  if (!golden.find(pre + "input_ids")) return false;
  out.ids = tensor_values<int32_t>(golden, pre + "input_ids");
  out.logits = tensor_values<float>(golden, pre + "logits");
  out.selected = tensor_values<int32_t>(golden, pre + "selected_blocks");
  out.experts = tensor_values<int32_t>(golden, pre + "expert_ids");
  out.greedy = tensor_values<int32_t>(golden, pre + "greedy");
  // Large goldens keep the logits of some positions only (prompt.i.logit_positions, ascending).
  out.rows.clear();
  if (golden.find(pre + "logit_positions")) {
    out.rows = tensor_values<int32_t>(golden, pre + "logit_positions");
  } else {
    for (size_t t = 0; t < out.ids.size(); ++t) out.rows.push_back(int32_t(t));
  }
  return true;
}

struct LogitsDiff {
  double cosine = 0, max_abs = 0, max_ref = 0;
  int argmax_mismatch = 0;
};

// Ours: [T, V] for every prompt position; the golden's: [rows, V].
inline LogitsDiff compare_logits(const std::vector<float>& ours, const GoldenPrompt& g, int64_t V) {
  LogitsDiff d;
  const int64_t T = int64_t(g.ids.size());
  if (g.logits.size() != g.rows.size() * size_t(V) || ours.size() != size_t(T * V)) {
    ADD_FAILURE() << "logits of unexpected size";
    return d;
  }
  double dot = 0, na = 0, nb = 0;
  for (size_t r = 0; r < g.rows.size(); ++r) {
    if (g.rows[r] < 0 || g.rows[r] >= T) {
      ADD_FAILURE() << "logit position out of range";
      return d;
    }
    const float* a = ours.data() + int64_t(g.rows[r]) * V;
    const float* b = g.logits.data() + int64_t(r) * V;
    for (int64_t i = 0; i < V; ++i) {
      dot += double(a[i]) * b[i];
      na += double(a[i]) * a[i];
      nb += double(b[i]) * b[i];
      d.max_abs = std::max(d.max_abs, double(std::fabs(a[i] - b[i])));
      d.max_ref = std::max(d.max_ref, double(std::fabs(b[i])));
    }
    d.argmax_mismatch += (std::max_element(a, a + V) - a) != (std::max_element(b, b + V) - b);
  }
  d.cosine = dot / std::sqrt(na * nb);
  return d;
}

// Selected blocks: ours [G, T, K] per sparse layer (ascending, -1 padded); golden [Ls, T, G, K].
inline int64_t selection_mismatches(const ForwardTrace& trace, const GoldenPrompt& g, int G, int K) {
  const int64_t T = int64_t(g.ids.size());
  if (int64_t(g.selected.size()) != int64_t(trace.selected_blocks.size()) * T * G * K) {
    ADD_FAILURE() << "selection count differs from the golden's";
    return -1;
  }
  int64_t n = 0;
  for (size_t l = 0; l < trace.selected_blocks.size(); ++l)
    for (int64_t t = 0; t < T; ++t)
      for (int gr = 0; gr < G; ++gr)
        for (int k = 0; k < K; ++k)
          n += trace.selected_blocks[l][size_t((gr * T + t) * K + k)] !=
               g.selected[size_t(((int64_t(l) * T + t) * G + gr) * K + k)];
  return n;
}

// Experts: ours in choice order per token; golden sorted ascending.
inline int64_t expert_mismatches(const ForwardTrace& trace, const GoldenPrompt& g, int E) {
  const int64_t T = int64_t(g.ids.size());
  if (int64_t(g.experts.size()) != int64_t(trace.expert_ids.size()) * T * E) {
    ADD_FAILURE() << "expert count differs from the golden's";
    return -1;
  }
  int64_t n = 0;
  for (size_t l = 0; l < trace.expert_ids.size(); ++l)
    for (int64_t t = 0; t < T; ++t) {
      std::vector<int32_t> got(trace.expert_ids[l].begin() + t * E, trace.expert_ids[l].begin() + (t + 1) * E);
      std::sort(got.begin(), got.end());
      for (int e = 0; e < E; ++e) n += got[size_t(e)] != g.experts[size_t((int64_t(l) * T + t) * E + e)];
    }
  return n;
}

}  // namespace m3::testing
