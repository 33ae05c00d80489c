// `m3serve generate`: offline batched generation of token-id prompts through the public
// engine API (greedy or sampled); prints the ids, per-step stats on request, and throughput.
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>

#include "app/commands.h"
#include "m3serve/engine.h"
#include "tokenizer/tokenizer.h"

namespace m3::app {
namespace {

std::vector<int32_t> parse_ids(const std::string& text) {
  std::vector<int32_t> ids;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (item.find_first_not_of(" \t\r") == std::string::npos) continue;
    try {
      size_t used = 0;
      long v = std::stol(item, &used);
      if (item.find_first_not_of(" \t\r", used) != std::string::npos) throw std::invalid_argument(item);
      ids.push_back(int32_t(v));
    } catch (...) {
      throw std::runtime_error("prompt ids must be comma-separated integers, got '" + item + "'");
    }
  }
  if (ids.empty()) throw std::runtime_error("empty prompt");
  return ids;
}

}  // namespace

void register_generate(CLI::App& app) {
  auto* cmd = app.add_subcommand("generate", "Offline batched generation from token-id prompts");
  struct Opts {
    EngineConfig engine;
    std::string prompt_file;
    std::vector<std::string> prompts;
    std::vector<std::string> text_prompts;
    bool add_bos = false;
    SamplingParams sampling;
    bool print_steps = false;
    bool no_prefix = false;
  };
  auto opts = std::make_shared<Opts>();
  opts->sampling.temperature = 0.0f;
  opts->engine.model_dir = M3_DEFAULT_MODEL_DIR;
  cmd->add_option("--model", opts->engine.model_dir, "HF model directory (default: the embedded m3-small)")
      ->capture_default_str();
  cmd->add_option("--prompt", opts->text_prompts, "text prompt, encoded with the model's tokenizer (repeatable)");
  cmd->add_flag("--add-bos", opts->add_bos, "prepend the BOS token to text prompts");
  cmd->add_option("--prompt-ids", opts->prompts, "comma-separated token ids (repeatable)");
  cmd->add_option("--prompt-file", opts->prompt_file, "one comma-separated prompt per line");
  cmd->add_option("--max-tokens", opts->sampling.max_tokens, "tokens to generate per prompt")->capture_default_str();
  cmd->add_option("--temperature", opts->sampling.temperature, "0 = greedy")->capture_default_str();
  cmd->add_option("--top-p", opts->sampling.top_p)->capture_default_str();
  cmd->add_option("--top-k", opts->sampling.top_k)->capture_default_str();
  cmd->add_option("--min-p", opts->sampling.min_p)->capture_default_str();
  cmd->add_option("--seed", opts->sampling.seed, "-1 = random")->capture_default_str();
  cmd->add_flag("--ignore-eos", opts->sampling.ignore_eos);
  cmd->add_option("--max-num-batched-tokens", opts->engine.max_num_batched_tokens)->capture_default_str();
  cmd->add_option("--max-num-seqs", opts->engine.max_num_seqs)->capture_default_str();
  cmd->add_option("--max-model-len", opts->engine.max_model_len, "0 = model / pool limit")->capture_default_str();
  cmd->add_option("--num-kv-blocks", opts->engine.num_kv_blocks, "0 = from --kv-cache-memory")->capture_default_str();
  cmd->add_option("--kv-cache-memory", opts->engine.kv_cache_memory_bytes, "bytes of KV cache")->capture_default_str();
  cmd->add_flag("--no-enable-prefix-caching", opts->no_prefix, "disable prefix caching");
  cmd->add_option("--device", opts->engine.device, "auto (CUDA when a GPU is present), cuda or cpu")
      ->check(CLI::IsMember({"auto", "cuda", "cpu"}))
      ->capture_default_str();
  cmd->add_option("--device-id", opts->engine.device_id, "CUDA device ordinal")->capture_default_str();
  cmd->add_option("--kv-cache-dtype", opts->engine.kv_cache_dtype,
                  "KV cache element type: auto (bf16 on CUDA, f32 on CPU), f32, bf16")
      ->check(CLI::IsMember({"auto", "f32", "bf16"}))
      ->capture_default_str();
  cmd->add_option("--index-cache-dtype", opts->engine.index_cache_dtype,
                  "MSA index-key cache element type: auto (the KV cache's), f32, bf16, fp8 (e4m3: half of bf16's "
                  "bytes for the indexer's scan, coarser block scores)")
      ->check(CLI::IsMember({"auto", "f32", "bf16", "fp8"}))
      ->capture_default_str();
  cmd->add_flag("--enforce-eager{false}", opts->engine.cuda_graphs,
                "run decode steps eagerly instead of replaying a CUDA graph per batch bucket");
  cmd->add_flag("--dequantize-mxfp8", opts->engine.dequantize_mxfp8, "hold MXFP8 weights as BF16 on the GPU (twice the bytes)");
  cmd->add_flag("--no-batch-invariant{false}", opts->engine.batch_invariant,
                "allow kernels whose per-token results depend on the batch (cuBLAS / BLAS GEMMs)");
  cmd->add_flag("--trace-dispatch", opts->engine.trace_dispatch, "log the first use of each (op, kernel, shape class)");
  cmd->add_flag("--print-steps", opts->print_steps, "print every step's stats");
  cmd->callback([opts] {
    opts->engine.enable_prefix_caching = !opts->no_prefix;
    std::vector<std::vector<int32_t>> prompts;
    for (const auto& p : opts->prompts) prompts.push_back(parse_ids(p));
    if (!opts->prompt_file.empty()) {
      std::ifstream in(opts->prompt_file);
      if (!in) throw std::runtime_error("cannot open " + opts->prompt_file);
      for (std::string line; std::getline(in, line);)
        if (line.find_first_not_of(" \t\r") != std::string::npos) prompts.push_back(parse_ids(line));
    }
    std::unique_ptr<Tokenizer> tokenizer;
    if (auto tok = Tokenizer::from_dir(opts->engine.model_dir); tok.is_ok()) tokenizer = std::move(*tok);
    if (!opts->text_prompts.empty() && !tokenizer)
      throw std::runtime_error("--prompt needs a tokenizer in " + opts->engine.model_dir + " (use --prompt-ids)");
    for (const auto& text : opts->text_prompts) {
      std::vector<int32_t> ids;
      if (opts->add_bos) {
        auto bos = tokenizer->token_to_id("]~!b[");
        if (!bos) throw std::runtime_error("--add-bos: the tokenizer has no ]~!b[ token");
        ids.push_back(*bos);
      }
      auto body = tokenizer->encode(text, true);
      ids.insert(ids.end(), body.begin(), body.end());
      if (ids.empty()) throw std::runtime_error("empty text prompt");
      prompts.push_back(std::move(ids));
    }
    if (prompts.empty()) throw std::runtime_error("give --prompt, --prompt-ids or --prompt-file");
    auto t0 = std::chrono::steady_clock::now();
    auto engine = Engine::create(opts->engine);
    if (!engine) throw std::runtime_error(engine.error());
    const ModelSummary& ms = (*engine)->model();
    std::printf("loaded %s in %.2f s on %s (%d KV blocks of %d tokens, KV %s, index keys %s, max_model_len %d)\n",
                opts->engine.model_dir.c_str(), std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
                ms.device.c_str(), ms.num_kv_blocks, ms.block_size, ms.kv_cache_dtype.c_str(),
                ms.index_cache_dtype.c_str(), ms.max_model_len);
    std::map<RequestId, size_t> index;
    int64_t prompt_tokens = 0;
    for (size_t i = 0; i < prompts.size(); ++i) {
      auto id = (*engine)->submit({prompts[i], opts->sampling});
      if (!id) throw std::runtime_error("prompt " + std::to_string(i) + ": " + id.error());
      index[*id] = i;
      prompt_tokens += int64_t(prompts[i].size());
    }
    std::vector<std::vector<int32_t>> outputs(prompts.size());
    auto ts = std::chrono::steady_clock::now();
    int64_t steps = 0, output_tokens = 0;
    while ((*engine)->has_unfinished_requests()) {
      EngineStepStats st;
      for (auto& ev : (*engine)->step(&st))
        for (auto& t : ev.new_tokens) {
          outputs[index[ev.request_id]].push_back(t.token);
          ++output_tokens;
        }
      ++steps;
      if (opts->print_steps) {
        std::printf("step %lld: prefill %d decode %d running %d waiting %d preempted %d kv %d/%d prefix hit %d/%d "
                    "tokens, %.1f ms%s\n",
                    (long long)steps, st.scheduler.num_prefill_tokens, st.scheduler.num_decode_tokens,
                    st.scheduler.num_running, st.scheduler.num_waiting, st.scheduler.num_preemptions,
                    st.scheduler.kv_blocks_used, st.scheduler.kv_blocks_used + st.scheduler.kv_blocks_free,
                    st.scheduler.prefix_hit_tokens, st.scheduler.prefix_query_tokens, st.step_ms,
                    st.graph_batch > 0 ? (" graph b" + std::to_string(st.graph_batch)).c_str() : "");
        if (opts->engine.trace_dispatch) {
          std::printf("  kernels:");
          for (const auto& p : st.kernel_paths) std::printf(" %s", p.c_str());
          std::printf("\n");
        }
      }
    }
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - ts).count();
    for (size_t i = 0; i < prompts.size(); ++i) {
      std::printf("prompt %zu (%zu tokens) -> %zu tokens:", i, prompts[i].size(), outputs[i].size());
      for (int32_t t : outputs[i]) std::printf(" %d", t);
      std::printf("\n");
      if (tokenizer) std::printf("  text: %s\n", tokenizer->decode(outputs[i]).c_str());
    }
    std::printf("%zu requests, %lld prompt + %lld output tokens in %.3f s over %lld steps: %.1f output tok/s, "
                "%.1f total tok/s\n",
                prompts.size(), (long long)prompt_tokens, (long long)output_tokens, secs, (long long)steps,
                double(output_tokens) / secs, double(prompt_tokens + output_tokens) / secs);
  });
}

}  // namespace m3::app
