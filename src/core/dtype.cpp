#include "core/dtype.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace m3 {

std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "F32";
    case DType::kBF16: return "BF16";
    case DType::kF16: return "F16";
    case DType::kF8E4M3: return "F8_E4M3";
    case DType::kU8: return "U8";
    case DType::kI32: return "I32";
    case DType::kI64: return "I64";
    case DType::kBool: return "BOOL";
  }
  return "?";
}

std::optional<DType> dtype_from_name(std::string_view name) {
  for (DType d : {DType::kF32, DType::kBF16, DType::kF16, DType::kF8E4M3, DType::kU8, DType::kI32,
                  DType::kI64, DType::kBool}) {
    if (dtype_name(d) == name) return d;
  }
  return std::nullopt;
}

size_t dtype_size_bytes(DType dtype) {
  switch (dtype) {
    case DType::kF32: case DType::kI32: return 4;
    case DType::kBF16: case DType::kF16: return 2;
    case DType::kF8E4M3: case DType::kU8: case DType::kBool: return 1;
    case DType::kI64: return 8;
  }
  return 0;
}

float f16_to_f32(uint16_t h) {
  uint32_t sign = (h >> 15) & 1, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  float v;
  if (exp == 0) v = std::ldexp(float(mant), -24);
  else if (exp == 31) v = mant ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  else v = std::ldexp(float(mant | 0x400), int(exp) - 25);
  return sign ? -v : v;
}

float fp8_e4m3_to_f32(uint8_t bits) {
  uint32_t sign = bits >> 7, exp = (bits >> 3) & 0xf, mant = bits & 0x7;
  float v;
  if (exp == 0xf && mant == 0x7) return std::numeric_limits<float>::quiet_NaN();
  if (exp == 0) v = std::ldexp(float(mant), -9);  // subnormal: mant/8 * 2^-6
  else v = std::ldexp(float(mant | 0x8), int(exp) - 10);  // (1+m/8) * 2^(e-7)
  return sign ? -v : v;
}

uint8_t f32_to_fp8_e4m3(float f) {
  if (std::isnan(f)) return 0x7f;
  uint8_t sign = std::signbit(f) ? 0x80 : 0;
  float a = std::fabs(f);
  if (a >= 448.0f) return sign | 0x7e;
  if (a < 0.015625f) {  // below 2^-6: subnormal grid of 2^-9; q == 8 is exactly code 0x08
    return sign | uint8_t(std::nearbyint(a * 512.0f));
  }
  int e2;
  float m = std::frexp(a, &e2);  // a = m * 2^e2, m in [0.5, 1)
  int exponent = e2 - 1;         // a = (2m) * 2^exponent, 2m in [1, 2)
  int q = int(std::nearbyint((2.0f * m - 1.0f) * 8.0f));  // exact product, RNE
  if (q == 8) { q = 0; ++exponent; }
  int code = ((exponent + 7) << 3) | q;
  if (code > 0x7e) code = 0x7e;
  return sign | uint8_t(code);
}

float e8m0_to_f32(uint8_t bits) {
  if (bits == 255) return std::numeric_limits<float>::quiet_NaN();
  return std::ldexp(1.0f, int(bits) - 127);
}

void e8m0_row_max(const uint8_t* scale, int64_t rows, int64_t cols, uint8_t* out) {
  for (int64_t r = 0; r < rows; ++r) {
    uint8_t m = 0;
    for (int64_t c = 0; c < cols; ++c) m = std::max(m, scale[r * cols + c]);
    out[r] = m;
  }
}

}  // namespace m3
