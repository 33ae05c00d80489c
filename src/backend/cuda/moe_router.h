// The fused MoE router (moe_router.cu): batch-invariant split-K logits + a warp per token
// selecting, two launches for any token count.
#pragma once

#include <cstdint>
#include <string>

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

}  // namespace m3::cuda
