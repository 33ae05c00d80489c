#pragma once
// Per-step inputs in backend memory at fixed addresses: token ids, positions, slot mapping,
// query offsets, sequence lengths, page tables and logits rows, staged in page-locked host
// memory and copied up once per step. Fixed addresses are what lets a captured decode graph
// be replayed with each step's new metadata. Also the sample op's parameters and results.
#include <cstdint>
#include <vector>

#include "exec/sampler.h"
#include "ops/attention_metadata.h"
#include "ops/ops.h"
#include "ops/runtime.h"

namespace m3 {

class StepBuffers {
 public:
  // max_rows: logits rows one step samples (max_seqs, times 1 + the draft length when speculating).
  StepBuffers(ops::BackendRuntime* rt, int max_tokens, int max_seqs, int max_rows, int max_blocks_per_seq);

  void begin();
  // One sequence's new tokens at absolute positions start_pos.., through its page table.
  void add_sequence(const std::vector<int32_t>& tokens, int32_t start_pos, const std::vector<int32_t>& block_table,
                    int block_size);
  // A sequence of `tokens` tokens that writes no KV (slot -1) and reads positions 0.. of page 0
  // (graph padding; tokens must fit one page).
  void add_padding_sequence(int tokens = 1);
  void set_logits_rows(const std::vector<int32_t>& rows);
  int num_tokens() const { return num_tokens_; }
  int num_seqs() const { return num_seqs_; }
  void upload();
  // Replaces the logits rows after the step's forward and sampling have completed (the runtime
  // synchronized): rows for another LM-head pass (prompt logprobs). Returns them in runtime memory.
  const int32_t* upload_rows(const std::vector<int32_t>& rows);
  int max_rows() const { return max_rows_; }

  const int32_t* device_tokens() const { return d_tokens_.as<int32_t>(); }
  // The step's input tokens in runtime memory, for a kernel to write after upload() (chained drafts).
  int32_t* device_tokens_mut() { return d_tokens_.as<int32_t>(); }
  // The last sample()'s tokens in runtime memory (valid in stream order after it).
  const int32_t* device_sampled() const { return d_out_tokens_.as<int32_t>(); }
  const int32_t* device_logits_rows() const { return d_logits_rows_.as<int32_t>(); }
  ops::AttentionMetadata metadata(int block_size) const;

  // Runs the sample op over logits [rows, vocab] and queues the results' download; they are
  // readable with sampled() after the runtime's next synchronize().
  // with_logprobs false: only the tokens come down (draft argmax).
  void sample(const ops::OpContext& ctx, const TensorView& logits, const std::vector<ops::SampleRowParams>& params,
              bool with_logprobs = true);
  SampleResult sampled(int row, int num_logprobs) const;

 private:
  ops::BackendRuntime* rt_;
  int max_tokens_, max_seqs_, max_rows_, max_blocks_;
  int num_tokens_ = 0, num_seqs_ = 0, num_rows_ = 0;
  ops::HostStaging h_tokens_, h_positions_, h_slots_, h_query_start_, h_seq_lens_, h_tables_, h_logits_rows_;
  ops::DeviceBuffer d_tokens_, d_positions_, d_slots_, d_query_start_, d_seq_lens_, d_tables_, d_logits_rows_;
  // Sampling: parameters up, tokens / logprobs / top-N down.
  ops::HostStaging h_params_, h_out_tokens_, h_out_logprobs_, h_top_ids_, h_top_logprobs_;
  ops::DeviceBuffer d_params_, d_out_tokens_, d_out_logprobs_, d_top_ids_, d_top_logprobs_;
};

}  // namespace m3
