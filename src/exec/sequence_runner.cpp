#include "exec/sequence_runner.h"

#include <numeric>
#include <stdexcept>

namespace m3 {

SequenceRunner::SequenceRunner(const MiniMaxM3Model& model, const ops::OpContext& ctx, int64_t max_tokens)
    : model_(model), ctx_(ctx), block_size_(model.config().index_block_size) {
  const int64_t blocks = (max_tokens + block_size_ - 1) / block_size_;
  cache_ = HostKvCache::allocate(model.config(), blocks, block_size_);
  // Pages in reverse order: a wrong page-table read shows up as a parity failure.
  block_table_.resize(size_t(blocks));
  std::iota(block_table_.rbegin(), block_table_.rend(), 0);
}

std::vector<float> SequenceRunner::extend(const std::vector<int32_t>& tokens, bool all_logits, ForwardTrace* trace) {
  const int num = int(tokens.size());
  if (length_ + num > int64_t(block_table_.size()) * block_size_) {
    throw std::runtime_error("SequenceRunner: sequence exceeds its KV capacity");
  }
  std::vector<int32_t> positions(static_cast<size_t>(num)), query_start = {0, num};
  std::vector<int32_t> seq_lens = {int32_t(length_ + num)};
  std::vector<int64_t> slots(static_cast<size_t>(num));
  ForwardBatch batch;
  batch.token_ids = tokens.data();
  auto& m = batch.meta;
  m.num_seqs = 1;
  m.num_tokens = num;
  m.query_start = query_start.data();
  m.positions = positions.data();
  m.seq_lens = seq_lens.data();
  m.block_tables = block_table_.data();
  m.max_blocks_per_seq = int(block_table_.size());
  m.block_size = block_size_;
  for (int i = 0; i < num; ++i) {
    positions[size_t(i)] = int32_t(length_ + i);
    slots[size_t(i)] = m.slot_of(0, length_ + i);
  }
  m.slot_mapping = slots.data();
  if (all_logits) {
    batch.logits_rows.resize(size_t(num));
    std::iota(batch.logits_rows.begin(), batch.logits_rows.end(), 0);
  } else {
    batch.logits_rows = {num - 1};
  }
  std::vector<float> logits(batch.logits_rows.size() * size_t(model_.config().vocab_size));
  model_.forward(ctx_, batch, cache_.views(), logits.data(), trace);
  length_ += num;
  return logits;
}

}  // namespace m3
