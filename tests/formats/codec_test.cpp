// Exhaustive tables for the FP8 scalar codecs (all 256 E4M3 and E5M2 codes, both directions, every
// rounding boundary) and E8M0, checked against an independent bit-level decoder written here.
#include <gtest/gtest.h>
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <vector>
#include "formats/mxfp8/mxfp8.h"
#include "formats/scalar_codecs.h"

using namespace nb;

namespace {

struct Fp8Spec {
  int mant_bits, bias;
  uint32_t max_code;  // largest finite magnitude code
  float max_value;
  bool (*is_nan)(uint32_t mag);
  bool (*is_inf)(uint32_t mag);
  float (*decode)(uint32_t);
  uint32_t (*encode)(float);
};

// Independent decoder: sign * 2^(e - bias) * (1 + m/2^M), subnormals 2^(1-bias) * m/2^M, in double.
double reference_decode(const Fp8Spec& s, uint32_t code) {
  uint32_t mag = code & 0x7F;
  double sign = (code & 0x80) ? -1.0 : 1.0;
  if (s.is_nan(mag)) return NAN;
  if (s.is_inf(mag)) return sign * INFINITY;
  int e = int(mag >> s.mant_bits), m = int(mag & ((1u << s.mant_bits) - 1));
  double frac = double(m) / double(1 << s.mant_bits);
  if (e == 0) return sign * std::ldexp(frac, 1 - s.bias);
  return sign * std::ldexp(1.0 + frac, e - s.bias);
}

const Fp8Spec kE4M3{3,
                    7,
                    0x7E,
                    448.0f,
                    [](uint32_t m) { return m == 0x7F; },
                    [](uint32_t) { return false; },
                    [](uint32_t c) { return e4m3_to_f32(c); },
                    [](float x) { return f32_to_e4m3_satfinite(x); }};
const Fp8Spec kE5M2{2,
                    15,
                    0x7B,
                    57344.0f,
                    [](uint32_t m) { return m > 0x7C; },
                    [](uint32_t m) { return m == 0x7C; },
                    [](uint32_t c) { return e5m2_to_f32(c); },
                    [](float x) { return f32_to_e5m2_satfinite(x); }};

void check_all_codes(const Fp8Spec& s) {
  int nan_codes = 0;
  for (uint32_t code = 0; code < 256; ++code) {
    double want = reference_decode(s, code);
    float got = s.decode(code);
    if (std::isnan(want)) {
      ++nan_codes;
      EXPECT_TRUE(std::isnan(got)) << "code " << code;
      EXPECT_TRUE(s.is_nan(s.encode(got) & 0x7F)) << "NaN encodes to a NaN code, code " << code;
      continue;
    }
    EXPECT_EQ(double(got), want) << "decode of code " << code;
    EXPECT_EQ(std::signbit(got), (code & 0x80) != 0) << "sign of code " << code;
    if (std::isinf(want)) {
      EXPECT_EQ(s.encode(got), (code & 0x80) | s.max_code) << "Inf saturates, code " << code;
      continue;
    }
    EXPECT_EQ(s.encode(got), code) << "encode(decode(code)) round trip, code " << code;
  }
  EXPECT_EQ(nan_codes, s.max_code == 0x7E ? 2 : 6);
}

void check_rounding_boundaries(const Fp8Spec& s) {
  for (uint32_t c = 0; c < s.max_code; ++c) {
    for (uint32_t sign : {0u, 0x80u}) {
      float lo = s.decode(c | sign), hi = s.decode((c + 1) | sign);
      float mid = 0.5f * (lo + hi);  // exact: both are short binary fractions
      ASSERT_EQ(double(mid), 0.5 * (double(lo) + double(hi)));
      uint32_t even = (c % 2 == 0) ? c : c + 1;
      EXPECT_EQ(s.encode(mid), even | sign) << "tie between codes " << c << " and " << c + 1 << " goes to even";
      float toward_zero = std::nextafter(mid, 0.0f), away = std::nextafter(mid, sign ? -INFINITY : INFINITY);
      EXPECT_EQ(s.encode(toward_zero), c | sign) << "just below the midpoint after code " << c;
      EXPECT_EQ(s.encode(away), (c + 1) | sign) << "just above the midpoint after code " << c;
      EXPECT_EQ(s.encode(std::nextafter(lo, INFINITY)) & 0x7F, c) << "one FP32 ulp off a code stays on it, code " << c;
    }
  }
  // Saturation: everything finite beyond the largest value (and Inf) maps to the max code.
  for (float v : {s.max_value, std::nextafter(s.max_value, INFINITY), s.max_value * 1.0625f, s.max_value * 1.5f,
                  s.max_value * 2.0f, 1e30f, FLT_MAX, INFINITY}) {
    EXPECT_EQ(s.encode(v), s.max_code) << v;
    EXPECT_EQ(s.encode(-v), 0x80 | s.max_code) << -v;
  }
  // Below half the smallest subnormal: zero with the input's sign; FP32 subnormals too.
  float min_sub = s.decode(1);
  EXPECT_EQ(s.encode(0.5f * min_sub), 0u);  // tie with 0 -> even (0)
  EXPECT_EQ(s.encode(std::nextafter(0.5f * min_sub, 1.0f)), 1u);
  EXPECT_EQ(s.encode(-0.25f * min_sub), 0x80u);
  EXPECT_EQ(s.encode(1e-40f), 0u);
  EXPECT_EQ(s.encode(-0.0f), 0x80u);
  EXPECT_EQ(s.encode(NAN) & 0x7F, s.max_code == 0x7E ? 0x7Fu : 0x7Eu);
}

}  // namespace

TEST(Codecs, E4M3AllCodes) { check_all_codes(kE4M3); }
TEST(Codecs, E5M2AllCodes) { check_all_codes(kE5M2); }
TEST(Codecs, E4M3RoundingBoundaries) { check_rounding_boundaries(kE4M3); }
TEST(Codecs, E5M2RoundingBoundaries) { check_rounding_boundaries(kE5M2); }

TEST(Codecs, E4M3AndE5M2KnownValues) {
  EXPECT_EQ(e4m3_to_f32(0x7E), 448.0f);
  EXPECT_EQ(e4m3_to_f32(0x01), 0x1p-9f);
  EXPECT_EQ(e4m3_to_f32(0x08), 0x1p-6f);
  EXPECT_EQ(e5m2_to_f32(0x7B), 57344.0f);
  EXPECT_EQ(e5m2_to_f32(0x01), 0x1p-16f);
  EXPECT_TRUE(std::isinf(e5m2_to_f32(0x7C)));
  EXPECT_EQ(f32_to_e4m3_satfinite(464.0f), 0x7Eu);    // would be the tie 448|480: saturates
  EXPECT_EQ(f32_to_e5m2_satfinite(61440.0f), 0x7Bu);  // tie 57344|65536: saturates
}

TEST(Codecs, E8M0AllCodes) {
  for (uint32_t code = 0; code < 256; ++code) {
    float v = e8m0_to_f32(code);
    if (code == 255) {
      EXPECT_TRUE(std::isnan(v));
      continue;
    }
    EXPECT_EQ(double(v), std::ldexp(1.0, int(code) - 127)) << code;
  }
}

// Independent E8M0 scale rule: 2^ceil(log2(amax * fl(1/448))) clamped to codes [0, 254].
static uint32_t reference_e8m0_code(float amax) {
  float v = amax * (1.0f / 448.0f);
  if (std::isnan(v)) return 255;
  if (std::isinf(v)) return 254;
  if (v == 0.0f) return 0;
  int e;
  double m = std::frexp(double(v), &e);  // v = m * 2^e, m in [0.5, 1)
  int ceil_log2 = m == 0.5 ? e - 1 : e;
  return uint32_t(std::min(254, std::max(0, 127 + ceil_log2)));
}

TEST(Codecs, E8M0ScaleCodeMatchesCeilLog2) {
  std::vector<float> probes = {0.0f, 448.0f, 450.0f, 896.0f, 1.0f, 0x1p-140f, 0x1p-126f, 0x1p-120f, FLT_MAX, 0x1p127f};
  for (int e = -149; e < 128; ++e)
    for (float f : {1.0f, 1.0000001f, 1.5f, 1.75f, 1.9999999f}) probes.push_back(std::ldexp(f, e));
  for (float a : probes) EXPECT_EQ(mxfp8::e8m0_scale_code(a), reference_e8m0_code(a)) << a;
  EXPECT_EQ(mxfp8::e8m0_scale_code(448.0f), 127u);  // 448 * fl(1/448) rounds to exactly 1
  EXPECT_EQ(mxfp8::e8m0_scale_code(450.0f), 128u);  // anything above 448 needs the next power of two
  EXPECT_EQ(mxfp8::e8m0_scale_code(NAN), 255u);
  EXPECT_EQ(mxfp8::e8m0_scale_code(INFINITY), 254u);
  EXPECT_EQ(mxfp8::e8m0_scale_code(FLT_MAX), 247u);  // 2^128 / 448 -> 2^120: finite amax never reaches the clamp
  EXPECT_EQ(mxfp8::e8m0_inverse_scale(127), 1.0f);
  EXPECT_EQ(mxfp8::e8m0_inverse_scale(0), 0x1p127f);
  EXPECT_EQ(mxfp8::e8m0_inverse_scale(254), 0x1p-127f);
  EXPECT_EQ(mxfp8::e8m0_inverse_scale(119), 256.0f);
}
