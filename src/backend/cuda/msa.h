#pragma once
// The tuned MSA entries (msa_indexer.cu, msa_decode.cu, msa_prefill.cu) and the generic
// kernels of attention.cu they hand shapes they do not take to (so a BF16 cache always has a
// kernel).
#include <string>
#include <vector>

#include "ops/ops.h"

namespace m3::cuda {

// Generic entries (attention.cu): any head_dim <= 256, block size, top_k <= 64.
void launch_generic_attention(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                              const ops::AttentionMetadata& meta, const TensorView& selected, int top_k,
                              const TensorView& out);
void launch_generic_indexer_topk(const TensorView& index_q, const TensorView& index_k_cache,
                                 const ops::AttentionMetadata& meta, const ops::IndexerParams& params,
                                 const TensorView& selected);

// Tuned entries, callable directly (the benchmark and the parity test time and check them
// without the dispatch table).
enum class MsaIndexerLayout {
  kAuto,   // prefill-shaped batches with blocks of 128 keys: kPrefill; else the warp-streamed
           // kernel where it takes the shape (blocks of 16..128 keys; its CTAs whose chunk holds at
           // most kExactMaxRowBlocks (row, block) pairs scan them exactly), else the tiles
  kTiles,  // the 128-row tiles (also what blocks of 8 keys always run)
  kStreamed,  // the warp-streamed kernel (approximate MMA pass in every CTA) where it takes the
              // shape, else the tiles
  kPrefill,  // 256-row groups, a warp per 16 rows and whole 128-key blocks (blocks of 128 keys only;
             // other shapes fall back to kAuto's choice)
  kExact,    // the warp-streamed kernel with every CTA scanning exactly (chunks of at most 64 blocks)
  kDynamic,  // the warp-streamed kernel, two CTAs per group, its warps taking units from the group's
             // counter wherever each has one (kAuto: where a warp's fixed share would be >=
             // kDynamicMinUnits units)
  kPrefillSliced,  // kPrefill with a score scratch of about three query groups, so that any
                   // prefill of more runs in several launches (long prefills' slices, at test sizes)
};
// kAuto's exact scan: a decode CTA's (row, block) pairs at most (M3 at B = 1: two blocks of 4 rows).
constexpr int kExactMaxRowBlocks = 8;
// kAuto's shared unit counters: where a warp's fixed share of its group's units would be at least
// this (H200, M3 shapes, 128K: BF16 B = 64 and 128, FP8 B = 64 and 128; at 8-16 units per warp,
// B = 8 and 32K contexts, the counter's round trips cost more than the balance saves).
constexpr int kDynamicMinUnits = 24;
// How launch_msa_indexer_layout runs a batch, from its shape and the SM count alone: the kernel,
// query groups and CTAs per group, the unit counters, the exact scan's limit, the score slices
// and where the scores go. The launcher takes all of it from here; the dispatch trace prints it.
struct MsaIndexerShape {
  int64_t tokens = 0, heads = 0, dim = 0;
  int num_seqs = 0, max_blocks = 0, bs = 0, top_k = 0;
  bool bf16 = true, fp8 = false;  // the index-K cache's type (neither: the generic kernel)
  bool after_prologue = false;    // AttentionMetadata::indexer_after_prologue
};
struct MsaIndexerPlan {
  bool tuned = false;             // else the generic kernel runs
  bool prefill = false, tiles = false;  // neither: the warp-streamed decode kernel
  bool tma = false;            // prefill kernel: key blocks by TMA (BF16 keys), else by cp.async
  int max_blocks = 0, group_tokens = 0, chunks = 0, ctas_per_sm = 0, exact_max = 0, dyn_min_units = 0;
  int64_t groups = 0, slice = 0, first_slice = 0, launches = 0;
  bool unit_counters = false;  // the decode kernel's warps may take units from a counter per group
  size_t row_bytes = 0, score_bytes = 0;
  bool fixed_scores = false;   // score rows in a fixed buffer (no memory node in a graph), else the pool
  // The decode kernel at pure decode right after the attention prologue: that kernel's
  // programmatic dependent, its page ids and first key tiles requested before its wait.
  bool keys_before_wait = false;
};
MsaIndexerShape msa_indexer_shape(const TensorView& index_q, const TensorView& index_k_cache,
                                  const ops::AttentionMetadata& meta, int top_k);
MsaIndexerShape msa_indexer_shape(const ops::Problem& p);  // p.attention set (ops::indexer_topk)
std::string msa_indexer_refusal(const MsaIndexerShape& shape);  // "" when the tuned kernels take it
MsaIndexerPlan msa_indexer_plan(const MsaIndexerShape& shape, int64_t sms, MsaIndexerLayout layout = MsaIndexerLayout::kAuto);
std::string msa_indexer_plan_text(const MsaIndexerPlan& plan);
void launch_msa_indexer(const TensorView& index_q, const TensorView& index_k_cache, const ops::AttentionMetadata& meta,
                        const ops::IndexerParams& params, const TensorView& selected);
void launch_msa_indexer_layout(const TensorView& index_q, const TensorView& index_k_cache,
                               const ops::AttentionMetadata& meta, const ops::IndexerParams& params,
                               const TensorView& selected, MsaIndexerLayout layout);
// How the query-major kernel (launch_msa_attention) runs a batch, from its shape and the
// device's limits alone: row groups, m-tiles, the stage layout, the cluster split and where
// the split partials go. The launcher takes all of it from here; the dispatch trace prints it.
struct MsaAttnShape {
  int64_t tokens = 0, q_heads = 0, kv_heads = 0, head_dim = 0;
  int num_seqs = 0, max_blocks = 0, bs = 0, top_k = 0;
  bool sparse = false;  // block-sparse (top_k selected blocks per token and KV group), else dense causal
  bool bf16 = true;     // K and V caches are BF16
  bool has_seq_lens = true;  // the metadata carries seq_lens (the block-major kernels need them)
  bool early_reads = false;  // AttentionMetadata::qkv_before_previous_kernel
};
MsaAttnShape msa_attn_shape(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                            const ops::AttentionMetadata& meta, const TensorView& selected, int top_k);
MsaAttnShape msa_attn_shape(const ops::Problem& p);  // p.attention set (ops::attention)
struct MsaAttnLimits {
  int64_t sms = 132;
  int cluster_deep = 16, cluster_ring = 16, cluster_four = 16;  // largest cluster each kernel launches with
  // Clusters of 2, 4, 8, 16 CTAs of the split ring with pushed partials beside the ring (one CTA
  // per SM) that can be resident at once (0: not asked; those plans keep the global fold).
  int push_wide_clusters[4] = {0, 0, 0, 0};
  // CTAs a dense pure-decode row group's stripes may take in all (MsaAttnPlan::stripes; 0: no
  // stripes). msa_attention_limits: two per SM, the split ring's residency (M3_MSA_STRIPE_CTAS=N
  // overrides it).
  int64_t stripe_ctas = 0;
};
// The stripes' default cap: two CTAs per SM, the split ring's residency (msa_attention_limits).
constexpr int64_t default_stripe_ctas(int64_t sms) { return 2 * sms; }
// Row groups a launch with stripes may have (one arrival counter each).
constexpr int kMaxStripeGroups = 256;
struct MsaAttnPlan {
  bool tuned = false;        // else the generic kernel runs
  bool pure_decode = false;  // one query token per sequence
  int tokens_per_group = 0, m_tiles = 0, splits = 1;
  bool split_ring = false, early = false;
  int early_max_blocks = 0;  // early: contexts of at most this many blocks (<= top_k; a CTA may take several)
  int64_t groups = 0, su_cap = 0, ctas = 0;
  size_t part_bytes = 0;
  bool fixed_partials = false;  // the split partials in a fixed buffer (no memory node in a graph), else the pool
  bool push = false;  // split partials stored into the folding CTAs' shared memory
  size_t push_recv_bytes = 0;  // push: 0 = into the ring's third slot (one unit per CTA), else beside the ring
  // Dense pure decode of a few sequences: clusters per row group (a power of two). Above 1 each
  // cluster writes its partials and counts in; the last one in folds them all (split ring only).
  int stripes = 1;
};
// Why the query-major kernel does not take a shape ("" when it does; else the generic kernel runs).
std::string msa_attention_refusal(const MsaAttnShape& shape);
MsaAttnPlan msa_attention_plan(const MsaAttnShape& shape, const MsaAttnLimits& limits);
std::string msa_attention_plan_text(const MsaAttnPlan& plan);
MsaAttnLimits msa_attention_limits();  // the current device's (asks the CUDA runtime)
// The plan a tuned MSA entry (by name) gives for a problem with its batch layout, on a device of
// these limits ("" without a layout or for other entries): the dispatch trace's text, with the
// current device's limits there; docs/kernel_paths.md's with an H200's.
std::string msa_entry_plan(const std::string& entry, const ops::Problem& problem, const MsaAttnLimits& limits);

// Query-major (decode, speculative verification, and the query-major prefill baseline).
// Launched as a programmatic dependent of the previous kernel on the stream: Q, positions and
// block tables, and for sparse decode of contexts of at most top_k blocks (early units) the K/V
// cache too, must have been written before that kernel started (true after the layer's indexer,
// a plain launch that starts once all earlier work has completed).
void launch_msa_attention(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                          const ops::AttentionMetadata& meta, const TensorView& selected, int top_k,
                          const TensorView& out);
// Why the block-major kernels do not take a shape ("" when they do; else launch_msa_attention
// runs it), and their tokens per chunk (a chunk's partials stay under the scratch budget; hilo:
// the canonical variant's fp32 partials, else the fast one's bf16).
std::string msa_block_major_refusal(const MsaAttnShape& shape);
int64_t msa_block_major_chunk(const MsaAttnShape& shape, bool hilo);
// Why the wgmma dense prefill does not take a shape (""), and its tokens per 128-row tile.
std::string msa_dense_prefill_refusal(const MsaAttnShape& shape);
int64_t msa_dense_prefill_tile_tokens(const MsaAttnShape& shape);
// KV-block-major sparse prefill: selections inverted to {block -> tokens}, each selected block
// loaded once per CTA for all the tokens that chose it, partials merged per row. Shapes it
// does not take (dense, pages > 128, > 128 query heads per KV head) run launch_msa_attention.
void launch_msa_attention_block_major(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                                      const ops::AttentionMetadata& meta, const TensorView& selected, int top_k,
                                      const TensorView& out);
// The same with Q and P rounded to bf16 (half the MMAs): not bit-identical to the other
// entries, so only for batch_invariant == false.
void launch_msa_attention_block_major_fast(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                                           const ops::AttentionMetadata& meta, const TensorView& selected, int top_k,
                                           const TensorView& out);
// The dispatch entries: block-major when the batch averages >= 64 tokens per sequence, else
// query-major (bit-identical results either way for the canonical variant).
void launch_msa_attention_prefill(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                                  const ops::AttentionMetadata& meta, const TensorView& selected, int top_k,
                                  const TensorView& out);
void launch_msa_attention_prefill_fast(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                                       const ops::AttentionMetadata& meta, const TensorView& selected, int top_k,
                                       const TensorView& out);

// Dense causal prefill on wgmma (msa_dense_prefill.cu): 128 rows (query heads x consecutive
// tokens) of one (sequence, KV group) per CTA, bit-identical to the query-major kernel's dense
// result. Shapes it does not take (query heads per KV head > 64, page size not a power of two)
// run launch_msa_attention.
void launch_msa_attention_dense_prefill(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                                        const ops::AttentionMetadata& meta, const TensorView& out);
// Without batch invariance (msa_dense_fa.cu): Q and P rounded to bf16, a producer warpgroup and
// two consumer warpgroups (each unit's softmax under the previous unit's P.V), within the fast
// variants' tolerance of the reference.
constexpr int kDenseFaStages = 2;  // K/V units in flight (the producer's ring)
void launch_msa_attention_dense_prefill_fast(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                                             const ops::AttentionMetadata& meta, const TensorView& out);
// The dispatch entries: dense batches averaging >= 64 tokens per sequence take the kernel above
// (the canonical one, or its fast variant), everything else the query-major one.
void launch_msa_attention_dense(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                                const ops::AttentionMetadata& meta, const TensorView& selected, int top_k,
                                const TensorView& out);
void launch_msa_attention_dense_fast(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                                     const ops::AttentionMetadata& meta, const TensorView& selected, int top_k,
                                     const TensorView& out);

// Decode batches of at most this many sequences: a sequence whose context is at most top_k
// blocks (all selected) and at most one block per CTA of its attention cluster computes its
// attention units while the indexer selects (the indexer lets the attention start early; at M3's
// shapes such batches have clusters of 8-16 CTAs). Larger batches gain nothing from the early
// start and lose ~1 us to it (H200).
constexpr int kEarlyUnitsMaxSeqs = 4;

// Multiprocessor count of the current device (cached per device).
int current_sm_count();

// The fixed device buffers the decode kernels write and read back within a step (the indexer's
// score rows and counters, the attention's split partials), for diagnostics: msa_bench's
// M3_BENCH_WARM_CODE=2 reads them alone into L2 after each flush.
struct MsaFixedBuffer {
  const void* data;
  size_t bytes;
};
std::vector<MsaFixedBuffer> msa_indexer_fixed_buffers();
std::vector<MsaFixedBuffer> msa_attention_fixed_buffers();

}  // namespace m3::cuda
