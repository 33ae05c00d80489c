#pragma once
// The model's only entry points to computation. Each op builds a Problem, asks its table
// for the first eligible kernel (recorded in DispatchStats), and runs it. Tensors are views;
// whether they are host or device memory is the backend's business.
#include <cstdint>

#include "core/tensor.h"
#include "ops/attention_metadata.h"
#include "ops/communicator.h"
#include "ops/dispatch.h"

namespace m3::ops {

// A GEMM weight [out, in] as the backend holds it: F32/BF16 data, or F8E4M3 data with a
// U8 e8m0 scale [out, in/32] (MXFP8), and optionally each scale row's largest byte, U8 [out]
// (e8m0_row_max): the reference the f16 dequantising kernels scale a row against, which they
// otherwise find by reading the whole scale row before their first step.
struct LinearWeight {
  TensorView data;
  TensorView scale;      // empty unless MXFP8
  TensorView scale_max;  // optional, MXFP8 only
  int64_t out_features() const { return data.shape[0]; }
  int64_t in_features() const { return data.shape[1]; }
  // scale_max absent, or U8 [out].
  bool scale_max_fits() const {
    return !scale_max.data || (scale_max.dtype == DType::kU8 && scale_max.shape.rank() == 1 &&
                               scale_max.shape[0] == out_features());
  }
};

// Experts of one MoE layer. Index num_routed is the shared expert (always chosen, weight 1).
struct ExpertWeights {
  int num_routed = 0;
  bool has_shared = false;
  const LinearWeight* gate = nullptr;  // [num_routed + has_shared] entries each
  const LinearWeight* up = nullptr;
  const LinearWeight* down = nullptr;
};

struct SwigluParams {
  float alpha = 1.702f;
  float limit = 7.0f;
  float beta = 1.0f;  // added to the clamped up projection
};

struct RouterParams {
  int top_k = 4;
  float routed_scale = 2.0f;
  bool use_bias = true;
};

struct IndexerParams {
  int block_size = 128;
  int top_k = 16;  // blocks kept per (query, KV group), local block included
};

// Rows of ids in [first_id, first_id + table rows) are copied, others are zero (a vocab-parallel
// table's slice; the ranks' rows are then summed). A table of I32 [rows, 1] maps ids to ids.
using EmbeddingFn = void (*)(const int32_t* ids, int num_tokens, const TensorView& table, const TensorView& out,
                             int64_t first_id);
using RmsNormFn = void (*)(const TensorView& x, const TensorView& weight, float eps, const TensorView& out);
using RopeFn = void (*)(const TensorView& x, const int32_t* positions, int rotary_dim, double theta);
using LinearFn = void (*)(const TensorView& x, const LinearWeight& w, const TensorView& y);
// count linears over one x, all of one dtype and in_features: y[i] = x w[i]^T.
using LinearGroupFn = void (*)(const TensorView& x, const LinearWeight* const* w, const TensorView* y, int count);
using KvWriteFn = void (*)(const TensorView& src, const int64_t* slot_mapping, const TensorView& cache);
using AttentionFn = void (*)(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                             const AttentionMetadata& meta, const TensorView& selected, int top_k,
                             const TensorView& out);
using IndexerTopkFn = void (*)(const TensorView& index_q, const TensorView& index_k_cache,
                               const AttentionMetadata& meta, const IndexerParams& params,
                               const TensorView& selected);
using RouterFn = void (*)(const TensorView& x, const TensorView& router_w, const TensorView& bias,
                          const RouterParams& params, const TensorView& expert_ids, const TensorView& expert_weights);
using MoeFn = void (*)(const TensorView& x, const TensorView& expert_ids, const TensorView& expert_weights,
                       const ExpertWeights& experts, const SwigluParams& act, const TensorView& out);
using MlpFn = void (*)(const TensorView& x, const LinearWeight& gate, const LinearWeight& up,
                       const LinearWeight& down, const SwigluParams& act, const TensorView& out);
using AddFn = void (*)(const TensorView& x, const TensorView& y);  // x += y
// x += y, then out = rms_norm(x, weight) (x: [rows, dim]; out may not alias y).
using AddRmsNormFn = void (*)(const TensorView& x, const TensorView& y, const TensorView& weight, float eps,
                              const TensorView& out);

// What an attention layer does to its projections before attending, per token: every q and k
// head RMS-normed with its weight and rotated (NeoX, first rotary_dim dims), k and v written to
// their caches; on sparse layers the index q heads and the index key the same, the index key into
// its cache. q, k, index_q and index_k are rewritten in place (F32, contiguous).
struct AttnPrologue {
  TensorView q, k, v;                     // [T, Hq, D], [T, Hkv, D], [T, Hkv, D]
  TensorView q_norm, k_norm;              // [D]
  TensorView k_cache, v_cache;            // [slots, Hkv, D] (F32, BF16 or F8E4M3)
  TensorView index_q, index_k;            // [T, Hi, Di], [T, 1, Di]; empty on dense layers
  TensorView index_q_norm, index_k_norm;  // [Di]
  TensorView index_k_cache;               // [slots, Di]
  const int32_t* positions = nullptr;     // [T]
  const int64_t* slot_mapping = nullptr;  // [T], -1 = not cached
  int rotary_dim = 0;
  double theta = 0.0;
  float eps = 0.0f;
  bool sparse() const { return index_q.data != nullptr; }
};
using AttnPrologueFn = void (*)(const AttnPrologue& p);

// Per-row parameters of on-device sampling (a plain struct: copied to the device as bytes).
struct SampleRowParams {
  float temperature = 0.0f;  // 0 = greedy (argmax, ties to the lower id)
  int32_t top_n = 0;         // top-N logprobs to report, 0..kMaxTopLogprobs
  uint64_t seed = 0;         // with `step`, the key of a counter-based generator: no state
  uint64_t step = 0;         // the request's output index being sampled
};
constexpr int kMaxTopLogprobs = 20;
// logits [rows, vocab] F32; params [rows] SampleRowParams (dtype U8, rows * sizeof bytes);
// tokens [rows] I32; logprobs [rows] F32 (the chosen token under log_softmax(raw logits));
// top_ids [rows, kMaxTopLogprobs] I32 and top_logprobs F32 (first top_n filled, descending,
// ties to the lower id).
using SampleFn = void (*)(const TensorView& logits, const TensorView& params, const TensorView& tokens,
                          const TensorView& logprobs, const TensorView& top_ids, const TensorView& top_logprobs);

// One dispatch entry as documentation and /debug/kernels show it.
struct EntryInfo {
  std::string op, entry, condition;
};

// Every op's table; backends append their entries at start-up (CPU last, as the reference).
struct KernelTable {
  OpTable<EmbeddingFn> embedding{"embedding"};
  OpTable<RmsNormFn> rms_norm{"rms_norm"};
  OpTable<RopeFn> rope{"rope"};
  OpTable<LinearFn> linear{"linear"};
  OpTable<LinearGroupFn> linear_group{"linear_group"};
  OpTable<KvWriteFn> kv_write{"kv_write"};
  OpTable<AttentionFn> attention{"attention"};
  OpTable<IndexerTopkFn> indexer_topk{"indexer_topk"};
  OpTable<RouterFn> router{"moe_router"};
  OpTable<MoeFn> moe{"moe_experts"};
  OpTable<MlpFn> mlp{"dense_mlp"};
  OpTable<AddFn> add{"add"};
  OpTable<AddRmsNormFn> add_rms_norm{"add_rms_norm"};
  OpTable<AttnPrologueFn> attn_prologue{"attn_prologue"};
  OpTable<SampleFn> sample{"sample"};

  // Every entry of every table, in selection order per op.
  std::vector<EntryInfo> describe() const;
  // Removes the named entry from whichever table holds it; false if none does.
  bool remove_entry(const std::string& name);

  // f(table) for every op's table, in the order above.
  template <class F>
  void for_each_table(F&& f) { each_table(*this, f); }
  template <class F>
  void for_each_table(F&& f) const { each_table(*this, f); }

 private:
  template <class Self, class F>
  static void each_table(Self& t, F& f) {
    f(t.embedding), f(t.rms_norm), f(t.rope), f(t.linear), f(t.linear_group), f(t.kv_write), f(t.attention);
    f(t.indexer_topk), f(t.router), f(t.moe), f(t.mlp), f(t.add), f(t.add_rms_norm), f(t.attn_prologue), f(t.sample);
  }
};

struct OpContext {
  const KernelTable* kernels = nullptr;
  DispatchStats* stats = nullptr;
  Device device = Device::kCpu;
  // Results per token independent of batch composition and chunking (so a prefix-cache hit,
  // a chunked prefill and a cold run give bit-identical logits). Costs GEMM efficiency.
  bool batch_invariant = true;
  // The tensor-parallel group (null or size 1: the whole model on this rank).
  Communicator* comm = nullptr;
};

void embedding(const OpContext& ctx, const int32_t* ids, int num_tokens, const TensorView& table, const TensorView& out,
               int64_t first_id = 0);
// x = the sum of x over the tensor-parallel ranks (OpContext::comm); nothing without a group.
void all_reduce(const OpContext& ctx, const TensorView& x);
// out [rows, ranks * cols] = every rank's local [rows, cols] side by side, rank order (OpContext::comm).
void all_gather_cols(const OpContext& ctx, const TensorView& local, const TensorView& out);
// Gemma RMSNorm over the last dim: y = x * rsqrt(mean(x^2) + eps) * (1 + w). x: [rows, dim].
void rms_norm(const OpContext& ctx, const TensorView& x, const TensorView& weight, float eps, const TensorView& out);
// NeoX rotation of the first rotary_dim dims of every head, in place. x: [tokens, heads, head_dim].
void rope(const OpContext& ctx, const TensorView& x, const int32_t* positions, int rotary_dim, double theta);
void linear(const OpContext& ctx, const TensorView& x, const LinearWeight& w, const TensorView& y);
// y[i] = linear(x, w[i]) for i < count (a layer's projections of one input). Each run of
// consecutive weights of one dtype and in_features goes to the first eligible linear_group entry
// (which must give the bits of separate linear calls), else each weight through linear().
void linear_group(const OpContext& ctx, const TensorView& x, const LinearWeight* const* w, const TensorView* y,
                  int count);
// cache[slot_mapping[t]] = src[t]. src: [tokens, ...], cache: [slots, ...] of the same row size.
void kv_write(const OpContext& ctx, const TensorView& src, const int64_t* slot_mapping, const TensorView& cache);
// Causal GQA attention through page tables. `selected` empty = dense; else [kv_heads, tokens, top_k]
// block ids (-1 padded) restricting each KV group's keys (MSA).
void attention(const OpContext& ctx, const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
               const AttentionMetadata& meta, const TensorView& selected, int top_k, const TensorView& out);
// MSA lightning indexer: per (index head = KV group, query) the top-k blocks, local block forced,
// ascending block ids then -1 padding. index_q: [tokens, heads, dim]; selected: [heads, tokens, top_k].
void indexer_topk(const OpContext& ctx, const TensorView& index_q, const TensorView& index_k_cache,
                  const AttentionMetadata& meta, const IndexerParams& params, const TensorView& selected);
// Sigmoid router with selection-only bias; weights renormalised and scaled. ids/weights: [tokens, top_k].
void moe_router(const OpContext& ctx, const TensorView& x, const TensorView& router_w, const TensorView& bias,
                const RouterParams& params, const TensorView& expert_ids, const TensorView& expert_weights);
// Routed experts plus the shared expert (index num_routed, weight 1), SwiGLU-OAI.
void moe_experts(const OpContext& ctx, const TensorView& x, const TensorView& expert_ids,
                 const TensorView& expert_weights, const ExpertWeights& experts, const SwigluParams& act,
                 const TensorView& out);
void dense_mlp(const OpContext& ctx, const TensorView& x, const LinearWeight& gate, const LinearWeight& up,
               const LinearWeight& down, const SwigluParams& act, const TensorView& out);
void add(const OpContext& ctx, const TensorView& x, const TensorView& y);
// x += y; out = rms_norm(x). One entry when a backend fuses them (the bits of add then rms_norm),
// else those two ops.
void add_rms_norm(const OpContext& ctx, const TensorView& x, const TensorView& y, const TensorView& weight, float eps,
                  const TensorView& out);
// The per-token attention prologue (AttnPrologue). One entry when a backend fuses it (the bits of
// the separate ops), else rms_norm, rope and kv_write in the order the model would call them.
void attn_prologue(const OpContext& ctx, const AttnPrologue& p);
// Greedy or temperature sampling per row without leaving the device (Gumbel-max over a
// counter-based generator keyed by (seed, step, token id)), plus log-softmax logprobs.
// Penalties, top-k/top-p/min-p are the host Sampler's; the engine routes such rows there.
void sample(const OpContext& ctx, const TensorView& logits, const TensorView& params, const TensorView& tokens,
            const TensorView& logprobs, const TensorView& top_ids, const TensorView& top_logprobs);

// SwiGLU-OAI on one element pair; shared by every backend's reference and tests.
inline float swiglu_oai(float gate, float up, const SwigluParams& p);

}  // namespace m3::ops

#include <algorithm>
#include <cmath>
namespace m3::ops {
inline float swiglu_oai(float gate, float up, const SwigluParams& p) {
  const float g = std::min(gate, p.limit);
  const float u = std::clamp(up, -p.limit, p.limit);
  return (u + p.beta) * g * (1.0f / (1.0f + std::exp(-p.alpha * g)));
}
}  // namespace m3::ops
