#include "model/minimax_m3/model.h"

#include <algorithm>
#include <cstring>
#include <initializer_list>
#include <utility>

#include "core/check.h"
#include "ops/host_runtime.h"
#include "model/minimax_m3/weight_reader.h"
#include "model/minimax_m3/tp_shard.h"
#include "model/minimax_m3/weight_specs.h"

namespace m3 {

LoadOptions engine_load_options(ops::BackendRuntime* runtime, bool cpu, bool dequantize_mxfp8, bool batch_invariant) {
  LoadOptions o;
  o.runtime = runtime;
  if (cpu) {
    o.linear_format = LinearFormat::kF32;
  } else {
    o.linear_format = (dequantize_mxfp8 || !batch_invariant) ? LinearFormat::kBF16 : LinearFormat::kNative;
    o.expert_format = dequantize_mxfp8 ? LinearFormat::kBF16 : LinearFormat::kNative;
  }
  return o;
}

Result<std::unique_ptr<MiniMaxM3Model>> MiniMaxM3Model::load(const std::string& model_dir, const LoadProgress& progress) {
  auto dir = ModelDir::open(model_dir);
  if (!dir) return dir.status();
  return load(**dir, progress);
}

Result<std::unique_ptr<MiniMaxM3Model>> MiniMaxM3Model::load(const ModelDir& dir, const LoadProgress& progress) {
  return load(dir, progress, LoadOptions{});
}

Result<std::unique_ptr<MiniMaxM3Model>> MiniMaxM3Model::load(const ModelDir& dir, const LoadProgress& progress,
                                                             const LoadOptions& options) {
  auto cfg = MiniMaxM3Config::from_json(dir.config_json());
  if (!cfg) return Status::error(dir.path() + "/config.json: " + cfg.error());
  const MiniMaxM3Config whole = *cfg;
  if (options.tp_size != 1) {
    cfg = whole.shard(options.tp_size, options.tp_rank);
    if (!cfg) return Status::error(dir.path() + ": " + cfg.error());
  }
  auto model = std::unique_ptr<MiniMaxM3Model>(new MiniMaxM3Model());
  model->config_ = *cfg;
  model->runtime_ = options.runtime ? options.runtime : ops::host_runtime();
  ops::BackendRuntime* rt = model->runtime_;
  const MiniMaxM3Config& c = model->config_;
  model->layers_.resize(size_t(c.num_hidden_layers));
  model->layer_weight_bytes_.assign(size_t(c.num_hidden_layers), 0);
  model->routed_expert_bytes_.assign(size_t(c.num_hidden_layers), 0);
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    if (c.is_moe_layer(l)) {
      const size_t n = size_t(c.num_local_experts + (c.n_shared_experts > 0 ? 1 : 0));
      model->layers_[size_t(l)].expert_gate.resize(n);
      model->layers_[size_t(l)].expert_up.resize(n);
      model->layers_[size_t(l)].expert_down.resize(n);
    }
  }
  const auto specs = weight_specs(whole);  // named and shaped as stored; each rank loads its slice
  size_t total_bytes = 0, done_bytes = 0;
  for (const auto& s : specs) total_bytes += size_t(s.shape.numel()) * 4;
  const bool mxfp8 = c.quant_method == QuantMethod::kMxfp8;

  // One tensor at a time: read (dequantised or raw), convert, copy into backend memory.
  // Pieces of host bytes, back to back in one buffer.
  using Pieces = std::initializer_list<std::pair<const void*, size_t>>;
  auto to_backend_pieces = [&](Pieces pieces, DType dtype, const Shape& shape, int layer) -> TensorView {
    size_t size = 0;
    for (const auto& p : pieces) size += p.second;
    ops::DeviceBuffer buf(rt, size);
    size_t off = 0;
    for (const auto& p : pieces) {
      rt->upload(static_cast<uint8_t*>(buf.data()) + off, p.first, p.second);
      off += p.second;
    }
    rt->synchronize();  // the host copy is freed next
    TensorView v = buf.view(dtype, shape);
    model->weight_bytes_ += size;
    if (layer >= 0) model->layer_weight_bytes_[size_t(layer)] += size;
    model->storage_.push_back(std::move(buf));
    return v;
  };
  auto to_backend = [&](const void* bytes, size_t size, DType dtype, const Shape& shape, int layer) {
    return to_backend_pieces({{bytes, size}}, dtype, shape, layer);
  };
  for (const auto& spec : specs) {
    ops::LinearWeight linear_w;
    TensorView t;
    const TpSlice slice = tp_slice(spec, c);
    const Shape shape = sliced_shape(spec.shape, slice);
    const bool is_linear = spec.role == WeightRole::kLinear || spec.role == WeightRole::kLmHead;
    const LinearFormat format = spec.expert ? options.expert_format.value_or(options.linear_format) : options.linear_format;
    bool done = false;
    if (is_linear && format == LinearFormat::kNative && mxfp8) {
      auto stored = locate_weight(dir, spec, mxfp8);
      if (!stored) return stored.status();
      if (stored->is_mxfp8()) {
        const TensorInfo& sc = *stored->scale;
        for (size_t i = 0; i < sc.size_bytes; ++i) {
          if (sc.data[i] == 255) {
            return Status::error(dir.path() + ": " + sc.name + ": scale byte " + std::to_string(i) +
                                 " is 255 (e8m0 NaN), expected 0..254");
          }
        }
        const Mxfp8Slice part = slice_mxfp8(*stored, slice, c.quant_block_k);
        linear_w.data = to_backend(part.weight.data(), part.weight.size(), DType::kF8E4M3, part.weight_shape, spec.layer);
        // The scales and each row's largest scale byte (the kernels' row reference) in one buffer.
        const int64_t rows = part.scale_shape[0];
        std::vector<uint8_t> smax(static_cast<size_t>(rows));
        e8m0_row_max(part.scale.data(), rows, part.scale_shape[1], smax.data());
        const TensorView both = to_backend_pieces({{part.scale.data(), part.scale.size()}, {smax.data(), smax.size()}}, DType::kU8,
                                           Shape{int64_t(part.scale.size() + smax.size())}, spec.layer);
        linear_w.scale = TensorView{both.data, DType::kU8, part.scale_shape, both.device};
        linear_w.scale_max = TensorView{static_cast<uint8_t*>(both.data) + part.scale.size(), DType::kU8, Shape{rows}, both.device};
        done = true;
      }
    }
    if (!done) {
      auto values = read_f32(dir, spec, mxfp8);
      if (!values) return values.status();
      if (!slice.whole()) {
        const auto part = slice_bytes(reinterpret_cast<const uint8_t*>(values->data()), spec.shape, 4, slice);
        values->resize(part.size() / 4);
        std::memcpy(values->data(), part.data(), part.size());
      }
      if (is_linear && format != LinearFormat::kF32) {
        std::vector<uint16_t> bf(values->size());
        for (size_t i = 0; i < bf.size(); ++i) bf[i] = f32_to_bf16((*values)[i]);
        linear_w.data = to_backend(bf.data(), bf.size() * 2, DType::kBF16, shape, spec.layer);
      } else {
        t = to_backend(values->data(), values->size() * 4, DType::kF32, shape, spec.layer);
        linear_w.data = t;
      }
    }
    done_bytes += size_t(spec.shape.numel()) * 4;
    if (progress.on_progress) progress.on_progress(done_bytes, total_bytes);

    // Where the tensor goes: by the name after "layers.<l>." (or the global names).
    const std::string& name = spec.name;
    auto ends_with = [&name](std::string_view tail) {
      return name.size() >= tail.size() && name.compare(name.size() - tail.size(), tail.size(), tail) == 0;
    };
    if (spec.layer < 0) {
      if (spec.role == WeightRole::kEmbedding) model->embed_ = t;
      else if (spec.role == WeightRole::kLmHead) model->lm_head_ = linear_w;
      else model->final_norm_ = t;
      continue;
    }
    Layer& L = model->layers_[size_t(spec.layer)];
    const std::string tail = name.substr(name.find(".layers.") + 8 + std::to_string(spec.layer).size() + 1);
    if (tail == "input_layernorm.weight") L.input_norm = t;
    else if (tail == "post_attention_layernorm.weight") L.post_norm = t;
    else if (tail == "self_attn.q_proj.weight") L.q_proj = linear_w;
    else if (tail == "self_attn.k_proj.weight") L.k_proj = linear_w;
    else if (tail == "self_attn.v_proj.weight") L.v_proj = linear_w;
    else if (tail == "self_attn.o_proj.weight") L.o_proj = linear_w;
    else if (tail == "self_attn.q_norm.weight") L.q_norm = t;
    else if (tail == "self_attn.k_norm.weight") L.k_norm = t;
    else if (tail == "self_attn.index_q_proj.weight") L.index_q_proj = linear_w;
    else if (tail == "self_attn.index_k_proj.weight") L.index_k_proj = linear_w;
    else if (tail == "self_attn.index_q_norm.weight") L.index_q_norm = t;
    else if (tail == "self_attn.index_k_norm.weight") L.index_k_norm = t;
    else if (tail == "mlp.gate_proj.weight") L.mlp_gate = linear_w;
    else if (tail == "mlp.up_proj.weight") L.mlp_up = linear_w;
    else if (tail == "mlp.down_proj.weight") L.mlp_down = linear_w;
    else if (tail == "block_sparse_moe.gate.weight") L.router = t;
    else if (tail == "block_sparse_moe.e_score_correction_bias") L.router_bias = t;
    else if (tail.rfind("block_sparse_moe.shared_experts.", 0) == 0) {
      const size_t shared = size_t(c.num_local_experts);
      if (ends_with("gate_proj.weight")) L.expert_gate[shared] = linear_w;
      else if (ends_with("up_proj.weight")) L.expert_up[shared] = linear_w;
      else L.expert_down[shared] = linear_w;
    } else if (tail.rfind("block_sparse_moe.experts.", 0) == 0) {
      const size_t e = size_t(std::stoi(tail.substr(25)));
      if (e == 0) {
        model->routed_expert_bytes_[size_t(spec.layer)] +=
            linear_w.data.size_bytes() + (linear_w.scale.data ? linear_w.scale.size_bytes() : 0);
      }
      if (ends_with(".w1.weight")) L.expert_gate[e] = linear_w;
      else if (ends_with(".w3.weight")) L.expert_up[e] = linear_w;
      else L.expert_down[e] = linear_w;
    } else {
      return Status::error("internal: no slot for weight " + name);
    }
  }
  return model;
}

std::unique_ptr<ForwardWorkspace> MiniMaxM3Model::make_workspace(int64_t max_tokens, int64_t max_logit_rows) const {
  const MiniMaxM3Config& c = config_;
  auto ws = std::make_unique<ForwardWorkspace>();
  ws->max_tokens = max_tokens = std::max<int64_t>(1, max_tokens);
  ws->max_logit_rows = max_logit_rows = std::max<int64_t>(1, max_logit_rows);
  ops::BackendRuntime* rt = runtime_;
  auto f32 = [&](int64_t n) { return ops::DeviceBuffer(rt, size_t(n) * 4); };
  const int64_t T = max_tokens, H = c.hidden_size, D = c.head_dim;
  ws->h = f32(T * H);
  ws->x = f32(T * H);
  ws->y = f32(T * H);
  ws->q = f32(T * c.num_attention_heads * D);
  ws->k = f32(T * c.num_key_value_heads * D);
  ws->v = f32(T * c.num_key_value_heads * D);
  ws->o = f32(T * c.num_attention_heads * D);
  ws->iq = f32(T * c.index_n_heads * c.index_head_dim);
  ws->ik = f32(T * c.index_head_dim);
  ws->selected = f32(int64_t(c.num_key_value_heads) * T * c.index_topk_blocks);
  ws->expert_ids = f32(T * c.num_experts_per_tok);
  ws->expert_weights = f32(T * c.num_experts_per_tok);
  ws->rows = f32(max_logit_rows * H);
  ws->normed = f32(max_logit_rows * H);
  ws->logits = f32(max_logit_rows * c.vocab_size);
  if (lm_head_.out_features() != c.vocab_size) ws->logits_local = f32(max_logit_rows * lm_head_.out_features());
  return ws;
}

void MiniMaxM3Model::forward(const ops::OpContext& ctx, const ForwardBatch& batch, const KvCacheTensors& cache,
                             ForwardWorkspace& ws, ForwardTrace* trace, const ForwardHooks* hooks) const {
  const MiniMaxM3Config& c = config_;
  const ops::AttentionMetadata& meta = batch.meta;
  const int64_t T = meta.num_tokens, H = c.hidden_size, D = c.head_dim;
  const int64_t Hq = c.num_attention_heads, Hkv = c.num_key_value_heads;
  const int64_t Hi = c.index_n_heads, Di = c.index_head_dim;
  const int64_t R = int64_t(batch.logits_rows.size());
  const int64_t E = c.num_experts_per_tok;
  M3_CHECK(cache.block_size == meta.block_size && meta.block_size == c.index_block_size,
           "KV page size must equal the MSA block size");
  M3_CHECK(T <= ws.max_tokens && R <= ws.max_logit_rows, "forward batch exceeds its workspace");
  const Device dev = runtime_->device();
  auto f2 = [dev](const ops::DeviceBuffer& b, int64_t rows, int64_t cols) {
    return TensorView{b.data(), DType::kF32, {rows, cols}, dev};
  };
  auto f3 = [dev](const ops::DeviceBuffer& b, int64_t a, int64_t b2, int64_t c3) {
    return TensorView{b.data(), DType::kF32, {a, b2, c3}, dev};
  };
  if (trace) {
    trace->selected_blocks.clear();
    trace->expert_ids.clear();
  }
  const TensorView hv = f2(ws.h, T, H), xv = f2(ws.x, T, H), yv = f2(ws.y, T, H);
  const TensorView q2 = f2(ws.q, T * Hq, D), k2 = f2(ws.k, T * Hkv, D);
  const TensorView q3 = f3(ws.q, T, Hq, D), k3 = f3(ws.k, T, Hkv, D), v3 = f3(ws.v, T, Hkv, D), o3 = f3(ws.o, T, Hq, D);
  const TensorView iq2 = f2(ws.iq, T * Hi, Di), iq3 = f3(ws.iq, T, Hi, Di), ik2 = f2(ws.ik, T, Di), ik3 = f3(ws.ik, T, 1, Di);
  const TensorView sel{ws.selected.data(), DType::kI32, {Hi, T, c.index_topk_blocks}, dev};
  const TensorView ids{ws.expert_ids.data(), DType::kI32, {T, E}, dev};
  const TensorView wts{ws.expert_weights.data(), DType::kF32, {T, E}, dev};
  embed(ctx, batch.token_ids, T, hv);
  auto mark = [hooks](int l) {
    if (hooks && hooks->after_layer) hooks->after_layer(l);
  };
  mark(-1);
  auto tap = [hooks](int l, const char* op, const TensorView& v) {
    if (hooks && hooks->on_activation) hooks->on_activation(l, op, v);
  };
  const ops::SwigluParams act{c.swiglu_alpha, c.swiglu_limit, c.swiglu_beta};

  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const Layer& L = layers_[size_t(l)];
    for (const auto& [layer, dst] : batch.captures)
      if (layer == l) runtime_->copy(dst, hv.data, size_t(T * H) * 4);
    // The input norm of later layers ran with the previous layer's residual add (add_rms_norm).
    if (l == 0) ops::rms_norm(ctx, hv, L.input_norm, c.rms_norm_eps, xv);
    tap(l, "attn_in", xv);
    // The layer's projections of x in one group (on the GPU: one x split, small projections
    // streamed in the same launch as q; the same bits as separate calls).
    const bool sparse = c.is_sparse_layer(l);
    // With index sharing a sparse layer may take the previous selection (still in ws.selected):
    // no index projections, keys or top-k of its own.
    const bool own_index = c.computes_index(l);
    const ops::LinearWeight* proj_w[5] = {&L.q_proj, &L.k_proj, &L.v_proj, &L.index_q_proj, &L.index_k_proj};
    const TensorView proj_y[5] = {f2(ws.q, T, Hq * D), f2(ws.k, T, Hkv * D), f2(ws.v, T, Hkv * D),
                                  own_index ? f2(ws.iq, T, Hi * Di) : TensorView{}, own_index ? ik2 : TensorView{}};
    ops::linear_group(ctx, xv, proj_w, proj_y, own_index ? 5 : 3);
    static constexpr const char* kProjNames[5] = {"q", "k", "v", "iq", "ik"};
    for (int i = 0; i < (own_index ? 5 : 3); ++i) tap(l, kProjNames[i], proj_y[i]);
    ops::AttnPrologue pro;
    pro.q = q3;
    pro.k = k3;
    pro.v = v3;
    pro.q_norm = L.q_norm;
    pro.k_norm = L.k_norm;
    pro.k_cache = cache.k[size_t(l)];
    pro.v_cache = cache.v[size_t(l)];
    if (own_index) {
      pro.index_q = iq3;
      pro.index_k = ik3;
      pro.index_q_norm = L.index_q_norm;
      pro.index_k_norm = L.index_k_norm;
      pro.index_k_cache = cache.index_k[size_t(l)];
    }
    pro.positions = meta.positions;
    pro.slot_mapping = meta.slot_mapping;
    pro.rotary_dim = c.rotary_dim;
    pro.theta = c.rope_theta;
    pro.eps = c.rms_norm_eps;
    ops::attn_prologue(ctx, pro);
    tap(l, "q_rope", q3);
    if (own_index) tap(l, "iq_rope", iq3);
    // The attention may read Q and K/V early only right after this layer's own indexer.
    ops::AttentionMetadata attn_meta = meta;
    attn_meta.qkv_before_previous_kernel = sparse && own_index;
    if (sparse) {
      if (own_index) {
        ops::AttentionMetadata index_meta = meta;
        index_meta.indexer_after_prologue = true;  // the prologue above wrote its queries and keys
        ops::indexer_topk(ctx, iq3, cache.index_k[size_t(l)], index_meta,
                          ops::IndexerParams{c.index_block_size, c.index_topk_blocks}, sel);
      }
      if (trace) {
        std::vector<int32_t> host(size_t(sel.numel()));
        runtime_->download(host.data(), sel.data, host.size() * 4);
        trace->selected_blocks.push_back(std::move(host));
      }
      ops::attention(ctx, q3, cache.k[size_t(l)], cache.v[size_t(l)], attn_meta, sel, c.index_topk_blocks, o3);
    } else {
      ops::attention(ctx, q3, cache.k[size_t(l)], cache.v[size_t(l)], attn_meta, TensorView{}, 0, o3);
    }
    tap(l, "attn", o3);
    ops::linear(ctx, f2(ws.o, T, Hq * D), L.o_proj, yv);
    ops::all_reduce(ctx, yv);  // tensor parallel: each rank's heads' share of the projection
    tap(l, "o_proj", yv);
    ops::add_rms_norm(ctx, hv, yv, L.post_norm, c.rms_norm_eps, xv);
    tap(l, "mlp_in", xv);
    if (c.is_moe_layer(l)) {
      ops::moe_router(ctx, xv, L.router, L.router_bias,
                      ops::RouterParams{c.num_experts_per_tok, c.routed_scaling_factor, c.use_routing_bias}, ids, wts);
      tap(l, "expert_ids", ids);
      tap(l, "expert_weights", wts);
      if (trace) {
        std::vector<int32_t> host(size_t(ids.numel()));
        runtime_->download(host.data(), ids.data, host.size() * 4);
        trace->expert_ids.push_back(std::move(host));
      }
      ops::ExpertWeights experts{c.num_local_experts, c.n_shared_experts > 0, L.expert_gate.data(), L.expert_up.data(),
                                 L.expert_down.data()};
      ops::moe_experts(ctx, xv, ids, wts, experts, act, yv);
    } else {
      ops::dense_mlp(ctx, xv, L.mlp_gate, L.mlp_up, L.mlp_down, act, yv);
    }
    ops::all_reduce(ctx, yv);  // tensor parallel: each rank's slice of the intermediate width
    tap(l, "mlp", yv);
    if (l + 1 < c.num_hidden_layers) {
      ops::add_rms_norm(ctx, hv, yv, layers_[size_t(l) + 1].input_norm, c.rms_norm_eps, xv);
    } else {
      ops::add(ctx, hv, yv);
    }
    tap(l, "residual", hv);
    mark(l);
  }

  // Final norm and LM head only on the rows that need logits (gathered like embeddings).
  if (R == 0) return;
  logits_of_rows(ctx, batch.logits_rows_ptr ? batch.logits_rows_ptr : batch.logits_rows.data(), R, T, ws);
  tap(c.num_hidden_layers, "logits", ws.logits_view(R, c.vocab_size));
  mark(c.num_hidden_layers + 1);
}

void MiniMaxM3Model::logits_of_rows(const ops::OpContext& ctx, const int32_t* rows, int64_t R, int64_t num_tokens,
                                    ForwardWorkspace& ws) const {
  const MiniMaxM3Config& c = config_;
  const int64_t H = c.hidden_size;
  M3_CHECK(R >= 1 && R <= ws.max_logit_rows && num_tokens <= ws.max_tokens, "logits rows exceed the workspace");
  const Device dev = runtime_->device();
  auto f2 = [dev](const ops::DeviceBuffer& b, int64_t r, int64_t cols) {
    return TensorView{b.data(), DType::kF32, {r, cols}, dev};
  };
  ops::embedding(ctx, rows, int(R), f2(ws.h, num_tokens, H), f2(ws.rows, R, H));
  ops::rms_norm(ctx, f2(ws.rows, R, H), final_norm_, c.rms_norm_eps, f2(ws.normed, R, H));
  vocab_logits(ctx, f2(ws.normed, R, H), f2(ws.logits, R, c.vocab_size), ws.logits_local.data());
}

void MiniMaxM3Model::embed(const ops::OpContext& ctx, const int32_t* ids, int64_t n, const TensorView& out) const {
  // A vocab-parallel table embeds its own ids (zero rows for the others'); the ranks' rows summed
  // are the whole table's (x + 0 + ... = x).
  const TpSlice vocab = vocab_slice(config_);
  ops::embedding(ctx, ids, int(n), embed_, out, vocab.offset);
  if (!vocab.whole()) ops::all_reduce(ctx, out);
}

void MiniMaxM3Model::vocab_logits(const ops::OpContext& ctx, const TensorView& normed, const TensorView& logits,
                                  void* local) const {
  if (lm_head_.out_features() == config_.vocab_size) {
    ops::linear(ctx, normed, lm_head_, logits);
    return;
  }
  // Vocab-parallel head: this rank's columns, then every rank's side by side.
  const TensorView part{local, DType::kF32, {normed.shape[0], lm_head_.out_features()}, runtime_->device()};
  ops::linear(ctx, normed, lm_head_, part);
  ops::all_gather_cols(ctx, part, logits);
}

void MiniMaxM3Model::forward(const ops::OpContext& ctx, const ForwardBatch& batch, const KvCacheTensors& cache,
                             float* logits, ForwardTrace* trace) const {
  M3_CHECK(runtime_->device() == Device::kCpu, "the host-logits forward needs a host-memory model");
  auto ws = make_workspace(batch.meta.num_tokens, int64_t(batch.logits_rows.size()));
  forward(ctx, batch, cache, *ws, trace);
  std::memcpy(logits, ws->logits.data(), batch.logits_rows.size() * size_t(config_.vocab_size) * 4);
}

KvCacheTensors BackendKvCache::views(Device device) const {
  KvCacheTensors t;
  t.block_size = block_size;
  t.k = k_views_;
  t.v = v_views_;
  t.index_k = index_k_views_;
  for (auto* vs : {&t.k, &t.v, &t.index_k})
    for (auto& v : *vs) v.device = v.data ? device : Device::kCpu;
  return t;
}

int64_t BackendKvCache::bytes_per_block(const MiniMaxM3Config& c, int block_size, DType dtype,
                                        std::optional<DType> index_dtype) {
  int64_t kv = 0, index = 0;  // elements per token
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    kv += 2 * int64_t(c.num_key_value_heads) * c.head_dim;
    if (c.computes_index(l)) index += c.index_head_dim;
  }
  return (kv * int64_t(dtype_size_bytes(dtype)) + index * int64_t(dtype_size_bytes(index_dtype.value_or(dtype)))) *
         block_size;
}

namespace {

// The copies that move a page holding the global KV heads [src_first, src_first + src_heads) into
// one holding [dst_first, dst_first + dst_heads): per layer a head range of every token of K and
// of V (pitched pieces) and the index keys whole. dst_at(tensor, offset) is where the destination
// tensor (K, V, index keys of layer 0, then 1, ...) lives: `offset` is its place in a page.
template <class DstAt>
void head_pieces(const MiniMaxM3Config& c, int bs, DType dtype, DType index_dtype, const char* src, int src_first,
                 int src_heads, int dst_first, int dst_heads, DstAt dst_at,
                 std::vector<ops::BackendRuntime::CopyPiece>& out) {
  const size_t head_bytes = size_t(c.head_dim) * dtype_size_bytes(dtype);
  const size_t index_bytes = size_t(bs) * size_t(c.index_head_dim) * dtype_size_bytes(index_dtype);
  const int first = std::max(src_first, dst_first), last = std::min(src_first + src_heads, dst_first + dst_heads);
  size_t so = 0, dof = 0;  // the tensor's offset in the source page and in a destination page
  int tensor = 0;
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    for (int kv = 0; kv < 2; ++kv, ++tensor) {  // K, then V: [bs][heads][head_dim]
      if (last > first)
        out.push_back({dst_at(tensor, dof) + size_t(first - dst_first) * head_bytes,
                       src + so + size_t(first - src_first) * head_bytes, size_t(last - first) * head_bytes, size_t(bs),
                       size_t(dst_heads) * head_bytes, size_t(src_heads) * head_bytes});
      so += size_t(bs) * size_t(src_heads) * head_bytes;
      dof += size_t(bs) * size_t(dst_heads) * head_bytes;
    }
    if (c.computes_index(l)) {
      out.push_back({dst_at(tensor++, dof), src + so, index_bytes});
      so += index_bytes;
      dof += index_bytes;
    }
  }
}

}  // namespace

void BackendKvCache::block_head_pieces(const MiniMaxM3Config& c, int64_t block, const char* src, int src_first,
                                       int src_heads, std::vector<ops::BackendRuntime::CopyPiece>& out) const {
  std::vector<char*> tensors;  // this block of each tensor, in page order
  for_each_block_piece(block, [&](char* dev, size_t, size_t) { tensors.push_back(dev); });
  head_pieces(c, block_size, dtype, index_dtype, src, src_first, src_heads, c.kv_head_offset, c.num_key_value_heads,
              [&](int tensor, size_t) { return tensors[size_t(tensor)]; }, out);
}

void BackendKvCache::copy_page_heads(const MiniMaxM3Config& c, int bs, DType dtype, DType index_dtype, const char* src,
                                     int src_first, int src_heads, char* dst, int dst_first, int dst_heads) {
  std::vector<ops::BackendRuntime::CopyPiece> pieces;
  head_pieces(c, bs, dtype, index_dtype, src, src_first, src_heads, dst_first, dst_heads,
              [&](int, size_t offset) { return dst + offset; }, pieces);
  for (const auto& p : pieces)
    for (size_t r = 0; r < p.rows; ++r)
      std::memcpy(static_cast<char*>(p.dst) + r * p.dst_pitch, static_cast<const char*>(p.src) + r * p.src_pitch, p.bytes);
}

BackendKvCache BackendKvCache::allocate(ops::BackendRuntime* rt, const MiniMaxM3Config& c, int64_t num_blocks,
                                        int block_size, DType dtype, std::optional<DType> index_dtype) {
  M3_CHECK(dtype == DType::kF32 || dtype == DType::kBF16, "KV cache dtype must be F32 or BF16");
  const DType idt = index_dtype.value_or(dtype);
  M3_CHECK(idt == DType::kF32 || idt == DType::kBF16 || idt == DType::kF8E4M3,
           "index-key cache dtype must be F32, BF16 or F8E4M3");
  const size_t esz = dtype_size_bytes(dtype), iesz = dtype_size_bytes(idt);
  BackendKvCache cache;
  cache.block_size = block_size;
  cache.num_blocks = num_blocks;
  cache.dtype = dtype;
  cache.index_dtype = idt;
  const int64_t slots = num_blocks * block_size;
  const Device dev = rt->device();
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const Shape kv{slots, c.num_key_value_heads, c.head_dim};
    cache.k.emplace_back(rt, size_t(kv.numel()) * esz);
    cache.v.emplace_back(rt, size_t(kv.numel()) * esz);
    cache.k_views_.push_back(TensorView{cache.k.back().data(), dtype, kv, dev});
    cache.v_views_.push_back(TensorView{cache.v.back().data(), dtype, kv, dev});
    if (c.computes_index(l)) {
      const Shape ik{slots, c.index_head_dim};
      cache.index_k.emplace_back(rt, size_t(ik.numel()) * iesz);
      cache.index_k_views_.push_back(TensorView{cache.index_k.back().data(), idt, ik, dev});
    } else {
      cache.index_k.emplace_back();
      cache.index_k_views_.push_back(TensorView{});
    }
  }
  return cache;
}

template <typename Fn>
void BackendKvCache::for_each_block_piece(int64_t block, Fn&& fn) const {
  size_t offset = 0;  // into the host copy: K, V, index-K of layer 0, then layer 1, ...
  for (size_t l = 0; l < k.size(); ++l)
    for (const ops::DeviceBuffer* t : {&k[l], &v[l], &index_k[l]}) {
      if (t->size_bytes() == 0) continue;
      const size_t n = t->size_bytes() / size_t(num_blocks);  // one block of this tensor
      fn(static_cast<char*>(t->data()) + size_t(block) * n, offset, n);
      offset += n;
    }
}

// Both queue the copies on the runtime's stream like the forward after them: a save reads the
// block before anything overwrites it, and `host` is pinned.
void BackendKvCache::save_block(ops::BackendRuntime* rt, int64_t block, void* host) const {
  for_each_block_piece(block, [&](char* dev, size_t offset, size_t n) {
    rt->download_async(static_cast<char*>(host) + offset, dev, n);
  });
}

void BackendKvCache::load_block(ops::BackendRuntime* rt, int64_t block, const void* host) const {
  for_each_block_piece(block, [&](char* dev, size_t offset, size_t n) {
    rt->upload(dev, static_cast<const char*>(host) + offset, n);
  });
}

void BackendKvCache::page_pieces(int64_t block, char* page, bool to_page,
                                 std::vector<ops::BackendRuntime::CopyPiece>& out) const {
  for_each_block_piece(block, [&](char* dev, size_t offset, size_t n) {
    out.push_back(to_page ? ops::BackendRuntime::CopyPiece{page + offset, dev, n}
                          : ops::BackendRuntime::CopyPiece{dev, page + offset, n});
  });
}

}  // namespace m3
