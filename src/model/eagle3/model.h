#pragma once
// An EAGLE-3 draft model (Eagle3Config) over the ops:: layer: one Llama decoder layer fed by
// the target's captured hidden states, its own one-layer KV cache through the target's page
// tables, and the target's embedding and LM head where the draft ships none. Under tensor
// parallelism the draft's heads and MLP width split over the ranks like the target's (two
// all-reduces per pass) where they divide, else every rank runs the whole draft; fc, norms and
// the draft's own head stay whole, a shared embedding / LM head is the rank's vocabulary slice.
#include <cstdint>
#include <memory>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"
#include "loader/model_dir.h"
#include "model/eagle3/config.h"
#include "model/minimax_m3/model.h"
#include "ops/ops.h"
#include "ops/runtime.h"

namespace m3 {

// The draft layer's K and V, [blocks * block_size, kv_heads, head_dim] each. Block ids are the
// target's (the scheduler's), plus `scratch_blocks` past them for chained draft tokens whose
// page the target has not allocated yet.
struct Eagle3KvCache {
  ops::DeviceBuffer k, v;
  DType dtype = DType::kF32;
  int block_size = 0;
  int64_t num_blocks = 0;  // scratch included
  static int64_t bytes_per_block(const Eagle3Config& c, int block_size, DType dtype);
  static Eagle3KvCache allocate(ops::BackendRuntime* rt, const Eagle3Config& c, int64_t num_blocks, int block_size,
                                DType dtype);
  // The host KV tier: block `block`'s K then V to / from `host` (bytes_per_block bytes), queued.
  void save_block(ops::BackendRuntime* rt, int64_t block, void* host) const;
  void load_block(ops::BackendRuntime* rt, int64_t block, const void* host) const;
  // The copies between block `block` and the same page in backend memory (BackendKvCache::page_pieces).
  void page_pieces(int64_t block, char* page, bool to_page, std::vector<ops::BackendRuntime::CopyPiece>& out) const;
};

struct Eagle3Workspace {
  int64_t max_tokens = 0, max_rows = 0;
  ops::DeviceBuffer e, h, xe, xh, res, q, q2, k, k2, v, v2, o, x, y, rows, normed, logits, logits_local;
  std::vector<ops::DeviceBuffer> aux;  // the target's captured hidden states, one [T, Ht] per aux layer
};

struct Eagle3Batch {
  const int32_t* token_ids = nullptr;  // [num_tokens] runtime memory
  ops::AttentionMetadata meta;
  // Where each token's hidden input comes from: the target's captures (ws.aux, true) or rows of
  // the previous pass's pre-norm output (`hidden_rows` [num_tokens]: rows of ws.res).
  bool from_target = true;
  const int32_t* hidden_rows = nullptr;
  const int32_t* logits_rows = nullptr;  // [num_logits_rows] runtime memory
  int64_t num_logits_rows = 0;
};

class Eagle3Model {
 public:
  // Reads the draft checkpoint in `dir` for `target` (which must outlive it). Linear weights in
  // options.linear_format (kNative means BF16 here: drafts ship BF16); options.tp_size / tp_rank: this
  // rank's share (Eagle3Config::shard).
  static Result<std::unique_ptr<Eagle3Model>> load(const ModelDir& dir, const MiniMaxM3Model& target,
                                                   const LoadOptions& options);

  const Eagle3Config& config() const { return config_; }
  size_t weight_bytes() const { return weight_bytes_; }
  bool shares_embedding() const { return embed_.data == nullptr; }
  bool shares_lm_head() const { return head_.data.data == nullptr; }
  std::unique_ptr<Eagle3Workspace> make_workspace(int64_t max_tokens, int64_t max_rows) const;

  // One draft pass: writes the tokens' K/V, leaves their pre-norm outputs in ws.res and the
  // logits of the requested rows in ws.logits [rows, draft_vocab_size]. Issues work only.
  void forward(const ops::OpContext& ctx, const Eagle3Batch& batch, const Eagle3KvCache& cache,
               Eagle3Workspace& ws) const;
  // A draft-vocabulary id as a target id (d2t offsets; identity without them).
  int32_t target_id(int32_t draft_id) const {
    return d2t_.empty() ? draft_id : int32_t(draft_id + d2t_[size_t(draft_id)]);
  }
  // The same map in runtime memory, I32 [draft_vocab_size, 1] (an id-map table for ops::embedding):
  // a chained pass turns the previous pass's draft ids into its input tokens without the host.
  const TensorView& target_ids() const { return target_ids_; }

 private:
  Eagle3Config config_;
  const MiniMaxM3Model* target_ = nullptr;
  ops::BackendRuntime* runtime_ = nullptr;
  std::vector<ops::DeviceBuffer> storage_;
  size_t weight_bytes_ = 0;
  std::vector<ops::LinearWeight> fc_;  // fc's column block per aux layer: [hidden, target_hidden]
  // Norms as Gemma deltas (w - 1: the ops' rms_norm scales by 1 + w).
  TensorView input_norm_, hidden_norm_, post_norm_, final_norm_, embed_;
  // q/k/v split by input half: *_e read the embedding's half, *_h the hidden's.
  ops::LinearWeight q_e_, k_e_, v_e_, q_h_, k_h_, v_h_, o_, gate_, up_, down_, head_;
  std::vector<int64_t> d2t_;
  TensorView target_ids_;
};

}  // namespace m3
