#include "model/minimax_m3/weight_specs.h"

namespace m3 {

std::string scale_name_for(const std::string& weight_name) {
  // "...proj.weight" -> "...proj.weight_scale_inv"
  return weight_name + "_scale_inv";
}

std::vector<WeightSpec> weight_specs(const MiniMaxM3Config& c) {
  std::vector<WeightSpec> specs;
  const std::string root = std::string(kTextPrefix) + "model.";
  const int64_t hidden = c.hidden_size, hd = c.head_dim;
  const int64_t q_out = int64_t(c.num_attention_heads) * hd, kv_out = int64_t(c.num_key_value_heads) * hd;
  auto add = [&](std::string name, Shape shape, WeightRole role, int layer, bool expert = false) {
    specs.push_back(WeightSpec{std::move(name), std::move(shape), role, layer, expert});
  };
  add(root + "embed_tokens.weight", {c.vocab_size, hidden}, WeightRole::kEmbedding, -1);
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = root + "layers." + std::to_string(l) + ".";
    add(p + "input_layernorm.weight", {hidden}, WeightRole::kNorm, l);
    add(p + "post_attention_layernorm.weight", {hidden}, WeightRole::kNorm, l);
    add(p + "self_attn.q_proj.weight", {q_out, hidden}, WeightRole::kLinear, l);
    add(p + "self_attn.k_proj.weight", {kv_out, hidden}, WeightRole::kLinear, l);
    add(p + "self_attn.v_proj.weight", {kv_out, hidden}, WeightRole::kLinear, l);
    add(p + "self_attn.o_proj.weight", {hidden, q_out}, WeightRole::kLinear, l);
    add(p + "self_attn.q_norm.weight", {hd}, WeightRole::kNorm, l);
    add(p + "self_attn.k_norm.weight", {hd}, WeightRole::kNorm, l);
    if (c.is_sparse_layer(l)) {
      add(p + "self_attn.index_q_proj.weight", {int64_t(c.index_n_heads) * c.index_head_dim, hidden},
          WeightRole::kLinear, l);
      add(p + "self_attn.index_k_proj.weight", {c.index_head_dim, hidden}, WeightRole::kLinear, l);
      add(p + "self_attn.index_q_norm.weight", {c.index_head_dim}, WeightRole::kNorm, l);
      add(p + "self_attn.index_k_norm.weight", {c.index_head_dim}, WeightRole::kNorm, l);
    }
    if (c.is_moe_layer(l)) {
      const std::string m = p + "block_sparse_moe.";
      add(m + "gate.weight", {c.num_local_experts, hidden}, WeightRole::kRouter, l);
      add(m + "e_score_correction_bias", {c.num_local_experts}, WeightRole::kRouterBias, l);
      for (int e = 0; e < c.num_local_experts; ++e) {
        const std::string x = m + "experts." + std::to_string(e) + ".";
        add(x + "w1.weight", {c.intermediate_size, hidden}, WeightRole::kLinear, l, true);
        add(x + "w3.weight", {c.intermediate_size, hidden}, WeightRole::kLinear, l, true);
        add(x + "w2.weight", {hidden, c.intermediate_size}, WeightRole::kLinear, l, true);
      }
      if (c.n_shared_experts > 0) {
        const int64_t si = c.shared_intermediate_size * c.n_shared_experts;
        add(m + "shared_experts.gate_proj.weight", {si, hidden}, WeightRole::kLinear, l, true);
        add(m + "shared_experts.up_proj.weight", {si, hidden}, WeightRole::kLinear, l, true);
        add(m + "shared_experts.down_proj.weight", {hidden, si}, WeightRole::kLinear, l, true);
      }
    } else {
      add(p + "mlp.gate_proj.weight", {c.dense_intermediate_size, hidden}, WeightRole::kLinear, l);
      add(p + "mlp.up_proj.weight", {c.dense_intermediate_size, hidden}, WeightRole::kLinear, l);
      add(p + "mlp.down_proj.weight", {hidden, c.dense_intermediate_size}, WeightRole::kLinear, l);
    }
  }
  add(root + "norm.weight", {hidden}, WeightRole::kNorm, -1);
  add(std::string(kTextPrefix) + "lm_head.weight", {c.vocab_size, hidden}, WeightRole::kLmHead, -1);
  return specs;
}

}  // namespace m3
