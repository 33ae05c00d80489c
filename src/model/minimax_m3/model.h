#pragma once
// The MiniMax-M3 text model: weights and the forward pass over a ragged batch. Calls ops::
// only (never a backend), reads and writes KV through page tables in AttentionMetadata.
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"
#include "loader/model_dir.h"
#include "model/minimax_m3/config.h"
#include "ops/ops.h"
#include "ops/runtime.h"

namespace m3 {

// Per-layer cache tensors (backend memory). k/v: [slots, kv_heads, head_dim];
// index_k: [slots, index_head_dim] on sparse layers (empty view on dense ones).
struct KvCacheTensors {
  std::vector<TensorView> k, v, index_k;
  int block_size = 0;
  int64_t num_slots() const { return k.empty() ? 0 : k[0].shape[0]; }
};

// KV cache tensors in a backend's memory (the layout KvCacheTensors describes): K and V of
// `dtype` (F32 or BF16), index keys of `index_dtype` (F32, BF16 or F8E4M3; unset: `dtype`).
struct BackendKvCache {
  std::vector<ops::DeviceBuffer> k, v, index_k;
  int block_size = 0;
  DType dtype = DType::kF32;
  DType index_dtype = DType::kF32;
  KvCacheTensors views(Device device) const;
  // Bytes one block (page) takes over all layers.
  static int64_t bytes_per_block(const MiniMaxM3Config& config, int block_size, DType dtype = DType::kF32,
                                 std::optional<DType> index_dtype = std::nullopt);
  static BackendKvCache allocate(ops::BackendRuntime* runtime, const MiniMaxM3Config& config, int64_t num_blocks,
                                 int block_size, DType dtype = DType::kF32, std::optional<DType> index_dtype = std::nullopt);
  // Block `block` of every layer's K, V and index keys copied to / from `host` (bytes_per_block
  // bytes: K, V, index-K of layer 0, then layer 1, ...) through the runtime (the host KV tier).
  // Both only queue the copies (stream order); `host` must be the runtime's pinned memory.
  void save_block(ops::BackendRuntime* rt, int64_t block, void* host) const;
  void load_block(ops::BackendRuntime* rt, int64_t block, const void* host) const;
  // The same page (same layout) in backend memory (a KV transfer's device slot, or another
  // process's mapped into this one): the copies between it and block `block` (`to_page`: from the
  // block), appended to `out` for one BackendRuntime::copy_batch over many blocks.
  void page_pieces(int64_t block, char* page, bool to_page, std::vector<ops::BackendRuntime::CopyPiece>& out) const;
  // KV transfers between tensor-parallel sizes: copies into `dst` (a page of `config`'s layers
  // holding the global KV heads [dst_first, dst_first + dst_heads)) the heads it shares with `src`
  // (a page holding [src_first, src_first + src_heads)), and the index keys (one shared head,
  // the same on every rank). `config` gives the layers, head dims and index layers.
  static void copy_page_heads(const MiniMaxM3Config& config, int block_size, DType dtype, DType index_dtype,
                              const char* src, int src_first, int src_heads, char* dst, int dst_first, int dst_heads);
  // The same copies as pieces for BackendRuntime::copy_batch: into block `block` of this cache
  // (the KV heads `config` gives this rank) from a page in backend memory holding the global heads
  // [src_first, src_first + src_heads).
  void block_head_pieces(const MiniMaxM3Config& config, int64_t block, const char* src, int src_first, int src_heads,
                         std::vector<ops::BackendRuntime::CopyPiece>& out) const;
  int64_t num_blocks = 0;

 private:
  // fn(device address, offset in the host copy, bytes) for each tensor's piece of `block`.
  template <typename Fn>
  void for_each_block_piece(int64_t block, Fn&& fn) const;
  std::vector<TensorView> k_views_, v_views_, index_k_views_;
};

// All pointers live in the memory of the runtime the model was loaded into.
struct ForwardBatch {
  const int32_t* token_ids = nullptr;  // [num_tokens]
  ops::AttentionMetadata meta;         // num_tokens, positions, page tables, slot mapping
  std::vector<int32_t> logits_rows;    // which batch rows produce logits (in this order; host copy)
  const int32_t* logits_rows_ptr = nullptr;  // the same rows in runtime memory (null: logits_rows.data())
  // EAGLE-3 draft inputs: the residual stream entering layer captures[i].first ([num_tokens,
  // hidden] F32) is copied to captures[i].second (runtime memory) as the forward passes it.
  std::vector<std::pair<int, void*>> captures;
};

// Activations of one forward pass, allocated once for the largest batch (CUDA graphs need
// their addresses fixed). Logits [max_logit_rows, vocab] stay in runtime memory.
struct ForwardWorkspace {
  int64_t max_tokens = 0, max_logit_rows = 0;
  ops::DeviceBuffer h, x, y, q, k, v, o, iq, ik, selected, expert_ids, expert_weights, rows, normed, logits;
  ops::DeviceBuffer logits_local;  // tensor parallel: this rank's vocabulary slice, before the gather
  TensorView logits_view(int64_t rows, int64_t vocab) const { return logits.view(DType::kF32, {rows, vocab}); }
};

// How linear weights are held in backend memory. kF32: the CPU reference (dequantised);
// kBF16: BF16 (exact for BF16 and MXFP8 checkpoints); kNative: MXFP8 stays fp8 + e8m0
// scales (the kernels dequantise in registers), everything else BF16.
enum class LinearFormat { kF32, kBF16, kNative };

struct LoadOptions {
  ops::BackendRuntime* runtime = nullptr;  // null: host memory
  LinearFormat linear_format = LinearFormat::kF32;
  // The MoE experts' projections; unset: as linear_format. The MXFP8 MoE kernels read native
  // experts in both of their paths, so the engine keeps them native where dense linears go BF16.
  std::optional<LinearFormat> expert_format;
  // Tensor parallelism: load rank tp_rank's share of tp_size (MiniMaxM3Config::shard); the
  // forward then sums row-parallel outputs through OpContext::comm.
  int tp_size = 1, tp_rank = 0;
};

// What the engine loads: F32 on the CPU. On a GPU, MXFP8 stays native under batch invariance
// (the row-dot linears read it); without invariance dense linears go BF16 (cuBLAS), while the
// MoE experts stay native for the MXFP8 MoE kernels (W8A16, and W8A8 from 256 tokens), unless
// `dequantize_mxfp8` asks for BF16 everywhere.
LoadOptions engine_load_options(ops::BackendRuntime* runtime, bool cpu, bool dequantize_mxfp8, bool batch_invariant);

// Optional capture of the model's discrete decisions, for parity with the HF oracle.
struct ForwardTrace {
  std::vector<std::vector<int32_t>> selected_blocks;  // per sparse layer: [kv_groups, tokens, top_k]
  std::vector<std::vector<int32_t>> expert_ids;       // per MoE layer: [tokens, experts_per_tok]
};

// Called after the embedding (-1), after each layer l (l), and after the LM head (layers + 1),
// for per-layer timing; it may only queue work (it can run inside graph capture).
struct ForwardHooks {
  std::function<void(int layer)> after_layer;
  // Each op's output within a layer (`op`: "attn_in", "q", ..., "residual"; rows = tokens first;
  // layer = num_hidden_layers for "logits"), for per-op parity between two batch shapes
  // (tools/invariance_probe). Null in serving.
  std::function<void(int layer, const char* op, const TensorView& value)> on_activation;
};

struct LoadProgress {
  std::function<void(size_t done_bytes, size_t total_bytes)> on_progress;
};

class MiniMaxM3Model {
 public:
  // Loads every text weight, dequantised to F32 host tensors (the CPU reference's format).
  static Result<std::unique_ptr<MiniMaxM3Model>> load(const ModelDir& dir, const LoadProgress& progress = {});
  static Result<std::unique_ptr<MiniMaxM3Model>> load(const std::string& model_dir, const LoadProgress& progress = {});
  static Result<std::unique_ptr<MiniMaxM3Model>> load(const ModelDir& dir, const LoadProgress& progress,
                                                      const LoadOptions& options);

  const MiniMaxM3Config& config() const { return config_; }
  // Index sharing across layers (MiniMaxM3Config::msa_index_reuse); set before caches are made.
  void set_msa_index_reuse(int n) { config_.msa_index_reuse = n < 1 ? 1 : n; }

  ops::BackendRuntime* runtime() const { return runtime_; }
  // Bytes of weights in backend memory, per layer and in all.
  size_t weight_bytes() const { return weight_bytes_; }
  const std::vector<size_t>& layer_weight_bytes() const { return layer_weight_bytes_; }
  // Per MoE layer: bytes of one routed expert (gate + up + down, with scales); 0 elsewhere.
  const std::vector<size_t>& routed_expert_bytes() const { return routed_expert_bytes_; }

  std::unique_ptr<ForwardWorkspace> make_workspace(int64_t max_tokens, int64_t max_logit_rows) const;

  // The forward pass in the runtime's memory; logits land in ws.logits [logits_rows, vocab].
  // Issues work only (no host synchronisation unless `trace` is set), so it can be recorded.
  void forward(const ops::OpContext& ctx, const ForwardBatch& batch, const KvCacheTensors& cache,
               ForwardWorkspace& ws, ForwardTrace* trace = nullptr, const ForwardHooks* hooks = nullptr) const;

  // The final norm and LM head again, on other rows of the last forward's final hidden states
  // (ws.h, [num_tokens, hidden]): logits [R, vocab] into ws.logits, R <= ws.max_logit_rows; `rows`
  // in the runtime's memory. The same bits the forward gives those rows (prompt logprobs).
  void logits_of_rows(const ops::OpContext& ctx, const int32_t* rows, int64_t R, int64_t num_tokens,
                      ForwardWorkspace& ws) const;

  // The embedding of `n` token ids (runtime memory) into out [n, hidden]; under tensor
  // parallelism each rank's vocabulary slice, summed over the ranks.
  void embed(const ops::OpContext& ctx, const int32_t* ids, int64_t n, const TensorView& out) const;
  // The LM head on normed hidden states [R, hidden] into logits [R, vocab]; under tensor
  // parallelism each rank's columns into `local` ([R, lm_head_rows()] F32) and then gathered.
  void vocab_logits(const ops::OpContext& ctx, const TensorView& normed, const TensorView& logits, void* local) const;
  int64_t lm_head_rows() const { return lm_head_.out_features(); }

  // Host convenience (host runtime only): logits [batch.logits_rows.size(), vocab] into `logits`.
  void forward(const ops::OpContext& ctx, const ForwardBatch& batch, const KvCacheTensors& cache, float* logits,
               ForwardTrace* trace = nullptr) const;

 private:
  struct Layer {
    TensorView input_norm, post_norm, q_norm, k_norm;
    ops::LinearWeight q_proj, k_proj, v_proj, o_proj;
    // MSA indexer (sparse layers)
    TensorView index_q_norm, index_k_norm;
    ops::LinearWeight index_q_proj, index_k_proj;
    // Dense MLP
    ops::LinearWeight mlp_gate, mlp_up, mlp_down;
    // MoE: router (fp32), bias, experts + shared expert as the last entry
    TensorView router, router_bias;
    std::vector<ops::LinearWeight> expert_gate, expert_up, expert_down;
  };
  MiniMaxM3Config config_;
  ops::BackendRuntime* runtime_ = nullptr;
  std::vector<ops::DeviceBuffer> storage_;  // owns every weight's bytes
  size_t weight_bytes_ = 0;
  std::vector<size_t> layer_weight_bytes_;
  std::vector<size_t> routed_expert_bytes_;
  TensorView embed_, final_norm_;
  ops::LinearWeight lm_head_;
  std::vector<Layer> layers_;
};

}  // namespace m3
