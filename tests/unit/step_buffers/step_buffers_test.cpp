// The per-step metadata the runner uploads: a sequence's positions and slots through its page
// table, graph padding sequences of q tokens (no KV written, positions 0.., page 0), and the
// logits-row capacity that speculative steps need beyond one row per sequence.
#include <gtest/gtest.h>

#include <stdexcept>

#include "engine/step_buffers.h"
#include "ops/host_runtime.h"

namespace m3 {
namespace {

TEST(StepBuffers, SequencesAndPaddingOfQTokens) {
  StepBuffers sb(ops::host_runtime(), /*max_tokens=*/16, /*max_seqs=*/3, /*max_rows=*/8, /*max_blocks_per_seq=*/4);
  EXPECT_EQ(sb.max_rows(), 8);
  sb.begin();
  sb.add_sequence({5, 6, 7}, 14, {3, 9}, 16);  // positions 14, 15 (page 3), 16 (page 9)
  sb.add_padding_sequence(3);
  sb.set_logits_rows({0, 1, 2, 3, 4, 5});  // every row of both: 6 > max_seqs
  sb.upload();
  const ops::AttentionMetadata m = sb.metadata(16);
  ASSERT_EQ(m.num_seqs, 2);
  ASSERT_EQ(m.num_tokens, 6);
  const std::vector<int32_t> pos(m.positions, m.positions + 6), qs(m.query_start, m.query_start + 3),
      lens(m.seq_lens, m.seq_lens + 2);
  const std::vector<int64_t> slots(m.slot_mapping, m.slot_mapping + 6);
  EXPECT_EQ(pos, (std::vector<int32_t>{14, 15, 16, 0, 1, 2}));
  EXPECT_EQ(slots, (std::vector<int64_t>{3 * 16 + 14, 3 * 16 + 15, 9 * 16 + 0, -1, -1, -1}));
  EXPECT_EQ(qs, (std::vector<int32_t>{0, 3, 6}));
  EXPECT_EQ(lens, (std::vector<int32_t>{17, 3}));
  EXPECT_EQ(m.block_tables[1 * m.max_blocks_per_seq], 0);  // the padding reads page 0
  EXPECT_EQ(sb.device_tokens()[3], 0);
  EXPECT_THROW(sb.set_logits_rows(std::vector<int32_t>(9, 0)), std::runtime_error);
  EXPECT_THROW(sb.add_padding_sequence(11), std::runtime_error);  // 6 + 11 tokens > 16
}

}  // namespace
}  // namespace m3
