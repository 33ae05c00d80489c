#pragma once
// Checked access to a checkpoint's text weights: each WeightSpec is located in the model
// directory and validated (dtype for its role, shape, and for MXFP8 linears the e8m0 scale
// tensor), then either handed out as-is (views into the mmapped shards) or read as fp32.
// Every error names the file, the tensor and what was expected.
#include <string>
#include <vector>

#include "core/status.h"
#include "loader/model_dir.h"
#include "model/minimax_m3/config.h"
#include "model/minimax_m3/weight_specs.h"

namespace m3 {

// A validated weight as stored on disk. `scale` is set only for an MXFP8 linear: weight
// F8_E4M3 [out, in], scale U8 [out, in / 32], W = fp8(q) * 2^(scale - 127).
struct StoredWeight {
  const TensorInfo* weight = nullptr;
  const TensorInfo* scale = nullptr;
  bool is_mxfp8() const { return scale != nullptr; }
};

// Accepted dtypes: BF16, F32 or F16 for every role; F8_E4M3 (+ scale) only for kLinear and
// only when `allow_mxfp8` (the config has an mxfp8 quantization_config). A kLinear left in
// BF16 inside an MXFP8 checkpoint (an ignored layer) is accepted.
Result<StoredWeight> locate_weight(const ModelDir& dir, const WeightSpec& spec, bool allow_mxfp8);

// Reads a checkpoint tensor as fp32 (BF16 / F16 / F32 converted exactly; MXFP8 dequantised
// exactly as fp8 * 2^(scale - 127)), validating dtype and shape.
Result<std::vector<float>> read_f32(const ModelDir& dir, const WeightSpec& spec, bool allow_mxfp8);

// Locates every weight of weight_specs(config) and reports all problems at once
// (at most `max_problems` lines).
Status validate_checkpoint(const ModelDir& dir, const MiniMaxM3Config& config, size_t max_problems = 20);

}  // namespace m3
