// Embedding, Gemma RMSNorm, partial NeoX RoPE, residual add and cache writes on the CPU.
#include <cmath>
#include <cstring>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/eligibility.h"

namespace m3::cpu {
namespace {

// Rows of 4-byte words (F32 values, or I32 ids when the table maps ids), copied bit for bit.
void embedding_f32(const int32_t* ids, int num_tokens, const TensorView& table, const TensorView& out, int64_t first_id) {
  const int64_t dim = table.shape[1], rows = table.shape[0];
  for (int t = 0; t < num_tokens; ++t) {
    const int64_t row = int64_t(ids[t]) - first_id;
    float* dst = out.as<float>() + int64_t(t) * dim;
    if (row >= 0 && row < rows) std::memcpy(dst, table.as<const float>() + row * dim, size_t(dim) * 4);
    else std::memset(dst, 0, size_t(dim) * 4);
  }
}

void rms_norm_f32(const TensorView& x, const TensorView& weight, float eps, const TensorView& out) {
  const int64_t rows = x.shape[0], dim = x.shape[1];
  const float* w = weight.as<const float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x.as<const float>() + r * dim;
    float* yr = out.as<float>() + r * dim;
    float sum_sq = 0.0f;
    for (int64_t i = 0; i < dim; ++i) sum_sq += xr[i] * xr[i];
    const float inv = 1.0f / std::sqrt(sum_sq / float(dim) + eps);
    for (int64_t i = 0; i < dim; ++i) yr[i] = (xr[i] * inv) * (1.0f + w[i]);
  }
}

// Tables computed the way the HF reference does in fp32: inv_freq = 1 / theta^(2i/R),
// angle = position * inv_freq, both in float.
void rope_f32(const TensorView& x, const int32_t* positions, int rotary_dim, double theta) {
  const int64_t tokens = x.shape[0], heads = x.shape[1], head_dim = x.shape[2];
  const int half = rotary_dim / 2;
  std::vector<float> inv_freq(static_cast<size_t>(half)), cos_t(static_cast<size_t>(half)), sin_t(static_cast<size_t>(half));
  for (int i = 0; i < half; ++i) {
    inv_freq[size_t(i)] = 1.0f / std::pow(float(theta), float(2 * i) / float(rotary_dim));
  }
  for (int64_t t = 0; t < tokens; ++t) {
    for (int i = 0; i < half; ++i) {
      const float angle = float(positions[t]) * inv_freq[size_t(i)];
      cos_t[size_t(i)] = std::cos(angle);
      sin_t[size_t(i)] = std::sin(angle);
    }
    for (int64_t h = 0; h < heads; ++h) {
      float* v = x.as<float>() + (t * heads + h) * head_dim;
      for (int i = 0; i < half; ++i) {
        const float a = v[i], b = v[i + half];
        v[i] = a * cos_t[size_t(i)] - b * sin_t[size_t(i)];
        v[i + half] = b * cos_t[size_t(i)] + a * sin_t[size_t(i)];
      }
    }
  }
}

void add_f32(const TensorView& x, const TensorView& y) {
  float* a = x.as<float>();
  const float* b = y.as<const float>();
  for (int64_t i = 0, n = x.numel(); i < n; ++i) a[i] += b[i];
}

// F32 rows into an F32 (copy), BF16 (round to nearest even) or F8E4M3 (RNE, saturating to
// +-448, no scale) cache; the CUDA entry rounds identically.
void kv_write_cpu(const TensorView& src, const int64_t* slot_mapping, const TensorView& cache) {
  const int64_t tokens = src.shape[0], row = src.numel() / std::max<int64_t>(1, tokens);
  for (int64_t t = 0; t < tokens; ++t) {
    if (slot_mapping[t] < 0) continue;  // padding token: nothing to cache
    const float* x = src.as<const float>() + t * row;
    const int64_t base = slot_mapping[t] * row;
    switch (cache.dtype) {
      case DType::kBF16:
        for (int64_t i = 0; i < row; ++i) cache.as<uint16_t>()[base + i] = f32_to_bf16(x[i]);
        break;
      case DType::kF8E4M3:
        for (int64_t i = 0; i < row; ++i) cache.as<uint8_t>()[base + i] = f32_to_fp8_e4m3(x[i]);
        break;
      default:
        std::memcpy(cache.as<float>() + base, x, size_t(row) * 4);
    }
  }
}

}  // namespace

void register_elementwise(ops::KernelTable& table) {
  table.embedding.add({"embedding.gather.cpu", "host F32 (or I32: an id map) table",
                       [](const ops::Problem& p) -> std::string {
                         if (p.device == Device::kCpu && p.dtype == DType::kI32) return "";
                         return need_cpu_f32(p);
                       },
                       embedding_f32});
  table.rms_norm.add({"rms_norm.gemma.cpu", "host F32", need_cpu_f32, rms_norm_f32});
  table.rope.add({"rope.neox_partial.cpu", "host F32, even rotary_dim <= head_dim",
                  [](const ops::Problem& p) -> std::string {
                    std::string why = need_cpu_f32(p);
                    if (!why.empty()) return why;
                    if (p.extra <= 0 || p.extra % 2 || p.extra > p.k) return "rotary_dim must be even and <= head_dim";
                    return "";
                  },
                  rope_f32});
  table.add.add({"add.inplace.cpu", "host F32", need_cpu_f32, add_f32});
  table.kv_write.add({"kv_write.scatter.cpu", "host F32 rows into an F32, BF16 (RNE) or F8E4M3 (RNE, saturating) cache",
                      [](const ops::Problem& p) -> std::string {
                        if (p.device != Device::kCpu) return "tensors are not in host memory";
                        if (p.dtype != DType::kF32 && p.dtype != DType::kBF16 && p.dtype != DType::kF8E4M3)
                          return "cache dtype " + std::string(dtype_name(p.dtype)) + " not supported";
                        return "";
                      },
                      kv_write_cpu});
}

}  // namespace m3::cpu
