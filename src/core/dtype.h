#pragma once
// Element types of checkpoints and tensors, and exact scalar conversions.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>

namespace m3 {

enum class DType { kF32, kBF16, kF16, kF8E4M3, kU8, kI32, kI64, kBool };

std::string_view dtype_name(DType dtype);                     // safetensors spelling ("BF16")
std::optional<DType> dtype_from_name(std::string_view name);  // inverse of dtype_name
size_t dtype_size_bytes(DType dtype);

inline float bf16_to_f32(uint16_t bits) {
  uint32_t u = uint32_t(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even; NaN stays NaN.
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

float f16_to_f32(uint16_t bits);

// OCP FP8 E4M3 (fn variant: no inf, 0x7f/0xff are NaN, max 448).
float fp8_e4m3_to_f32(uint8_t bits);
// Round to nearest even with saturation to ±448 (what torch's .to(float8_e4m3fn) does after clamp).
uint8_t f32_to_fp8_e4m3(float f);

// E8M0 scale: 2^(bits-127); 255 is NaN.
float e8m0_to_f32(uint8_t bits);
// out[r] = the largest byte of scale row r ([rows, cols] e8m0): an MXFP8 weight row's reference
// scale, which the f16 dequantising kernels take instead of scanning the row each call.
void e8m0_row_max(const uint8_t* scale, int64_t rows, int64_t cols, uint8_t* out);

}  // namespace m3
