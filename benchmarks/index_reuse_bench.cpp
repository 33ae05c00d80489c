// MSA index sharing (--msa-index-reuse N) against the model as trained, on one checkpoint
// (default: the bundled m3-small) and held-out corpus text: the quality cost (perplexity over
// windows of the corpus's last fifth, and how often the greedy next token agrees with N = 1) beside
// the time saved (one-sequence decode steps at the end of each window). Prints and saves JSON.
//   index_reuse_bench [--model DIR] [--corpus FILE] [--reuse 1,2,3,5] [--windows 3] [--window-len 1024]
//                     [--decode-tokens 16] [--json FILE]
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench_util.h"

#include "backend/cpu/cpu_backend.h"
#include "exec/sequence_runner.h"
#include "model/minimax_m3/model.h"
#include "tokenizer/tokenizer.h"

namespace {

using Clock = std::chrono::steady_clock;

}  // namespace

int main(int argc, char** argv) {
  std::string model_dir = M3_SOURCE_DIR "/models/m3-small";
  std::string corpus_path = M3_SOURCE_DIR "/../shared/data/corpus/pg1184-monte-cristo.txt";
  std::string json_path = "index_reuse_bench.json", reuse_list = "1,2,3,5";
  int windows = 3, window_len = 1024, decode_tokens = 16;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    if (k == "--model") model_dir = v;
    else if (k == "--corpus") corpus_path = v;
    else if (k == "--reuse") reuse_list = v;
    else if (k == "--windows") windows = std::stoi(v);
    else if (k == "--window-len") window_len = std::stoi(v);
    else if (k == "--decode-tokens") decode_tokens = std::stoi(v);
    else if (k == "--json") json_path = v;
    else { std::fprintf(stderr, "unknown option %s\n", k.c_str()); return 2; }
  }
  auto corpus_ids = m3::bench::corpus_tokens(corpus_path, model_dir);
  if (!corpus_ids) {
    std::fprintf(stderr, "%s\n", corpus_ids.error().c_str());
    return 1;
  }
  const std::vector<int32_t>& corpus = *corpus_ids;
  auto model = m3::MiniMaxM3Model::load(model_dir);
  if (!model) { std::fprintf(stderr, "%s\n", model.error().c_str()); return 1; }
  const int64_t vocab = (*model)->config().vocab_size;
  m3::ops::KernelTable table;
  m3::cpu::register_cpu_kernels(table);
  m3::ops::OpContext ctx{&table, nullptr, m3::Device::kCpu};
  nlohmann::json out = {{"model", model_dir}, {"windows", windows}, {"window_len", window_len},
                        {"decode_tokens", decode_tokens}, {"points", nlohmann::json::array()}};
  std::vector<std::vector<int32_t>> base_argmax;  // N = 1's greedy next token at every position
  double base_ppl = 0, base_decode_ms = 0;
  for (int reuse : m3::bench::parse_list(reuse_list)) {
    (*model)->set_msa_index_reuse(reuse);
    double nll = 0, decode_s = 0, prefill_s = 0;
    int64_t count = 0, agree = 0, compared = 0;
    std::vector<std::vector<int32_t>> argmax;
    for (int w = 0; w < windows; ++w) {
      const size_t start = corpus.size() * 4 / 5 + size_t(w) * size_t(window_len) * 4;
      if (start + size_t(window_len) + size_t(decode_tokens) > corpus.size()) break;
      std::vector<int32_t> window(corpus.begin() + long(start), corpus.begin() + long(start) + window_len);
      m3::SequenceRunner r(**model, ctx, window_len + decode_tokens);
      const auto t0 = Clock::now();
      const std::vector<float> logits = r.extend(window, /*all_logits=*/true);
      prefill_s += std::chrono::duration<double>(Clock::now() - t0).count();
      std::vector<int32_t> am;
      for (int p = 0; p + 1 < window_len; ++p) {
        const float* row = logits.data() + size_t(p) * size_t(vocab);
        const float mx = *std::max_element(row, row + vocab);
        double z = 0;
        for (int64_t v = 0; v < vocab; ++v) z += std::exp(double(row[v] - mx));
        nll += -(double(row[window[size_t(p) + 1]] - mx) - std::log(z));
        ++count;
        am.push_back(int32_t(std::max_element(row, row + vocab) - row));
      }
      if (!base_argmax.empty() && size_t(w) < base_argmax.size())
        for (size_t p = 0; p < am.size(); ++p, ++compared) agree += am[p] == base_argmax[size_t(w)][p];
      argmax.push_back(std::move(am));
      // Decode steps at the end of the window (the corpus's next tokens fed back).
      const auto t1 = Clock::now();
      for (int d = 0; d < decode_tokens; ++d) r.extend({corpus[start + size_t(window_len) + size_t(d)]}, false);
      decode_s += std::chrono::duration<double>(Clock::now() - t1).count();
    }
    if (reuse == 1 && base_argmax.empty()) base_argmax = argmax;
    const double ppl = std::exp(nll / double(std::max<int64_t>(1, count)));
    const double decode_ms = 1e3 * decode_s / double(std::max(1, windows * decode_tokens));
    if (reuse == 1) base_ppl = ppl, base_decode_ms = decode_ms;
    nlohmann::json point = {{"msa_index_reuse", reuse}, {"perplexity", ppl}, {"tokens_scored", count},
                            {"greedy_agreement_with_reuse_1", compared ? double(agree) / double(compared) : 1.0},
                            {"prefill_s", prefill_s}, {"decode_ms_per_token", decode_ms}};
    if (base_ppl > 0) point["perplexity_vs_reuse_1"] = ppl / base_ppl;
    if (base_decode_ms > 0) point["decode_time_vs_reuse_1"] = decode_ms / base_decode_ms;
    std::printf("reuse %d: perplexity %.3f (x%.4f), greedy agreement %.4f, decode %.2f ms/token (x%.3f), prefill %.2f s\n",
                reuse, ppl, base_ppl > 0 ? ppl / base_ppl : 1.0, point["greedy_agreement_with_reuse_1"].get<double>(),
                decode_ms, base_decode_ms > 0 ? decode_ms / base_decode_ms : 1.0, prefill_s);
    out["points"].push_back(point);
  }
  std::ofstream(json_path) << out.dump(2) << "\n";
  std::printf("wrote %s\n", json_path.c_str());
  return 0;
}
