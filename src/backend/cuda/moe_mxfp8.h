#pragma once
// MXFP8 MoE experts on Hopper (moe_mxfp8.cu): two grouped-GEMM paths over the native MXFP8
// weights (e4m3 [out, in] + e8m0 [out, in/32]), the shared expert fused as the last expert.
//   kW8A16: activations in f16 with a power-of-two scale per token, e4m3 weights dequantised
//           exactly to f16 in registers (block scales folded in relative to each row's largest
//           scale), mma.sync m16n8k16, fp32 accumulation. Fixed per-output order: batch-invariant.
//   kW8A8:  activations quantised to e4m3 with a power-of-two scale per token, wgmma m64nNk32
//           (sm_90a) fed by a cp.async producer warpgroup, the weight's e8m0 block scale applied
//           per 32-wide K step in fp32, persistent CTAs. Token-count dependent choice of path, so
//           only for batch_invariant == false (see docs/adr/0003-moe-mxfp8-kernels.md).
// Both: device routing (counting sort in the CPU reference's order), fused gate+up SwiGLU-OAI,
// one combine pass in the CPU's order, no host synchronisation (graph capturable).
// Declarations here are for the dispatch registration, the parity test and the benchmark.
#include <cstddef>
#include <cstdint>
#include <string>

#include "ops/ops.h"

namespace m3::cuda {

// moe_experts entries: W8A8 (large token counts, batch invariance off) then W8A16; appended
// before register_gemm's grouped row-dot entry so they win where eligible.
void register_moe_mxfp8(ops::KernelTable& table);

namespace moe_mxfp8 {

//   kW8A16Wg: kW8A16's numerics bit for bit (same fragments, same MMA order) on wgmma m64nNk16 with
//           the activations (f16, stored in the kernel's K order) in shared memory: the
//           batch-invariant path for prefill-sized calls.
enum class Path { kW8A16, kW8A8, kW8A16Wg };

// Token counts from which the dispatch takes kW8A16Wg for W8A16's numerics (any batch-invariance
// setting; W8A8 wins where it is eligible). The choice changes no bit. Measured on the H200 (M3
// TP1 block): the mma.sync kernel is 4-6 % faster at 256 tokens, the wgmma one 28 % faster at 512.
constexpr int64_t kW8A16WgMinTokens = 384;

// Token counts from which the dispatch takes W8A8 (when batch invariance is off). Measured on the
// H200 (M3 TP1 block): W8A8 is 15 % faster at 256 tokens, 34 % at 512, 45 % at 1024; below 256
// W8A16 keeps 11-bit activations (W8A8 would gain 5-10 % there).
constexpr int64_t kW8A8MinTokens = 256;

// "" when the experts can run on `path`: device F8E4M3 + U8 e8m0 weights, hidden and every
// intermediate size multiples of 128, 16-byte aligned data, <= 256 experts, 1 <= top_k <= 64.
std::string check(const ops::ExpertWeights& experts, int64_t hidden, int64_t top_k);

// Which parts of the block `run` launches (the benchmark times the GEMMs alone).
enum Stage : unsigned { kRoute = 1u, kPrep = 2u, kGemms = 4u, kCombine = 8u, kAll = 15u };

// Device workspace `run` needs (a function of shapes only).
size_t workspace_bytes(int64_t tokens, int64_t top_k, const ops::ExpertWeights& experts, int64_t hidden, Path path);

// out[t] = sum over t's experts (ascending id, shared last with weight 1) of w * expert(x[t]).
// x, out: F32 [tokens, hidden] device; ids I32, weights F32 [tokens, top_k]. On current_stream();
// `workspace` from workspace_bytes (device, 256-byte aligned). Throws on an invalid problem.
void run(const TensorView& x, const TensorView& expert_ids, const TensorView& expert_weights,
         const ops::ExpertWeights& experts, const ops::SwigluParams& act, const TensorView& out, Path path,
         void* workspace, unsigned stages = kAll);

// The power of two the f16 intermediate h = swiglu_oai(gate, up) is multiplied by (|h| * it < 2^15
// for every input, from the clamp); the down projection divides it out.
float intermediate_scale(const ops::SwigluParams& act);

// Rows per work item each path uses at a token count (the routing's tile size).
int rows_per_item(Path path, int64_t tokens);

// How `run` lays out a call's GEMMs and combine, from shapes alone (the work items are counted on
// the device, so grids over items are sized by their bound). `run` takes its launch geometry from
// here, and the dispatch trace prints it (plan_text), so the two cannot disagree.
struct GemmPlan {
  Path path = Path::kW8A16;
  int rows_per_item = 0;
  // W8A16 mma.sync: the token tile in 8-row sub-tiles (2: 16 rows, 8 for items of <= 8 rows; 0:
  // per item, 16 rows with the weight ring or 64 with weights in registers). wgmma paths: 0 (N
  // = the item's rows rounded up to 32, at most 128, per tile).
  int token_tile = 0;
  int threads = 0;                             // per CTA
  bool persistent = false;                     // CTAs walk the (item, column tile) list
  int gu_cols = 0, dn_cols = 0;                // output columns per tile (gate_up: SwiGLU columns)
  int64_t gu_col_tiles = 0, dn_col_tiles = 0;  // per item, over the widest expert
  int stages = 0;  // W8A16 mma: shared-memory weight stages (the 64-row tile keeps weights in registers); wgmma: pipeline
  int64_t combine_ctas_per_token = 0;
};
GemmPlan gemm_plan(Path path, int64_t tokens, int64_t inter, int64_t hidden);
std::string plan_text(const GemmPlan& plan);

// The routing step alone (for the parity test): perm [tokens * top_k + tokens * has_shared]
// (token of each permuted row), pos [tokens * top_k] (row of each assignment, -1 for ids outside
// [0, routed)), items [item_bound] int4 (expert, row_begin, row_end, 0), meta[0] = item count,
// meta[1] = first row of the shared expert. Device pointers, current_stream().
int64_t item_bound(int64_t tokens, int64_t top_k, int total_experts, int rows_per_item);
void route(const int32_t* ids, int tokens, int top_k, int routed, bool has_shared, int rows_per_item, int32_t* perm,
           int32_t* pos, void* items, int* meta);

}  // namespace moe_mxfp8
}  // namespace m3::cuda
