#pragma once
// make-model: writes a random-weight M3 checkpoint of any shape in the exact HF layout
// (config.json, generation_config.json, sharded safetensors + index), BF16 or MXFP8.
//
// Values are bit-identical across machines for a given seed: every element is a pure
// function of (seed, tensor name, element index) through splitmix64 and Box-Muller in
// double, so tensors can be produced in parallel and streamed shard by shard. An MXFP8
// checkpoint quantises exactly the fp32 draws that the BF16 checkpoint of the same seed
// rounds to bf16.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "core/status.h"
#include "model/minimax_m3/config.h"
#include "model/minimax_m3/weight_specs.h"

namespace m3 {

struct MakeModelOptions {
  std::string out_dir;
  MiniMaxM3Config config;
  bool mxfp8 = false;
  uint64_t seed = 0;
  size_t max_shard_bytes = size_t(64) << 20;
  int num_threads = 0;  // generation threads; 0 = hardware concurrency
};

Status make_model(const MakeModelOptions& options);

// The small vision tensor every make-model checkpoint carries, so that readers prove they
// skip non-text keys.
inline constexpr const char* kMakeModelVisionTensor = "vision_tower.vision_model.pre_layrnorm.weight";

// Standard deviation of a tensor's N(0, std) init: embedding 1, linear / lm_head
// 1/sqrt(in_features), norm deltas 0.1, router 1/sqrt(hidden), router bias 0.05.
double init_std(const WeightSpec& spec);

// Element `index` (row-major) of the fp32 draw for `tensor_name` under `seed`, times `std`.
float make_model_value(uint64_t seed, std::string_view tensor_name, double std, int64_t index);

// MXFP8-quantises one row of `k` values (k % 32 == 0): per run of 32, shared exponent
// e = ceil(log2(amax / 448)) (amax == 0 -> -127), clamped to [-127, 127]; scale byte e + 127;
// q = fp8_e4m3(w / 2^e). Writes k bytes to `q` and k / 32 bytes to `scales`.
void quantize_mxfp8_row(const float* w, int64_t k, uint8_t* q, uint8_t* scales);

}  // namespace m3
