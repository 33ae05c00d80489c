#include "model/eagle3/model.h"

#include <cstring>
#include <limits>

#include "core/check.h"
#include "core/dtype.h"
#include "model/minimax_m3/weight_reader.h"

namespace m3 {
namespace {

// The checkpoint's name for a draft tensor: EAGLE-3 trainers write "midlayer.*" (vLLM reads it as
// "layers.0.*"), some exports prefix "model.".
const TensorInfo* find_draft(const ModelDir& dir, const std::string& name, std::string* found) {
  std::vector<std::string> names = {name, "model." + name};
  if (name.rfind("midlayer.", 0) == 0) {
    const std::string l0 = "layers.0." + name.substr(9);
    names.push_back(l0);
    names.push_back("model." + l0);
  }
  for (const auto& n : names) {
    if (const TensorInfo* t = dir.find(n)) {
      *found = n;
      return t;
    }
  }
  return nullptr;
}

}  // namespace

int64_t Eagle3KvCache::bytes_per_block(const Eagle3Config& c, int block_size, DType dtype) {
  return 2 * int64_t(block_size) * c.num_key_value_heads * c.head_dim * int64_t(dtype_size_bytes(dtype));
}

Eagle3KvCache Eagle3KvCache::allocate(ops::BackendRuntime* rt, const Eagle3Config& c, int64_t num_blocks,
                                      int block_size, DType dtype) {
  Eagle3KvCache kv;
  kv.dtype = dtype;
  kv.block_size = block_size;
  kv.num_blocks = num_blocks;
  const size_t bytes = size_t(bytes_per_block(c, block_size, dtype) / 2) * size_t(num_blocks);
  kv.k = ops::DeviceBuffer(rt, bytes);
  kv.v = ops::DeviceBuffer(rt, bytes);
  return kv;
}

void Eagle3KvCache::save_block(ops::BackendRuntime* rt, int64_t block, void* host) const {
  const size_t half = k.size_bytes() / size_t(num_blocks);
  rt->download_async(host, k.as<char>() + size_t(block) * half, half);
  rt->download_async(static_cast<char*>(host) + half, v.as<char>() + size_t(block) * half, half);
}

void Eagle3KvCache::load_block(ops::BackendRuntime* rt, int64_t block, const void* host) const {
  const size_t half = k.size_bytes() / size_t(num_blocks);
  rt->upload(k.as<char>() + size_t(block) * half, host, half);
  rt->upload(v.as<char>() + size_t(block) * half, static_cast<const char*>(host) + half, half);
}

void Eagle3KvCache::page_pieces(int64_t block, char* page, bool to_page,
                                std::vector<ops::BackendRuntime::CopyPiece>& out) const {
  const size_t half = k.size_bytes() / size_t(num_blocks);
  char* kb = k.as<char>() + size_t(block) * half;
  char* vb = v.as<char>() + size_t(block) * half;
  if (to_page) {
    out.push_back({page, kb, half});
    out.push_back({page + half, vb, half});
  } else {
    out.push_back({kb, page, half});
    out.push_back({vb, page + half, half});
  }
}

Result<std::unique_ptr<Eagle3Model>> Eagle3Model::load(const ModelDir& dir, const MiniMaxM3Model& target,
                                                       const LoadOptions& options) {
  const MiniMaxM3Config& tc = target.config();
  auto cfg = Eagle3Config::from_json(dir.config_json(), tc);
  if (!cfg) return Status::error("draft model " + dir.path() + "/config.json: " + cfg.error());
  auto m = std::unique_ptr<Eagle3Model>(new Eagle3Model());
  m->config_ = cfg->shard(options.tp_size, options.tp_rank);
  const Eagle3Config& whole = *cfg;  // the checkpoint's shapes
  m->target_ = &target;
  m->runtime_ = options.runtime ? options.runtime : target.runtime();
  const Eagle3Config& c = m->config_;
  ops::BackendRuntime* rt = m->runtime_;
  const bool bf16 = options.linear_format != LinearFormat::kF32;
  const int64_t H = c.hidden_size, Ht = c.target_hidden_size, D = c.head_dim;
  const int64_t Nq = whole.num_attention_heads * D, Nkv = whole.num_key_value_heads * D, I = whole.intermediate_size;
  // This rank's rows of q/k/v and gate/up, columns of o_proj and down (all of them when whole).
  const int64_t nq = c.num_attention_heads * D, nkv = c.num_key_value_heads * D, ni = c.intermediate_size;
  const int64_t part = c.tp_size > 1 ? c.tp_rank : 0;

  // Reads a tensor as fp32 (validated dtype and shape; the error names file and tensor).
  auto read = [&](const std::string& name, const Shape& shape, WeightRole role) -> Result<std::vector<float>> {
    std::string found;
    if (!find_draft(dir, name, &found))
      return Status::error("draft model " + dir.path() + ": tensor '" + name + "' not found");
    WeightSpec spec{found, shape, role, 0, false};
    return read_f32(dir, spec, false);
  };
  auto upload = [&](const void* bytes, size_t size, DType dtype, const Shape& shape) {
    ops::DeviceBuffer buf(rt, size);
    rt->upload(buf.data(), bytes, size);
    rt->synchronize();
    TensorView v = buf.view(dtype, shape);
    m->weight_bytes_ += size;
    m->storage_.push_back(std::move(buf));
    return v;
  };
  // Rows [r0, r0 + m) and columns [c0, c0 + n) of a row-major [.., cols] matrix as a linear weight.
  auto block = [&](const std::vector<float>& w, int64_t cols, int64_t r0, int64_t m, int64_t c0, int64_t n) {
    std::vector<float> sub(size_t(m * n));
    for (int64_t r = 0; r < m; ++r)
      std::memcpy(sub.data() + r * n, w.data() + (r0 + r) * cols + c0, size_t(n) * 4);
    ops::LinearWeight lw;
    if (bf16) {
      std::vector<uint16_t> b(sub.size());
      for (size_t i = 0; i < b.size(); ++i) b[i] = f32_to_bf16(sub[i]);
      lw.data = upload(b.data(), b.size() * 2, DType::kBF16, {m, n});
    } else {
      lw.data = upload(sub.data(), sub.size() * 4, DType::kF32, {m, n});
    }
    return lw;
  };
  auto linear = [&](const std::vector<float>& w, int64_t rows, int64_t cols, int64_t c0, int64_t n) {
    return block(w, cols, 0, rows, c0, n);
  };
  auto norm = [&](const std::string& name, TensorView& out) -> Status {
    auto w = read(name, {H}, WeightRole::kNorm);
    if (!w) return w.status();
    for (float& x : *w) x -= 1.0f;  // Llama scales by w, the ops by 1 + w
    out = upload(w->data(), w->size() * 4, DType::kF32, {H});
    return Status::ok();
  };
  M3_RETURN_IF_ERROR(norm("midlayer.input_layernorm.weight", m->input_norm_));
  M3_RETURN_IF_ERROR(norm("midlayer.hidden_norm.weight", m->hidden_norm_));
  M3_RETURN_IF_ERROR(norm("midlayer.post_attention_layernorm.weight", m->post_norm_));
  M3_RETURN_IF_ERROR(norm("norm.weight", m->final_norm_));
  {
    auto fc = read("fc.weight", {H, c.fc_in()}, WeightRole::kLinear);
    if (!fc) return fc.status();
    for (size_t i = 0; i < c.aux_layer_ids.size(); ++i) m->fc_.push_back(linear(*fc, H, c.fc_in(), int64_t(i) * Ht, Ht));
  }
  struct Split {
    const char* name;
    int64_t rows, local;
    ops::LinearWeight *e, *h;
  };
  for (const Split& s : {Split{"midlayer.self_attn.q_proj.weight", Nq, nq, &m->q_e_, &m->q_h_},
                         Split{"midlayer.self_attn.k_proj.weight", Nkv, nkv, &m->k_e_, &m->k_h_},
                         Split{"midlayer.self_attn.v_proj.weight", Nkv, nkv, &m->v_e_, &m->v_h_}}) {
    auto w = read(s.name, {s.rows, 2 * H}, WeightRole::kLinear);
    if (!w) return w.status();
    *s.e = block(*w, 2 * H, part * s.local, s.local, 0, H);
    *s.h = block(*w, 2 * H, part * s.local, s.local, H, H);
  }
  struct Part {
    const char* name;
    int64_t rows, cols, r0, m, c0, n;
    ops::LinearWeight* out;
  };
  for (const Part& s : {Part{"midlayer.self_attn.o_proj.weight", H, Nq, 0, H, part * nq, nq, &m->o_},
                        Part{"midlayer.mlp.gate_proj.weight", I, H, part * ni, ni, 0, H, &m->gate_},
                        Part{"midlayer.mlp.up_proj.weight", I, H, part * ni, ni, 0, H, &m->up_},
                        Part{"midlayer.mlp.down_proj.weight", H, I, 0, H, part * ni, ni, &m->down_}}) {
    auto w = read(s.name, {s.rows, s.cols}, WeightRole::kLinear);
    if (!w) return w.status();
    *s.out = block(*w, s.cols, s.r0, s.m, s.c0, s.n);
  }
  std::string found;
  if (find_draft(dir, "lm_head.weight", &found)) {
    auto w = read("lm_head.weight", {c.draft_vocab_size, H}, WeightRole::kLmHead);
    if (!w) return w.status();
    m->head_ = linear(*w, c.draft_vocab_size, H, 0, H);
  } else if (c.draft_vocab_size != c.vocab_size || H != Ht) {
    return Status::error("draft model " + dir.path() +
                         ": no lm_head.weight, and the target's LM head cannot stand in (draft_vocab_size " +
                         std::to_string(c.draft_vocab_size) + ", hidden_size " + std::to_string(H) + ")");
  }
  if (find_draft(dir, "embed_tokens.weight", &found)) {
    auto w = read("embed_tokens.weight", {c.vocab_size, H}, WeightRole::kEmbedding);
    if (!w) return w.status();
    m->embed_ = upload(w->data(), w->size() * 4, DType::kF32, {c.vocab_size, H});
  } else if (H != Ht) {
    return Status::error("draft model " + dir.path() + ": no embed_tokens.weight, and the target's embedding (" +
                         std::to_string(Ht) + " wide) does not match hidden_size " + std::to_string(H));
  }
  if (const TensorInfo* t = find_draft(dir, "d2t", &found)) {
    if (t->dtype != DType::kI64 || t->shape != Shape{c.draft_vocab_size})
      return Status::error("draft model " + dir.path() + ": tensor '" + found + "' must be I64 [" +
                           std::to_string(c.draft_vocab_size) + "]");
    m->d2t_.resize(size_t(c.draft_vocab_size));
    std::memcpy(m->d2t_.data(), t->data, m->d2t_.size() * 8);
    for (int64_t i = 0; i < c.draft_vocab_size; ++i) {
      const int64_t id = i + m->d2t_[size_t(i)];
      if (id < 0 || id >= c.vocab_size)
        return Status::error("draft model " + dir.path() + ": d2t maps draft id " + std::to_string(i) + " to " +
                             std::to_string(id) + ", outside the vocabulary");
    }
  } else if (c.draft_vocab_size != c.vocab_size) {
    return Status::error("draft model " + dir.path() + ": draft_vocab_size " + std::to_string(c.draft_vocab_size) +
                         " < vocab_size needs the d2t tensor");
  }
  std::vector<int32_t> ids(static_cast<size_t>(c.draft_vocab_size));
  for (int64_t i = 0; i < c.draft_vocab_size; ++i) ids[size_t(i)] = m->target_id(int32_t(i));
  m->target_ids_ = upload(ids.data(), ids.size() * 4, DType::kI32, {c.draft_vocab_size, 1});
  return m;
}

std::unique_ptr<Eagle3Workspace> Eagle3Model::make_workspace(int64_t max_tokens, int64_t max_rows) const {
  const Eagle3Config& c = config_;
  auto ws = std::make_unique<Eagle3Workspace>();
  ws->max_tokens = max_tokens = std::max<int64_t>(1, max_tokens);
  ws->max_rows = max_rows = std::max<int64_t>(1, max_rows);
  auto f32 = [&](int64_t n) { return ops::DeviceBuffer(runtime_, size_t(n) * 4); };
  const int64_t T = max_tokens, H = c.hidden_size, Nq = int64_t(c.num_attention_heads) * c.head_dim,
                Nkv = int64_t(c.num_key_value_heads) * c.head_dim;
  ws->e = f32(T * c.target_hidden_size);
  for (ops::DeviceBuffer* b : {&ws->h, &ws->xe, &ws->xh, &ws->res, &ws->x, &ws->y}) *b = f32(T * H);
  ws->q = f32(T * Nq);
  ws->q2 = f32(T * Nq);
  ws->o = f32(T * Nq);
  for (ops::DeviceBuffer* b : {&ws->k, &ws->k2, &ws->v, &ws->v2}) *b = f32(T * Nkv);
  ws->rows = f32(max_rows * H);
  ws->normed = f32(max_rows * H);
  ws->logits = f32(max_rows * c.draft_vocab_size);
  if (shares_lm_head() && target_->lm_head_rows() != c.vocab_size)
    ws->logits_local = f32(max_rows * target_->lm_head_rows());
  for (size_t i = 0; i < c.aux_layer_ids.size(); ++i) ws->aux.push_back(f32(T * c.target_hidden_size));
  return ws;
}

void Eagle3Model::forward(const ops::OpContext& ctx, const Eagle3Batch& batch, const Eagle3KvCache& cache,
                          Eagle3Workspace& ws) const {
  const Eagle3Config& c = config_;
  const ops::AttentionMetadata& meta = batch.meta;
  const int64_t T = meta.num_tokens, H = c.hidden_size, D = c.head_dim, Hq = c.num_attention_heads,
                Hkv = c.num_key_value_heads, R = batch.num_logits_rows;
  M3_CHECK(T <= ws.max_tokens && R <= ws.max_rows, "draft batch exceeds its workspace");
  M3_CHECK(cache.block_size == meta.block_size, "draft KV page size must equal the target's");
  const Device dev = runtime_->device();
  auto v2 = [dev](const ops::DeviceBuffer& b, int64_t rows, int64_t cols) {
    return TensorView{b.data(), DType::kF32, {rows, cols}, dev};
  };
  auto v3 = [dev](const ops::DeviceBuffer& b, int64_t a, int64_t h, int64_t d) {
    return TensorView{b.data(), DType::kF32, {a, h, d}, dev};
  };
  const TensorView hv = v2(ws.h, T, H), res = v2(ws.res, T, H), xh = v2(ws.xh, T, H), xe = v2(ws.xe, T, H),
                   xv = v2(ws.x, T, H), yv = v2(ws.y, T, H);
  const TensorView ev = v2(ws.e, T, c.target_hidden_size);

  // The token's embedding: the draft's own table, else the target's (vocab-parallel under TP).
  if (!shares_embedding()) ops::embedding(ctx, batch.token_ids, int(T), embed_, ev);
  else target_->embed(ctx, batch.token_ids, T, ev);
  // The hidden input: fc over the target's captures (its column blocks summed), or the previous
  // pass's pre-norm rows (gathered before this pass overwrites them).
  if (batch.from_target) {
    M3_CHECK(ws.aux.size() == fc_.size(), "draft workspace has no captures");
    for (size_t i = 0; i < fc_.size(); ++i) {
      const TensorView a = v2(ws.aux[i], T, c.target_hidden_size);
      if (i == 0) {
        ops::linear(ctx, a, fc_[0], hv);
      } else {
        ops::linear(ctx, a, fc_[i], yv);
        ops::add(ctx, hv, yv);
      }
    }
  } else {
    ops::embedding(ctx, batch.hidden_rows, int(T), v2(ws.res, ws.max_tokens, H), hv);
  }
  if (c.norm_before_residual) {
    ops::rms_norm(ctx, hv, hidden_norm_, c.rms_norm_eps, xh);
    runtime_->copy(res.data, xh.data, size_t(T * H) * 4);
  } else {
    runtime_->copy(res.data, hv.data, size_t(T * H) * 4);
    ops::rms_norm(ctx, hv, hidden_norm_, c.rms_norm_eps, xh);
  }
  ops::rms_norm(ctx, ev, input_norm_, c.rms_norm_eps, xe);
  // q/k/v of [xe, xh]: each input half's projection, summed.
  const TensorView q = v2(ws.q, T, Hq * D), k = v2(ws.k, T, Hkv * D), v = v2(ws.v, T, Hkv * D);
  const TensorView q2 = v2(ws.q2, T, Hq * D), k2 = v2(ws.k2, T, Hkv * D), vv2 = v2(ws.v2, T, Hkv * D);
  const ops::LinearWeight* we[3] = {&q_e_, &k_e_, &v_e_};
  const ops::LinearWeight* wh[3] = {&q_h_, &k_h_, &v_h_};
  const TensorView ye[3] = {q, k, v}, yh[3] = {q2, k2, vv2};
  ops::linear_group(ctx, xe, we, ye, 3);
  ops::linear_group(ctx, xh, wh, yh, 3);
  ops::add(ctx, q, q2);
  ops::add(ctx, k, k2);
  ops::add(ctx, v, vv2);
  const TensorView q3 = v3(ws.q, T, Hq, D), k3 = v3(ws.k, T, Hkv, D), o3 = v3(ws.o, T, Hq, D);
  ops::rope(ctx, q3, meta.positions, int(D), c.rope_theta);
  ops::rope(ctx, k3, meta.positions, int(D), c.rope_theta);
  const TensorView kc{cache.k.data(), cache.dtype, {cache.num_blocks * cache.block_size, Hkv, D}, dev};
  const TensorView vc{cache.v.data(), cache.dtype, {cache.num_blocks * cache.block_size, Hkv, D}, dev};
  ops::kv_write(ctx, k3, meta.slot_mapping, kc);
  ops::kv_write(ctx, v3(ws.v, T, Hkv, D), meta.slot_mapping, vc);
  ops::attention(ctx, q3, kc, vc, meta, TensorView{}, 0, o3);
  ops::linear(ctx, v2(ws.o, T, Hq * D), o_, yv);
  if (c.tp_size > 1) ops::all_reduce(ctx, yv);  // each rank's heads' share of the projection
  ops::add_rms_norm(ctx, res, yv, post_norm_, c.rms_norm_eps, xv);
  // Llama's SiLU gate: SwiGLU-OAI with alpha 1, no clamp, no bias on the up half.
  const ops::SwigluParams silu{1.0f, std::numeric_limits<float>::max(), 0.0f};
  ops::dense_mlp(ctx, xv, gate_, up_, down_, silu, yv);
  if (c.tp_size > 1) ops::all_reduce(ctx, yv);  // each rank's slice of the MLP width
  ops::add(ctx, res, yv);  // res: the pre-norm output, the next chained token's hidden input

  if (R == 0) return;
  const TensorView rows = v2(ws.rows, R, H), normed = v2(ws.normed, R, H);
  ops::embedding(ctx, batch.logits_rows, int(R), res, rows);
  ops::rms_norm(ctx, rows, final_norm_, c.rms_norm_eps, normed);
  const TensorView logits = v2(ws.logits, R, c.draft_vocab_size);
  if (!shares_lm_head()) ops::linear(ctx, normed, head_, logits);
  else target_->vocab_logits(ctx, normed, logits, ws.logits_local.data());
}

}  // namespace m3
