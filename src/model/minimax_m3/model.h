#pragma once
// The MiniMax-M3 text model: weights and the forward pass over a ragged batch. Calls ops::
// only (never a backend), reads and writes KV through page tables in AttentionMetadata.
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"
#include "loader/model_dir.h"
#include "model/minimax_m3/config.h"
#include "ops/ops.h"

namespace m3 {

// Per-layer cache tensors (backend memory). k/v: [slots, kv_heads, head_dim];
// index_k: [slots, index_head_dim] on sparse layers (empty view on dense ones).
struct KvCacheTensors {
  std::vector<TensorView> k, v, index_k;
  int block_size = 0;
  int64_t num_slots() const { return k.empty() ? 0 : k[0].shape[0]; }
};

// Host storage for KvCacheTensors (the CPU backend's cache).
struct HostKvCache {
  std::vector<HostTensor> k, v, index_k;
  int block_size = 0;
  KvCacheTensors views() const;
  static HostKvCache allocate(const MiniMaxM3Config& config, int64_t num_blocks, int block_size);
};

struct ForwardBatch {
  const int32_t* token_ids = nullptr;  // [num_tokens]
  ops::AttentionMetadata meta;         // num_tokens, positions, page tables, slot mapping
  std::vector<int32_t> logits_rows;    // which batch rows produce logits (in this order)
};

// Optional capture of the model's discrete decisions, for parity with the HF oracle.
struct ForwardTrace {
  std::vector<std::vector<int32_t>> selected_blocks;  // per sparse layer: [kv_groups, tokens, top_k]
  std::vector<std::vector<int32_t>> expert_ids;       // per MoE layer: [tokens, experts_per_tok]
};

struct LoadProgress {
  std::function<void(size_t done_bytes, size_t total_bytes)> on_progress;
};

class MiniMaxM3Model {
 public:
  // Loads every text weight, dequantised to F32 host tensors (the CPU reference's format).
  static Result<std::unique_ptr<MiniMaxM3Model>> load(const ModelDir& dir, const LoadProgress& progress = {});
  static Result<std::unique_ptr<MiniMaxM3Model>> load(const std::string& model_dir, const LoadProgress& progress = {});

  const MiniMaxM3Config& config() const { return config_; }

  // logits: [batch.logits_rows.size(), vocab] floats (host).
  void forward(const ops::OpContext& ctx, const ForwardBatch& batch, const KvCacheTensors& cache, float* logits,
               ForwardTrace* trace = nullptr) const;

 private:
  struct Layer {
    HostTensor input_norm, post_norm, q_norm, k_norm;
    ops::LinearWeight q_proj, k_proj, v_proj, o_proj;
    // MSA indexer (sparse layers)
    HostTensor index_q_norm, index_k_norm;
    ops::LinearWeight index_q_proj, index_k_proj;
    // Dense MLP
    ops::LinearWeight mlp_gate, mlp_up, mlp_down;
    // MoE: router (fp32), bias, experts + shared expert as the last entry
    HostTensor router, router_bias;
    std::vector<ops::LinearWeight> expert_gate, expert_up, expert_down;
  };
  MiniMaxM3Config config_;
  std::vector<HostTensor> storage_;  // owns every linear weight's bytes
  HostTensor embed_, final_norm_;
  ops::LinearWeight lm_head_;
  std::vector<Layer> layers_;
};

}  // namespace m3
