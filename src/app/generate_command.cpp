// `m3serve generate`: continue token-id prompts, greedily or sampled, and report timing.
#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "app/commands.h"
#include "backend/cpu/cpu_backend.h"
#include "exec/sampler.h"
#include "exec/sequence_runner.h"

namespace m3::app {
namespace {

std::vector<int32_t> parse_ids(const std::string& text) {
  std::vector<int32_t> ids;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (item.find_first_not_of(" \t") == std::string::npos) continue;
    try {
      ids.push_back(int32_t(std::stol(item)));
    } catch (...) {
      throw std::runtime_error("prompt ids must be comma-separated integers, got '" + item + "'");
    }
  }
  if (ids.empty()) throw std::runtime_error("empty prompt");
  return ids;
}

}  // namespace

void register_generate(CLI::App& app) {
  auto* cmd = app.add_subcommand("generate", "Offline generation from token-id prompts");
  struct Opts {
    std::string model, prompt_file;
    std::vector<std::string> prompts;
    SamplingParams sampling;
    bool trace_dispatch = false;
  };
  auto opts = std::make_shared<Opts>();
  opts->sampling.temperature = 0.0f;
  cmd->add_option("--model", opts->model, "HF model directory")->required();
  cmd->add_option("--prompt-ids", opts->prompts, "comma-separated token ids (repeatable)");
  cmd->add_option("--prompt-file", opts->prompt_file, "one comma-separated prompt per line");
  cmd->add_option("--max-tokens", opts->sampling.max_tokens, "tokens to generate")->capture_default_str();
  cmd->add_option("--temperature", opts->sampling.temperature, "0 = greedy")->capture_default_str();
  cmd->add_option("--top-p", opts->sampling.top_p)->capture_default_str();
  cmd->add_option("--top-k", opts->sampling.top_k)->capture_default_str();
  cmd->add_option("--min-p", opts->sampling.min_p)->capture_default_str();
  cmd->add_option("--seed", opts->sampling.seed, "-1 = random")->capture_default_str();
  cmd->add_flag("--ignore-eos", opts->sampling.ignore_eos);
  cmd->add_flag("--trace-dispatch", opts->trace_dispatch, "log the first use of each (op, kernel, shape class)");
  cmd->callback([opts] {
    auto problems = opts->sampling.validate();
    if (!problems.empty()) throw std::runtime_error(problems[0]);
    std::vector<std::vector<int32_t>> prompts;
    for (const auto& p : opts->prompts) prompts.push_back(parse_ids(p));
    if (!opts->prompt_file.empty()) {
      std::ifstream in(opts->prompt_file);
      if (!in) throw std::runtime_error("cannot open " + opts->prompt_file);
      for (std::string line; std::getline(in, line);)
        if (line.find_first_not_of(" \t\r") != std::string::npos) prompts.push_back(parse_ids(line));
    }
    if (prompts.empty()) throw std::runtime_error("give --prompt-ids or --prompt-file");
    auto t0 = std::chrono::steady_clock::now();
    auto model = MiniMaxM3Model::load(opts->model);
    if (!model) throw std::runtime_error(model.error());
    const auto& cfg = (*model)->config();
    for (const auto& p : prompts)
      for (int32_t id : p)
        if (id < 0 || id >= cfg.vocab_size)
          throw std::runtime_error("token id " + std::to_string(id) + " outside the vocabulary [0, " +
                                   std::to_string(cfg.vocab_size) + ")");
    double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("loaded %s in %.2f s\n", opts->model.c_str(), load_s);
    ops::KernelTable table;
    cpu::register_cpu_kernels(table);
    ops::DispatchStats stats(opts->trace_dispatch);
    ops::OpContext ctx{&table, &stats, Device::kCpu};
    for (size_t i = 0; i < prompts.size(); ++i) {
      const auto& prompt = prompts[i];
      SequenceRunner runner(**model, ctx, int64_t(prompt.size()) + opts->sampling.max_tokens);
      Sampler sampler(opts->sampling);
      std::vector<int32_t> out;
      auto tp = std::chrono::steady_clock::now();
      auto logits = runner.extend(prompt, false);
      double prefill_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - tp).count();
      auto td = std::chrono::steady_clock::now();
      for (int n = 0; n < opts->sampling.max_tokens; ++n) {
        int32_t tok = sampler.sample(logits.data(), cfg.vocab_size, prompt, out).token;
        out.push_back(tok);
        bool stop = false;
        for (int32_t s : opts->sampling.stop_token_ids) stop |= tok == s;
        if (!opts->sampling.ignore_eos)
          for (int32_t e : cfg.eos_token_ids) stop |= tok == e;
        if (stop || n + 1 == opts->sampling.max_tokens) break;
        logits = runner.extend({tok}, false);
      }
      double decode_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - td).count();
      std::printf("prompt %zu (%zu tokens) -> %zu tokens:", i, prompt.size(), out.size());
      for (int32_t t : out) std::printf(" %d", t);
      std::printf("\n  prefill %.1f ms (%.0f tok/s), decode %.1f ms (%.1f tok/s)\n", prefill_s * 1e3,
                  double(prompt.size()) / prefill_s, decode_s * 1e3, double(out.size()) / std::max(decode_s, 1e-9));
    }
  });
}

}  // namespace m3::app
