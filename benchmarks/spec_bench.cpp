// Speculative decoding (ngram drafts) against plain decoding on one checkpoint (default: the
// bundled m3-small), greedy, on two workloads cut from a public-domain corpus:
//   echo: a passage, then its first 24 tokens again: the continuation repeats the
//         context (what agents quoting tool output, code edits and summaries look like);
//   free: a passage alone: the continuation is new text (drafts are mostly wrong: the cost).
// For each (workload, batch, draft length) it prints and saves the wall time, output tokens/s,
// steps, mean acceptance length and acceptance rate, the speed-up over plain decoding, whether
// every output equals plain decoding's, and on the CPU the matmul FLOP/s of the tokens computed
// (drafts included) over the measured sgemm ceiling.
//   spec_bench [--model DIR] [--tokenizer DIR] [--corpus FILE] [--batch-sizes 1,8] [--draft-lens 0,3,5]
//              [--input-len 256] [--output-len 128] [--device auto|cpu|cuda] [--spec-graphs 0|1]
//              [--tensor-parallel-size N] [--logprobs N] [--enforce-eager 0|1] [--eagle3 DRAFT_DIR] [--json FILE]
// --eagle3: drafts from an EAGLE-3 draft model (its passes' time is in the steps' and in draft_s)
// instead of prompt lookup.
// The first run with k = 0 of a (workload, batch) is the reference every later run of it is
// compared with (repeat 0 in --draft-lens to check run-to-run determinism); a differing output
// prints its first differing position, with the reference's top-2 logprob margin there when
// --logprobs >= 2.
// --spec-graphs 1: verification steps replay CUDA graphs (full-length drafts; EngineConfig::spec_cuda_graphs).
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench_util.h"

#include "cpu_roofline.h"
#include "m3serve/engine.h"
#include "tokenizer/tokenizer.h"

namespace {

using Clock = std::chrono::steady_clock;


// Prompt b of a workload: input_len tokens of the corpus from the last fifth (held out from
// m3-small's training), passages 4096 tokens apart.
std::vector<int32_t> make_prompt(const std::vector<int32_t>& corpus,
                                 const std::string& workload, int b, int input_len) {
  const size_t start = corpus.size() * 4 / 5 + size_t(b) * 4096;
  std::vector<int32_t> p(corpus.begin() + long(start), corpus.begin() + long(start) + input_len);
  if (workload == "echo") {
    const std::vector<int32_t> head(p.begin(), p.begin() + 24);
    p.insert(p.end(), head.begin(), head.end());
  }
  return p;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model_dir = M3_SOURCE_DIR "/models/m3-small", corpus_path = M3_SOURCE_DIR "/../shared/data/corpus/pg1184-monte-cristo.txt";
  std::string tokenizer_dir, eagle3_dir;
  std::string json_path = "spec_bench.json", batches = "1,8", drafts = "0,3,5", device = "auto";
  int input_len = 256, output_len = 128, spec_graphs = 0, tp = 1, logprobs = 0, eager = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    if (k == "--model") model_dir = v;
    else if (k == "--corpus") corpus_path = v;
    else if (k == "--tokenizer") tokenizer_dir = v;
    else if (k == "--batch-sizes") batches = v;
    else if (k == "--draft-lens") drafts = v;
    else if (k == "--input-len") input_len = std::stoi(v);
    else if (k == "--output-len") output_len = std::stoi(v);
    else if (k == "--device") device = v;
    else if (k == "--spec-graphs") spec_graphs = std::stoi(v);
    else if (k == "--tensor-parallel-size") tp = std::stoi(v);
    else if (k == "--logprobs") logprobs = std::stoi(v);
    else if (k == "--enforce-eager") eager = std::stoi(v);  // no CUDA graphs
    else if (k == "--json") json_path = v;
    else if (k == "--eagle3") eagle3_dir = v;
    else { std::fprintf(stderr, "unknown option %s\n", k.c_str()); return 2; }
  }
  auto corpus_ids = m3::bench::corpus_tokens(corpus_path, tokenizer_dir.empty() ? model_dir : tokenizer_dir);
  if (!corpus_ids) {
    std::fprintf(stderr, "%s\n", corpus_ids.error().c_str());
    return 1;
  }
  const std::vector<int32_t>& corpus = *corpus_ids;
  auto cfg = m3::MiniMaxM3Config::from_file(model_dir + "/config.json");
  if (!cfg) { std::fprintf(stderr, "%s\n", cfg.error().c_str()); return 1; }
  const std::vector<int> batch_sizes = m3::bench::parse_list(batches);
  int max_batch = 1;
  for (int b : batch_sizes) max_batch = std::max(max_batch, b);
  if (corpus.size() < corpus.size() * 4 / 5 + size_t(max_batch) * 4096 + size_t(input_len)) {
    std::fprintf(stderr, "corpus too short for %d prompts\n", max_batch);
    return 1;
  }
  const double fpt = m3::bench::flops_per_token(*cfg);
  nlohmann::json out = {{"model", model_dir}, {"corpus", corpus_path}, {"input_len", input_len}, {"spec_graphs", spec_graphs},
                        {"output_len", output_len}, {"tensor_parallel_size", tp}, {"matmul_flops_per_token", fpt}, {"points", nlohmann::json::array()}};
  double ceiling = 0;
  std::map<std::string, std::vector<std::vector<int32_t>>> plain_outputs;
  std::map<std::string, double> plain_s;
  std::map<std::string, std::vector<std::vector<float>>> plain_margins;
  for (const std::string workload : {"echo", "free"})
  for (int batch : batch_sizes)
  for (int k : m3::bench::parse_list(drafts)) {
    m3::EngineConfig ec;
    ec.model_dir = model_dir;
    ec.device = device;
    ec.tensor_parallel_size = tp;
    ec.cuda_graphs = eager == 0;
    ec.max_num_seqs = batch;
    ec.max_num_batched_tokens = 2048;
    ec.enable_prefix_caching = false;
    if (k > 0) {
      ec.speculative_method = eagle3_dir.empty() ? "ngram" : "eagle3";
      ec.speculative_model = eagle3_dir;
      ec.ngram.num_speculative_tokens = k;
      ec.spec_cuda_graphs = spec_graphs != 0;
    }
    auto engine = m3::Engine::create(ec);
    if (!engine) { std::fprintf(stderr, "%s\n", engine.error().c_str()); return 1; }
    const bool cpu = (*engine)->model().device.rfind("cpu", 0) == 0;
    if (cpu && ceiling == 0) {
      ceiling = m3::bench::measure_sgemm_gflops();
      out["sgemm_ceiling_gflops"] = ceiling;
      std::printf("sgemm ceiling %.1f GFLOP/s; %.2f MFLOP per token (matmuls)\n", ceiling, fpt / 1e6);
    }
    std::map<m3::RequestId, int> which;
    for (int b = 0; b < batch; ++b) {
      m3::GenerationRequest r;
      r.prompt_token_ids = make_prompt(corpus, workload, b, input_len);
      r.sampling.temperature = 0.0f;
      r.sampling.max_tokens = output_len;
      r.sampling.ignore_eos = true;
      r.sampling.logprobs = logprobs;
      auto id = (*engine)->submit(std::move(r));
      if (!id) { std::fprintf(stderr, "%s\n", id.error().c_str()); return 1; }
      which[*id] = b;
    }
    std::vector<std::vector<int32_t>> outputs(static_cast<size_t>(batch));
    std::vector<std::vector<float>> margins(static_cast<size_t>(batch));  // top-1 minus top-2 logprob
    int64_t steps = 0, drafts_n = 0, draft_tokens = 0, accepted = 0, computed = 0, decode_steps = 0, graph_steps = 0;
    double decode_s = 0, draft_s = 0;
    const auto t0 = Clock::now();
    while ((*engine)->has_unfinished_requests()) {
      m3::EngineStepStats st;
      for (auto& ev : (*engine)->step(&st))
        for (auto& t : ev.new_tokens) {
          outputs[size_t(which[ev.request_id])].push_back(t.token);
          margins[size_t(which[ev.request_id])].push_back(
              t.top_logprobs.size() >= 2 ? t.top_logprobs[0].logprob - t.top_logprobs[1].logprob : -1.0f);
        }
      ++steps;
      drafts_n += st.spec_num_drafts;
      draft_tokens += st.spec_num_draft_tokens;
      accepted += st.spec_num_accepted_tokens;
      draft_s += st.draft_ms / 1e3;
      if (st.scheduler.num_prefill_tokens == 0) {
        ++decode_steps;
        graph_steps += st.graph_batch > 0;
        decode_s += st.step_ms / 1e3;
        computed += st.scheduler.num_decode_tokens;
      }
    }
    const double total_s = std::chrono::duration<double>(Clock::now() - t0).count();
    const std::string key = workload + "/" + std::to_string(batch);
    if (k == 0 && !plain_outputs.count(key)) {
      plain_outputs[key] = outputs;
      plain_margins[key] = margins;
      plain_s[key] = decode_s;
    }
    const bool same = plain_outputs.count(key) && plain_outputs[key] == outputs;
    for (size_t b = 0; !same && b < outputs.size(); ++b) {
      const auto& ref = plain_outputs[key][b];
      size_t i = 0;
      while (i < ref.size() && i < outputs[b].size() && ref[i] == outputs[b][i]) ++i;
      if (i == ref.size() && i == outputs[b].size()) continue;
      const float margin = i < plain_margins[key][b].size() ? plain_margins[key][b][i] : -1.0f;
      std::printf("  sequence %zu differs from output %zu on (%d vs %d; reference top-2 margin %.3g)\n", b, i,
                  i < ref.size() ? ref[i] : -1, i < outputs[b].size() ? outputs[b][i] : -1, double(margin));
    }
    const int64_t generated = int64_t(batch) * output_len;
    nlohmann::json point = {{"workload", workload}, {"batch", batch}, {"num_speculative_tokens", k},
                            {"method", k > 0 ? ec.speculative_method : "none"},
                            {"total_s", total_s}, {"decode_s", decode_s}, {"draft_s", draft_s}, {"steps", steps}, {"decode_steps", decode_steps},
                            {"graph_replayed_decode_steps", graph_steps},
                            {"output_tok_s", double(generated) / std::max(total_s, 1e-9)},
                            {"decode_tok_s", double(generated - batch) / std::max(decode_s, 1e-9)},
                            {"drafts", drafts_n}, {"draft_tokens", draft_tokens}, {"accepted_tokens", accepted},
                            {"mean_acceptance_length", drafts_n ? 1.0 + double(accepted) / double(drafts_n) : 1.0},
                            {"acceptance_rate", draft_tokens ? double(accepted) / double(draft_tokens) : 0.0},
                            {"decode_speedup", plain_s.count(key) ? plain_s[key] / std::max(decode_s, 1e-9) : 1.0},
                            {"same_output_as_plain", same}, {"device", (*engine)->model().device}};
    if (cpu && ceiling > 0) {
      const double gflops = double(computed) * fpt / std::max(decode_s, 1e-9) / 1e9;
      point["decode_matmul_gflops"] = gflops;
      point["decode_roofline_ratio"] = gflops / ceiling;
    }
    std::printf("%-4s batch %2d k=%d: decode %6.1f tok/s (%.2fx), %4lld decode steps (%lld in graphs), acceptance "
                "length %.2f (rate %.0f%%), same output %s\n",
                workload.c_str(), batch, k, point["decode_tok_s"].get<double>(), point["decode_speedup"].get<double>(),
                static_cast<long long>(decode_steps), static_cast<long long>(graph_steps),
                point["mean_acceptance_length"].get<double>(),
                100.0 * point["acceptance_rate"].get<double>(), same ? "yes" : "NO");
    out["points"].push_back(point);
  }
  std::ofstream(json_path) << out.dump(2) << "\n";
  std::printf("wrote %s\n", json_path.c_str());
  return 0;
}
