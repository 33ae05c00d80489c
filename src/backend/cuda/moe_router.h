// The fused MoE router (moe_router.cu): batch-invariant split-K logits + a warp per token
// selecting, two launches for any token count.
#pragma once

#include <cstdint>
#include <string>

#include "ops/ops.h"

namespace m3::cuda {

// Why the fused router cannot take this shape ("" when it can).
std::string fused_router_problem(int64_t experts, int64_t hidden, int top_k, const float* x, int64_t ldx,
                                 const float* w);

// How launch_fused_router lays out a call, from shapes alone: the logits kernel (rows staged in
// shared memory up to 256 tokens, register-tiled past that) and its grid, the partials it stores
// (per 192-wide segment or per group of segments; the fold order is the same), and the select
// kernel's tokens per CTA. The launcher takes its grids from here, so the trace cannot disagree.
struct RouterPlan {
  bool wide = false;     // register-tiled logits kernel (tokens > 256)
  bool per_seg = true;   // a partial per segment (else per group of spg segments)
  int nseg = 0, spg = 0, ngroups = 0, nstored = 0;
  int tokens_per_cta = 0, experts_per_cta = 0;
  int64_t grid[3] = {0, 0, 0};  // logits CTAs
  int select_tokens_per_cta = 0;
};
RouterPlan fused_router_plan(int64_t tokens, int64_t experts, int64_t hidden);
std::string fused_router_plan_text(const RouterPlan& plan);

// ids/weights: [tokens, top_k]; bias may be null. On current_stream().
void launch_fused_router(const float* x, int64_t ldx, int64_t tokens, const float* w, int64_t experts, int64_t hidden,
                         const float* bias, int top_k, float scale, int32_t* ids, float* weights);

// What the router's select kernel hands the MXFP8 experts at one or two tokens (moe_block): x's
// rows converted as the experts' W8A16 prep converts them (f16, a power-of-two scale per row),
// before its wait, and the ids it selects routed as their routing does (one warp), into their
// workspace (moe_mxfp8::hand_off). Their GEMMs then follow the select kernel directly.
struct RouterHandOff {
  void* xc = nullptr;   // __half [tokens, hidden]
  float* xs = nullptr;  // [tokens]
  int routed = 0, rows_per_item = 0;
  bool has_shared = false;
  int32_t* perm = nullptr;
  int32_t* pos = nullptr;
  void* items = nullptr;  // int4 [item bound]
  int* meta = nullptr;
};
// One select CTA (two tokens per CTA) and one routing warp (at most 32 assignments).
constexpr int64_t kHandOffMaxTokens = 2;
// launch_fused_router with the hand-off. Needs fused_router_problem(...) == "", tokens <=
// kHandOffMaxTokens and tokens * top_k <= 32 (throws otherwise); x rows of hidden floats.
void launch_fused_router_hand_off(const float* x, int64_t ldx, int64_t tokens, const float* w, int64_t experts,
                                  int64_t hidden, const float* bias, int top_k, float scale, int32_t* ids,
                                  float* weights, const RouterHandOff& hand_off);
// The CUDA moe_router entry: launch_fused_router where fused_router_problem allows, else row-dot
// logits and a thread per token selecting (moe.cu). Device F32 x and router weight.
void run_router(const TensorView& x, const TensorView& router_w, const TensorView& bias, const ops::RouterParams& params,
                const TensorView& expert_ids, const TensorView& expert_weights);

}  // namespace m3::cuda
