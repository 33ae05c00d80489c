#include <cstdio>
#include <stdexcept>

#include "app/commands.h"
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

}  // namespace m3::app
