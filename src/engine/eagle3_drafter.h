#pragma once
// EAGLE-3 drafting after a step: the draft layer runs once over every token the target computed
// (its K/V for those positions, from the target's captured hidden states), then chains one token
// at a time from each proposing sequence's last accepted position, feeding its own pre-norm
// output back. Drafts are greedy (argmax) in the draft's vocabulary, mapped to target ids; the
// engine verifies them like any other draft, so they change speed, never the output. Every
// pass's metadata is known before the first runs (positions follow the last accepted one), so all
// are uploaded at once and the passes chain on the device (each one's argmax, mapped to target
// ids, is the next one's input): one host synchronisation per step.
#include <cstdint>
#include <functional>
#include <memory>
#include <tuple>
#include <vector>

#include "engine/captured_graphs.h"
#include "engine/step_buffers.h"
#include "model/eagle3/model.h"
#include "ops/ops.h"
#include "ops/runtime.h"

namespace m3 {

// One tensor-parallel rank's draft (its share of the heads, or all of them; every rank takes the
// same argmax, since it chains its own tokens).
struct DraftRank {
  ops::BackendRuntime* rt = nullptr;
  ops::OpContext ctx;
  std::unique_ptr<Eagle3Model> model;
  Eagle3KvCache cache;
  std::unique_ptr<Eagle3Workspace> ws;
  std::unique_ptr<StepBuffers> step;                 // the pass over the target's tokens
  std::vector<std::unique_ptr<StepBuffers>> chain;   // chained pass j at chain[j - 1] (K - 1 of them)
  // Hidden-state rows of the chained passes: [0, max_seqs) the first's (rows of the pass over the
  // target's tokens), [max_seqs, 2 max_seqs) the later ones' (0, 1, ...: the previous pass's rows).
  ops::HostStaging h_hidden_rows;
  ops::DeviceBuffer d_hidden_rows;
  int max_seqs = 0;
  CapturedGraphs<std::tuple<int, int, int>> graphs;  // (pass j, batch bucket, tokens per sequence)
};

// One sequence of the step the target just ran, in the target batch's order (its rows of the
// captured hidden states follow the same order).
struct DraftSequence {
  int32_t start_pos = 0;
  // The draft's input at position start_pos + i is the token at start_pos + i + 1 (the target's
  // hidden state at a position and the token after it predict the one after that).
  std::vector<int32_t> inputs;
  std::vector<int32_t> block_table;
  int32_t propose_row = -1;  // the row whose output starts the chain (the last accepted); -1: none
  int32_t num_draft = 0;     // tokens to draft from it
};

class Eagle3Drafter {
 public:
  using RunRanks = std::function<void(const std::function<void(int)>&)>;
  // num_target_blocks: the scheduler's pool; the caches hold max_seqs scratch blocks past it.
  // bucket(n): the padded batch a chained pass of n rows replays as a graph (0: run it eagerly).
  Eagle3Drafter(std::vector<DraftRank*> ranks, int block_size, int64_t num_target_blocks, RunRanks run_ranks,
                std::function<int(int)> bucket = {});

  // Drafts (target ids) per sequence: num_draft of them where propose_row >= 0, else none.
  // step_bucket > 0: the target's step replayed the graph of that batch bucket, every sequence
  // with `tokens_per_seq` tokens: the first pass replays a graph of the same shape too.
  std::vector<std::vector<int32_t>> run(const std::vector<DraftSequence>& seqs, int step_bucket = 0,
                                        int tokens_per_seq = 0);

 private:
  std::vector<DraftRank*> ranks_;
  int block_size_;
  int64_t num_target_blocks_;
  RunRanks run_ranks_;
  std::function<int(int)> bucket_;
};

}  // namespace m3
