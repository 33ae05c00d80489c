#pragma once
// MiniMaxM3Config: the one struct holding the model's hyper-parameters, read from an HF
// config.json (deployment shape: text_config + sparse_attention_config + flat
// partial_rotary_factor; or HF 5.17's flattened index_* names). Immutable after validate().
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "core/status.h"

namespace m3 {

enum class QuantMethod { kNone, kMxfp8 };

struct MiniMaxM3Config {
  // Trunk
  int64_t vocab_size = 200064;
  int64_t hidden_size = 6144;
  int num_hidden_layers = 60;
  int num_attention_heads = 64;
  int num_key_value_heads = 4;
  int head_dim = 128;
  float rms_norm_eps = 1e-6f;
  bool tie_word_embeddings = false;
  int64_t max_position_embeddings = 1048576;
  int bos_token_id = 200034;
  std::vector<int> eos_token_ids = {200020};

  // RoPE: NeoX pairing on the first rotary_dim dims of every head.
  double rope_theta = 5e6;
  int rotary_dim = 64;

  // FFN
  int64_t dense_intermediate_size = 12288;
  int64_t intermediate_size = 3072;         // routed expert width
  int64_t shared_intermediate_size = 3072;  // per shared expert
  int num_local_experts = 128;
  int num_experts_per_tok = 4;
  int n_shared_experts = 1;
  float routed_scaling_factor = 2.0f;
  bool use_routing_bias = true;
  float swiglu_alpha = 1.702f;
  float swiglu_limit = 7.0f;
  float swiglu_beta = 1.0f;
  std::vector<int> moe_layer_freq;  // per layer: 1 = MoE, 0 = dense MLP

  // MSA
  std::vector<int> sparse_layer_freq;  // per layer: 1 = MSA, 0 = dense attention
  int index_n_heads = 4;
  int index_head_dim = 128;
  int index_block_size = 128;
  int index_topk_blocks = 16;
  int index_local_blocks = 1;
  int index_init_blocks = 0;
  // Index sharing across layers (a serving choice, never read from config.json; it changes the
  // model's work): groups of msa_index_reuse consecutive sparse layers use the first one's block
  // selection, the others compute no index keys and keep no index-key cache. 1 = off.
  int msa_index_reuse = 1;

  // Tensor parallelism (a serving choice): after shard(), the head counts, index heads and MLP /
  // expert widths above are this rank's share. Query heads and MLP widths split evenly; KV heads
  // (and the index heads, one per KV group) split while tp_size <= the model's KV heads and are
  // replicated beyond (rank r then holds KV head r / (tp_size / kv_heads)).
  int tp_size = 1, tp_rank = 0;
  int kv_head_offset = 0;  // the first global KV (= index) head this rank holds

  // Weights
  QuantMethod quant_method = QuantMethod::kNone;
  int quant_block_k = 32;  // MXFP8: one e8m0 scale per 1 x 32 run along K
  std::vector<std::string> quant_ignored_layers;

  bool is_moe_layer(int layer) const { return moe_layer_freq[size_t(layer)] != 0; }
  bool is_sparse_layer(int layer) const { return sparse_layer_freq[size_t(layer)] != 0; }
  // A sparse layer that selects its own blocks (first of its msa_index_reuse group).
  bool computes_index(int layer) const;
  int num_kv_groups() const { return num_attention_heads / num_key_value_heads; }
  int num_sparse_layers() const;
  int num_moe_layers() const;

  // This rank's config for tp_size ranks (from the whole model's); an error names the width that
  // does not divide. MXFP8 widths split along K must stay multiples of its 32-wide scale blocks.
  Result<MiniMaxM3Config> shard(int tp_size, int tp_rank) const;

  // Every problem at once; empty means valid.
  std::vector<std::string> validate() const;

  // Parses a whole config.json (top level with text_config, or a bare text config).
  static Result<MiniMaxM3Config> from_json(const nlohmann::json& root);
  static Result<MiniMaxM3Config> from_file(const std::string& path);
  // Deployment-shaped config.json (what MiniMaxAI ships; HF 5.17 reads it as is).
  nlohmann::json to_json() const;

  // Named presets: "tiny", "m3", "m3-layers:N".
  static Result<MiniMaxM3Config> preset(std::string_view name);
};

// Whether a (language_model-relative) module name is left unquantised in MXFP8 checkpoints.
bool is_quant_ignored(const MiniMaxM3Config& config, std::string_view module_name);

}  // namespace m3
