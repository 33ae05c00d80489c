#include <cstdio>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "app/commands.h"
#include "model/eagle3/make_draft.h"
#include "model/minimax_m3/make_model.h"

namespace m3::app {

void register_make_model(CLI::App& app) {
  auto* cmd = app.add_subcommand("make-model", "Write a random-weight M3 checkpoint in the exact HF layout");
  struct Opts {
    std::string preset = "tiny", out;
    bool mxfp8 = false;
    uint64_t seed = 0;
    int layers = -1;
    size_t shard_mib = 64;
  };
  auto opts = std::make_shared<Opts>();
  cmd->add_option("--preset", opts->preset, "tiny | m3 | m3-layers:N")->capture_default_str();
  cmd->add_option("--out", opts->out, "output directory")->required();
  cmd->add_flag("--mxfp8", opts->mxfp8, "MXFP8 weights (fp8 e4m3 + e8m0 scale per 1x32 along K)");
  cmd->add_option("--seed", opts->seed, "generator seed (same seed, same bytes on every machine)")->capture_default_str();
  cmd->add_option("--num-layers", opts->layers, "override the preset's layer count (keeps its dense/sparse pattern)");
  cmd->add_option("--shard-size-mib", opts->shard_mib, "maximum shard size")->capture_default_str();
  cmd->callback([opts] {
    auto config = MiniMaxM3Config::preset(opts->preset);
    if (!config) throw std::runtime_error(config.error());
    if (opts->layers > 0) {
      auto resized = MiniMaxM3Config::preset(opts->preset == "tiny" ? "tiny" : "m3-layers:" + std::to_string(opts->layers));
      if (!resized) throw std::runtime_error(resized.error());
      if (opts->preset == "tiny") {
        config->num_hidden_layers = opts->layers;
        config->moe_layer_freq.assign(size_t(opts->layers), 1);
        config->sparse_layer_freq.assign(size_t(opts->layers), 1);
        config->moe_layer_freq[0] = config->sparse_layer_freq[0] = 0;
      } else {
        config = resized;
      }
    }
    MakeModelOptions mm;
    mm.out_dir = opts->out;
    mm.config = *config;
    mm.mxfp8 = opts->mxfp8;
    mm.seed = opts->seed;
    mm.max_shard_bytes = opts->shard_mib << 20;
    Status st = make_model(mm);
    if (!st.is_ok()) throw std::runtime_error(st.message());
    std::printf("wrote %s checkpoint (%s, seed %llu) to %s\n", opts->preset.c_str(), opts->mxfp8 ? "MXFP8" : "BF16",
                (unsigned long long)opts->seed, opts->out.c_str());
  });
}

void register_make_draft(CLI::App& app) {
  auto* cmd = app.add_subcommand("make-draft", "Write a random-weight EAGLE-3 draft checkpoint for a target model");
  struct Opts {
    std::string target, out;
    uint64_t seed = 0;
    std::vector<int> aux_layers;
    int heads = 0, kv_heads = 0;
    int64_t intermediate = 0, draft_vocab = 0;
    bool no_lm_head = false;
  };
  auto opts = std::make_shared<Opts>();
  cmd->add_option("--target", opts->target, "the target model's directory (its config.json)")->required();
  cmd->add_option("--out", opts->out, "output directory")->required();
  cmd->add_option("--seed", opts->seed, "generator seed")->capture_default_str();
  cmd->add_option("--aux-layers", opts->aux_layers,
                  "target layers whose input hidden states feed the draft (default: 2, L/2, L-3 where they exist, "
                  "else spread over the layers)")
      ->delimiter(',');
  cmd->add_option("--heads", opts->heads, "attention heads (default: hidden / head_dim)");
  cmd->add_option("--kv-heads", opts->kv_heads, "KV heads (default: a quarter of the heads)");
  cmd->add_option("--intermediate-size", opts->intermediate, "MLP width (default: 2 x hidden)");
  cmd->add_option("--draft-vocab-size", opts->draft_vocab, "rows of the draft's LM head (smaller: with d2t)");
  cmd->add_flag("--no-lm-head", opts->no_lm_head, "no lm_head.weight: the target's LM head stands in");
  cmd->callback([opts] {
    auto target = MiniMaxM3Config::from_file(opts->target + "/config.json");
    if (!target) throw std::runtime_error(target.error());
    const int L = target->num_hidden_layers;
    std::vector<int> aux = opts->aux_layers;
    if (aux.empty()) aux = L > 3 ? std::vector<int>{2, L / 2, L - 3} : std::vector<int>{0, L / 2, L - 1};
    Eagle3Config c = default_draft_config(*target, aux);
    if (opts->heads > 0) c.num_attention_heads = opts->heads;
    if (opts->kv_heads > 0) c.num_key_value_heads = opts->kv_heads;
    else if (opts->heads > 0) c.num_key_value_heads = opts->heads % 4 == 0 ? opts->heads / 4 : opts->heads;
    if (opts->intermediate > 0) c.intermediate_size = opts->intermediate;
    if (opts->draft_vocab > 0) c.draft_vocab_size = opts->draft_vocab;
    auto checked = Eagle3Config::from_json(c.to_json(), *target);  // the checks a load makes
    if (!checked) throw std::runtime_error("make-draft: " + checked.error());
    MakeDraftOptions mo;
    mo.out_dir = opts->out;
    mo.config = *checked;
    mo.with_lm_head = !opts->no_lm_head;
    mo.seed = opts->seed;
    Status st = make_draft(mo);
    if (!st.is_ok()) throw std::runtime_error(st.message());
    std::printf("wrote an EAGLE-3 draft (hidden %lld, %d/%d heads, aux layers", (long long)c.hidden_size,
                c.num_attention_heads, c.num_key_value_heads);
    for (int a : c.aux_layer_ids) std::printf(" %d", a);
    std::printf(") to %s\n", opts->out.c_str());
  });
}

}  // namespace m3::app
