#include "model/minimax_m3/config.h"

#include <fstream>
#include <nlohmann/json.hpp>

namespace m3 {
namespace {

using json = nlohmann::json;

// Reads an optional field, recording a type error instead of throwing.
template <class T>
void read_opt(const json& obj, const char* key, T& out, std::vector<std::string>& errors) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return;
  try {
    out = it->get<T>();
  } catch (const std::exception& e) {
    errors.push_back(std::string("field '") + key + "': " + e.what());
  }
}

std::vector<int> flags_from_types(const json& types, std::string_view on_word) {
  std::vector<int> flags;
  for (const auto& t : types) {
    std::string s = t.get<std::string>();
    flags.push_back(s.find(on_word) != std::string::npos ? 1 : 0);
  }
  return flags;
}

}  // namespace

int MiniMaxM3Config::num_sparse_layers() const {
  int n = 0;
  for (int f : sparse_layer_freq) n += f != 0;
  return n;
}

bool MiniMaxM3Config::computes_index(int layer) const {
  if (!is_sparse_layer(layer)) return false;
  if (msa_index_reuse <= 1) return true;
  int ordinal = 0;  // sparse layers before this one
  for (int l = 0; l < layer; ++l) ordinal += is_sparse_layer(l);
  return ordinal % msa_index_reuse == 0;
}

Result<MiniMaxM3Config> MiniMaxM3Config::shard(int tp, int rank) const {
  if (this->tp_size != 1) return Status::error("shard: the config is already one rank's share");
  if (tp < 1 || rank < 0 || rank >= tp)
    return Status::error("tensor parallel rank " + std::to_string(rank) + " of " + std::to_string(tp) + " is invalid");
  const std::string of = " for tensor parallel size " + std::to_string(tp);
  if (num_attention_heads % tp != 0)
    return Status::error("num_attention_heads " + std::to_string(num_attention_heads) + " does not divide" + of);
  if (tp <= num_key_value_heads ? num_key_value_heads % tp != 0 : tp % num_key_value_heads != 0)
    return Status::error("num_key_value_heads " + std::to_string(num_key_value_heads) +
                         " neither divides by nor divides the tensor parallel size " + std::to_string(tp));
  // Row-parallel projections split their K: MXFP8 needs whole 32-wide scale blocks per rank.
  const int64_t align = quant_method == QuantMethod::kMxfp8 ? int64_t(tp) * quant_block_k : int64_t(tp);
  const std::pair<const char*, int64_t> widths[] = {{"intermediate_size", intermediate_size},
                                                     {"shared_intermediate_size", shared_intermediate_size},
                                                     {"dense_intermediate_size", dense_intermediate_size}};
  for (const auto& [name, w] : widths)
    if (w % align != 0)
      return Status::error(std::string(name) + " " + std::to_string(w) + " does not split into " + std::to_string(tp) +
                           (align > tp ? " multiples of the MXFP8 block (32)" : " equal parts") + of);
  if (quant_method == QuantMethod::kMxfp8 && (int64_t(num_attention_heads / tp) * head_dim) % quant_block_k != 0)
    return Status::error("a rank's o_proj input (" + std::to_string(num_attention_heads / tp) + " heads x " +
                         std::to_string(head_dim) + ") is not a multiple of the MXFP8 block (32)" + of);
  MiniMaxM3Config c = *this;
  c.tp_size = tp;
  c.tp_rank = rank;
  c.num_attention_heads = num_attention_heads / tp;
  c.num_key_value_heads = tp <= num_key_value_heads ? num_key_value_heads / tp : 1;
  c.kv_head_offset = tp <= num_key_value_heads ? rank * c.num_key_value_heads : rank / (tp / num_key_value_heads);
  c.index_n_heads = c.num_key_value_heads;
  c.intermediate_size = intermediate_size / tp;
  c.shared_intermediate_size = shared_intermediate_size / tp;
  c.dense_intermediate_size = dense_intermediate_size / tp;
  return c;
}

int MiniMaxM3Config::num_moe_layers() const {
  int n = 0;
  for (int f : moe_layer_freq) n += f != 0;
  return n;
}

std::vector<std::string> MiniMaxM3Config::validate() const {
  std::vector<std::string> p;
  auto need = [&](bool ok, const std::string& what) { if (!ok) p.push_back(what); };
  need(vocab_size > 0, "vocab_size must be > 0");
  need(hidden_size > 0, "hidden_size must be > 0");
  need(num_hidden_layers > 0, "num_hidden_layers must be > 0");
  need(num_attention_heads > 0 && num_key_value_heads > 0, "head counts must be > 0");
  need(num_key_value_heads > 0 && num_attention_heads % num_key_value_heads == 0,
       "num_attention_heads must be a multiple of num_key_value_heads");
  need(head_dim > 0, "head_dim must be > 0");
  need(rotary_dim > 0 && rotary_dim % 2 == 0 && rotary_dim <= head_dim,
       "rotary_dim must be even and in (0, head_dim]");
  need(rotary_dim <= index_head_dim, "rotary_dim must not exceed index_head_dim");
  need(int(moe_layer_freq.size()) == num_hidden_layers,
       "moe_layer_freq has " + std::to_string(moe_layer_freq.size()) + " entries, expected num_hidden_layers = " +
           std::to_string(num_hidden_layers));
  need(int(sparse_layer_freq.size()) == num_hidden_layers,
       "sparse_attention_freq has " + std::to_string(sparse_layer_freq.size()) +
           " entries, expected num_hidden_layers = " + std::to_string(num_hidden_layers));
  need(num_local_experts > 0 && num_experts_per_tok > 0 && num_experts_per_tok <= num_local_experts,
       "need 0 < num_experts_per_tok <= num_local_experts");
  need(n_shared_experts >= 0 && n_shared_experts <= 1, "n_shared_experts must be 0 or 1");
  need(index_n_heads == num_key_value_heads,
       "sparse_num_index_heads must equal num_key_value_heads (selection is per KV group)");
  need(index_block_size > 0, "sparse_block_size must be > 0");
  need(index_topk_blocks >= 1, "sparse_topk_blocks must be >= 1");
  need(index_local_blocks == 1, "only sparse_local_block = 1 is supported");
  need(index_init_blocks == 0, "only sparse_init_block = 0 is supported");
  need(quant_method == QuantMethod::kNone || quant_block_k == 32,
       "MXFP8 weight_block_size must be [1, 32]");
  need(hidden_size % quant_block_k == 0 || quant_method == QuantMethod::kNone,
       "hidden_size must be a multiple of the MXFP8 block (32)");
  return p;
}

Result<MiniMaxM3Config> MiniMaxM3Config::from_json(const json& root) {
  if (!root.is_object()) return Status::error("config.json: top level is not a JSON object");
  const json& tc = root.contains("text_config") ? root.at("text_config") : root;
  if (!tc.is_object()) return Status::error("config.json: text_config is not an object");
  MiniMaxM3Config c;
  std::vector<std::string> errors;
  for (const char* key : {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                          "num_key_value_heads"}) {
    if (!tc.contains(key)) errors.push_back(std::string("missing required field text_config.") + key);
  }
  read_opt(tc, "vocab_size", c.vocab_size, errors);
  read_opt(tc, "hidden_size", c.hidden_size, errors);
  read_opt(tc, "num_hidden_layers", c.num_hidden_layers, errors);
  read_opt(tc, "num_attention_heads", c.num_attention_heads, errors);
  read_opt(tc, "num_key_value_heads", c.num_key_value_heads, errors);
  c.head_dim = c.num_attention_heads > 0 ? int(c.hidden_size / c.num_attention_heads) : 0;
  read_opt(tc, "head_dim", c.head_dim, errors);
  read_opt(tc, "rms_norm_eps", c.rms_norm_eps, errors);
  read_opt(tc, "tie_word_embeddings", c.tie_word_embeddings, errors);
  read_opt(tc, "max_position_embeddings", c.max_position_embeddings, errors);
  read_opt(tc, "bos_token_id", c.bos_token_id, errors);
  if (auto it = tc.find("eos_token_id"); it != tc.end() && !it->is_null()) {
    if (it->is_array()) c.eos_token_ids = it->get<std::vector<int>>();
    else if (it->is_number_integer()) c.eos_token_ids = {it->get<int>()};
    else errors.push_back("field 'eos_token_id': expected an integer or a list of integers");
  }

  // RoPE width: the flat partial_rotary_factor is authoritative (m3-architecture.md 8.1).
  read_opt(tc, "rope_theta", c.rope_theta, errors);
  float partial = -1.0f;
  if (auto it = tc.find("rope_parameters"); it != tc.end() && it->is_object()) {
    read_opt(*it, "rope_theta", c.rope_theta, errors);
    read_opt(*it, "partial_rotary_factor", partial, errors);
  }
  read_opt(tc, "partial_rotary_factor", partial, errors);
  int rotary_dim_field = -1;
  read_opt(tc, "rotary_dim", rotary_dim_field, errors);
  if (partial > 0) {
    c.rotary_dim = int(float(c.head_dim) * partial + 0.5f);
    if (rotary_dim_field > 0 && rotary_dim_field != c.rotary_dim) {
      errors.push_back("rotary_dim = " + std::to_string(rotary_dim_field) +
                       " disagrees with partial_rotary_factor * head_dim = " + std::to_string(c.rotary_dim));
    }
  } else if (rotary_dim_field > 0) {
    c.rotary_dim = rotary_dim_field;
  } else {
    c.rotary_dim = c.head_dim / 2;  // M3's convention when neither is given
  }

  read_opt(tc, "dense_intermediate_size", c.dense_intermediate_size, errors);
  read_opt(tc, "intermediate_size", c.intermediate_size, errors);
  read_opt(tc, "shared_intermediate_size", c.shared_intermediate_size, errors);
  read_opt(tc, "num_local_experts", c.num_local_experts, errors);
  read_opt(tc, "num_experts_per_tok", c.num_experts_per_tok, errors);
  read_opt(tc, "n_shared_experts", c.n_shared_experts, errors);
  read_opt(tc, "routed_scaling_factor", c.routed_scaling_factor, errors);
  read_opt(tc, "use_routing_bias", c.use_routing_bias, errors);
  read_opt(tc, "swiglu_alpha", c.swiglu_alpha, errors);
  read_opt(tc, "swiglu_limit", c.swiglu_limit, errors);
  read_opt(tc, "swiglu_beta", c.swiglu_beta, errors);
  if (std::string scoring; tc.contains("scoring_func") && (read_opt(tc, "scoring_func", scoring, errors), true)) {
    if (!scoring.empty() && scoring != "sigmoid") errors.push_back("scoring_func '" + scoring + "' is not supported (sigmoid)");
  }
  if (tc.contains("moe_layer_freq")) read_opt(tc, "moe_layer_freq", c.moe_layer_freq, errors);
  else if (tc.contains("mlp_layer_types")) c.moe_layer_freq = flags_from_types(tc.at("mlp_layer_types"), "sparse");

  if (auto it = tc.find("sparse_attention_config"); it != tc.end() && it->is_object()) {
    const json& s = *it;
    bool use_sparse = true;
    read_opt(s, "use_sparse_attention", use_sparse, errors);
    read_opt(s, "sparse_attention_freq", c.sparse_layer_freq, errors);
    if (!use_sparse) c.sparse_layer_freq.assign(size_t(c.num_hidden_layers), 0);
    read_opt(s, "sparse_num_index_heads", c.index_n_heads, errors);
    read_opt(s, "sparse_index_dim", c.index_head_dim, errors);
    read_opt(s, "sparse_block_size", c.index_block_size, errors);
    read_opt(s, "sparse_topk_blocks", c.index_topk_blocks, errors);
    read_opt(s, "sparse_local_block", c.index_local_blocks, errors);
    read_opt(s, "sparse_init_block", c.index_init_blocks, errors);
    std::string score_type = "max";
    read_opt(s, "sparse_score_type", score_type, errors);
    if (score_type != "max") errors.push_back("sparse_score_type '" + score_type + "' is not supported (max)");
  } else {
    // HF >= 5.17 flattened names.
    read_opt(tc, "index_n_heads", c.index_n_heads, errors);
    read_opt(tc, "index_head_dim", c.index_head_dim, errors);
    read_opt(tc, "index_block_size", c.index_block_size, errors);
    read_opt(tc, "index_topk_blocks", c.index_topk_blocks, errors);
    read_opt(tc, "index_local_blocks", c.index_local_blocks, errors);
    if (tc.contains("layer_types")) c.sparse_layer_freq = flags_from_types(tc.at("layer_types"), "sparse");
  }
  if (c.sparse_layer_freq.empty()) c.sparse_layer_freq.assign(size_t(std::max(0, c.num_hidden_layers)), 0);
  if (c.moe_layer_freq.empty()) errors.push_back("missing moe_layer_freq (or mlp_layer_types) in text_config");

  const json* qc = nullptr;
  if (root.contains("quantization_config")) qc = &root.at("quantization_config");
  else if (tc.contains("quantization_config")) qc = &tc.at("quantization_config");
  if (qc && qc->is_object()) {
    std::string method;
    read_opt(*qc, "quant_method", method, errors);
    if (method == "mxfp8") {
      c.quant_method = QuantMethod::kMxfp8;
      std::vector<int> block;
      read_opt(*qc, "weight_block_size", block, errors);
      if (!block.empty() && (block.size() != 2 || block[0] != 1)) {
        errors.push_back("quantization_config.weight_block_size must be [1, 32]");
      } else if (!block.empty()) {
        c.quant_block_k = block[1];
      }
      read_opt(*qc, "ignored_layers", c.quant_ignored_layers, errors);
      if (c.quant_ignored_layers.empty()) read_opt(*qc, "modules_to_not_convert", c.quant_ignored_layers, errors);
    } else if (!method.empty()) {
      errors.push_back("quantization_config.quant_method '" + method + "' is not supported (mxfp8)");
    }
  }
  if (errors.empty()) errors = c.validate();
  if (!errors.empty()) {
    std::string msg = "config.json: ";
    for (size_t i = 0; i < errors.size(); ++i) msg += (i ? "; " : "") + errors[i];
    return Status::error(msg);
  }
  return c;
}

Result<MiniMaxM3Config> MiniMaxM3Config::from_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) return Status::error(path + ": cannot open");
  json root;
  try {
    in >> root;
  } catch (const std::exception& e) {
    return Status::error(path + ": invalid JSON: " + e.what());
  }
  auto r = from_json(root);
  if (!r) return Status::error(path + ": " + r.error());
  return r;
}

json MiniMaxM3Config::to_json() const {
  json sparse = {
      {"use_sparse_attention", true},
      {"sparse_attention_freq", sparse_layer_freq},
      {"sparse_num_index_heads", index_n_heads},
      {"sparse_index_dim", index_head_dim},
      {"sparse_block_size", index_block_size},
      {"sparse_topk_blocks", index_topk_blocks},
      {"sparse_local_block", index_local_blocks},
      {"sparse_init_block", index_init_blocks},
      {"sparse_score_type", "max"},
      {"sparse_disable_index_value", sparse_layer_freq},
  };
  json text = {
      {"architectures", {"MiniMaxM3SparseForCausalLM"}},
      {"model_type", "minimax_m3_vl_text"},
      {"vocab_size", vocab_size},
      {"hidden_size", hidden_size},
      {"num_hidden_layers", num_hidden_layers},
      {"num_attention_heads", num_attention_heads},
      {"num_key_value_heads", num_key_value_heads},
      {"head_dim", head_dim},
      {"intermediate_size", intermediate_size},
      {"shared_intermediate_size", shared_intermediate_size},
      {"dense_intermediate_size", dense_intermediate_size},
      {"num_local_experts", num_local_experts},
      {"num_experts_per_tok", num_experts_per_tok},
      {"n_shared_experts", n_shared_experts},
      {"scoring_func", "sigmoid"},
      {"use_routing_bias", use_routing_bias},
      {"routed_scaling_factor", routed_scaling_factor},
      {"hidden_act", "swigluoai"},
      {"swiglu_alpha", swiglu_alpha},
      {"swiglu_limit", swiglu_limit},
      {"swiglu_beta", swiglu_beta},
      {"rms_norm_eps", rms_norm_eps},
      {"use_gemma_norm", true},
      {"use_qk_norm", true},
      {"qk_norm_type", "per_head"},
      {"attention_output_gate", false},
      {"rope_theta", rope_theta},
      {"rotary_dim", rotary_dim},
      {"partial_rotary_factor", double(rotary_dim) / double(head_dim)},
      {"max_position_embeddings", max_position_embeddings},
      {"tie_word_embeddings", tie_word_embeddings},
      {"bos_token_id", bos_token_id},
      {"eos_token_id", eos_token_ids.size() == 1 ? json(eos_token_ids[0]) : json(eos_token_ids)},
      {"moe_layer_freq", moe_layer_freq},
      {"num_mtp_modules", 0},
      {"sparse_attention_config", sparse},
  };
  const bool full_width = hidden_size == 6144;
  json vision = full_width
      ? json{{"model_type", "clip_vision_model"}, {"hidden_size", 1280}, {"intermediate_size", 5120},
             {"num_hidden_layers", 32}, {"num_attention_heads", 16}, {"patch_size", 14},
             {"image_size", 2016}, {"temporal_patch_size", 2}, {"spatial_merge_size", 2}}
      : json{{"model_type", "clip_vision_model"}, {"hidden_size", 32}, {"intermediate_size", 64},
             {"num_hidden_layers", 1}, {"num_attention_heads", 2}, {"patch_size", 14},
             {"image_size", 56}, {"temporal_patch_size", 2}, {"spatial_merge_size", 2}};
  json root = {
      {"architectures", {"MiniMaxM3SparseForConditionalGeneration"}},
      {"model_type", "minimax_m3_vl"},
      {"torch_dtype", "bfloat16"},
      {"image_token_index", 200025},
      {"video_token_index", 200026},
      {"projector_hidden_size", hidden_size},
      {"tie_word_embeddings", tie_word_embeddings},
      {"text_config", text},
      {"vision_config", vision},
  };
  if (quant_method == QuantMethod::kMxfp8) {
    root["quantization_config"] = {
        {"quant_method", "mxfp8"}, {"activation_scheme", "dynamic"}, {"fmt", "e4m3"},
        {"scale_fmt", "ue8m0"}, {"weight_block_size", {1, quant_block_k}},
        {"ignored_layers", quant_ignored_layers}};
  }
  return root;
}

Result<MiniMaxM3Config> MiniMaxM3Config::preset(std::string_view name) {
  MiniMaxM3Config c;  // defaults are M3's deployment values
  auto set_layers = [&c](int layers, int dense_layers) {
    c.num_hidden_layers = layers;
    c.moe_layer_freq.assign(size_t(layers), 1);
    c.sparse_layer_freq.assign(size_t(layers), 1);
    for (int l = 0; l < dense_layers && l < layers; ++l) c.moe_layer_freq[size_t(l)] = c.sparse_layer_freq[size_t(l)] = 0;
  };
  c.quant_ignored_layers = {"lm_head", "model.embed_tokens", "re:.*block_sparse_moe\\.gate$"};
  if (name == "m3") {
    set_layers(60, 3);
  } else if (name.rfind("m3-layers:", 0) == 0) {
    int layers = 0;
    try {
      layers = std::stoi(std::string(name.substr(10)));
    } catch (...) {
      return Status::error("preset '" + std::string(name) + "': N must be an integer");
    }
    if (layers < 1 || layers > 60) return Status::error("preset m3-layers:N needs 1 <= N <= 60");
    // Keep M3's three dense layers when there is room; otherwise one, so MSA+MoE still appear.
    set_layers(layers, layers >= 4 ? 3 : (layers >= 2 ? 1 : 0));
  } else if (name == "tiny") {
    c.vocab_size = 512;
    c.hidden_size = 128;
    c.num_attention_heads = 4;
    c.num_key_value_heads = 2;
    c.head_dim = 32;
    c.rotary_dim = 16;
    c.rope_theta = 10000.0;
    c.max_position_embeddings = 4096;
    c.bos_token_id = 1;
    c.eos_token_ids = {2};
    c.dense_intermediate_size = 256;
    c.intermediate_size = 64;
    c.shared_intermediate_size = 64;
    c.num_local_experts = 8;
    c.num_experts_per_tok = 2;
    c.index_n_heads = 2;
    c.index_head_dim = 32;
    c.index_block_size = 16;
    c.index_topk_blocks = 4;
    set_layers(4, 1);
  } else {
    return Status::error("unknown preset '" + std::string(name) + "' (known: tiny, m3, m3-layers:N)");
  }
  auto problems = c.validate();
  if (!problems.empty()) return Status::error("preset " + std::string(name) + ": " + problems[0]);
  return c;
}

bool is_quant_ignored(const MiniMaxM3Config& config, std::string_view module_name) {
  for (const auto& pattern : config.quant_ignored_layers) {
    if (pattern.rfind("re:", 0) == 0) {
      // Only the suffix form we write ourselves is understood: ".*<literal>$".
      std::string p = pattern.substr(3);
      if (p.rfind(".*", 0) == 0) p = p.substr(2);
      if (!p.empty() && p.back() == '$') p.pop_back();
      std::string lit;
      for (size_t i = 0; i < p.size(); ++i) {
        if (p[i] == '\\' && i + 1 < p.size()) { lit += p[++i]; continue; }
        lit += p[i];
      }
      if (module_name.size() >= lit.size() && module_name.substr(module_name.size() - lit.size()) == lit) return true;
    } else if (module_name == pattern || (module_name.size() > pattern.size() &&
                                          module_name.substr(module_name.size() - pattern.size()) == pattern &&
                                          module_name[module_name.size() - pattern.size() - 1] == '.')) {
      return true;
    }
  }
  return false;
}

}  // namespace m3
