#include "engine/eagle3_drafter.h"

#include <algorithm>
#include <cstring>

namespace m3 {

Eagle3Drafter::Eagle3Drafter(std::vector<DraftRank*> ranks, int block_size, int64_t num_target_blocks,
                             RunRanks run_ranks)
    : ranks_(std::move(ranks)),
      block_size_(block_size),
      num_target_blocks_(num_target_blocks),
      run_ranks_(std::move(run_ranks)) {}

std::vector<std::vector<int32_t>> Eagle3Drafter::run(const std::vector<DraftSequence>& seqs) {
  std::vector<std::vector<int32_t>> drafts(seqs.size());
  const int64_t vocab = ranks_[0]->model->config().draft_vocab_size;
  // Pass 1: every sequence's tokens at the target's positions; logits at the proposing rows.
  std::vector<int32_t> rows, proposing;  // batch row per proposing sequence, and which sequence
  int32_t first = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    if (seqs[i].propose_row >= 0 && seqs[i].num_draft > 0) {
      rows.push_back(first + seqs[i].propose_row);
      proposing.push_back(int32_t(i));
    }
    first += int32_t(seqs[i].inputs.size());
  }
  const int64_t pass1_tokens = first;
  auto sample_params = [](size_t n) { return std::vector<ops::SampleRowParams>(n); };  // temperature 0: argmax
  run_ranks_([&](int r) {
    DraftRank& d = *ranks_[size_t(r)];
    d.rt->activate();
    StepBuffers& sb = *d.step;
    sb.begin();
    for (const DraftSequence& s : seqs) sb.add_sequence(s.inputs, s.start_pos, s.block_table, block_size_);
    sb.set_logits_rows(rows);
    sb.upload();
    Eagle3Batch b;
    b.token_ids = sb.device_tokens();
    b.meta = sb.metadata(block_size_);
    b.from_target = true;
    b.logits_rows = sb.device_logits_rows();
    b.num_logits_rows = int64_t(rows.size());
    d.model->forward(d.ctx, b, d.cache, *d.ws);
    if (r == 0 && !rows.empty())
      sb.sample(d.ctx, d.ws->logits.view(DType::kF32, {int64_t(rows.size()), vocab}), sample_params(rows.size()));
    d.rt->synchronize();
  });
  if (proposing.empty()) return drafts;
  for (size_t j = 0; j < proposing.size(); ++j)
    drafts[size_t(proposing[j])].push_back(ranks_[0]->model->target_id(ranks_[0]->step->sampled(int(j), 0).token));

  // Chained passes: one token per sequence still drafting, at the position after its last draft,
  // its hidden input the previous pass's pre-norm row for it.
  std::vector<int32_t> prev_row = rows;  // each proposing sequence's row in the previous pass
  int64_t prev_tokens = pass1_tokens;
  for (int32_t step = 1;; ++step) {
    std::vector<int32_t> active, hidden_rows;
    for (size_t j = 0; j < proposing.size(); ++j) {
      if (seqs[size_t(proposing[j])].num_draft > step) {
        active.push_back(int32_t(j));
        hidden_rows.push_back(prev_row[j]);
      }
    }
    if (active.empty()) break;
    std::vector<int32_t> out_rows(active.size());
    for (size_t a = 0; a < active.size(); ++a) out_rows[a] = int32_t(a);
    run_ranks_([&](int r) {
      DraftRank& d = *ranks_[size_t(r)];
      d.rt->activate();
      StepBuffers& sb = *d.step;
      sb.begin();
      for (size_t a = 0; a < active.size(); ++a) {
        const size_t si = size_t(proposing[size_t(active[a])]);
        const DraftSequence& s = seqs[si];
        const int32_t pos = s.start_pos + s.propose_row + step;
        // Pages the target has not allocated yet (the draft runs ahead of it): this row's scratch block.
        std::vector<int32_t> table = s.block_table;
        while (int64_t(table.size()) * block_size_ <= pos) table.push_back(int32_t(num_target_blocks_) + int32_t(a));
        sb.add_sequence({drafts[si].back()}, pos, table, block_size_);
      }
      sb.set_logits_rows(out_rows);
      sb.upload();
      std::memcpy(d.h_hidden_rows.as<int32_t>(), hidden_rows.data(), hidden_rows.size() * 4);
      d.rt->upload(d.d_hidden_rows.data(), d.h_hidden_rows.as<void>(), hidden_rows.size() * 4);
      Eagle3Batch b;
      b.token_ids = sb.device_tokens();
      b.meta = sb.metadata(block_size_);
      b.from_target = false;
      b.hidden_rows = d.d_hidden_rows.as<int32_t>();
      b.hidden_source_tokens = prev_tokens;
      b.logits_rows = sb.device_logits_rows();
      b.num_logits_rows = int64_t(out_rows.size());
      d.model->forward(d.ctx, b, d.cache, *d.ws);
      if (r == 0)
        sb.sample(d.ctx, d.ws->logits.view(DType::kF32, {int64_t(out_rows.size()), vocab}),
                  sample_params(out_rows.size()));
      d.rt->synchronize();
    });
    for (size_t a = 0; a < active.size(); ++a) {
      const size_t si = size_t(proposing[size_t(active[a])]);
      drafts[si].push_back(ranks_[0]->model->target_id(ranks_[0]->step->sampled(int(a), 0).token));
      prev_row[size_t(active[a])] = int32_t(a);
    }
    prev_tokens = int64_t(active.size());
  }
  return drafts;
}

}  // namespace m3
