// The plans section of docs/kernel_paths.md: at M3's shapes (TP1) on an H200, which entry each
// op's table selects and how that entry runs it (tiles, splits, buffers), for decode batches,
// prefills and MoE token counts. Built from the dispatch tables and the launchers' own plan
// functions, so any change of a rule changes the doc (unit_kernel_paths_doc checks it).
#include <sstream>
#include <string>

#include "app/kernel_plans.h"
#include "model/minimax_m3/config.h"
#include "ops/ops.h"
#ifdef M3_HAVE_M3_BACKEND_CUDA
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/msa.h"
#endif

namespace m3::app {

#ifdef M3_HAVE_M3_BACKEND_CUDA
namespace {

// The device the doc describes: an H200 (132 SMs; the attention kernels' largest clusters 16;
// dense decode stripes over up to two CTAs per SM, as msa_attention_limits sets).
const cuda::MsaAttnLimits kH200 = [] {
  cuda::MsaAttnLimits l{132, 16, 16, 16};
  l.stripe_ctas = cuda::default_stripe_ctas(l.sms);
  return l;
}();

// "`entry`: plan" for the entry the table selects. The MSA entries' own plan functions ask the
// current device for its limits; here they are kH200's.
template <class Table>
std::string cell(const Table& table, const ops::Problem& p) {
  const auto* e = table.find(p, nullptr);
  if (!e) return "(no entry)";
  const bool msa = e->name.rfind("attention.msa_", 0) == 0 || e->name.rfind("indexer_topk.msa_", 0) == 0;
  const std::string plan = msa ? cuda::msa_entry_plan(e->name, p, kH200) : e->plan ? e->plan(p) : "";
  return "`" + e->name + "`" + (plan.empty() ? "" : ": " + plan);
}

template <class Table>
std::string entry_name(const Table& table, const ops::Problem& p) {
  const auto* e = table.find(p, nullptr);
  return e ? "`" + e->name + "`" : "(no entry)";
}

ops::Problem problem(const char* op, DType dtype, int64_t m, int64_t n, int64_t k, int64_t extra, bool invariant) {
  return ops::make_problem(op, Device::kCuda, dtype, m, n, k, extra, invariant);
}

std::string k_of(int64_t tokens) { return tokens % 1024 == 0 ? std::to_string(tokens / 1024) + "K" : std::to_string(tokens); }

}  // namespace

std::string kernel_plans_markdown() {
  ops::KernelTable table;
  cuda::register_cuda_kernels(table);
  const MiniMaxM3Config c;  // M3's shapes
  const int bs = c.index_block_size, top_k = c.index_topk_blocks;
  int32_t seq_len_stub = 0;  // the plans read only whether seq_lens is present
  auto layout = [&](int seqs, int64_t context) {
    ops::AttentionMetadata meta;
    meta.num_seqs = seqs;
    meta.block_size = bs;
    meta.max_blocks_per_seq = int((context + bs - 1) / bs);
    meta.seq_lens = &seq_len_stub;
    meta.qkv_before_previous_kernel = true;  // an MSA layer's attention right after its own indexer
    meta.indexer_after_prologue = true;      // and that indexer right after the attention prologue
    return meta;
  };
  // Heads per GPU: TP1 or TP4 (M3's 64 / 4 query / KV heads and 4 index heads over 4 GPUs).
  int tp = 1;
  auto attention = [&](int64_t tokens, const ops::AttentionMetadata& meta, bool sparse, bool invariant) {
    ops::Problem p = problem(sparse ? "attention_sparse" : "attention_dense", DType::kBF16, tokens,
                             c.num_attention_heads / tp, c.head_dim, sparse ? top_k : 0, invariant);
    p.attention = &meta;
    p.kv_heads = c.num_key_value_heads / tp;
    return cell(table.attention, p);
  };
  auto indexer = [&](int64_t tokens, const ops::AttentionMetadata& meta, DType keys = DType::kBF16) {
    ops::Problem p = problem("indexer_topk", keys, tokens, c.index_n_heads / tp, c.index_head_dim, top_k, true);
    p.attention = &meta;
    return cell(table.indexer_topk, p);
  };
  auto decode_table = [&](std::ostringstream& md) {
    md << "| context | batch | indexer_topk | indexer_topk, FP8 index-K | attention_sparse | attention_dense (layers "
          "0-2) |\n|---|---|---|---|---|---|\n";
    for (int64_t context : {int64_t(8192), int64_t(131072)}) {
      for (int b : {1, 2, 4, 8, 16, 32, 64, 128}) {
        const ops::AttentionMetadata meta = layout(b, context);
        md << "| " << k_of(context) << " | " << b << " | " << indexer(b, meta) << " | "
           << indexer(b, meta, DType::kF8E4M3) << " | " << attention(b, meta, true, true) << " | "
           << attention(b, meta, false, true) << " |\n";
      }
    }
  };

  std::ostringstream md;
  md << "\n## Plans at M3's shapes\n\n"
        "What the tables above select at M3's TP1 shapes on an H200 (132 SMs, clusters of up to 16 CTAs), and\n"
        "how the entry runs it: the plan its launcher takes its geometry from, as the dispatch trace prints it\n"
        "at a shape's first use. BF16 KV and index-K caches and batch invariance on (the engine's default)\n"
        "unless a column says otherwise. Page tables here are as wide as the context; the engine's are\n"
        "max_model_len wide, so its decode indexer launches up to one CTA per SM per query group (those past a\n"
        "sequence's blocks exit at once).\n\n"
        "### An MSA layer's decode step\n\n";
  decode_table(md);
  tp = 4;
  md << "\n### The same at TP4 (" << c.num_attention_heads / tp << " query heads over " << c.num_key_value_heads / tp
     << " KV head, " << c.index_n_heads / tp << " index head per GPU)\n\n";
  decode_table(md);
  tp = 1;
  md << "\n### A prefill of one sequence\n\n"
        "| tokens | indexer_topk | attention_sparse | attention_sparse, invariance off | attention_dense |\n"
        "|---|---|---|---|---|\n";
  for (int64_t tokens : {int64_t(8192), int64_t(32768)}) {
    const ops::AttentionMetadata meta = layout(1, tokens);
    md << "| " << k_of(tokens) << " | " << indexer(tokens, meta) << " | " << attention(tokens, meta, true, true) << " | "
       << attention(tokens, meta, true, false) << " | " << attention(tokens, meta, false, true) << " |\n";
  }
  md << "\n### A MoE layer (MXFP8 experts, top-" << c.num_experts_per_tok << " of " << c.num_local_experts
     << " + the shared expert)\n\n"
        "| tokens | moe_router | moe_experts | moe_experts, invariance off | moe_experts at TP4 (intermediate "
     << c.intermediate_size / 4 << ") |\n|---|---|---|---|---|\n";
  for (int64_t t : {1, 8, 32, 128, 256, 512, 4096, 16384}) {
    md << "| " << t << " | "
       << cell(table.router, problem("moe_router", DType::kF32, t, c.num_local_experts, c.hidden_size,
                                     c.num_experts_per_tok, true))
       << " | "
       << cell(table.moe, problem("moe_experts", DType::kF8E4M3, t, c.intermediate_size, c.hidden_size,
                                  c.num_experts_per_tok, true))
       << " | "
       << cell(table.moe, problem("moe_experts", DType::kF8E4M3, t, c.intermediate_size, c.hidden_size,
                                  c.num_experts_per_tok, false))
       << " | "
       << cell(table.moe, problem("moe_experts", DType::kF8E4M3, t, c.intermediate_size / 4, c.hidden_size,
                                  c.num_experts_per_tok, true))
       << " |\n";
  }
  // A sparse layer's projections of x run as one group (q, k, v, index q, index k: model.cpp).
  const int64_t q = int64_t(c.num_attention_heads) * c.head_dim, kv = int64_t(c.num_key_value_heads) * c.head_dim;
  const int64_t group_n = q + 2 * kv + int64_t(c.index_n_heads) * c.index_head_dim + c.index_head_dim;
  md << "\n### Linears (MXFP8 weights; the LM head BF16)\n\n"
        "| rows | q, k, v, index q, index k as one group [" << group_n << " x " << c.hidden_size << "] | o_proj ["
     << c.hidden_size << " x " << q << "] | dense MLP [" << c.dense_intermediate_size << " x " << c.hidden_size
     << "] | lm_head [" << c.vocab_size << " x " << c.hidden_size << "] |\n|---|---|---|---|---|\n";
  for (int64_t m : {1, 8, 32, 128, 256, 384, 512, 4096}) {
    const ops::Problem group = problem("linear_group", DType::kF8E4M3, m, group_n, c.hidden_size, 5, true);
    md << "| " << m << " | "
       << (table.linear_group.find(group, nullptr)
               ? cell(table.linear_group, group)
               : "each weight as a linear: q " +
                     entry_name(table.linear, problem("linear", DType::kF8E4M3, m, q, c.hidden_size, 0, true)) +
                     ", k and v " +
                     entry_name(table.linear, problem("linear", DType::kF8E4M3, m, kv, c.hidden_size, 0, true)))
       << " | " << cell(table.linear, problem("linear", DType::kF8E4M3, m, c.hidden_size, q, 0, true)) << " | "
       << cell(table.mlp, problem("dense_mlp", DType::kF8E4M3, m, c.dense_intermediate_size, c.hidden_size, 0, true))
       << " | " << cell(table.linear, problem("linear", DType::kBF16, m, c.vocab_size, c.hidden_size, 0, true)) << " |\n";
  }
  return md.str();
}

#else

std::string kernel_plans_markdown() { return ""; }

#endif

}  // namespace m3::app
