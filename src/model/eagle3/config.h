#pragma once
// Eagle3Config: an EAGLE-3 draft model's hyper-parameters (config.json of a
// LlamaForCausalLMEagle3 checkpoint, e.g. Inferact/MiniMax-M3-EAGLE3), checked against the
// target it drafts for. One Llama decoder layer whose q/k/v read [norm(embedding), norm(hidden)]
// (2 x hidden); `hidden` is fc(the target's residual stream entering each aux layer,
// concatenated) for a token the target computed, or the draft's own pre-norm output for the
// tokens it chains after that.
#include <cstdint>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "core/status.h"

namespace m3 {

struct MiniMaxM3Config;

struct Eagle3Config {
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int num_attention_heads = 0;
  int num_key_value_heads = 0;
  int head_dim = 0;
  float rms_norm_eps = 1e-6f;
  double rope_theta = 10000.0;  // full-width NeoX rotation (Llama)
  int64_t max_position_embeddings = 0;
  int64_t vocab_size = 0;        // the target's vocabulary (input ids)
  int64_t draft_vocab_size = 0;  // the draft head's rows; d2t maps them to target ids when smaller
  int64_t target_hidden_size = 0;
  // Residual stream of the target entering these layers (vLLM / SGLang's capture convention),
  // concatenated in this order as fc's input.
  std::vector<int> aux_layer_ids;
  // vLLM's norm_before_residual: the residual branch starts from hidden_norm(hidden), not hidden.
  bool norm_before_residual = false;

  // Tensor parallelism (a serving choice, after shard()): the heads and the MLP width above are this
  // rank's share; q/k/v and gate/up keep a range of output rows, o_proj and down a range of input
  // columns (their outputs summed over the ranks). tp_size 1: the whole draft on this rank.
  int tp_size = 1, tp_rank = 0;

  int64_t fc_in() const { return target_hidden_size * int64_t(aux_layer_ids.size()); }
  // This rank's share when the heads, the KV heads and the MLP width divide by tp; else the whole
  // draft (replicated on every rank, tp_size 1).
  Eagle3Config shard(int tp, int rank) const;

  // Reads the draft's config.json and checks it against `target` (layer ids in range, the
  // vocabulary, hidden sizes a shared embedding needs). Errors name the field.
  static Result<Eagle3Config> from_json(const nlohmann::json& root, const MiniMaxM3Config& target);
  nlohmann::json to_json() const;
};

}  // namespace m3
