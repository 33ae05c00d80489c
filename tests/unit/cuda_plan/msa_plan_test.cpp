// Host-side plans of the MSA indexer and the query-major attention (msa.h): the split rules the
// launchers take and the dispatch trace prints, at M3's shapes on an H200's limits (132 SMs,
// clusters of up to 16). No GPU needed, so CI runs it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/msa.h"
#include "ops/ops.h"

namespace m3 {
namespace {

using cuda::MsaAttnPlan;
using cuda::MsaAttnShape;

constexpr int kBlock = 128, kTopK = 16;

// M3 at TP1: 64 query heads over 4 KV heads, head_dim 128, 128-key blocks, top-16.
MsaAttnShape decode(int64_t batch, int64_t context, bool sparse = true) {
  MsaAttnShape s;
  s.tokens = batch;
  s.num_seqs = int(batch);
  s.q_heads = 64;
  s.kv_heads = 4;
  s.head_dim = 128;
  s.bs = kBlock;
  s.max_blocks = int((context + kBlock - 1) / kBlock);
  s.sparse = sparse;
  s.top_k = sparse ? kTopK : 0;
  s.early_reads = sparse;  // a sparse layer's attention right after its own indexer
  return s;
}

const cuda::MsaAttnLimits kH200{132, 16, 16, 16};

TEST(MsaAttentionPlan, DecodeSplitFollowsTheBatch) {
  // B = 1: a cluster of 16 per KV group over the 16 selected blocks, early units (contexts of at
  // most top_k blocks), partials in the fixed buffer.
  const MsaAttnPlan one = cuda::msa_attention_plan(decode(1, 8192), kH200);
  ASSERT_TRUE(one.tuned);
  EXPECT_TRUE(one.pure_decode);
  EXPECT_EQ(one.m_tiles, 1);
  EXPECT_EQ(one.tokens_per_group, 1);
  EXPECT_EQ(one.su_cap, 16);
  EXPECT_EQ(one.splits, 16);
  EXPECT_TRUE(one.split_ring);
  EXPECT_TRUE(one.early);
  EXPECT_EQ(one.early_max_blocks, 16);
  EXPECT_TRUE(one.fixed_partials);
  EXPECT_EQ(one.ctas, 64);
  EXPECT_TRUE(one.push);  // 16 partials per group over 16 CTAs, one head's row folded by each
  EXPECT_EQ(cuda::msa_attention_plan_text(one),
            "4 row groups of 1 token (1 m-tile), K/V split ring, two CTAs per SM, early units (contexts of <= 16 "
            "blocks), partials pushed into the folding CTAs' shared memory, 64 CTAs in clusters of 16, up to 16 "
            "super-unit partials per row group (fixed buffer)");
  // B = 2 still has a CTA per selected block; from B = 4 (8-CTA clusters, 16 blocks) a CTA may take
  // two units, whose ring fills the third slot: partials through global memory.
  EXPECT_TRUE(cuda::msa_attention_plan(decode(2, 131072), kH200).push);
  EXPECT_FALSE(cuda::msa_attention_plan(decode(4, 131072), kH200).push);
  EXPECT_FALSE(cuda::msa_attention_plan(decode(1, 8192), cuda::MsaAttnLimits{132, 8, 8, 8}).push);
  EXPECT_FALSE(cuda::msa_attention_plan(decode(1, 131072, false), kH200).push);  // dense: no push
  // Beside the ring (one CTA per SM) where the device says all the clusters fit at once: B = 4
  // (16 clusters of 8, two rows of 16 partials per CTA), 8, 16; not past one CTA per SM (B = 32).
  cuda::MsaAttnLimits wide = kH200;
  wide.push_wide_clusters[0] = 66, wide.push_wide_clusters[1] = 33, wide.push_wide_clusters[2] = 16;
  wide.push_wide_clusters[3] = 8;
  const MsaAttnPlan p4 = cuda::msa_attention_plan(decode(4, 131072), wide);
  EXPECT_TRUE(p4.push);
  EXPECT_EQ(p4.push_recv_bytes, 16u * 2 * 520);
  EXPECT_NE(cuda::msa_attention_plan_text(p4).find("partials pushed into the folding CTAs' shared memory (17 KB beside "
                                                   "the ring, one CTA per SM)"),
            std::string::npos);
  EXPECT_EQ(cuda::msa_attention_plan(decode(8, 131072), wide).push_recv_bytes, 16u * 4 * 520);
  EXPECT_EQ(cuda::msa_attention_plan(decode(16, 131072), wide).push_recv_bytes, 16u * 8 * 520);
  EXPECT_FALSE(cuda::msa_attention_plan(decode(32, 131072), wide).push);
  // The H100 of the sixty-seventh session (66 / 30 / 15 / 7): B = 4 is one 8-CTA cluster short
  // (the global fold), B = 3's 12 clusters of 8 fit (early units, two blocks per CTA, pushed).
  const cuda::MsaAttnLimits h100{132, 16, 16, 16, {66, 30, 15, 7}};
  EXPECT_FALSE(cuda::msa_attention_plan(decode(4, 131072), h100).push);
  const MsaAttnPlan p3 = cuda::msa_attention_plan(decode(3, 2047), h100);
  EXPECT_TRUE(p3.early);
  EXPECT_EQ(p3.splits, 8);
  EXPECT_EQ(p3.push_recv_bytes, 16u * 2 * 520);
  EXPECT_TRUE(cuda::msa_attention_plan(decode(16, 131072), h100).push);
  EXPECT_EQ(cuda::msa_attention_plan(decode(1, 8192), wide).push_recv_bytes, 0u);  // B = 1: the ring's slot
  // Early units only up to 4 sequences, B = 4's 8-CTA clusters taking two blocks per CTA; the
  // fixed partials up to 15 (532 KB per token).
  const MsaAttnPlan four = cuda::msa_attention_plan(decode(4, 8192), kH200);
  EXPECT_TRUE(four.early);
  EXPECT_EQ(four.splits, 8);
  EXPECT_EQ(four.early_max_blocks, 16);
  EXPECT_FALSE(cuda::msa_attention_plan(decode(5, 8192), kH200).early);
  // Not where the kernel just before wrote Q and K/V (a layer sharing an earlier selection).
  MsaAttnShape shared = decode(1, 8192);
  shared.early_reads = false;
  EXPECT_FALSE(cuda::msa_attention_plan(shared, kH200).early);
  EXPECT_TRUE(cuda::msa_attention_plan(decode(15, 8192), kH200).fixed_partials);
  // B = 16: 64 clusters of 2 (one CTA per SM), partials from the pool.
  const MsaAttnPlan b16 = cuda::msa_attention_plan(decode(16, 131072), kH200);
  EXPECT_EQ(b16.splits, 2);
  EXPECT_FALSE(b16.fixed_partials);
  // B = 32: two splits while the row groups fit the SMs; B = 64: none.
  EXPECT_EQ(cuda::msa_attention_plan(decode(32, 131072), kH200).splits, 2);
  const MsaAttnPlan b64 = cuda::msa_attention_plan(decode(64, 131072), kH200);
  EXPECT_EQ(b64.splits, 1);
  EXPECT_EQ(b64.ctas, 256);
  EXPECT_EQ(cuda::msa_attention_plan_text(b64), "256 row groups of 1 token (1 m-tile), K/V split ring, two CTAs per SM, 256 CTAs");
  // A short context bounds the split by its blocks (3 blocks: at most 2 splits).
  EXPECT_EQ(cuda::msa_attention_plan(decode(1, 300), kH200).splits, 2);
  // Smaller clusters on a device that launches no 16-CTA ones.
  EXPECT_EQ(cuda::msa_attention_plan(decode(1, 8192), cuda::MsaAttnLimits{132, 8, 8, 8}).splits, 8);
}

TEST(MsaAttentionPlan, DenseDecodeStripes) {
  // Two CTAs per SM for the stripes (msa_attention_limits' default on a 132-SM device).
  cuda::MsaAttnLimits lim = kH200;
  lim.stripe_ctas = cuda::default_stripe_ctas(lim.sms);
  // B = 1 at 128K: four 16-CTA clusters per KV group on the split ring (256 CTAs), 8 super-units each.
  const MsaAttnPlan one = cuda::msa_attention_plan(decode(1, 131072, false), lim);
  EXPECT_TRUE(one.split_ring);
  EXPECT_EQ(one.splits, 16);
  EXPECT_EQ(one.stripes, 4);
  EXPECT_EQ(one.ctas, 256);
  EXPECT_TRUE(one.fixed_partials);
  EXPECT_EQ(cuda::msa_attention_plan_text(one),
            "4 row groups of 1 token (1 m-tile), K/V split ring, two CTAs per SM, 256 CTAs in clusters of 16 (4 per row "
            "group, the last one in folds), up to 128 super-unit partials per row group (fixed buffer)");
  // At 32K two (32 super-units: one per CTA); at 20K one cluster, the deep stages as before.
  EXPECT_EQ(cuda::msa_attention_plan(decode(1, 32768, false), lim).stripes, 2);
  const MsaAttnPlan short1 = cuda::msa_attention_plan(decode(1, 20000, false), lim);
  EXPECT_EQ(short1.stripes, 1);
  EXPECT_FALSE(short1.split_ring);
  EXPECT_EQ(short1.ctas, 64);
  // B = 2 at 128K: two; from B = 4 the clusters alone fill the device.
  EXPECT_EQ(cuda::msa_attention_plan(decode(2, 131072, false), lim).stripes, 2);
  EXPECT_EQ(cuda::msa_attention_plan(decode(2, 131072, false), lim).ctas, 256);
  EXPECT_EQ(cuda::msa_attention_plan(decode(4, 131072, false), lim).stripes, 1);
  // Past one CTA per SM only with two super-units per CTA: B = 2 at 64K takes two (256 CTAs),
  // at 32K none (it would keep one; measured 1-1.5 % slower).
  EXPECT_EQ(cuda::msa_attention_plan(decode(2, 65536, false), lim).stripes, 2);
  EXPECT_EQ(cuda::msa_attention_plan(decode(2, 32768, false), lim).stripes, 1);
  EXPECT_EQ(cuda::msa_attention_plan(decode(2, 70000, false), lim).stripes, 2);  // kernels_cuda_msa's pair
  // B = 1 at 64K: two (128 CTAs), not four (256 CTAs of one super-unit each: measured no faster).
  EXPECT_EQ(cuda::msa_attention_plan(decode(1, 65536, false), lim).stripes, 2);
  // Never for sparse layers or prefills, nor without the limit (M3_MSA_STRIPE_CTAS=0).
  EXPECT_EQ(cuda::msa_attention_plan(decode(1, 131072, true), lim).stripes, 1);
  MsaAttnShape pre = decode(1, 131072, false);
  pre.tokens = 2;
  EXPECT_EQ(cuda::msa_attention_plan(pre, lim).stripes, 1);
  EXPECT_EQ(cuda::msa_attention_plan(decode(1, 131072, false), kH200).stripes, 1);
  // TP4 (16 query heads over 1 KV head): B = 1 at 128K spreads its one row group over 8 clusters
  // (128 super-units: one per CTA), from the 16 CTAs of one cluster.
  auto tp4_batch = [&](int64_t b, int64_t ctx) {
    MsaAttnShape s = decode(b, ctx, false);
    s.q_heads = 16;
    s.kv_heads = 1;
    return cuda::msa_attention_plan(s, lim);
  };
  const MsaAttnPlan t4 = tp4_batch(1, 131072);
  EXPECT_EQ(t4.stripes, 8);
  EXPECT_EQ(t4.ctas, 128);
  // TP4 B = 2 at 128K: four (128 CTAs; eight would leave one super-unit per CTA), B = 8 two;
  // B = 8 at 32K none.
  EXPECT_EQ(tp4_batch(2, 131072).stripes, 4);
  EXPECT_EQ(tp4_batch(2, 131072).ctas, 128);
  EXPECT_EQ(tp4_batch(4, 131072).stripes, 4);
  EXPECT_EQ(tp4_batch(8, 131072).stripes, 2);
  EXPECT_EQ(tp4_batch(8, 32768).stripes, 1);
  // Smaller clusters (8): more of them, within the same CTAs.
  cuda::MsaAttnLimits eight{132, 8, 8, 8};
  eight.stripe_ctas = 264;
  const MsaAttnPlan e1 = cuda::msa_attention_plan(decode(1, 131072, false), eight);
  EXPECT_EQ(e1.splits, 8);
  EXPECT_EQ(e1.stripes, 8);
  EXPECT_EQ(e1.ctas, 256);
}

TEST(MsaAttentionPlan, DenseAndPrefillLayouts) {
  // A dense 128K context alone keeps the deep whole-unit stages; 32 of them take the split ring.
  const MsaAttnPlan dense1 = cuda::msa_attention_plan(decode(1, 131072, false), kH200);
  EXPECT_FALSE(dense1.split_ring);
  EXPECT_EQ(dense1.splits, 16);
  EXPECT_EQ(dense1.su_cap, 128);  // 1024 units in super-units of 8
  EXPECT_NE(cuda::msa_attention_plan_text(dense1).find("3 whole-unit stages"), std::string::npos);
  const MsaAttnPlan dense32 = cuda::msa_attention_plan(decode(32, 131072, false), kH200);
  EXPECT_TRUE(dense32.split_ring);
  EXPECT_EQ(dense32.splits, 2);
  EXPECT_FALSE(dense32.early);
  // A prefill: 4 tokens x 16 heads per row group, four m-tiles, partials (when split) from the pool.
  MsaAttnShape pre = decode(1, 8192);
  pre.tokens = 8192;
  const MsaAttnPlan p = cuda::msa_attention_plan(pre, kH200);
  EXPECT_FALSE(p.pure_decode);
  EXPECT_EQ(p.tokens_per_group, 4);
  EXPECT_EQ(p.m_tiles, 4);
  EXPECT_EQ(p.groups, (2048 + 1) * 4);
  EXPECT_EQ(p.splits, 1);
  EXPECT_FALSE(p.fixed_partials);
  // Shapes outside the tuned kernel.
  MsaAttnShape odd = decode(1, 8192);
  odd.head_dim = 64;
  EXPECT_EQ(cuda::msa_attention_refusal(odd), "head_dim is not 128");
  EXPECT_EQ(cuda::msa_attention_plan_text(cuda::msa_attention_plan(odd, kH200)), "the generic kernel (shape outside the tuned one)");
  odd = decode(1, 8192);
  odd.bf16 = false;
  EXPECT_FALSE(cuda::msa_attention_plan(odd, kH200).tuned);
}

TEST(MsaPrefillPlan, BlockMajorAndDenseTake) {
  MsaAttnShape s = decode(1, 8192);
  s.tokens = 8192;
  EXPECT_EQ(cuda::msa_block_major_refusal(s), "");
  // M3 at 8K under the 2 GB budget: the fp32 partials (~533 KB per token) in three equal
  // chunks, the fast variant's bf16 ones (~288 KB with its bf16 Q) in two.
  EXPECT_EQ(cuda::msa_block_major_chunk(s, true), 2731);
  EXPECT_EQ(cuda::msa_block_major_chunk(s, false), 4096);
  // 128K tokens: equal chunks under the budget, the fp32 partials in more of them.
  s.tokens = 131072;
  const int64_t hilo = cuda::msa_block_major_chunk(s, true), fast = cuda::msa_block_major_chunk(s, false);
  EXPECT_LT(hilo, fast);
  EXPECT_GE(hilo * ((s.tokens + hilo - 1) / hilo), s.tokens);
  s.has_seq_lens = false;
  EXPECT_EQ(cuda::msa_block_major_refusal(s), "no sequence lengths in the metadata");
  MsaAttnShape d = decode(1, 8192, false);
  d.tokens = 8192;
  EXPECT_EQ(cuda::msa_dense_prefill_refusal(d), "");
  EXPECT_EQ(cuda::msa_dense_prefill_tile_tokens(d), 8);  // 128 rows of 16 heads
  d.bs = 96;
  EXPECT_EQ(cuda::msa_dense_prefill_refusal(d), "page size is not a power of two");
}

// The dense entries' plans in the trace: the fast one says it is the warp-specialised kernel.
TEST(MsaPrefillPlan, DenseEntriesSayWhatRuns) {
  ops::AttentionMetadata meta;
  meta.num_seqs = 1;
  meta.block_size = kBlock;
  meta.max_blocks_per_seq = 64;
  int32_t lens = 0;
  meta.seq_lens = &lens;
  ops::Problem p = ops::make_problem("attention", Device::kCuda, DType::kBF16, 8192, 64, 128, 0, false);
  p.attention = &meta;
  p.kv_heads = 4;
  const std::string tiles = "tiles of 8 tokens x 16 heads, <= 4100 CTAs";  // (1024 + 1) tiles x 4 KV heads
  EXPECT_EQ(cuda::msa_entry_plan("attention.msa_dense_prefill.sm90", p, kH200), tiles);
  const std::string ring = " through a " + std::to_string(cuda::kDenseFaStages) + "-stage ring";
  EXPECT_EQ(cuda::msa_entry_plan("attention.msa_dense_prefill_fast.sm90", p, kH200),
            tiles + ", a producer and two consumer warpgroups, K/V units by TMA" + ring);
  // Pages of fewer than 128 keys hold no whole unit: the producer copies them row by row.
  meta.block_size = 16;
  meta.max_blocks_per_seq = 512;
  EXPECT_EQ(cuda::msa_entry_plan("attention.msa_dense_prefill_fast.sm90", p, kH200),
            tiles + ", a producer and two consumer warpgroups, K/V units by cp.async (pages under 128 keys)" + ring);
}

cuda::MsaIndexerShape index_shape(int64_t tokens, int seqs, int64_t context, bool fp8 = false) {
  cuda::MsaIndexerShape s;
  s.tokens = tokens;
  s.num_seqs = seqs;
  s.heads = 4;  // M3 at TP1
  s.dim = 128;
  s.bs = kBlock;
  s.max_blocks = int((context + kBlock - 1) / kBlock);
  s.top_k = kTopK;
  s.bf16 = !fp8;
  s.fp8 = fp8;
  return s;
}

TEST(MsaIndexerPlan, DecodeSpreadsThePagesAndPrefillTakesItsKernel) {
  // B = 1 at 8K: the warp-streamed kernel, one query group of 2 tokens' rows (8 rows), split
  // over every block but the local one, scores in the fixed buffer, one launch.
  const cuda::MsaIndexerPlan one = cuda::msa_indexer_plan(index_shape(1, 1, 8192), 132);
  ASSERT_TRUE(one.tuned);
  EXPECT_FALSE(one.prefill);
  EXPECT_FALSE(one.tiles);
  EXPECT_EQ(one.group_tokens, 2);
  EXPECT_EQ(one.groups, 1);
  EXPECT_EQ(one.chunks, 63);
  EXPECT_TRUE(one.fixed_scores);
  EXPECT_EQ(one.launches, 1);
  EXPECT_TRUE(one.unit_counters);
  EXPECT_EQ(one.exact_max, cuda::kExactMaxRowBlocks);
  EXPECT_EQ(cuda::msa_indexer_plan_text(one).rfind("warp-streamed decode kernel, 1 query group of 2 tokens x 63 CTAs", 0), 0u)
      << cuda::msa_indexer_plan_text(one);
  // Pure decode right after the attention prologue (the model's sparse layers): the prologue's
  // programmatic dependent, keys requested before its wait. After anything else: a plain launch.
  EXPECT_FALSE(one.keys_before_wait);
  EXPECT_EQ(cuda::msa_indexer_plan_text(one).find("programmatic dependent"), std::string::npos);
  auto after_prologue = [](cuda::MsaIndexerShape s) {
    s.after_prologue = true;
    return s;
  };
  const cuda::MsaIndexerPlan chained = cuda::msa_indexer_plan(after_prologue(index_shape(1, 1, 8192)), 132);
  EXPECT_TRUE(chained.keys_before_wait);
  EXPECT_EQ(chained.chunks, one.chunks);
  EXPECT_NE(cuda::msa_indexer_plan_text(chained).find("the prologue's programmatic dependent (page ids and first key tiles"),
            std::string::npos)
      << cuda::msa_indexer_plan_text(chained);
  // Four tokens of one sequence (speculative verification): a row's earlier blocks may hold keys
  // the prologue writes in the same step, so the launch stays plain.
  const cuda::MsaIndexerPlan verify = cuda::msa_indexer_plan(after_prologue(index_shape(4, 1, 8192)), 132);
  EXPECT_FALSE(verify.prefill);
  EXPECT_FALSE(verify.keys_before_wait);
  EXPECT_EQ(cuda::msa_indexer_plan_text(verify).find("programmatic dependent"), std::string::npos);
  // B = 64 at 128K: fewer CTAs per group, still the fixed scores (16 KB per token).
  const cuda::MsaIndexerPlan b64 = cuda::msa_indexer_plan(index_shape(64, 64, 131072, true), 132);
  EXPECT_EQ(b64.groups, 64);
  EXPECT_GE(b64.chunks, 2);
  EXPECT_LE(b64.chunks * b64.groups, 132 * b64.ctas_per_sm);
  EXPECT_TRUE(b64.fixed_scores);
  EXPECT_TRUE(cuda::msa_indexer_plan(after_prologue(index_shape(64, 64, 131072, true)), 132).keys_before_wait);
  // An 8K prefill: the prefill kernel, 64-token groups, four CTAs per SM, pool scores.
  const cuda::MsaIndexerPlan pre = cuda::msa_indexer_plan(after_prologue(index_shape(8192, 1, 8192)), 132);
  EXPECT_TRUE(pre.prefill);
  EXPECT_EQ(pre.group_tokens, 64);
  EXPECT_EQ(pre.groups, 129);
  EXPECT_EQ(pre.chunks, 4);
  EXPECT_FALSE(pre.fixed_scores);
  EXPECT_FALSE(pre.keys_before_wait);
  EXPECT_EQ(pre.launches, 1);
  EXPECT_TRUE(pre.tma);  // BF16 key blocks by TMA; FP8 ones by cp.async (converted where they land)
  EXPECT_EQ(cuda::msa_indexer_plan_text(pre).rfind("prefill kernel (a warp per 16 rows, whole blocks by TMA), 129 query groups", 0), 0u)
      << cuda::msa_indexer_plan_text(pre);
  const cuda::MsaIndexerPlan pre8 = cuda::msa_indexer_plan(index_shape(8192, 1, 8192, true), 132);
  EXPECT_TRUE(pre8.prefill);
  EXPECT_FALSE(pre8.tma);
  EXPECT_NE(cuda::msa_indexer_plan_text(pre8).find("whole blocks by cp.async"), std::string::npos)
      << cuda::msa_indexer_plan_text(pre8);
  // The sliced layout runs long prefills in several launches, the remainder first.
  const cuda::MsaIndexerPlan sliced =
      cuda::msa_indexer_plan(index_shape(8192, 1, 8192), 132, cuda::MsaIndexerLayout::kPrefillSliced);
  EXPECT_GT(sliced.launches, 1);
  EXPECT_EQ(sliced.first_slice + (sliced.launches - 1) * sliced.slice, 8192);
  // Blocks of 8 keys take the 128-row tiles; an index dim of 64 the generic kernel.
  cuda::MsaIndexerShape small = index_shape(1, 1, 8192);
  small.bs = 8;
  small.max_blocks = 1024;
  EXPECT_TRUE(cuda::msa_indexer_plan(small, 132).tiles);
  small = index_shape(1, 1, 8192);
  small.dim = 64;
  EXPECT_FALSE(cuda::msa_indexer_plan(small, 132).tuned);
}

// The tuned entries carry these plans; without the batch layout they have nothing to say (and
// ask the device nothing, so this runs without a GPU).
TEST(MsaPlans, EntriesCarryPlans) {
  ops::KernelTable table;
  cuda::register_cuda_kernels(table);
  ops::Problem p;
  p.device = Device::kCuda;
  p.dtype = DType::kBF16;
  p.m = 1, p.n = 64, p.k = 128, p.extra = kTopK;
  int with_plan = 0;
  for (const auto& e : table.attention.entries()) {
    if (e.name.rfind("attention.msa_", 0) != 0) continue;
    ASSERT_TRUE(e.plan) << e.name;
    EXPECT_EQ(e.plan(p), "") << e.name;
    ++with_plan;
  }
  EXPECT_EQ(with_plan, 5);
  for (const auto& e : table.indexer_topk.entries()) {
    if (e.name != "indexer_topk.msa_tc_exact.sm90") continue;
    ASSERT_TRUE(e.plan);
    EXPECT_EQ(e.plan(p), "");
    ++with_plan;
  }
  EXPECT_EQ(with_plan, 6);
}

}  // namespace
}  // namespace m3

namespace m3 {
namespace {

// What the kernels rely on, over a sweep of batches, contexts, head layouts and device limits:
// a split is a power of two within the cluster limit and never more than the row group's
// super-units; partials fit their buffer; the early units only where the kernel variant exists;
// the indexer's chunks and score slices cover the work once.
TEST(MsaPlans, InvariantsOverASweep) {
  const cuda::MsaAttnLimits limits[] = {{132, 16, 16, 16}, {132, 8, 8, 8}, {114, 16, 8, 8}, {20, 4, 2, 2},
                                        {132, 16, 16, 16, {66, 30, 15, 7}, 264}};
  struct Heads {
    int64_t q, kv, index;
  };
  const Heads heads[] = {{64, 4, 4}, {16, 1, 1}, {8, 2, 2}, {32, 2, 4}};
  int checked = 0;
  for (const auto& lim : limits) {
    for (const Heads& h : heads) {
      for (int64_t context : {int64_t(1), int64_t(127), int64_t(128), int64_t(300), int64_t(2048), int64_t(8192),
                              int64_t(131072), int64_t(524288)}) {
        for (int seqs : {1, 2, 3, 4, 5, 15, 16, 33, 64, 128, 300}) {
          for (int per_seq : {1, 4, 100}) {
            for (bool sparse : {true, false}) {
              MsaAttnShape s;
              s.tokens = int64_t(seqs) * per_seq;
              s.num_seqs = seqs;
              s.q_heads = h.q;
              s.kv_heads = h.kv;
              s.head_dim = 128;
              s.bs = kBlock;
              s.max_blocks = int((context + kBlock - 1) / kBlock);
              s.sparse = sparse;
              s.top_k = sparse ? kTopK : 0;
              const MsaAttnPlan p = cuda::msa_attention_plan(s, lim);
              ASSERT_TRUE(p.tuned);
              const std::string at = std::to_string(seqs) + " x " + std::to_string(per_seq) + " tokens at " +
                                     std::to_string(context) + (sparse ? " sparse" : " dense");
              EXPECT_EQ(p.pure_decode, per_seq == 1) << at;
              EXPECT_GE(p.splits, 1) << at;
              EXPECT_EQ(p.splits & (p.splits - 1), 0) << at;
              const int cap = p.m_tiles == 4 ? lim.cluster_four : p.split_ring ? lim.cluster_ring : lim.cluster_deep;
              EXPECT_LE(p.splits, std::max(cap, 2)) << at;
              EXPECT_LE(p.splits, std::max<int64_t>(1, p.su_cap)) << at;
              EXPECT_EQ(p.ctas, s.tokens * s.kv_heads * p.splits * p.stripes) << at;
              EXPECT_GE(p.stripes, 1) << at;
              EXPECT_EQ(p.stripes & (p.stripes - 1), 0) << at;
              if (p.stripes > 1) {  // the kernel variant's domain: dense decode on the ring, a counter per row group
                EXPECT_TRUE(!sparse && p.pure_decode && p.split_ring && p.m_tiles == 1) << at;
                EXPECT_EQ(p.splits, lim.cluster_ring) << at;
                EXPECT_LE(p.groups, cuda::kMaxStripeGroups) << at;
                EXPECT_LE(p.ctas, lim.stripe_ctas) << at;
                EXPECT_LE(int64_t(p.splits) * p.stripes, p.su_cap) << at;  // a super-unit per CTA at the longest context
              }
              EXPECT_GE(int64_t(p.tokens_per_group) * (sparse ? kTopK : 0), 0);
              if (sparse) {
                EXPECT_LE(int64_t(p.tokens_per_group) * kTopK, 512) << at;
              }
              if (p.m_tiles == 1) {
                EXPECT_LE(int64_t(p.tokens_per_group) * (h.q / h.kv), 16) << at;
              }
              if (p.splits > 1) {
                EXPECT_LE(p.part_bytes, size_t(256) << 20) << at;
              }
              if (p.fixed_partials) {
                EXPECT_TRUE(p.splits > 1 && p.pure_decode && p.part_bytes <= (size_t(8) << 20)) << at;
              }
              if (p.early) {
                EXPECT_TRUE(sparse && p.pure_decode && seqs <= cuda::kEarlyUnitsMaxSeqs && p.split_ring) << at;
                EXPECT_LE(p.early_max_blocks, kTopK) << at;          // all selected
                EXPECT_LE(p.early_max_blocks, p.splits * 16) << at;  // a CTA's units fit its list
                EXPECT_GE(p.su_cap, std::min<int64_t>(p.early_max_blocks, s.max_blocks)) << at;  // a partial per block
              } else {
                EXPECT_EQ(p.early_max_blocks, 0) << at;
              }

              cuda::MsaIndexerShape is;
              is.tokens = s.tokens;
              is.num_seqs = seqs;
              is.heads = h.index;
              is.dim = 128;
              is.bs = kBlock;
              is.max_blocks = s.max_blocks;
              is.top_k = kTopK;
              const cuda::MsaIndexerPlan ip = cuda::msa_indexer_plan(is, lim.sms);
              ASSERT_TRUE(ip.tuned);
              EXPECT_GE(ip.chunks, 1) << at;
              EXPECT_LE(ip.chunks, std::max(1, std::min(1024, ip.max_blocks - 1))) << at;
              EXPECT_GE(ip.group_tokens, 1) << at;
              EXPECT_GE(ip.slice, ip.group_tokens) << at;
              EXPECT_GE(ip.first_slice, 1) << at;
              EXPECT_LE(ip.first_slice, ip.slice) << at;
              EXPECT_EQ(ip.first_slice + (ip.launches - 1) * ip.slice, s.tokens) << at;
              if (ip.fixed_scores) {
                EXPECT_LE(ip.score_bytes, size_t(4) << 20) << at;
              }
              ++checked;
            }
          }
        }
      }
    }
  }
  EXPECT_EQ(checked, 5 * 4 * 8 * 11 * 3 * 2);
}

}  // namespace
}  // namespace m3
