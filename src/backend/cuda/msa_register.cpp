// Dispatch entries of the tuned MSA kernels. Registered before the generic CUDA entries, so
// they win wherever eligible. Attention and indexer problems carry the batch layout
// (Problem::attention), so the eligibility sees the page size and the tokens per sequence and the
// trace names the kernel that runs; the launchers keep their own hand-offs (prefill entries to
// query-major, tuned to generic) for direct callers and problems without a layout.
#include <algorithm>
#include <functional>
#include <string>

#include "backend/cuda/cuda_internal.h"
#include "backend/cuda/msa.h"

namespace m3::cuda {
namespace {

constexpr const char* kIndexerName = "indexer_topk.msa_tc_exact.sm90";
constexpr const char* kBlockMajorFastName = "attention.msa_block_major_prefill_fast.sm90";
constexpr const char* kBlockMajorName = "attention.msa_block_major_prefill.sm90";
constexpr const char* kDensePrefillFastName = "attention.msa_dense_prefill_fast.sm90";
constexpr const char* kDensePrefillName = "attention.msa_dense_prefill.sm90";
constexpr const char* kQueryMajorName = "attention.msa_query_major.sm90";

// Query tokens from which a sparse attention call is a prefill for the KV-block-major entry.
constexpr int64_t kBlockMajorMinTokens = 1024;
// Query tokens from which a dense attention call is a prefill for the wgmma dense entry.
constexpr int64_t kDensePrefillMinTokens = 64;

bool has_layout(const ops::Problem& p) { return p.attention != nullptr && p.kv_heads >= 1; }

// A batch averaging at least 64 tokens per sequence is a prefill for the two prefill entries
// (block-major pays off when many tokens of a sequence share blocks).
bool prefill_shaped(const ops::Problem& p) { return p.m >= 64 * int64_t(std::max(1, p.attention->num_seqs)); }

// What every tuned attention entry needs: device BF16 K/V, head_dim 128, top_k <= 64.
std::string need_bf16_head128(const ops::Problem& p) {
  if (p.device != Device::kCuda) return "tensors are not in device memory";
  if (p.dtype != DType::kBF16) return "KV cache is not BF16";
  if (p.k != 128) return "head_dim is not 128";
  if (p.extra > 64) return "top_k above 64";
  return "";
}

std::string need_query_major(const ops::Problem& p) {
  std::string why = need_bf16_head128(p);
  if (why.empty() && has_layout(p)) why = msa_attention_refusal(msa_attn_shape(p));
  return why;
}

// The block-major entries: a sparse prefill as well.
std::string need_block_major(const ops::Problem& p) {
  std::string why = need_bf16_head128(p);
  if (!why.empty()) return why;
  if (p.extra < 1) return "dense attention";
  if (p.m < kBlockMajorMinTokens) return "fewer than 1024 query tokens (not a prefill)";
  if (!has_layout(p)) return "";
  if (!prefill_shaped(p)) return "the batch averages fewer than 64 tokens per sequence (not a prefill)";
  return msa_block_major_refusal(msa_attn_shape(p));
}

std::string need_dense_prefill(const ops::Problem& p) {
  std::string why = need_bf16_head128(p);
  if (!why.empty()) return why;
  if (p.extra >= 1) return "block-sparse attention";
  if (p.m < kDensePrefillMinTokens) return "fewer than 64 query tokens (not a prefill)";
  if (!has_layout(p)) return "";
  if (!prefill_shaped(p)) return "the batch averages fewer than 64 tokens per sequence (not a prefill)";
  return msa_dense_prefill_refusal(msa_attn_shape(p));
}

std::string need_indexer(const ops::Problem& p) {
  if (p.device != Device::kCuda) return "tensors are not in device memory";
  if (p.dtype != DType::kBF16 && p.dtype != DType::kF8E4M3) return "index-K cache is not BF16 or F8E4M3";
  if (p.k != 128) return "index head dim is not 128";
  if (p.n > 16) return "more than 16 index heads";
  if (p.extra < 1 || p.extra > 64) return "top_k outside 1..64";
  if (p.attention) return msa_indexer_refusal(msa_indexer_shape(p));
  return "";
}

// The fast (non-invariant) variants: eligible where their canonical entry is, when batch
// invariance is not requested.
std::function<std::string(const ops::Problem&)> without_invariance(std::string (*need)(const ops::Problem&)) {
  return [need](const ops::Problem& p) -> std::string {
    if (p.batch_invariant) return "batch invariance requested (the canonical entries are bit-identical)";
    return need(p);
  };
}

// Plans: what the launchers run for this batch (eligible entries only: the layout passed).
std::string plan_of_entry(const std::string& entry, const ops::Problem& p, const MsaAttnLimits& lim) {
  if (!has_layout(p) && !(p.attention && entry == kIndexerName)) return "";
  if (entry == kIndexerName) return msa_indexer_plan_text(msa_indexer_plan(msa_indexer_shape(p), lim.sms));
  const MsaAttnShape s = msa_attn_shape(p);
  if (entry == kQueryMajorName) return msa_attention_plan_text(msa_attention_plan(s, lim));
  if (entry == kDensePrefillName || entry == kDensePrefillFastName) {
    const int64_t tt = msa_dense_prefill_tile_tokens(s);
    std::string plan = "tiles of " + std::to_string(tt) + " tokens x " + std::to_string(s.q_heads / s.kv_heads) +
                       " heads, <= " + std::to_string(((s.tokens + tt - 1) / tt + s.num_seqs) * s.kv_heads) + " CTAs";
    if (entry == kDensePrefillFastName)
      plan += ", a producer and two consumer warpgroups, K/V units by " +
              std::string(s.bs >= 128 ? "TMA" : "cp.async (pages under 128 keys)") + " through a " +
              std::to_string(kDenseFaStages) + "-stage ring";
    return plan;
  }
  const bool hilo = entry == kBlockMajorName;
  if (!hilo && entry != kBlockMajorFastName) return "";
  const int64_t chunk = msa_block_major_chunk(s, hilo), chunks = (s.tokens + chunk - 1) / chunk;
  return std::to_string(chunks) + " chunk" + (chunks == 1 ? "" : "s") + " of <= " + std::to_string(chunk) + " tokens, " +
         (hilo ? "fp32" : "bf16") + " partials merged per row";
}

// The entries plan on the current device's limits (asked of the runtime once per device), when
// there is a layout to plan.
ops::PlanFn device_plan(const char* entry) {
  return [entry](const ops::Problem& p) -> std::string {
    return p.attention ? plan_of_entry(entry, p, msa_attention_limits()) : "";
  };
}

}  // namespace

std::string msa_entry_plan(const std::string& entry, const ops::Problem& problem, const MsaAttnLimits& limits) {
  return plan_of_entry(entry, problem, limits);
}

void register_msa(ops::KernelTable& table) {
  table.indexer_topk.add(
      {kIndexerName,
       "device BF16 or F8E4M3 index-K cache, index dim 128, <= 16 index heads, 1 <= top_k <= 64, page size a power "
       "of two in 8..128; decode: query groups of 8 or 16 (token, head) rows, pages "
       "split over CTAs, each warp streaming whole 128-key units through its own cp.async ring (blocks of 16..128 "
       "keys; 8-key blocks take the 128-row tiles; long contexts: the units taken from a counter per group shared "
       "by its CTAs), a CTA whose chunk holds <= 8 (row, block) pairs (small "
       "batches) computing every dot exactly with all its threads on each block; prefills with 128-key blocks: 256-row groups, a warp per 16 rows "
       "and whole blocks (BF16 keys by TMA, one CTA barrier per block), candidates within twice the block's bound of its approximate maximum; tensor-core "
       "approximate dots with a rigorous error bound, the reference's exact dot for the keys that can be a block's "
       "maximum (block scores bit-identical to the CPU), warp selection by ranks of the blocks that can make the "
       "top k (a threshold from each lane's two largest scores; radix passes under heavy ties), ties to the lower id",
       need_indexer, launch_msa_indexer, device_plan(kIndexerName)});
  table.attention.add(
      {kBlockMajorFastName,
       "as attention.msa_block_major_prefill.sm90, with Q and P rounded to bf16 (half the tensor-core work) and bf16 "
       "partials (half the bytes the merge reads; within 6e-3 of max|ref|): only when batch invariance is not requested",
       without_invariance(need_block_major),
       launch_msa_attention_prefill_fast, device_plan(kBlockMajorFastName)});
  table.attention.add(
      {kBlockMajorName,
       "device BF16 KV cache, head_dim 128, block-sparse with top_k <= 64, >= 1024 query tokens averaging "
       ">= 64 per sequence (a prefill), pages of <= 128 keys, <= 128 query heads per KV head; "
       "selections inverted to {block -> tokens}, each selected block loaded once for all the tokens that chose it, "
       "canonical unit partials merged in block order (bit-identical to the query-major entry: batch-invariant)",
       need_block_major, launch_msa_attention_prefill, device_plan(kBlockMajorName)});
  table.attention.add(
      {kDensePrefillFastName,
       "as attention.msa_dense_prefill.sm90's shapes, only when batch invariance is not requested: Q and P rounded "
       "to bf16, fp32 softmax; a producer warpgroup loads each 128-key K/V unit (by TMA from pages of >= 128 keys) into a ring of stages, two "
       "consumer warpgroups of 64 rows each run a unit's softmax while the tensor cores do the previous unit's P.V",
       without_invariance(need_dense_prefill),
       launch_msa_attention_dense_fast, device_plan(kDensePrefillFastName)});
  table.attention.add(
      {kDensePrefillName,
       "device BF16 KV cache, head_dim 128, dense (causal), >= 64 query tokens averaging >= 64 per "
       "sequence (a prefill), <= 64 query heads per KV head, pages a power of two; 128 rows "
       "(the query heads of a KV group x consecutive tokens) per CTA share each 128-key K/V unit (by TMA where it lies "
       "whole in the causal prefix of pages of >= 128 keys), two warpgroups on "
       "wgmma (S over all 128 keys with Q from shared memory, P.V per half of the dims with V read transposed by its "
       "descriptor; one warpgroup's softmax under the other's S), "
       "canonical unit partials folded in registers (bit-identical to the query-major entry: batch-invariant)",
       need_dense_prefill, launch_msa_attention_dense, device_plan(kDensePrefillName)});
  table.attention.add(
      {kQueryMajorName,
       "device BF16 KV cache, head_dim 128, dense or block-sparse with top_k <= 64, query heads per KV head <= 64; "
       "the query heads of a KV group (and up to 64 rows of consecutive tokens) share "
       "each 128-key K/V tile, m-tiles of tokens that did not choose a block skip it, bf16 hi+lo tensor-core MMAs, "
       "canonical fp32 unit partials folded in a fixed order (batch-invariant), small batches split over a "
       "thread-block cluster (<= 16 CTAs) and merged in parallel through it; one-m-tile decode streams K and V tiles "
       "through a 3-slot ring (two CTAs per SM) unless a dense context runs on at most half the SMs",
       need_query_major, launch_msa_attention, device_plan(kQueryMajorName)});
}

}  // namespace m3::cuda
