#pragma once
// One sequence through the model with its own KV pages in the model's runtime memory (host
// or device): the simplest correct runner, used by parity tests (goldens, CPU and GPU) and
// as the one-at-a-time reference for batched runs.
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "model/minimax_m3/model.h"

namespace m3 {

class SequenceRunner {
 public:
  // index_dtype: the index-key cache's element type (unset: kv_dtype).
  SequenceRunner(const MiniMaxM3Model& model, const ops::OpContext& ctx, int64_t max_tokens,
                 DType kv_dtype = DType::kF32, std::optional<DType> index_dtype = std::nullopt);

  // Appends `tokens` at positions [length(), length() + tokens.size()) and returns logits
  // for every new token (all_logits) or only the last one: [rows, vocab] (host).
  std::vector<float> extend(const std::vector<int32_t>& tokens, bool all_logits, ForwardTrace* trace = nullptr,
                            const ForwardHooks* hooks = nullptr);
  int64_t length() const { return length_; }
  // Drops tokens from the end (length <= length()); their KV stays in the pages, as a rejected
  // speculative draft's does, until the next extend overwrites it.
  void truncate(int64_t length);

 private:
  const MiniMaxM3Model& model_;
  ops::BackendRuntime* rt_;
  ops::OpContext ctx_;
  int block_size_;
  int64_t max_tokens_;
  BackendKvCache cache_;
  std::vector<int32_t> block_table_;
  ops::DeviceBuffer d_table_;
  int64_t length_ = 0;
};

}  // namespace m3
