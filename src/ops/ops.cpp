#include "ops/ops.h"

#include "core/check.h"

namespace m3::ops {
namespace {
Problem problem(const OpContext& ctx, const char* op, DType dtype, int64_t m, int64_t n, int64_t k, int64_t extra = 0) {
  return make_problem(op, ctx.device, dtype, m, n, k, extra, ctx.batch_invariant);
}
}  // namespace

void embedding(const OpContext& ctx, const int32_t* ids, int num_tokens, const TensorView& table, const TensorView& out,
               int64_t first_id) {
  auto& e = ctx.kernels->embedding.select(problem(ctx, "embedding", table.dtype, num_tokens, table.shape[1], table.shape[0]), ctx.stats);
  e.fn(ids, num_tokens, table, out, first_id);
}

void all_reduce(const OpContext& ctx, const TensorView& x) {
  if (!ctx.comm || ctx.comm->size() == 1) return;
  if (ctx.stats) ctx.stats->record(problem(ctx, "all_reduce", x.dtype, x.shape[0], x.numel() / x.shape[0], ctx.comm->size()),
                                   ctx.comm->entry_name("all_reduce"), "tensor parallel size " + std::to_string(ctx.comm->size()));
  ctx.comm->all_reduce_sum(x);
}

void all_gather_cols(const OpContext& ctx, const TensorView& local, const TensorView& out) {
  M3_CHECK(ctx.comm && ctx.comm->size() > 1, "all_gather_cols needs a tensor-parallel group");
  if (ctx.stats) ctx.stats->record(problem(ctx, "all_gather", local.dtype, local.shape[0], local.shape[1], ctx.comm->size()),
                                   ctx.comm->entry_name("all_gather"), "tensor parallel size " + std::to_string(ctx.comm->size()));
  ctx.comm->all_gather_cols(local, out);
}

void rms_norm(const OpContext& ctx, const TensorView& x, const TensorView& weight, float eps, const TensorView& out) {
  auto& e = ctx.kernels->rms_norm.select(problem(ctx, "rms_norm", x.dtype, x.shape[0], x.shape[1], 0), ctx.stats);
  e.fn(x, weight, eps, out);
}

void rope(const OpContext& ctx, const TensorView& x, const int32_t* positions, int rotary_dim, double theta) {
  auto& e = ctx.kernels->rope.select(problem(ctx, "rope", x.dtype, x.shape[0], x.shape[1], x.shape[2], rotary_dim), ctx.stats);
  e.fn(x, positions, rotary_dim, theta);
}

void linear(const OpContext& ctx, const TensorView& x, const LinearWeight& w, const TensorView& y) {
  auto& e = ctx.kernels->linear.select(problem(ctx, "linear", w.data.dtype, x.shape[0], w.out_features(), w.in_features()), ctx.stats);
  e.fn(x, w, y);
}

void linear_group(const OpContext& ctx, const TensorView& x, const LinearWeight* const* w, const TensorView* y,
                  int count) {
  for (int i = 0; i < count;) {
    int j = i + 1;
    while (j < count && w[j]->data.dtype == w[i]->data.dtype && w[j]->in_features() == w[i]->in_features()) ++j;
    const KernelEntry<LinearGroupFn>* e = nullptr;
    if (j - i > 1) {
      int64_t n = 0;
      for (int q = i; q < j; ++q) n += w[q]->out_features();
      e = ctx.kernels->linear_group.find(
          problem(ctx, "linear_group", w[i]->data.dtype, x.shape[0], n, w[i]->in_features(), j - i), ctx.stats);
    }
    if (e) {
      e->fn(x, w + i, y + i, j - i);
    } else {
      for (int q = i; q < j; ++q) linear(ctx, x, *w[q], y[q]);
    }
    i = j;
  }
}

void kv_write(const OpContext& ctx, const TensorView& src, const int64_t* slot_mapping, const TensorView& cache) {
  auto& e = ctx.kernels->kv_write.select(problem(ctx, "kv_write", cache.dtype, src.shape[0], src.numel() / std::max<int64_t>(1, src.shape[0]), 0), ctx.stats);
  e.fn(src, slot_mapping, cache);
}

void attention(const OpContext& ctx, const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
               const AttentionMetadata& meta, const TensorView& selected, int top_k, const TensorView& out) {
  // m = query tokens, n = query heads, k = head dim; extra = top-k blocks (0 = dense).
  Problem p = problem(ctx, selected.data ? "attention_sparse" : "attention_dense", k_cache.dtype, q.shape[0], q.shape[1],
                      q.shape[2], selected.data ? top_k : 0);
  p.attention = &meta;
  p.kv_heads = k_cache.shape[1];
  auto& e = ctx.kernels->attention.select(p, ctx.stats);
  e.fn(q, k_cache, v_cache, meta, selected, top_k, out);
}

void indexer_topk(const OpContext& ctx, const TensorView& index_q, const TensorView& index_k_cache,
                  const AttentionMetadata& meta, const IndexerParams& params, const TensorView& selected) {
  Problem p = problem(ctx, "indexer_topk", index_k_cache.dtype, index_q.shape[0], index_q.shape[1], index_q.shape[2],
                      params.top_k);
  p.attention = &meta;
  auto& e = ctx.kernels->indexer_topk.select(p, ctx.stats);
  e.fn(index_q, index_k_cache, meta, params, selected);
}

void moe_router(const OpContext& ctx, const TensorView& x, const TensorView& router_w, const TensorView& bias,
                const RouterParams& params, const TensorView& expert_ids, const TensorView& expert_weights) {
  auto& e = ctx.kernels->router.select(
      problem(ctx, "moe_router", router_w.dtype, x.shape[0], router_w.shape[0], router_w.shape[1], params.top_k), ctx.stats);
  e.fn(x, router_w, bias, params, expert_ids, expert_weights);
}

void moe_experts(const OpContext& ctx, const TensorView& x, const TensorView& expert_ids,
                 const TensorView& expert_weights, const ExpertWeights& experts, const SwigluParams& act,
                 const TensorView& out) {
  auto& e = ctx.kernels->moe.select(
      problem(ctx, "moe_experts", experts.gate[0].data.dtype, x.shape[0], experts.gate[0].out_features(),
              x.shape[1], expert_ids.shape[1]),
      ctx.stats);
  e.fn(x, expert_ids, expert_weights, experts, act, out);
}

void dense_mlp(const OpContext& ctx, const TensorView& x, const LinearWeight& gate, const LinearWeight& up,
               const LinearWeight& down, const SwigluParams& act, const TensorView& out) {
  auto& e = ctx.kernels->mlp.select(problem(ctx, "dense_mlp", gate.data.dtype, x.shape[0], gate.out_features(), x.shape[1]), ctx.stats);
  e.fn(x, gate, up, down, act, out);
}

void add(const OpContext& ctx, const TensorView& x, const TensorView& y) {
  auto& e = ctx.kernels->add.select(problem(ctx, "add", x.dtype, x.numel(), 0, 0), ctx.stats);
  e.fn(x, y);
}

void add_rms_norm(const OpContext& ctx, const TensorView& x, const TensorView& y, const TensorView& weight, float eps,
                  const TensorView& out) {
  if (auto* e = ctx.kernels->add_rms_norm.find(problem(ctx, "add_rms_norm", x.dtype, x.shape[0], x.shape[1], 0), ctx.stats)) {
    e->fn(x, y, weight, eps, out);
    return;
  }
  add(ctx, x, y);
  rms_norm(ctx, x, weight, eps, out);
}

void attn_prologue(const OpContext& ctx, const AttnPrologue& p) {
  const int64_t T = p.q.shape[0], D = p.q.shape[2], Di = p.sparse() ? p.index_q.shape[2] : 0;
  // m = tokens, n = head_dim, k = index head_dim (0 on dense layers), extra = rotary_dim.
  if (auto* e = ctx.kernels->attn_prologue.find(problem(ctx, "attn_prologue", p.q.dtype, T, D, Di, p.rotary_dim),
                                                 ctx.stats)) {
    e->fn(p);
    return;
  }
  auto rows = [](const TensorView& t) {  // [T, heads, dim] as [T * heads, dim]
    TensorView r = t;
    r.shape = {t.shape[0] * t.shape[1], t.shape[2]};
    return r;
  };
  rms_norm(ctx, rows(p.q), p.q_norm, p.eps, rows(p.q));
  rms_norm(ctx, rows(p.k), p.k_norm, p.eps, rows(p.k));
  rope(ctx, p.q, p.positions, p.rotary_dim, p.theta);
  rope(ctx, p.k, p.positions, p.rotary_dim, p.theta);
  kv_write(ctx, p.k, p.slot_mapping, p.k_cache);
  kv_write(ctx, p.v, p.slot_mapping, p.v_cache);
  if (!p.sparse()) return;
  rms_norm(ctx, rows(p.index_q), p.index_q_norm, p.eps, rows(p.index_q));
  rms_norm(ctx, rows(p.index_k), p.index_k_norm, p.eps, rows(p.index_k));
  rope(ctx, p.index_q, p.positions, p.rotary_dim, p.theta);
  rope(ctx, p.index_k, p.positions, p.rotary_dim, p.theta);
  kv_write(ctx, rows(p.index_k), p.slot_mapping, p.index_k_cache);
}

void sample(const OpContext& ctx, const TensorView& logits, const TensorView& params, const TensorView& tokens,
            const TensorView& logprobs, const TensorView& top_ids, const TensorView& top_logprobs) {
  auto& e = ctx.kernels->sample.select(problem(ctx, "sample", logits.dtype, logits.shape[0], logits.shape[1], 0), ctx.stats);
  e.fn(logits, params, tokens, logprobs, top_ids, top_logprobs);
}

namespace {
template <class Fn>
void describe_table(const OpTable<Fn>& table, std::vector<EntryInfo>& out) {
  for (const auto& e : table.entries()) out.push_back({table.op(), e.name, e.condition});
}
}  // namespace

bool KernelTable::remove_entry(const std::string& name) {
  bool found = false;
  for_each_table([&](auto& table) { found = table.remove(name) || found; });
  return found;
}

std::vector<EntryInfo> KernelTable::describe() const {
  std::vector<EntryInfo> out;
  for_each_table([&](const auto& table) { describe_table(table, out); });
  return out;
}

}  // namespace m3::ops
