// The fused MoE router (moe_router.cu): batch-invariant split-K logits + a warp per token
// selecting, two launches for any token count.
#pragma once

#include <cstdint>
#include <string>

namespace m3::cuda {

// Why the fused router cannot take this shape ("" when it can).
std::string fused_router_problem(int64_t experts, int64_t hidden, int top_k, const float* x, int64_t ldx,
                                 const float* w);

// ids/weights: [tokens, top_k]; bias may be null. On current_stream().
void launch_fused_router(const float* x, int64_t ldx, int64_t tokens, const float* w, int64_t experts, int64_t hidden,
                         const float* bias, int top_k, float scale, int32_t* ids, float* weights);

}  // namespace m3::cuda
