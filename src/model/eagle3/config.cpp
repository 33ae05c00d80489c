#include "model/eagle3/config.h"

#include <nlohmann/json.hpp>

#include "model/minimax_m3/config.h"

namespace m3 {
namespace {

using json = nlohmann::json;

template <typename T>
void read(const json& o, const char* key, T& out, std::vector<std::string>& errors, bool required) {
  auto it = o.find(key);
  if (it == o.end() || it->is_null()) {
    if (required) errors.push_back(std::string("missing required field ") + key);
    return;
  }
  try {
    out = it->get<T>();
  } catch (const std::exception&) {
    errors.push_back(std::string("field ") + key + " has the wrong type");
  }
}

Status joined(const std::vector<std::string>& errors) {
  std::string msg;
  for (const auto& s : errors) msg += (msg.empty() ? "" : "; ") + s;
  return Status::error(msg);
}

}  // namespace

Result<Eagle3Config> Eagle3Config::from_json(const json& root, const MiniMaxM3Config& target) {
  if (!root.is_object()) return Status::error("config.json: top level is not a JSON object");
  Eagle3Config c;
  std::vector<std::string> e;
  read(root, "hidden_size", c.hidden_size, e, true);
  read(root, "intermediate_size", c.intermediate_size, e, true);
  read(root, "num_attention_heads", c.num_attention_heads, e, true);
  c.num_key_value_heads = c.num_attention_heads;
  read(root, "num_key_value_heads", c.num_key_value_heads, e, false);
  c.head_dim = c.num_attention_heads > 0 ? int(c.hidden_size / c.num_attention_heads) : 0;
  read(root, "head_dim", c.head_dim, e, false);
  read(root, "rms_norm_eps", c.rms_norm_eps, e, false);
  read(root, "rope_theta", c.rope_theta, e, false);
  c.max_position_embeddings = target.max_position_embeddings;
  read(root, "max_position_embeddings", c.max_position_embeddings, e, false);
  read(root, "vocab_size", c.vocab_size, e, true);
  c.draft_vocab_size = c.vocab_size;
  read(root, "draft_vocab_size", c.draft_vocab_size, e, false);
  c.target_hidden_size = target.hidden_size;
  read(root, "target_hidden_size", c.target_hidden_size, e, false);
  read(root, "norm_before_residual", c.norm_before_residual, e, false);
  int layers = 1;
  read(root, "num_hidden_layers", layers, e, false);
  std::string act = "silu";
  read(root, "hidden_act", act, e, false);
  bool bias = false, mlp_bias = false;
  read(root, "attention_bias", bias, e, false);
  read(root, "mlp_bias", mlp_bias, e, false);
  if (auto it = root.find("eagle_config"); it != root.end() && it->is_object()) {
    bool use_aux = true;
    read(*it, "use_aux_hidden_state", use_aux, e, false);
    if (!use_aux) e.push_back("eagle_config.use_aux_hidden_state is false (EAGLE-1/2 drafts are not supported)");
    read(*it, "eagle_aux_hidden_state_layer_ids", c.aux_layer_ids, e, false);
  }
  if (auto it = root.find("rope_scaling"); it != root.end() && !it->is_null()) {
    std::string type = "default";
    if (it->is_object()) {
      if (auto t = it->find("rope_type"); t != it->end() && t->is_string()) type = t->get<std::string>();
      else if (auto t2 = it->find("type"); t2 != it->end() && t2->is_string()) type = t2->get<std::string>();
    }
    if (type != "default") e.push_back("rope_scaling of type '" + type + "' is not supported (plain RoPE only)");
  }
  const int L = target.num_hidden_layers;
  // vLLM's default capture when the draft names none: an early, the middle and a late layer.
  if (c.aux_layer_ids.empty()) c.aux_layer_ids = {2, L / 2, L - 3};
  if (!e.empty()) return joined(e);
  auto need = [&](bool ok, const std::string& what) {
    if (!ok) e.push_back(what);
  };
  need(layers == 1, "num_hidden_layers is " + std::to_string(layers) + " (drafts of one decoder layer only)");
  need(act == "silu", "hidden_act '" + act + "' is not supported (silu)");
  need(!bias && !mlp_bias, "attention_bias / mlp_bias are not supported");
  need(c.hidden_size > 0 && c.intermediate_size > 0, "hidden_size and intermediate_size must be > 0");
  need(c.num_attention_heads > 0 && c.num_key_value_heads > 0 && c.num_attention_heads % c.num_key_value_heads == 0,
       "num_attention_heads must be a positive multiple of num_key_value_heads");
  need(c.head_dim > 0 && c.head_dim % 2 == 0, "head_dim must be even and > 0");
  need(c.vocab_size == target.vocab_size, "vocab_size " + std::to_string(c.vocab_size) + " differs from the target's " +
                                              std::to_string(target.vocab_size));
  need(c.draft_vocab_size > 0 && c.draft_vocab_size <= c.vocab_size, "draft_vocab_size must be in [1, vocab_size]");
  need(c.target_hidden_size == target.hidden_size, "target_hidden_size " + std::to_string(c.target_hidden_size) +
                                                       " differs from the target's hidden_size " +
                                                       std::to_string(target.hidden_size));
  need(!c.aux_layer_ids.empty(), "no aux hidden state layers");
  for (int id : c.aux_layer_ids)
    need(id >= 0 && id < L, "aux hidden state layer " + std::to_string(id) + " is outside the target's layers [0, " +
                                std::to_string(L) + ")");
  if (!e.empty()) return joined(e);
  return c;
}

Eagle3Config Eagle3Config::shard(int tp, int rank) const {
  if (tp <= 1 || num_attention_heads % tp != 0 || num_key_value_heads % tp != 0 || intermediate_size % tp != 0)
    return *this;
  Eagle3Config c = *this;
  c.num_attention_heads /= tp;
  c.num_key_value_heads /= tp;
  c.intermediate_size /= tp;
  c.tp_size = tp;
  c.tp_rank = rank;
  return c;
}

json Eagle3Config::to_json() const {
  return json{{"architectures", {"LlamaForCausalLMEagle3"}},
              {"model_type", "llama"},
              {"hidden_size", hidden_size},
              {"intermediate_size", intermediate_size},
              {"num_hidden_layers", 1},
              {"num_attention_heads", num_attention_heads},
              {"num_key_value_heads", num_key_value_heads},
              {"head_dim", head_dim},
              {"hidden_act", "silu"},
              {"rms_norm_eps", rms_norm_eps},
              {"rope_theta", rope_theta},
              {"rope_scaling", nullptr},
              {"max_position_embeddings", max_position_embeddings},
              {"vocab_size", vocab_size},
              {"draft_vocab_size", draft_vocab_size},
              {"target_hidden_size", target_hidden_size},
              {"norm_before_residual", norm_before_residual},
              {"tie_word_embeddings", false},
              {"torch_dtype", "bfloat16"},
              {"eagle_config", {{"use_aux_hidden_state", true}, {"eagle_aux_hidden_state_layer_ids", aux_layer_ids}}}};
}

}  // namespace m3
