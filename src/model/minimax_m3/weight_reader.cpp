#include "model/minimax_m3/weight_reader.h"

#include <cmath>
#include <cstring>

#include "core/dtype.h"

namespace m3 {
namespace {

constexpr int64_t kMxBlock = 32;

std::string where(const TensorInfo& t) { return "safetensors file " + t.file + ", tensor '" + t.name + "'"; }

std::string not_found(const ModelDir& dir, const std::string& name, const std::string& what) {
  std::string msg = "model dir " + dir.path() + ": " + what + " '" + name + "' not found";
  const std::string prefix = kTextPrefix;
  if (name.rfind(prefix, 0) == 0) msg += " (also tried '" + name.substr(prefix.size()) + "')";
  return msg;
}

bool is_plain_float(DType d) { return d == DType::kBF16 || d == DType::kF32 || d == DType::kF16; }

// Converts `count` elements of a plain float dtype to fp32.
void to_f32(const uint8_t* src, DType dtype, int64_t count, float* out) {
  switch (dtype) {
    case DType::kF32:
      std::memcpy(out, src, size_t(count) * 4);
      break;
    case DType::kBF16:
      for (int64_t i = 0; i < count; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        out[i] = bf16_to_f32(h);
      }
      break;
    case DType::kF16:
      for (int64_t i = 0; i < count; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        out[i] = f16_to_f32(h);
      }
      break;
    default:
      break;
  }
}

}  // namespace

Result<StoredWeight> locate_weight(const ModelDir& dir, const WeightSpec& spec, bool allow_mxfp8) {
  const TensorInfo* t = dir.find(spec.name);
  if (!t) return Status::error(not_found(dir, spec.name, "tensor"));
  const bool linear = spec.role == WeightRole::kLinear;
  const std::string accepted =
      linear && allow_mxfp8 ? "F8_E4M3 (+ U8 scale) or BF16/F32/F16" : "BF16, F32 or F16";
  if (t->dtype == DType::kF8E4M3) {
    if (!linear) {
      return Status::error(where(*t) + ": dtype F8_E4M3, expected " + accepted +
                           " (only linear projection weights are quantised)");
    }
    if (!allow_mxfp8) {
      return Status::error(where(*t) + ": dtype F8_E4M3, expected " + accepted +
                           " (config.json has no mxfp8 quantization_config)");
    }
  } else if (!is_plain_float(t->dtype)) {
    return Status::error(where(*t) + ": dtype " + std::string(dtype_name(t->dtype)) + ", expected " + accepted);
  }
  if (!(t->shape == spec.shape)) {
    return Status::error(where(*t) + ": shape " + t->shape.str() + ", expected " + spec.shape.str());
  }
  StoredWeight w;
  w.weight = t;
  if (t->dtype != DType::kF8E4M3) return w;

  const int64_t out = spec.shape[0], in = spec.shape[1];
  if (in % kMxBlock != 0) {
    return Status::error(where(*t) + ": MXFP8 needs in_features divisible by 32, found " + std::to_string(in));
  }
  const std::string scale_name = scale_name_for(spec.name);
  const TensorInfo* s = dir.find(scale_name);
  if (!s) return Status::error(not_found(dir, scale_name, "MXFP8 scale tensor for " + t->name + ":"));
  if (s->dtype != DType::kU8) {
    return Status::error(where(*s) + ": dtype " + std::string(dtype_name(s->dtype)) +
                         ", expected U8 (e8m0 scales of " + t->name + ")");
  }
  const Shape scale_shape{out, in / kMxBlock};
  if (!(s->shape == scale_shape)) {
    return Status::error(where(*s) + ": shape " + s->shape.str() + ", expected " + scale_shape.str() +
                         " (one e8m0 scale per 1x32 block of " + t->name + " " + spec.shape.str() + ")");
  }
  w.scale = s;
  return w;
}

Result<std::vector<float>> read_f32(const ModelDir& dir, const WeightSpec& spec, bool allow_mxfp8) {
  auto located = locate_weight(dir, spec, allow_mxfp8);
  if (!located) return located.status();
  const StoredWeight& w = located.value();
  const int64_t numel = spec.shape.numel();
  std::vector<float> values(static_cast<size_t>(numel));
  if (!w.is_mxfp8()) {
    to_f32(w.weight->data, w.weight->dtype, numel, values.data());
    return values;
  }
  const int64_t out = spec.shape[0], in = spec.shape[1], blocks = in / kMxBlock;
  const uint8_t* q = w.weight->data;
  const uint8_t* scales = w.scale->data;
  for (int64_t o = 0; o < out; ++o) {
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t sbits = scales[o * blocks + b];
      if (sbits == 255) {
        return Status::error(where(*w.scale) + ": scale [" + std::to_string(o) + ", " + std::to_string(b) +
                             "] is 255 (e8m0 NaN), expected 0..254");
      }
      const int exponent = int(sbits) - 127;
      for (int64_t i = 0; i < kMxBlock; ++i) {
        const int64_t idx = o * in + b * kMxBlock + i;
        // Exact: a 4-bit-mantissa value times a power of two within float range.
        values[size_t(idx)] = std::ldexp(fp8_e4m3_to_f32(q[idx]), exponent);
      }
    }
  }
  return values;
}

Status validate_checkpoint(const ModelDir& dir, const MiniMaxM3Config& config, size_t max_problems) {
  const bool mxfp8 = config.quant_method == QuantMethod::kMxfp8;
  std::vector<std::string> problems;
  size_t total = 0;
  for (const WeightSpec& spec : weight_specs(config)) {
    auto r = locate_weight(dir, spec, mxfp8);
    if (r) continue;
    ++total;
    if (problems.size() < max_problems) problems.push_back(r.error());
  }
  if (total == 0) return Status::ok();
  std::string msg = "checkpoint " + dir.path() + " does not match the config (" + std::to_string(total) +
                    " problem" + (total == 1 ? "" : "s") + "):";
  for (const auto& p : problems) msg += "\n  " + p;
  if (total > problems.size()) msg += "\n  ... and " + std::to_string(total - problems.size()) + " more";
  return Status::error(msg);
}

}  // namespace m3
