#include "engine/eagle3_drafter.h"

#include <algorithm>
#include <cstring>

namespace m3 {

Eagle3Drafter::Eagle3Drafter(std::vector<DraftRank*> ranks, int block_size, int64_t num_target_blocks,
                             RunRanks run_ranks, std::function<int(int)> bucket)
    : ranks_(std::move(ranks)),
      block_size_(block_size),
      num_target_blocks_(num_target_blocks),
      run_ranks_(std::move(run_ranks)),
      bucket_(std::move(bucket)) {}

std::vector<std::vector<int32_t>> Eagle3Drafter::run(const std::vector<DraftSequence>& seqs, int step_bucket,
                                                     int tokens_per_seq) {
  std::vector<std::vector<int32_t>> drafts(seqs.size());
  const int64_t vocab = ranks_[0]->model->config().draft_vocab_size;
  // Pass 1: every sequence's tokens at the target's positions; logits at the proposing rows.
  std::vector<int32_t> rows, proposing;  // batch row per proposing sequence, and which sequence
  int32_t first = 0, longest = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    if (seqs[i].propose_row >= 0 && seqs[i].num_draft > 0) {
      rows.push_back(first + seqs[i].propose_row);
      proposing.push_back(int32_t(i));
      longest = std::max(longest, seqs[i].num_draft);
    }
    first += int32_t(seqs[i].inputs.size());
  }
  const int64_t n = int64_t(proposing.size());
  // The first pass as a graph: the target step's bucket (padding sequences past the real ones) and
  // one logits row per sequence of it (the proposing rows first).
  const bool graph1 = bucket_ && step_bucket > 0 && tokens_per_seq > 0 && step_bucket >= int(seqs.size());
  const int64_t rows1 = graph1 ? step_bucket : n;
  std::vector<int32_t> rows1_list = rows;
  rows1_list.resize(size_t(rows1), 0);
  const std::vector<ops::SampleRowParams> argmax(static_cast<size_t>(n));  // temperature 0: the proposing rows
  // Chained passes run `rows_c` rows: n, or its graph bucket (padding rows past n).
  const int bucket = bucket_ && n > 0 ? bucket_(int(n)) : 0;
  const int64_t rows_c = bucket > 0 ? bucket : n;
  std::vector<int32_t> chain_rows(static_cast<size_t>(rows_c));
  for (int64_t a = 0; a < rows_c; ++a) chain_rows[size_t(a)] = int32_t(a);
  run_ranks_([&](int r) {
    DraftRank& d = *ranks_[size_t(r)];
    d.rt->activate();
    StepBuffers& sb = *d.step;
    sb.begin();
    for (const DraftSequence& s : seqs) sb.add_sequence(s.inputs, s.start_pos, s.block_table, block_size_);
    if (graph1)
      for (int i = int(seqs.size()); i < step_bucket; ++i) sb.add_padding_sequence(tokens_per_seq);
    sb.set_logits_rows(rows1_list);
    sb.upload();
    // Chained pass j: one row per proposing sequence at the position after its j-th draft (a row
    // whose sequence drafts fewer tokens is padding: no KV written); tokens come from the device.
    for (int32_t j = 1; j < longest; ++j) {
      StepBuffers& cb = *d.chain[size_t(j) - 1];
      cb.begin();
      for (int64_t a = 0; a < rows_c; ++a) {
        if (a >= n) {
          cb.add_padding_sequence(1);
          continue;
        }
        const DraftSequence& s = seqs[size_t(proposing[size_t(a)])];
        if (s.num_draft <= j) {
          cb.add_padding_sequence(1);
          continue;
        }
        const int32_t pos = s.start_pos + s.propose_row + j;
        // Pages the target has not allocated yet (the draft runs ahead of it): this row's scratch page.
        std::vector<int32_t> table = s.block_table;
        while (int64_t(table.size()) * block_size_ <= pos) table.push_back(int32_t(num_target_blocks_ + a));
        cb.add_sequence({0}, pos, table, block_size_);
      }
      cb.set_logits_rows(chain_rows);
      cb.upload();
    }
    if (longest > 1) {
      int32_t* hr = d.h_hidden_rows.as<int32_t>();
      std::fill(hr, hr + 2 * d.max_seqs, 0);  // padding rows read row 0
      std::copy(rows.begin(), rows.end(), hr);
      std::copy(chain_rows.begin(), chain_rows.end(), hr + d.max_seqs);
      d.rt->upload(d.d_hidden_rows.data(), hr, size_t(2 * d.max_seqs) * 4);
    }
    d.graphs.run(d.rt, d.ctx, graph1, {0, step_bucket, tokens_per_seq}, [&](const ops::OpContext& ctx) {
      Eagle3Batch b;
      b.token_ids = sb.device_tokens();
      b.meta = sb.metadata(block_size_);
      b.from_target = true;
      b.logits_rows = sb.device_logits_rows();
      b.num_logits_rows = rows1;
      d.model->forward(ctx, b, d.cache, *d.ws);
    });
    if (n == 0) {
      d.rt->synchronize();
      return;
    }
    // Every rank takes the argmax (the same logits): each needs the tokens for the next pass.
    sb.sample(d.ctx, d.ws->logits.view(DType::kF32, {n, vocab}), argmax, /*with_logprobs=*/false);
    const int32_t* prev = sb.device_sampled();
    for (int32_t j = 1; j < longest; ++j) {
      StepBuffers& cb = *d.chain[size_t(j) - 1];
      // The previous pass's draft ids as target ids: this pass's input tokens (padding rows read
      // past the previous pass's rows: any id, out-of-range ones map to 0).
      auto pass = [&, j, prev](const ops::OpContext& ctx) {
        ops::embedding(ctx, prev, int(rows_c), d.model->target_ids(),
                       TensorView{cb.device_tokens_mut(), DType::kI32, {rows_c, 1}, d.rt->device()});
        Eagle3Batch c;
        c.token_ids = cb.device_tokens();
        c.meta = cb.metadata(block_size_);
        c.from_target = false;
        c.hidden_rows = d.d_hidden_rows.as<int32_t>() + (j == 1 ? 0 : d.max_seqs);
        c.logits_rows = cb.device_logits_rows();
        c.num_logits_rows = rows_c;
        d.model->forward(ctx, c, d.cache, *d.ws);
      };
      d.graphs.run(d.rt, d.ctx, bucket > 0, {j, bucket, 1}, pass);
      cb.sample(d.ctx, d.ws->logits.view(DType::kF32, {n, vocab}), argmax, /*with_logprobs=*/false);
      prev = cb.device_sampled();
    }
    d.rt->synchronize();
  });
  const DraftRank& d0 = *ranks_[0];
  for (int64_t a = 0; a < n; ++a) {
    const size_t si = size_t(proposing[size_t(a)]);
    drafts[si].push_back(d0.model->target_id(d0.step->sampled(int(a), 0).token));
    for (int32_t j = 1; j < seqs[si].num_draft; ++j)
      drafts[si].push_back(d0.model->target_id(d0.chain[size_t(j) - 1]->sampled(int(a), 0).token));
  }
  return drafts;
}

}  // namespace m3
