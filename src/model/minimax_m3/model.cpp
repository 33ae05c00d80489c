#include "model/minimax_m3/model.h"

#include <cstring>

#include "core/check.h"
#include "model/minimax_m3/weight_reader.h"
#include "model/minimax_m3/weight_specs.h"

namespace m3 {

KvCacheTensors HostKvCache::views() const {
  KvCacheTensors t;
  for (const auto& x : k) t.k.push_back(x.view);
  for (const auto& x : v) t.v.push_back(x.view);
  for (const auto& x : index_k) t.index_k.push_back(x.view);
  t.block_size = block_size;
  return t;
}

HostKvCache HostKvCache::allocate(const MiniMaxM3Config& c, int64_t num_blocks, int block_size) {
  HostKvCache cache;
  cache.block_size = block_size;
  const int64_t slots = num_blocks * block_size;
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    cache.k.push_back(HostTensor::empty(DType::kF32, {slots, c.num_key_value_heads, c.head_dim}));
    cache.v.push_back(HostTensor::empty(DType::kF32, {slots, c.num_key_value_heads, c.head_dim}));
    cache.index_k.push_back(c.is_sparse_layer(l) ? HostTensor::empty(DType::kF32, {slots, c.index_head_dim})
                                                 : HostTensor{});
  }
  return cache;
}

Result<std::unique_ptr<MiniMaxM3Model>> MiniMaxM3Model::load(const std::string& model_dir, const LoadProgress& progress) {
  auto dir = ModelDir::open(model_dir);
  if (!dir) return dir.status();
  return load(**dir, progress);
}

Result<std::unique_ptr<MiniMaxM3Model>> MiniMaxM3Model::load(const ModelDir& dir, const LoadProgress& progress) {
  auto cfg = MiniMaxM3Config::from_json(dir.config_json());
  if (!cfg) return Status::error(dir.path() + "/config.json: " + cfg.error());
  auto model = std::unique_ptr<MiniMaxM3Model>(new MiniMaxM3Model());
  model->config_ = *cfg;
  const MiniMaxM3Config& c = model->config_;
  model->layers_.resize(size_t(c.num_hidden_layers));
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    if (c.is_moe_layer(l)) {
      const size_t n = size_t(c.num_local_experts + (c.n_shared_experts > 0 ? 1 : 0));
      model->layers_[size_t(l)].expert_gate.resize(n);
      model->layers_[size_t(l)].expert_up.resize(n);
      model->layers_[size_t(l)].expert_down.resize(n);
    }
  }
  const auto specs = weight_specs(c);
  size_t total_bytes = 0, done_bytes = 0;
  for (const auto& s : specs) total_bytes += size_t(s.shape.numel()) * 4;
  const bool mxfp8 = c.quant_method == QuantMethod::kMxfp8;
  for (const auto& spec : specs) {
    auto values = read_f32(dir, spec, mxfp8);
    if (!values) return values.status();
    HostTensor t = HostTensor::empty(DType::kF32, spec.shape);
    std::memcpy(t.as<float>(), values->data(), values->size() * 4);
    done_bytes += values->size() * 4;
    if (progress.on_progress) progress.on_progress(done_bytes, total_bytes);

    // Where the tensor goes: by the name after "layers.<l>." (or the global names).
    const std::string& name = spec.name;
    auto ends_with = [&name](std::string_view tail) {
      return name.size() >= tail.size() && name.compare(name.size() - tail.size(), tail.size(), tail) == 0;
    };
    auto as_linear = [&](ops::LinearWeight& w) {
      w.data = t.view;
      model->storage_.push_back(std::move(t));
    };
    if (spec.layer < 0) {
      if (spec.role == WeightRole::kEmbedding) model->embed_ = std::move(t);
      else if (spec.role == WeightRole::kLmHead) as_linear(model->lm_head_);
      else model->final_norm_ = std::move(t);
      continue;
    }
    Layer& L = model->layers_[size_t(spec.layer)];
    const std::string tail = name.substr(name.find(".layers.") + 8 + std::to_string(spec.layer).size() + 1);
    if (tail == "input_layernorm.weight") L.input_norm = std::move(t);
    else if (tail == "post_attention_layernorm.weight") L.post_norm = std::move(t);
    else if (tail == "self_attn.q_proj.weight") as_linear(L.q_proj);
    else if (tail == "self_attn.k_proj.weight") as_linear(L.k_proj);
    else if (tail == "self_attn.v_proj.weight") as_linear(L.v_proj);
    else if (tail == "self_attn.o_proj.weight") as_linear(L.o_proj);
    else if (tail == "self_attn.q_norm.weight") L.q_norm = std::move(t);
    else if (tail == "self_attn.k_norm.weight") L.k_norm = std::move(t);
    else if (tail == "self_attn.index_q_proj.weight") as_linear(L.index_q_proj);
    else if (tail == "self_attn.index_k_proj.weight") as_linear(L.index_k_proj);
    else if (tail == "self_attn.index_q_norm.weight") L.index_q_norm = std::move(t);
    else if (tail == "self_attn.index_k_norm.weight") L.index_k_norm = std::move(t);
    else if (tail == "mlp.gate_proj.weight") as_linear(L.mlp_gate);
    else if (tail == "mlp.up_proj.weight") as_linear(L.mlp_up);
    else if (tail == "mlp.down_proj.weight") as_linear(L.mlp_down);
    else if (tail == "block_sparse_moe.gate.weight") L.router = std::move(t);
    else if (tail == "block_sparse_moe.e_score_correction_bias") L.router_bias = std::move(t);
    else if (tail.rfind("block_sparse_moe.shared_experts.", 0) == 0) {
      const size_t shared = size_t(c.num_local_experts);
      if (ends_with("gate_proj.weight")) as_linear(L.expert_gate[shared]);
      else if (ends_with("up_proj.weight")) as_linear(L.expert_up[shared]);
      else as_linear(L.expert_down[shared]);
    } else if (tail.rfind("block_sparse_moe.experts.", 0) == 0) {
      const size_t e = size_t(std::stoi(tail.substr(25)));
      if (ends_with(".w1.weight")) as_linear(L.expert_gate[e]);
      else if (ends_with(".w3.weight")) as_linear(L.expert_up[e]);
      else as_linear(L.expert_down[e]);
    } else {
      return Status::error("internal: no slot for weight " + name);
    }
  }
  return model;
}

namespace {
TensorView view2d(float* data, int64_t rows, int64_t cols) { return TensorView{data, DType::kF32, {rows, cols}, Device::kCpu}; }
TensorView view3d(float* data, int64_t a, int64_t b, int64_t c) { return TensorView{data, DType::kF32, {a, b, c}, Device::kCpu}; }
}  // namespace

void MiniMaxM3Model::forward(const ops::OpContext& ctx, const ForwardBatch& batch, const KvCacheTensors& cache,
                             float* logits, ForwardTrace* trace) const {
  const MiniMaxM3Config& c = config_;
  const ops::AttentionMetadata& meta = batch.meta;
  const int64_t T = meta.num_tokens, H = c.hidden_size, D = c.head_dim;
  const int64_t Hq = c.num_attention_heads, Hkv = c.num_key_value_heads;
  const int64_t Hi = c.index_n_heads, Di = c.index_head_dim;
  M3_CHECK(cache.block_size == meta.block_size && meta.block_size == c.index_block_size,
           "KV page size must equal the MSA block size");
  std::vector<float> h(size_t(T * H)), x(size_t(T * H)), y(size_t(T * H));
  std::vector<float> q(size_t(T * Hq * D)), k(size_t(T * Hkv * D)), v(size_t(T * Hkv * D)), o(size_t(T * Hq * D));
  std::vector<float> iq(size_t(T * Hi * Di)), ik(size_t(T * Di));
  std::vector<int32_t> selected(size_t(Hkv * T * c.index_topk_blocks));
  std::vector<int32_t> expert_ids(size_t(T * c.num_experts_per_tok));
  std::vector<float> expert_w(size_t(T * c.num_experts_per_tok));
  if (trace) {
    trace->selected_blocks.clear();
    trace->expert_ids.clear();
  }
  const TensorView hv = view2d(h.data(), T, H), xv = view2d(x.data(), T, H), yv = view2d(y.data(), T, H);
  ops::embedding(ctx, batch.token_ids, int(T), embed_.view, hv);
  const ops::SwigluParams act{c.swiglu_alpha, c.swiglu_limit, c.swiglu_beta};

  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const Layer& L = layers_[size_t(l)];
    ops::rms_norm(ctx, hv, L.input_norm.view, c.rms_norm_eps, xv);
    ops::linear(ctx, xv, L.q_proj, view2d(q.data(), T, Hq * D));
    ops::linear(ctx, xv, L.k_proj, view2d(k.data(), T, Hkv * D));
    ops::linear(ctx, xv, L.v_proj, view2d(v.data(), T, Hkv * D));
    ops::rms_norm(ctx, view2d(q.data(), T * Hq, D), L.q_norm.view, c.rms_norm_eps, view2d(q.data(), T * Hq, D));
    ops::rms_norm(ctx, view2d(k.data(), T * Hkv, D), L.k_norm.view, c.rms_norm_eps, view2d(k.data(), T * Hkv, D));
    ops::rope(ctx, view3d(q.data(), T, Hq, D), meta.positions, c.rotary_dim, c.rope_theta);
    ops::rope(ctx, view3d(k.data(), T, Hkv, D), meta.positions, c.rotary_dim, c.rope_theta);
    ops::kv_write(ctx, view3d(k.data(), T, Hkv, D), meta.slot_mapping, cache.k[size_t(l)]);
    ops::kv_write(ctx, view3d(v.data(), T, Hkv, D), meta.slot_mapping, cache.v[size_t(l)]);
    const TensorView qv = view3d(q.data(), T, Hq, D), ov = view3d(o.data(), T, Hq, D);
    if (c.is_sparse_layer(l)) {
      ops::linear(ctx, xv, L.index_q_proj, view2d(iq.data(), T, Hi * Di));
      ops::linear(ctx, xv, L.index_k_proj, view2d(ik.data(), T, Di));
      ops::rms_norm(ctx, view2d(iq.data(), T * Hi, Di), L.index_q_norm.view, c.rms_norm_eps, view2d(iq.data(), T * Hi, Di));
      ops::rms_norm(ctx, view2d(ik.data(), T, Di), L.index_k_norm.view, c.rms_norm_eps, view2d(ik.data(), T, Di));
      ops::rope(ctx, view3d(iq.data(), T, Hi, Di), meta.positions, c.rotary_dim, c.rope_theta);
      ops::rope(ctx, view3d(ik.data(), T, 1, Di), meta.positions, c.rotary_dim, c.rope_theta);
      ops::kv_write(ctx, view2d(ik.data(), T, Di), meta.slot_mapping, cache.index_k[size_t(l)]);
      const TensorView sel{selected.data(), DType::kI32, {Hi, T, c.index_topk_blocks}, Device::kCpu};
      ops::indexer_topk(ctx, view3d(iq.data(), T, Hi, Di), cache.index_k[size_t(l)], meta,
                        ops::IndexerParams{c.index_block_size, c.index_topk_blocks}, sel);
      if (trace) trace->selected_blocks.push_back(selected);
      ops::attention(ctx, qv, cache.k[size_t(l)], cache.v[size_t(l)], meta, sel, c.index_topk_blocks, ov);
    } else {
      ops::attention(ctx, qv, cache.k[size_t(l)], cache.v[size_t(l)], meta, TensorView{}, 0, ov);
    }
    ops::linear(ctx, view2d(o.data(), T, Hq * D), L.o_proj, yv);
    ops::add(ctx, hv, yv);

    ops::rms_norm(ctx, hv, L.post_norm.view, c.rms_norm_eps, xv);
    if (c.is_moe_layer(l)) {
      const TensorView ids{expert_ids.data(), DType::kI32, {T, c.num_experts_per_tok}, Device::kCpu};
      const TensorView wts{expert_w.data(), DType::kF32, {T, c.num_experts_per_tok}, Device::kCpu};
      ops::moe_router(ctx, xv, L.router.view, L.router_bias.view,
                      ops::RouterParams{c.num_experts_per_tok, c.routed_scaling_factor, c.use_routing_bias}, ids, wts);
      if (trace) trace->expert_ids.push_back(expert_ids);
      ops::ExpertWeights experts{c.num_local_experts, c.n_shared_experts > 0, L.expert_gate.data(), L.expert_up.data(),
                                 L.expert_down.data()};
      ops::moe_experts(ctx, xv, ids, wts, experts, act, yv);
    } else {
      ops::dense_mlp(ctx, xv, L.mlp_gate, L.mlp_up, L.mlp_down, act, yv);
    }
    ops::add(ctx, hv, yv);
  }

  // Final norm and LM head only on the rows that need logits.
  const int64_t R = int64_t(batch.logits_rows.size());
  if (R == 0) return;
  std::vector<float> rows(size_t(R * H)), normed(size_t(R * H));
  for (int64_t r = 0; r < R; ++r) {
    std::memcpy(rows.data() + r * H, h.data() + int64_t(batch.logits_rows[size_t(r)]) * H, size_t(H) * 4);
  }
  ops::rms_norm(ctx, view2d(rows.data(), R, H), final_norm_.view, c.rms_norm_eps, view2d(normed.data(), R, H));
  ops::linear(ctx, view2d(normed.data(), R, H), lm_head_, view2d(logits, R, c.vocab_size));
}

}  // namespace m3
