// Host-side selection among the CUDA attention entries (no device needed): which entry a
// problem reaches is decided by the eligibility rules and their order in the table, and a
// prefill must not land on a decode kernel (or the reverse) by a change elsewhere in the table.
#include <gtest/gtest.h>

#include <string>

#include "backend/cuda/cuda_backend.h"
#include "ops/ops.h"

namespace m3 {
namespace {

ops::Problem attention_problem(int64_t tokens, int64_t top_k, bool invariant, DType kv = DType::kBF16,
                               int64_t head_dim = 128, int64_t q_heads = 64) {
  return ops::make_problem("attention", Device::kCuda, kv, tokens, q_heads, head_dim, top_k, invariant);
}

std::string pick(const ops::KernelTable& t, int64_t tokens, int64_t top_k, bool invariant,
                 DType kv = DType::kBF16, int64_t head_dim = 128) {
  return t.attention.select(attention_problem(tokens, top_k, invariant, kv, head_dim), nullptr).name;
}

TEST(AttentionDispatch, PrefillAndDecodeReachTheirKernels) {
  ops::KernelTable t;
  cuda::register_cuda_kernels(t);
  // Dense (M3 layers 0-2): prefills on the wgmma dense kernel, decode and short chunks query-major.
  EXPECT_EQ(pick(t, 8192, 0, true), "attention.msa_dense_prefill.sm90");
  EXPECT_EQ(pick(t, 64, 0, true), "attention.msa_dense_prefill.sm90");
  EXPECT_EQ(pick(t, 63, 0, true), "attention.msa_query_major.sm90");
  // Without batch invariance the dense prefill takes the bf16 variant; decode stays query-major.
  EXPECT_EQ(pick(t, 8192, 0, false), "attention.msa_dense_prefill_fast.sm90");
  EXPECT_EQ(pick(t, 63, 0, false), "attention.msa_query_major.sm90");
  EXPECT_EQ(pick(t, 1, 0, false), "attention.msa_query_major.sm90");
  // Block-sparse (MSA layers): prefills block-major (the bf16 variant only without invariance).
  EXPECT_EQ(pick(t, 8192, 16, true), "attention.msa_block_major_prefill.sm90");
  EXPECT_EQ(pick(t, 8192, 16, false), "attention.msa_block_major_prefill_fast.sm90");
  EXPECT_EQ(pick(t, 1023, 16, true), "attention.msa_query_major.sm90");
  EXPECT_EQ(pick(t, 4, 16, true), "attention.msa_query_major.sm90");
  // Shapes the tuned entries do not take fall through to the generic kernels.
  EXPECT_EQ(pick(t, 8192, 0, true, DType::kF32).find("msa_"), std::string::npos);
  EXPECT_EQ(pick(t, 8192, 0, true, DType::kBF16, 64).find("msa_"), std::string::npos);
}

// With the batch layout (what ops::attention and ops::indexer_topk pass), the eligibility sees
// what the launchers would otherwise hand on: tokens per sequence, page size, heads per KV head.
// So the trace names the kernel that runs.
std::string pick_with(const ops::KernelTable& t, int64_t tokens, int seqs, int64_t top_k, int bs = 128,
                      int64_t q_heads = 64, int64_t kv_heads = 4) {
  ops::AttentionMetadata meta;
  meta.num_seqs = seqs;
  meta.block_size = bs;
  meta.max_blocks_per_seq = 64;
  int32_t lens = 0;
  meta.seq_lens = &lens;  // only its presence is read
  ops::Problem p = attention_problem(tokens, top_k, true, DType::kBF16, 128, q_heads);
  p.attention = &meta;
  p.kv_heads = kv_heads;
  return t.attention.select(p, nullptr).name;
}

TEST(AttentionDispatch, TheBatchLayoutDecides) {
  ops::KernelTable t;
  cuda::register_cuda_kernels(t);
  EXPECT_EQ(pick_with(t, 8192, 1, 16), "attention.msa_block_major_prefill.sm90");
  EXPECT_EQ(pick_with(t, 8192, 1, 0), "attention.msa_dense_prefill.sm90");
  // 1100 tokens over 20 sequences (55 each): chunks of a mixed batch, query-major.
  EXPECT_EQ(pick_with(t, 1100, 20, 16), "attention.msa_query_major.sm90");
  EXPECT_EQ(pick_with(t, 1100, 20, 0), "attention.msa_query_major.sm90");
  EXPECT_EQ(pick_with(t, 1100, 2, 16), "attention.msa_block_major_prefill.sm90");
  // Pages of 96 keys: the dense wgmma kernel needs a power of two, query-major does not.
  EXPECT_EQ(pick_with(t, 8192, 1, 0, 96), "attention.msa_query_major.sm90");
  // 128 query heads per KV head: block-major takes the prefill, a decode runs the generic kernel.
  EXPECT_EQ(pick_with(t, 8192, 1, 16, 128, 128, 1), "attention.msa_block_major_prefill.sm90");
  EXPECT_EQ(pick_with(t, 1, 1, 16, 128, 128, 1), "attention.paged_online_softmax.sm90");
  // The indexer: pages of 96 keys go to the generic kernel.
  ops::AttentionMetadata meta;
  meta.num_seqs = 1;
  meta.block_size = 96;
  meta.max_blocks_per_seq = 64;
  ops::Problem p;
  p.op = "indexer_topk";
  p.device = Device::kCuda;
  p.dtype = DType::kBF16;
  p.m = 1, p.n = 4, p.k = 128, p.extra = 16;
  p.attention = &meta;
  EXPECT_EQ(t.indexer_topk.select(p, nullptr).name, "indexer_topk.block_max_rank.sm90");
  meta.block_size = 128;
  EXPECT_EQ(t.indexer_topk.select(p, nullptr).name, "indexer_topk.msa_tc_exact.sm90");
}

}  // namespace
}  // namespace m3
