#pragma once
// Explicit per-step attention metadata (no globals): where each sequence's queries sit in the
// batch, their absolute positions, and the page tables through which every KV read goes.
// KV page = MSA block, so logical block b of a sequence is page block_tables[s][b].
#include <cstdint>

namespace m3::ops {

struct AttentionMetadata {
  int num_seqs = 0;
  int num_tokens = 0;
  const int32_t* query_start = nullptr;   // [num_seqs + 1] token offsets into the batch
  const int32_t* positions = nullptr;     // [num_tokens] absolute positions (= cache slots in the sequence)
  const int32_t* seq_lens = nullptr;      // [num_seqs] tokens in the cache after this step's writes
  const int32_t* block_tables = nullptr;  // [num_seqs, max_blocks_per_seq] physical page ids
  int max_blocks_per_seq = 0;
  int block_size = 0;                     // tokens per page (= MSA block)
  const int64_t* slot_mapping = nullptr;  // [num_tokens] physical slot each new token is written to
  // Per attention call: Q and the new K/V rows were complete before the kernel launched just
  // before the attention let it start (the model sets it for a sparse layer right after its own
  // indexer, which releases its dependents only past its own wait on the prologue). Only then
  // may a decode kernel read them while that kernel drains (programmatic dependent launch);
  // otherwise the kernel before is the one writing them (dense layers, layers sharing an
  // earlier selection) and the attention waits for it first.
  bool qkv_before_previous_kernel = false;
  // Per indexer call: launched right after the kernel writing its queries and this step's index
  // keys (the attention prologue; the model sets it for a sparse layer's own indexer). At pure
  // decode the indexer then becomes that kernel's programmatic dependent and requests the earlier
  // steps' keys while it drains; launched after anything else (nothing to overlap) it reads its
  // queries first, as a plain launch. Either way the same bits.
  bool indexer_after_prologue = false;

  int64_t slot_of(int seq, int64_t pos) const {
    return int64_t(block_tables[int64_t(seq) * max_blocks_per_seq + pos / block_size]) * block_size +
           pos % block_size;
  }
};

}  // namespace m3::ops
