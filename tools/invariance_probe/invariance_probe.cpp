// Is a speculative verification step the K + 1 one-token steps it stands for, op by op? One
// sequence is prefilled twice from the same prompt; one copy then decodes K + 1 given tokens one
// step at a time, the other computes them in one forward of K + 1 tokens. Every op's output row
// (ForwardHooks::on_activation), the MSA selections and the logits are compared bit for bit, and
// the dispatch entries with their plans for both step shapes are listed, so the first op whose
// bits depend on the tokens per request is named with the kernel that ran it.
//   invariance_probe --model DIR [--device cpu|cuda] [--prompt-lens 300,3000] [--draft 3]
//                    [--index-dtype bf16|fp8] [--stale none|verify|singles] [--seed 1] [--json FILE]
// --stale verify: before the verification step its sequence computes K + 1 other tokens and
// drops them (SequenceRunner::truncate), leaving their KV behind in the pages as rejected drafts
// do; --stale singles does that to the one-token steps' sequence instead.
// Exit status 1 when any op differs (so a script can stop on it), 2 on bad usage.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "backend/cpu/cpu_backend.h"
#include "exec/sequence_runner.h"
#include "loader/model_dir.h"
#include "model/minimax_m3/model.h"
#ifdef M3_HAVE_CUDA
#include "backend/cuda/cuda_backend.h"
#endif

namespace {

using namespace m3;

// One op's output of one step: rows x row_bytes, downloaded as it was produced.
struct Capture {
  int layer = 0;
  std::string op;
  DType dtype = DType::kF32;
  int64_t rows = 0;
  size_t row_bytes = 0;
  std::vector<unsigned char> bytes;
};

struct Step {
  std::vector<Capture> caps;
  ForwardTrace trace;
  std::vector<ops::DispatchStats::Selection> paths;  // every op's entry and plan in this step
};

std::vector<int> parse_list(const std::string& s) {
  std::vector<int> v;
  for (size_t p = 0; p < s.size();) {
    const size_t q = std::min(s.find(',', p), s.size());
    v.push_back(std::stoi(s.substr(p, q - p)));
    p = q + 1;
  }
  return v;
}

Step run_step(SequenceRunner& runner, ops::BackendRuntime* rt, ops::DispatchStats& stats,
              const std::vector<int32_t>& tokens) {
  Step st;
  ForwardHooks hooks;
  hooks.on_activation = [&](int layer, const char* op, const TensorView& v) {
    Capture c;
    c.layer = layer;
    c.op = op;
    c.dtype = v.dtype;
    c.rows = v.shape[0];
    c.bytes.resize(v.size_bytes());
    c.row_bytes = c.bytes.size() / size_t(c.rows);
    rt->download(c.bytes.data(), v.data, c.bytes.size());
    st.caps.push_back(std::move(c));
  };
  stats.begin_recording();
  runner.extend(tokens, true, &st.trace, &hooks);
  st.paths = stats.end_recording();
  return st;
}

// Largest |a - b| over a row of floats (NaN-aware: a NaN on one side only counts as infinity).
double max_abs_diff(const unsigned char* a, const unsigned char* b, size_t bytes) {
  double m = 0;
  for (size_t i = 0; i + 4 <= bytes; i += 4) {
    float x, y;
    std::memcpy(&x, a + i, 4);
    std::memcpy(&y, b + i, 4);
    if (std::isnan(x) != std::isnan(y)) return INFINITY;
    if (!std::isnan(x)) m = std::max(m, double(std::fabs(x - y)));
  }
  return m;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model_dir, device = "cpu", json_path = "invariance_probe.json", lens = "300,3000", index_dtype;
  std::string stale = "none";
  int draft = 3;
  uint32_t seed = 1;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--model") model_dir = v;
    else if (k == "--device") device = v;
    else if (k == "--prompt-lens") lens = v;
    else if (k == "--draft") draft = std::stoi(v);
    else if (k == "--index-dtype") index_dtype = v;
    else if (k == "--seed") seed = uint32_t(std::stoul(v));
    else if (k == "--stale") stale = v;
    else if (k == "--json") json_path = v;
    else {
      std::fprintf(stderr, "unknown option %s\n", k.c_str());
      return 2;
    }
  }
  if (model_dir.empty() || draft < 1 || (device != "cpu" && device != "cuda") ||
      (!index_dtype.empty() && index_dtype != "bf16" && index_dtype != "fp8") ||
      (stale != "none" && stale != "verify" && stale != "singles")) {
    std::fprintf(stderr, "usage: invariance_probe --model DIR [--device cpu|cuda] [--prompt-lens 300,3000] "
                         "[--draft K] [--index-dtype bf16|fp8] [--stale none|verify|singles] [--seed N] [--json FILE]\n");
    return 2;
  }
  std::unique_ptr<ops::BackendRuntime> owned_rt;
  ops::KernelTable table;
  LoadOptions lo;
  DType kv = DType::kF32;
  if (device == "cuda") {
#ifdef M3_HAVE_CUDA
    if (cuda::device_count() == 0) {
      std::fprintf(stderr, "invariance_probe: no CUDA device\n");
      return 2;
    }
    owned_rt = cuda::make_cuda_runtime(0);
    lo = engine_load_options(owned_rt.get(), false, false, true);  // what the engine loads
    cuda::register_cuda_kernels(table);
    kv = DType::kBF16;
#else
    std::fprintf(stderr, "invariance_probe: built without CUDA\n");
    return 2;
#endif
  }
  cpu::register_cpu_kernels(table);
  auto dir = ModelDir::open(model_dir);
  if (!dir) {
    std::fprintf(stderr, "%s\n", dir.error().c_str());
    return 1;
  }
  auto loaded = MiniMaxM3Model::load(**dir, {}, lo);
  if (!loaded) {
    std::fprintf(stderr, "%s\n", loaded.error().c_str());
    return 1;
  }
  const MiniMaxM3Model& model = **loaded;
  ops::BackendRuntime* rt = model.runtime();
  ops::DispatchStats stats;
  const ops::OpContext ctx{&table, &stats, device == "cuda" ? Device::kCuda : Device::kCpu, true};
  std::optional<DType> idx;
  if (index_dtype == "fp8") idx = DType::kF8E4M3;
  if (index_dtype == "bf16") idx = DType::kBF16;
  const int64_t vocab = model.config().vocab_size;
  std::printf("model %s on %s, %d layers, K = %d (verification steps of %d tokens), stale KV: %s\n", model_dir.c_str(),
              device.c_str(), model.config().num_hidden_layers, draft, draft + 1, stale.c_str());

  nlohmann::json out = {{"model", model_dir}, {"device", device}, {"draft", draft}, {"stale", stale},
                        {"cases", nlohmann::json::array()}};
  bool all_same = true;
  for (int P : parse_list(lens)) {
    std::mt19937 rng(seed + uint32_t(P));
    std::vector<int32_t> prompt(static_cast<size_t>(P)), next(static_cast<size_t>(draft) + 1);
    for (auto& t : prompt) t = int32_t(rng() % uint32_t(vocab));
    for (auto& t : next) t = int32_t(rng() % uint32_t(vocab));
    const int64_t cap = P + draft + 1;
    SequenceRunner one(model, ctx, cap, kv, idx), many(model, ctx, cap, kv, idx);
    one.extend(prompt, false);
    many.extend(prompt, false);
    if (stale != "none") {  // other tokens' KV left behind past the sequence's end
      std::vector<int32_t> junk(next.size());
      for (auto& t : junk) t = int32_t(rng() % uint32_t(vocab));
      SequenceRunner& r = stale == "verify" ? many : one;
      r.extend(junk, false);
      r.truncate(P);
    }
    std::vector<Step> singles;
    for (int j = 0; j <= draft; ++j) singles.push_back(run_step(one, rt, stats, {next[size_t(j)]}));
    const Step verify = run_step(many, rt, stats, next);

    nlohmann::json ops_json = nlohmann::json::array();
    std::string first;
    for (size_t c = 0; c < verify.caps.size(); ++c) {
      const Capture& v = verify.caps[c];
      std::vector<int> differ;
      double worst = 0;
      for (int j = 0; j <= draft; ++j) {
        const Capture& s = singles[size_t(j)].caps.at(c);
        if (s.op != v.op || s.layer != v.layer || s.row_bytes != v.row_bytes) {
          std::fprintf(stderr, "capture order differs at %zu (%s vs %s)\n", c, s.op.c_str(), v.op.c_str());
          return 1;
        }
        const unsigned char* a = s.bytes.data();
        const unsigned char* b = v.bytes.data() + size_t(j) * v.row_bytes;
        if (std::memcmp(a, b, v.row_bytes) != 0) {
          differ.push_back(j);
          if (v.dtype == DType::kF32) worst = std::max(worst, max_abs_diff(a, b, v.row_bytes));
        }
      }
      const std::string name = "layer " + std::to_string(v.layer) + " " + v.op;
      if (!differ.empty() && first.empty()) first = name;
      std::string rows;
      for (int j : differ) rows += (rows.empty() ? "" : ",") + std::to_string(j);
      std::printf("  P=%-6d %-28s %s\n", P, name.c_str(),
                  differ.empty() ? "same" : ("differs in rows " + rows + ", max |d| " + std::to_string(worst)).c_str());
      ops_json.push_back({{"layer", v.layer}, {"op", v.op}, {"rows_differ", differ}, {"max_abs_diff", worst}});
    }
    // Selections: [groups, tokens, top_k] per sparse layer (the step's whole selection, also
    // for layers that share an earlier layer's, which is the same buffer's content again).
    const size_t topk = size_t(model.config().index_topk_blocks), T = size_t(draft + 1);
    int sel_diff = 0;
    for (size_t s = 0; s < verify.trace.selected_blocks.size(); ++s) {
      const auto& vb = verify.trace.selected_blocks[s];
      for (size_t j = 0; j < T; ++j) {
        const auto& sb = singles[j].trace.selected_blocks.at(s);
        for (size_t g = 0; g < sb.size() / topk; ++g)
          sel_diff += std::memcmp(&sb[g * topk], &vb[(g * T + j) * topk], topk * 4) != 0;
      }
    }
    if (sel_diff) std::printf("  P=%-6d selections differ in %d (layer, group, row) triples\n", P, sel_diff);
    if (sel_diff && first.empty()) first = "MSA selection";
    std::printf("P=%d: %s\n", P, first.empty() ? "every op bit-identical" : ("first difference: " + first).c_str());
    auto paths = [](const Step& s) {
      nlohmann::json j = nlohmann::json::array();
      for (const auto& r : s.paths)
        j.push_back(std::string(r.problem.op) + " m=" + std::to_string(r.problem.m) + " n=" + std::to_string(r.problem.n) +
                    " k=" + std::to_string(r.problem.k) + " = " + r.entry + (r.plan.empty() ? "" : " [" + r.plan + "]"));
      return j;
    };
    // The kernels each shape ran (op, n, k, entry, plan; the row count left out): those only one
    // of the two steps used are the suspects.
    auto kinds = [](const Step& s) {
      std::set<std::string> k;
      for (const auto& r : s.paths)
        k.insert(std::string(r.problem.op) + " n=" + std::to_string(r.problem.n) + " k=" + std::to_string(r.problem.k) +
                 " = " + r.entry + (r.plan.empty() ? "" : " [" + r.plan + "]"));
      return k;
    };
    const std::set<std::string> ks = kinds(singles[0]), kv = kinds(verify);
    for (const auto& k : ks)
      if (!kv.count(k)) std::printf("  one-token step only:    %s\n", k.c_str());
    for (const auto& k : kv)
      if (!ks.count(k)) std::printf("  verification step only: %s\n", k.c_str());
    out["cases"].push_back({{"prompt_len", P}, {"first_difference", first}, {"selection_rows_differ", sel_diff}, {"ops", ops_json},
                            {"single_paths", paths(singles[0])}, {"verify_paths", paths(verify)}});
    all_same = all_same && first.empty();
  }
  std::ofstream(json_path) << out.dump(2);
  std::printf("%s\n", all_same ? "verification steps bit-identical to one-token steps" : "NOT bit-identical");
  return all_same ? 0 : 1;
}
