// CPU engine throughput at several batch sizes on one checkpoint (default: the tiny preset),
// with the achieved fraction of the measured sgemm ceiling. Writes JSON.
//   engine_bench [--model DIR] [--batch-sizes 1,8,32] [--input-len 64] [--output-len 32] [--json FILE]
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench_util.h"

#include "backend/cpu/cpu_backend.h"
#include "m3serve/engine.h"
#include "model/minimax_m3/make_model.h"
#include "cpu_roofline.h"

namespace {

using Clock = std::chrono::steady_clock;

}  // namespace

int main(int argc, char** argv) {
  std::string model_dir, json_path = "engine_bench.json", batches = "1,8,32";
  int input_len = 64, output_len = 32;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    if (k == "--model") model_dir = v;
    else if (k == "--batch-sizes") batches = v;
    else if (k == "--input-len") input_len = std::stoi(v);
    else if (k == "--output-len") output_len = std::stoi(v);
    else if (k == "--json") json_path = v;
    else { std::fprintf(stderr, "unknown option %s\n", k.c_str()); return 2; }
  }
  if (model_dir.empty()) {
    model_dir = (std::filesystem::temp_directory_path() / "m3_engine_bench_tiny").string();
    std::filesystem::remove_all(model_dir);
    m3::MakeModelOptions o;
    o.config = *m3::MiniMaxM3Config::preset("tiny");
    o.out_dir = model_dir;
    if (auto st = m3::make_model(o); !st.is_ok()) { std::fprintf(stderr, "%s\n", st.message().c_str()); return 1; }
  }
  auto cfg = m3::MiniMaxM3Config::from_file(model_dir + "/config.json");
  if (!cfg) { std::fprintf(stderr, "%s\n", cfg.error().c_str()); return 1; }
  const double ceiling = m3::bench::measure_sgemm_gflops();
  const double fpt = m3::bench::flops_per_token(*cfg);
  nlohmann::json out = {{"model", model_dir}, {"backend", "cpu"}, {"input_len", input_len}, {"output_len", output_len},
                        {"sgemm_ceiling_gflops", ceiling}, {"matmul_flops_per_token", fpt}, {"points", nlohmann::json::array()}};
  std::printf("sgemm ceiling %.1f GFLOP/s; %.2f MFLOP per token (matmuls)\n", ceiling, fpt / 1e6);
  for (bool invariant : {true, false})
  for (int batch : m3::bench::parse_list(batches)) {
    m3::EngineConfig ec;
    ec.batch_invariant = invariant;
    ec.model_dir = model_dir;
    ec.max_num_seqs = batch;
    ec.max_num_batched_tokens = std::max(2048, batch);
    ec.enable_prefix_caching = false;
    auto engine = m3::Engine::create(ec);
    if (!engine) { std::fprintf(stderr, "%s\n", engine.error().c_str()); return 1; }
    std::mt19937 rng{uint32_t(batch)};
    for (int b = 0; b < batch; ++b) {
      m3::GenerationRequest r;
      for (int i = 0; i < input_len; ++i) r.prompt_token_ids.push_back(3 + int32_t(rng() % uint32_t(cfg->vocab_size - 3)));
      r.sampling.temperature = 0.0f;
      r.sampling.max_tokens = output_len;
      r.sampling.ignore_eos = true;
      (*engine)->submit(std::move(r));
    }
    double prefill_s = 0, decode_s = 0;
    int64_t decode_tokens = 0, prefill_tokens = 0;
    auto t0 = Clock::now();
    while ((*engine)->has_unfinished_requests()) {
      m3::EngineStepStats st;
      (*engine)->step(&st);
      if (st.scheduler.num_prefill_tokens > 0) {
        prefill_s += st.step_ms / 1e3;
        prefill_tokens += st.scheduler.num_prefill_tokens;
      } else {
        decode_s += st.step_ms / 1e3;
        decode_tokens += st.scheduler.num_decode_tokens;
      }
    }
    const double total_s = std::chrono::duration<double>(Clock::now() - t0).count();
    const double decode_tps = decode_tokens / std::max(decode_s, 1e-9);
    const double achieved = decode_tps * fpt / 1e9;
    nlohmann::json point = {{"batch", batch}, {"batch_invariant", invariant}, {"prefill_tokens", prefill_tokens}, {"prefill_s", prefill_s},
                            {"prefill_tok_s", prefill_tokens / std::max(prefill_s, 1e-9)},
                            {"decode_tokens", decode_tokens}, {"decode_s", decode_s}, {"decode_tok_s", decode_tps},
                            {"total_s", total_s}, {"decode_matmul_gflops", achieved},
                            {"decode_roofline_ratio", achieved / ceiling}};
    std::printf("%s batch %3d: prefill %.0f tok/s, decode %.1f tok/s (%.2f GFLOP/s = %.1f%% of sgemm ceiling), total %.2f s\n",
                invariant ? "batch-invariant" : "batched-gemm   ", batch, point["prefill_tok_s"].get<double>(), decode_tps, achieved, 100.0 * achieved / ceiling, total_s);
    out["points"].push_back(point);
  }
  std::ofstream(json_path) << out.dump(2) << "\n";
  std::printf("wrote %s\n", json_path.c_str());
  return 0;
}
