// Exhaustive E2M1 codec tests: all 16 codes decode to the spec's values, every value encodes back,
// every round-to-nearest-even boundary of spec §1 lands on the right side, signs follow TE's rule,
// and stochastic rounding picks only the two neighbours with the right frequency.
#include <gtest/gtest.h>
#include <cmath>
#include "formats/scalar_codecs.h"

namespace nb {
namespace {

const float kMagnitudes[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};

TEST(E2M1, DecodesAllSixteenCodes) {
  for (uint32_t c = 0; c < 16; ++c) {
    float expect = (c & 8) ? -kMagnitudes[c & 7] : kMagnitudes[c & 7];
    EXPECT_EQ(e2m1_to_f32(c), expect) << "code " << c;
  }
  EXPECT_TRUE(std::signbit(e2m1_to_f32(8)));  // code 8 is -0
}

TEST(E2M1, EncodesEveryValueToItsCode) {
  for (uint32_t c = 0; c < 8; ++c) {
    EXPECT_EQ(f32_to_e2m1_rne(kMagnitudes[c]), c);
    if (c != 0) { EXPECT_EQ(f32_to_e2m1_rne(-kMagnitudes[c]), 8 + c); }
  }
}

float above(float x) { return std::nextafter(x, 100.0f); }
float below(float x) { return std::nextafter(x, -100.0f); }

TEST(E2M1, RoundingBoundariesTiesToEven) {
  // boundary, code at the boundary (tie -> even code), code just below, code just above
  struct B {
    float at;
    uint32_t tie, lo, hi;
  };
  const B bounds[] = {{0.25f, 0, 0, 1}, {0.75f, 2, 1, 2}, {1.25f, 2, 2, 3}, {1.75f, 4, 3, 4},
                      {2.5f, 4, 4, 5},  {3.5f, 6, 5, 6},  {5.0f, 6, 6, 7}};
  for (const B& b : bounds) {
    EXPECT_EQ(f32_to_e2m1_rne(b.at), b.tie) << b.at;
    EXPECT_EQ(f32_to_e2m1_rne(below(b.at)), b.lo) << b.at;
    EXPECT_EQ(f32_to_e2m1_rne(above(b.at)), b.hi) << b.at;
    EXPECT_EQ(f32_to_e2m1_rne(-b.at), 8 + b.tie) << -b.at;
    EXPECT_EQ(f32_to_e2m1_rne(-above(b.at)), 8 + b.hi) << -b.at;
  }
}

TEST(E2M1, SaturatesAndSigns) {
  EXPECT_EQ(f32_to_e2m1_rne(6.5f), 7u);
  EXPECT_EQ(f32_to_e2m1_rne(1e30f), 7u);
  EXPECT_EQ(f32_to_e2m1_rne(INFINITY), 7u);
  EXPECT_EQ(f32_to_e2m1_rne(-INFINITY), 15u);
  EXPECT_EQ(f32_to_e2m1_rne(-0.0f), 0u);  // exactly -0.0 -> code 0
  EXPECT_EQ(f32_to_e2m1_rne(-0.1f), 8u);  // negative rounding to zero -> code 8
  EXPECT_EQ(f32_to_e2m1_rne(-1e-30f), 8u);
  EXPECT_EQ(f32_to_e2m1_rne(1e-30f), 0u);
}

TEST(E2M1, StochasticRoundingPicksNeighboursWithExactFrequency) {
  // For x between two E2M1 values, 256 random bytes give floor-count ups; the mean over all bytes
  // is x up to the 1/256-of-a-step resolution of 8 random bits.
  const float xs[] = {0.1f, 0.3f, 0.6f, 1.1f, 1.9f, 2.2f, 3.7f, 4.5f, 5.9f, 0.5f, 3.0f, 6.0f};
  for (float x : xs) {
    for (float sign : {1.0f, -1.0f}) {
      double sum = 0;
      for (uint32_t r = 0; r < 256; ++r) {
        uint32_t c = f32_to_e2m1_sr(sign * x, r);
        float v = e2m1_to_f32(c);
        int lo = 0;
        while (lo < 7 && kMagnitudes[lo + 1] <= x) ++lo;
        EXPECT_TRUE(std::fabs(v) == kMagnitudes[lo] || (lo < 7 && std::fabs(v) == kMagnitudes[lo + 1])) << x;
        sum += v;
      }
      float step = x < 2 ? 0.5f : (x < 4 ? 1.0f : 2.0f);
      EXPECT_NEAR(sum / 256, sign * x, step / 256 + 1e-7) << x;
    }
  }
  EXPECT_EQ(f32_to_e2m1_sr(7.0f, 255), 7u);   // saturates
  EXPECT_EQ(f32_to_e2m1_sr(-0.0f, 255), 0u);  // 0 never rounds up (u * step < 0.5); -0.0 keeps code 0
}

}  // namespace
}  // namespace nb

// The quantizer's faster encoders (nvfp4_math.h) must equal the shared codecs on every input class.
#include "formats/nvfp4/nvfp4_math.h"
namespace nb {
namespace {

TEST(E2M1, FastEncodersEqualTheCodecs) {
  // Every float bit pattern with a stride (covers all exponents, NaN, Inf, subnormals, both signs),
  // plus a dense sweep around each rounding boundary.
  int64_t nans = 0;
  for (uint64_t b = 0; b < (1ull << 32); b += 251) {
    float x = bits_f32(uint32_t(b));
    if (std::isnan(x)) {  // documented difference: NaN -> code 7 (the block is flagged non-finite)
      // The quantizer encodes products x * enc, which are never signaling NaNs: test quiet ones.
      x = bits_f32(uint32_t(b) | 0x00400000u);
      ASSERT_EQ(nvfp4::e2m1_code_rne(x), 7u);
      ASSERT_EQ(nvfp4::e2m1_code_sr(x, uint32_t(b) & 0xFF), 7u);
      ++nans;
      continue;
    }
    ASSERT_EQ(nvfp4::e2m1_code_rne(x), f32_to_e2m1_rne(x)) << std::hex << b;
    ASSERT_EQ(nvfp4::e2m1_code_sr(x, uint32_t(b) & 0xFF), f32_to_e2m1_sr(x, uint32_t(b) & 0xFF)) << std::hex << b;
  }
  EXPECT_GT(nans, 0);
  for (float bound : {0.25f, 0.75f, 1.0f, 1.25f, 1.75f, 2.0f, 2.5f, 3.5f, 4.0f, 5.0f, 6.0f, 0.5f, 1.5f, 3.0f}) {
    float x = bound;
    for (int i = 0; i < 2000; ++i) x = std::nextafter(x, 0.0f);
    for (int i = 0; i < 4000; ++i, x = std::nextafter(x, 100.0f)) {
      ASSERT_EQ(nvfp4::e2m1_code_rne(x), f32_to_e2m1_rne(x)) << x;
      ASSERT_EQ(nvfp4::e2m1_code_rne(-x), f32_to_e2m1_rne(-x)) << -x;
      for (uint32_t r = 0; r < 256; r += 5) ASSERT_EQ(nvfp4::e2m1_code_sr(x, r), f32_to_e2m1_sr(x, r)) << x;
    }
  }
  // Stochastic rounding: every BF16 pattern (all magnitudes the quantizer can see after scaling by a
  // power of two) with every random byte.
  for (uint32_t h = 0; h < 65536; ++h) {
    float x = bits_f32(h << 16) * ((h & 1) ? 0.75f : 1.0f);
    if (std::isnan(x)) continue;
    for (uint32_t r = 0; r < 256; ++r) ASSERT_EQ(nvfp4::e2m1_code_sr(x, r), f32_to_e2m1_sr(x, r)) << x << " " << r;
  }
}

}  // namespace
}  // namespace nb
