#include "model/eagle3/make_draft.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/dtype.h"
#include "loader/safetensors.h"
#include "model/minimax_m3/config.h"
#include "model/minimax_m3/make_model.h"

namespace m3 {

Eagle3Config default_draft_config(const MiniMaxM3Config& target, std::vector<int> aux_layer_ids) {
  Eagle3Config c;
  c.hidden_size = target.hidden_size;
  c.target_hidden_size = target.hidden_size;
  c.head_dim = target.head_dim;
  c.num_attention_heads = int(std::max<int64_t>(1, target.hidden_size / target.head_dim));
  c.num_key_value_heads = c.num_attention_heads % 4 == 0 ? c.num_attention_heads / 4 : c.num_attention_heads;
  c.intermediate_size = 2 * target.hidden_size;
  c.rms_norm_eps = target.rms_norm_eps;
  c.rope_theta = 10000.0;
  c.max_position_embeddings = target.max_position_embeddings;
  c.vocab_size = c.draft_vocab_size = target.vocab_size;
  c.aux_layer_ids = std::move(aux_layer_ids);
  return c;
}

Status make_draft(const MakeDraftOptions& o) {
  namespace fs = std::filesystem;
  const Eagle3Config& c = o.config;
  std::error_code ec;
  fs::create_directories(o.out_dir, ec);
  if (ec) return Status::error("make_draft: cannot create " + o.out_dir + ": " + ec.message());
  const int64_t H = c.hidden_size, D = c.head_dim, Nq = int64_t(c.num_attention_heads) * D,
                Nkv = int64_t(c.num_key_value_heads) * D;
  SafetensorsWriter writer(o.out_dir, size_t(1) << 40);
  // BF16 N(mean, std) draws, a pure function of (seed, name, index) as in make-model.
  // Element draws in parallel (an M3-width draft holds ~0.5 G values, its own LM head 1.2 G more).
  const size_t threads = std::max(1u, std::thread::hardware_concurrency());
  auto add = [&](const std::string& name, const Shape& shape, double mean, double std) {
    std::vector<uint16_t> v(size_t(shape.numel()));
    std::vector<std::thread> pool;
    for (size_t t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        for (size_t i = v.size() * t / threads; i < v.size() * (t + 1) / threads; ++i)
          v[i] = f32_to_bf16(float(mean) + make_model_value(o.seed, name, std, int64_t(i)));
      });
    }
    for (auto& th : pool) th.join();
    writer.add(name, DType::kBF16, shape, v.data());
  };
  auto linear = [&](const std::string& name, int64_t out, int64_t in) {
    add(name, {out, in}, 0.0, 1.0 / std::sqrt(double(in)));
  };
  linear("fc.weight", H, c.fc_in());
  for (const char* n : {"midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
                        "midlayer.post_attention_layernorm.weight", "norm.weight"})
    add(n, {H}, 1.0, 0.1);
  linear("midlayer.self_attn.q_proj.weight", Nq, 2 * H);
  linear("midlayer.self_attn.k_proj.weight", Nkv, 2 * H);
  linear("midlayer.self_attn.v_proj.weight", Nkv, 2 * H);
  linear("midlayer.self_attn.o_proj.weight", H, Nq);
  linear("midlayer.mlp.gate_proj.weight", c.intermediate_size, H);
  linear("midlayer.mlp.up_proj.weight", c.intermediate_size, H);
  linear("midlayer.mlp.down_proj.weight", H, c.intermediate_size);
  if (o.with_lm_head) linear("lm_head.weight", c.draft_vocab_size, H);
  if (o.with_embedding) add("embed_tokens.weight", {c.vocab_size, H}, 0.0, 1.0);
  if (c.draft_vocab_size < c.vocab_size) {
    // Draft id i stands for target id i * stride (spread over the vocabulary), as an offset.
    const int64_t stride = c.vocab_size / c.draft_vocab_size;
    std::vector<int64_t> d2t(size_t(c.draft_vocab_size));
    for (int64_t i = 0; i < c.draft_vocab_size; ++i) d2t[size_t(i)] = i * stride - i;
    writer.add("d2t", DType::kI64, {c.draft_vocab_size}, d2t.data());
  }
  if (Status st = writer.finish(); !st.is_ok()) return st;
  std::ofstream out(fs::path(o.out_dir) / "config.json", std::ios::binary | std::ios::trunc);
  out << c.to_json().dump(2) << "\n";
  if (!out) return Status::error("make_draft: cannot write " + o.out_dir + "/config.json");
  return Status::ok();
}

}  // namespace m3
