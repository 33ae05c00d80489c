#include <gtest/gtest.h>

#include <cmath>

#include "core/dtype.h"

namespace m3 {
namespace {

TEST(DType, Bf16RoundTripAndRounding) {
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.0f)), 1.0f);
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(-3.5f)), -3.5f);
  // 1 + 2^-8 is exactly half-way between two bf16 values: ties to even (1.0).
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.0f + 1.0f / 256)), 1.0f);
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.0f + 3.0f / 256)), 1.0f + 4.0f / 256);
}

TEST(DType, Fp8E4M3DecodesKnownCodes) {
  EXPECT_EQ(fp8_e4m3_to_f32(0x00), 0.0f);
  EXPECT_EQ(fp8_e4m3_to_f32(0x38), 1.0f);        // exp 7, mant 0
  EXPECT_EQ(fp8_e4m3_to_f32(0x7e), 448.0f);      // max finite
  EXPECT_EQ(fp8_e4m3_to_f32(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_EQ(fp8_e4m3_to_f32(0xb8), -1.0f);
  EXPECT_TRUE(std::isnan(fp8_e4m3_to_f32(0x7f)));
}

TEST(DType, Fp8E4M3EncodeIsNearestEvenAndInvertsEveryCode) {
  for (int code = 0; code < 256; ++code) {
    if ((code & 0x7f) == 0x7f) continue;
    float v = fp8_e4m3_to_f32(uint8_t(code));
    uint8_t back = f32_to_fp8_e4m3(v);
    if (v == 0.0f) {
      EXPECT_EQ(back & 0x7f, 0);
    } else {
      EXPECT_EQ(back, code) << "code " << code;
    }
  }
  EXPECT_EQ(f32_to_fp8_e4m3(1000.0f), 0x7e);   // saturates
  EXPECT_EQ(f32_to_fp8_e4m3(-1000.0f), 0xfe);
  // Half-way between 1.0 (0x38) and 1.125 (0x39): ties to even -> 0x38.
  EXPECT_EQ(f32_to_fp8_e4m3(1.0625f), 0x38);
  // Half-way between 1.125 and 1.25 -> 1.25 (0x3a, even mantissa).
  EXPECT_EQ(f32_to_fp8_e4m3(1.1875f), 0x3a);
  // Brute-force agreement with a nearest search on a sweep of values.
  for (int i = -4000; i <= 4000; ++i) {
    float x = float(i) * 0.1173f;
    uint8_t got = f32_to_fp8_e4m3(x);
    float best = 0, best_err = 1e30f;
    for (int c = 0; c < 0x7f; ++c) {
      float err = std::fabs(fp8_e4m3_to_f32(uint8_t(c)) - std::fabs(x));
      if (err < best_err) { best_err = err; best = fp8_e4m3_to_f32(uint8_t(c)); }
    }
    EXPECT_EQ(std::fabs(fp8_e4m3_to_f32(got)), std::min(best, 448.0f)) << x;
  }
}

TEST(DType, E8M0) {
  EXPECT_EQ(e8m0_to_f32(127), 1.0f);
  EXPECT_EQ(e8m0_to_f32(130), 8.0f);
  EXPECT_EQ(e8m0_to_f32(120), 1.0f / 128);
  EXPECT_TRUE(std::isnan(e8m0_to_f32(255)));
}

TEST(DType, E8m0RowMax) {
  const uint8_t s[3 * 4] = {1, 9, 3, 2, 0, 0, 0, 0, 254, 127, 200, 254};
  uint8_t out[3] = {7, 7, 7};
  e8m0_row_max(s, 3, 4, out);
  EXPECT_EQ(out[0], 9);
  EXPECT_EQ(out[1], 0);
  EXPECT_EQ(out[2], 254);
}

TEST(DType, Names) {
  for (DType d : {DType::kF32, DType::kBF16, DType::kF8E4M3, DType::kU8, DType::kI64}) {
    EXPECT_EQ(dtype_from_name(dtype_name(d)), d);
  }
  EXPECT_FALSE(dtype_from_name("F9").has_value());
}

}  // namespace
}  // namespace m3
