#include "exec/sequence_runner.h"

#include <numeric>
#include <stdexcept>

namespace m3 {

SequenceRunner::SequenceRunner(const MiniMaxM3Model& model, const ops::OpContext& ctx, int64_t max_tokens,
                               DType kv_dtype, std::optional<DType> index_dtype)
    : model_(model), rt_(model.runtime()), ctx_(ctx), block_size_(model.config().index_block_size) {
  const int64_t blocks = (max_tokens + block_size_ - 1) / block_size_;
  max_tokens_ = blocks * block_size_;
  cache_ = BackendKvCache::allocate(rt_, model.config(), blocks, block_size_, kv_dtype, index_dtype);
  // Pages in reverse order: a wrong page-table read shows up as a parity failure.
  block_table_.resize(size_t(blocks));
  std::iota(block_table_.rbegin(), block_table_.rend(), 0);
  d_table_ = ops::DeviceBuffer(rt_, block_table_.size() * 4);
  rt_->upload(d_table_.data(), block_table_.data(), block_table_.size() * 4);
  rt_->synchronize();
}

std::vector<float> SequenceRunner::extend(const std::vector<int32_t>& tokens, bool all_logits, ForwardTrace* trace,
                                          const ForwardHooks* hooks) {
  const int num = int(tokens.size());
  if (length_ + num > max_tokens_) throw std::runtime_error("SequenceRunner: sequence exceeds its KV capacity");
  std::vector<int32_t> positions(static_cast<size_t>(num)), query_start = {0, num};
  std::vector<int32_t> seq_lens = {int32_t(length_ + num)};
  std::vector<int64_t> slots(static_cast<size_t>(num));
  ops::AttentionMetadata host_meta;
  host_meta.block_tables = block_table_.data();
  host_meta.max_blocks_per_seq = int(block_table_.size());
  host_meta.block_size = block_size_;
  for (int i = 0; i < num; ++i) {
    positions[size_t(i)] = int32_t(length_ + i);
    slots[size_t(i)] = host_meta.slot_of(0, length_ + i);
  }
  ForwardBatch batch;
  if (all_logits) {
    batch.logits_rows.resize(size_t(num));
    std::iota(batch.logits_rows.begin(), batch.logits_rows.end(), 0);
  } else {
    batch.logits_rows = {num - 1};
  }
  // Inputs into the runtime's memory (a plain copy on the host).
  const size_t n = size_t(num);
  ops::DeviceBuffer d_tokens(rt_, n * 4), d_pos(rt_, n * 4), d_slots(rt_, n * 8), d_qs(rt_, 8), d_lens(rt_, 4),
      d_rows(rt_, batch.logits_rows.size() * 4);
  rt_->upload(d_tokens.data(), tokens.data(), n * 4);
  rt_->upload(d_pos.data(), positions.data(), n * 4);
  rt_->upload(d_slots.data(), slots.data(), n * 8);
  rt_->upload(d_qs.data(), query_start.data(), 8);
  rt_->upload(d_lens.data(), seq_lens.data(), 4);
  rt_->upload(d_rows.data(), batch.logits_rows.data(), batch.logits_rows.size() * 4);
  batch.token_ids = d_tokens.as<int32_t>();
  batch.logits_rows_ptr = d_rows.as<int32_t>();
  auto& m = batch.meta;
  m.num_seqs = 1;
  m.num_tokens = num;
  m.query_start = d_qs.as<int32_t>();
  m.positions = d_pos.as<int32_t>();
  m.seq_lens = d_lens.as<int32_t>();
  m.block_tables = d_table_.as<int32_t>();
  m.max_blocks_per_seq = int(block_table_.size());
  m.block_size = block_size_;
  m.slot_mapping = d_slots.as<int64_t>();
  auto ws = model_.make_workspace(num, int64_t(batch.logits_rows.size()));
  model_.forward(ctx_, batch, cache_.views(rt_->device()), *ws, trace, hooks);
  std::vector<float> logits(batch.logits_rows.size() * size_t(model_.config().vocab_size));
  rt_->download(logits.data(), ws->logits.data(), logits.size() * 4);
  length_ += num;
  return logits;
}

void SequenceRunner::truncate(int64_t length) {
  if (length < 0 || length > length_) throw std::runtime_error("SequenceRunner: truncate past the sequence's length");
  length_ = length;
}

}  // namespace m3
