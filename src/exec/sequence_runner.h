#pragma once
// One sequence through the model with its own host KV pages: the simplest correct runner,
// used by parity tests (goldens) and as the one-at-a-time reference for batched runs.
#include <cstdint>
#include <vector>

#include "model/minimax_m3/model.h"

namespace m3 {

class SequenceRunner {
 public:
  SequenceRunner(const MiniMaxM3Model& model, const ops::OpContext& ctx, int64_t max_tokens);

  // Appends `tokens` at positions [length(), length() + tokens.size()) and returns logits
  // for every new token (all_logits) or only the last one: [rows, vocab].
  std::vector<float> extend(const std::vector<int32_t>& tokens, bool all_logits, ForwardTrace* trace = nullptr);
  int64_t length() const { return length_; }

 private:
  const MiniMaxM3Model& model_;
  ops::OpContext ctx_;
  int block_size_;
  HostKvCache cache_;
  std::vector<int32_t> block_table_;
  int64_t length_ = 0;
};

}  // namespace m3
