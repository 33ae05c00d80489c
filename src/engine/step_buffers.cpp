#include "engine/step_buffers.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

namespace m3 {

StepBuffers::StepBuffers(ops::BackendRuntime* rt, int max_tokens, int max_seqs, int max_rows, int max_blocks_per_seq)
    : rt_(rt),
      max_tokens_(max_tokens),
      max_seqs_(max_seqs),
      max_rows_(std::max(max_seqs, max_rows)),
      max_blocks_(std::max(1, max_blocks_per_seq)) {
  const size_t T = size_t(max_tokens), S = size_t(max_seqs), R = size_t(max_rows_), K = size_t(ops::kMaxTopLogprobs);
  auto pair = [rt](ops::HostStaging& h, ops::DeviceBuffer& d, size_t bytes) {
    h = ops::HostStaging(rt, bytes);
    d = ops::DeviceBuffer(rt, bytes);
  };
  pair(h_tokens_, d_tokens_, T * 4);
  pair(h_positions_, d_positions_, T * 4);
  pair(h_slots_, d_slots_, T * 8);
  pair(h_query_start_, d_query_start_, (S + 1) * 4);
  pair(h_seq_lens_, d_seq_lens_, S * 4);
  pair(h_tables_, d_tables_, S * size_t(max_blocks_) * 4);
  pair(h_logits_rows_, d_logits_rows_, R * 4);
  pair(h_params_, d_params_, R * sizeof(ops::SampleRowParams));
  pair(h_out_tokens_, d_out_tokens_, R * 4);
  pair(h_out_logprobs_, d_out_logprobs_, R * 4);
  pair(h_top_ids_, d_top_ids_, R * K * 4);
  pair(h_top_logprobs_, d_top_logprobs_, R * K * 4);
}

void StepBuffers::begin() {
  num_tokens_ = num_seqs_ = num_rows_ = 0;
  h_query_start_.as<int32_t>()[0] = 0;
}

void StepBuffers::add_sequence(const std::vector<int32_t>& tokens, int32_t start_pos,
                               const std::vector<int32_t>& block_table, int block_size) {
  const int n = int(tokens.size());
  if (num_seqs_ >= max_seqs_ || num_tokens_ + n > max_tokens_) {
    throw std::runtime_error("step exceeds its buffers: " + std::to_string(num_seqs_ + 1) + " sequences / " +
                             std::to_string(num_tokens_ + n) + " tokens, capacity " + std::to_string(max_seqs_) +
                             " / " + std::to_string(max_tokens_));
  }
  if (int(block_table.size()) > max_blocks_) {
    throw std::runtime_error("page table of " + std::to_string(block_table.size()) + " blocks exceeds " +
                             std::to_string(max_blocks_) + " (max_model_len)");
  }
  int32_t* table = h_tables_.as<int32_t>() + size_t(num_seqs_) * size_t(max_blocks_);
  std::copy(block_table.begin(), block_table.end(), table);
  for (int i = 0; i < n; ++i) {
    const int32_t pos = start_pos + i;
    h_tokens_.as<int32_t>()[num_tokens_ + i] = tokens[size_t(i)];
    h_positions_.as<int32_t>()[num_tokens_ + i] = pos;
    h_slots_.as<int64_t>()[num_tokens_ + i] = int64_t(table[pos / block_size]) * block_size + pos % block_size;
  }
  num_tokens_ += n;
  h_seq_lens_.as<int32_t>()[num_seqs_] = start_pos + n;
  ++num_seqs_;
  h_query_start_.as<int32_t>()[num_seqs_] = num_tokens_;
}

void StepBuffers::add_padding_sequence(int tokens) {
  if (num_seqs_ >= max_seqs_ || num_tokens_ + tokens > max_tokens_) throw std::runtime_error("padding exceeds the step buffers");
  h_tables_.as<int32_t>()[size_t(num_seqs_) * size_t(max_blocks_)] = 0;
  for (int i = 0; i < tokens; ++i) {
    h_tokens_.as<int32_t>()[num_tokens_] = 0;
    h_positions_.as<int32_t>()[num_tokens_] = i;
    h_slots_.as<int64_t>()[num_tokens_] = -1;
    ++num_tokens_;
  }
  h_seq_lens_.as<int32_t>()[num_seqs_] = tokens;
  ++num_seqs_;
  h_query_start_.as<int32_t>()[num_seqs_] = num_tokens_;
}

void StepBuffers::set_logits_rows(const std::vector<int32_t>& rows) {
  if (int(rows.size()) > max_rows_) throw std::runtime_error("more logits rows than the step buffers hold");
  std::copy(rows.begin(), rows.end(), h_logits_rows_.as<int32_t>());
  num_rows_ = int(rows.size());
}

const int32_t* StepBuffers::upload_rows(const std::vector<int32_t>& rows) {
  set_logits_rows(rows);
  rt_->upload(d_logits_rows_.data(), h_logits_rows_.as<void>(), size_t(num_rows_) * 4);
  return device_logits_rows();
}

void StepBuffers::upload() {
  const size_t T = size_t(num_tokens_), S = size_t(num_seqs_);
  rt_->upload(d_tokens_.data(), h_tokens_.as<void>(), T * 4);
  rt_->upload(d_positions_.data(), h_positions_.as<void>(), T * 4);
  rt_->upload(d_slots_.data(), h_slots_.as<void>(), T * 8);
  rt_->upload(d_query_start_.data(), h_query_start_.as<void>(), (S + 1) * 4);
  rt_->upload(d_seq_lens_.data(), h_seq_lens_.as<void>(), S * 4);
  rt_->upload(d_tables_.data(), h_tables_.as<void>(), S * size_t(max_blocks_) * 4);
  rt_->upload(d_logits_rows_.data(), h_logits_rows_.as<void>(), size_t(num_rows_) * 4);
}

ops::AttentionMetadata StepBuffers::metadata(int block_size) const {
  ops::AttentionMetadata m;
  m.num_seqs = num_seqs_;
  m.num_tokens = num_tokens_;
  m.query_start = d_query_start_.as<int32_t>();
  m.positions = d_positions_.as<int32_t>();
  m.seq_lens = d_seq_lens_.as<int32_t>();
  m.block_tables = d_tables_.as<int32_t>();
  m.max_blocks_per_seq = max_blocks_;
  m.block_size = block_size;
  m.slot_mapping = d_slots_.as<int64_t>();
  return m;
}

void StepBuffers::sample(const ops::OpContext& ctx, const TensorView& logits,
                         const std::vector<ops::SampleRowParams>& params, bool with_logprobs) {
  const int64_t rows = logits.shape[0];
  if (rows > max_rows_ || int64_t(params.size()) != rows) throw std::runtime_error("sample: rows do not match params");
  std::memcpy(h_params_.as<void>(), params.data(), params.size() * sizeof(ops::SampleRowParams));
  rt_->upload(d_params_.data(), h_params_.as<void>(), params.size() * sizeof(ops::SampleRowParams));
  const Device dev = rt_->device();
  const int64_t K = ops::kMaxTopLogprobs;
  ops::sample(ctx, logits,
              TensorView{d_params_.data(), DType::kU8, {rows * int64_t(sizeof(ops::SampleRowParams))}, dev},
              TensorView{d_out_tokens_.data(), DType::kI32, {rows}, dev},
              TensorView{d_out_logprobs_.data(), DType::kF32, {rows}, dev},
              TensorView{d_top_ids_.data(), DType::kI32, {rows, K}, dev},
              TensorView{d_top_logprobs_.data(), DType::kF32, {rows, K}, dev});
  rt_->download_async(h_out_tokens_.as<void>(), d_out_tokens_.data(), size_t(rows) * 4);
  if (!with_logprobs) return;
  rt_->download_async(h_out_logprobs_.as<void>(), d_out_logprobs_.data(), size_t(rows) * 4);
  rt_->download_async(h_top_ids_.as<void>(), d_top_ids_.data(), size_t(rows * K) * 4);
  rt_->download_async(h_top_logprobs_.as<void>(), d_top_logprobs_.data(), size_t(rows * K) * 4);
}

SampleResult StepBuffers::sampled(int row, int num_logprobs) const {
  SampleResult r;
  r.token = h_out_tokens_.as<int32_t>()[row];
  r.logprob = h_out_logprobs_.as<float>()[row];
  const int64_t K = ops::kMaxTopLogprobs;
  for (int i = 0; i < std::min<int>(num_logprobs, int(K)); ++i) {
    const int32_t id = h_top_ids_.as<int32_t>()[row * K + i];
    if (id < 0) break;
    r.top.push_back(TokenLogprob{id, h_top_logprobs_.as<float>()[row * K + i]});
  }
  return r;
}

}  // namespace m3
