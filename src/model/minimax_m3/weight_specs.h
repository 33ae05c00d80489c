#pragma once
// The checkpoint's text tensors for a config: names (with the `language_model.` prefix as
// shipped), shapes and roles. make-model writes exactly this list; the loader reads it.
#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/minimax_m3/config.h"

namespace m3 {

enum class WeightRole {
  kEmbedding,   // bf16, never quantised
  kLmHead,      // bf16, never quantised
  kNorm,        // bf16 Gemma delta
  kLinear,      // bf16, or fp8 e4m3 + e8m0 `weight_scale_inv` [out, in/32] under MXFP8
  kRouter,      // fp32 [experts, hidden]
  kRouterBias,  // fp32 [experts]
};

struct WeightSpec {
  std::string name;  // full checkpoint key, e.g. "language_model.model.layers.0.self_attn.q_proj.weight"
  Shape shape;
  WeightRole role;
  int layer = -1;       // -1 for embed / final norm / lm_head
  bool expert = false;  // a MoE expert's projection (routed or shared): loaded by LoadOptions::expert_format
};

inline constexpr const char* kTextPrefix = "language_model.";

// The quantisation scale tensor that goes with a kLinear weight under MXFP8.
std::string scale_name_for(const std::string& weight_name);

std::vector<WeightSpec> weight_specs(const MiniMaxM3Config& config);

}  // namespace m3
