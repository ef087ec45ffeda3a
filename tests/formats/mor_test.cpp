// MoR's statistics, scales and rules (formats/mor/mor.h) against a float64 reference written here: its own
// E4M3/E5M2 rounding (frexp and nearbyint in double), its own GAM scales and its own mean relative error.
// Only the scale and the scaled value are FP32, as the precision spec defines them.
#include <gtest/gtest.h>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>
#include "core/bf16.h"
#include "formats/mor/mor.h"
#include "formats/mor/mor_stat.h"
#include "formats/nvfp4/nvfp4.h"
#include "formats/mor_reference.h"

namespace nb::mor {
namespace {

// The reference's mean relative error of x quantized with per-element scales (scale_of(i)).
template <typename ScaleOf>
double mean_rel_error(const std::vector<bf16>& x, const Minifloat& f, ScaleOf scale_of) {
  double sum = 0.0;
  int64_t n = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double v = bf16_to_f32(x[i]);
    if (v == 0.0) continue;
    const float scale = scale_of(i);
    const double q = round_minifloat(double(float(v) * scale), f);
    const double x_hat = q * double(1.0f / scale);
    sum += std::min(1.0, std::fabs(v - x_hat) / std::fabs(v));
    ++n;
  }
  return n == 0 ? 0.0 : sum / double(n);
}

TensorDecision decide(const std::vector<bf16>& x, int64_t rows, int64_t cols, TensorRule rule) {
  TensorDecision d;
  EXPECT_TRUE(decide_tensor_ref(x.data(), rows, cols, rule, &d).is_ok());
  return d;
}

TEST(MorTensorRule, MeanErrorEqualsTheFloat64ReferenceAndDecidesAtTheThreshold) {
  for (uint64_t seed : {1u, 2u, 3u}) {
    const int64_t rows = 64, cols = 96;
    std::vector<bf16> x = normal_tensor(rows * cols, seed, seed == 3 ? 1e-3 : 1.0);
    const float scale = fp32_scale(amax_of(x), kE4M3);
    const double ref = mean_rel_error(x, kE4M3, [&](size_t) { return scale; });
    ASSERT_GT(ref, 0.0);
    const TensorDecision d = decide(x, rows, cols, TensorRule{});
    EXPECT_NEAR(d.stat.mean(), ref, ref * 1e-6) << "seed " << seed;
    EXPECT_EQ(d.stat.nonzero, rows * cols);
    // Just over and just under: the rule flips where the reference's mean is.
    EXPECT_EQ(decide(x, rows, cols, TensorRule{Scaling::tensor, ScaleMode::amax, ref * (1 - 1e-4)}).choice,
              Choice::bf16);
    const TensorDecision under = decide(x, rows, cols, TensorRule{Scaling::tensor, ScaleMode::amax, ref * (1 + 1e-4)});
    EXPECT_EQ(under.choice, Choice::fp8_e4m3);
    EXPECT_EQ(under.reason, Reason::below_threshold);
  }
}

// Values with known E4M3 errors at scale 1 (amax 448): 1 + 1/16 ties to 1 (error 1/17), 1 is exact. The share
// of the inexact ones sets the mean: 1/17 * k / n, so a threshold of 4.5% falls between k = 76 and 77 of 100.
TEST(MorTensorRule, CraftedErrorsJustUnderAndOverTheDefaultThreshold) {
  for (int k : {76, 77}) {
    std::vector<bf16> x(100, f32_to_bf16(1.0f));
    x[0] = f32_to_bf16(448.0f);
    for (int i = 1; i <= k; ++i) x[size_t(i)] = f32_to_bf16(1.0625f);
    const double ref = mean_rel_error(x, kE4M3, [](size_t) { return 1.0f; });
    EXPECT_NEAR(ref, (1.0 / 17.0) * k / 100.0, 1e-12);
    const TensorDecision d = decide(x, 1, 100, TensorRule{});
    EXPECT_EQ(d.choice, ref < 0.045 ? Choice::fp8_e4m3 : Choice::bf16) << k;
    EXPECT_EQ(d.choice, k == 76 ? Choice::fp8_e4m3 : Choice::bf16);
  }
}

TEST(MorTensorRule, AllZerosIsExactInE4M3) {
  std::vector<bf16> x(256, f32_to_bf16(0.0f));
  x[3] = f32_to_bf16(-0.0f);
  const TensorDecision d = decide(x, 2, 128, TensorRule{});
  EXPECT_EQ(d.choice, Choice::fp8_e4m3);
  EXPECT_EQ(d.stat.nonzero, 0);
  EXPECT_EQ(d.stat.err_fixed, 0u);
}

// One outlier flushes a per-tensor scale's small values to zero (error 1 each); scaling per row confines the
// loss to its row (1/128 of the elements).
TEST(MorTensorRule, ASingleOutlierSendsATensorScaleToBf16ButNotAChannelScale) {
  const int64_t rows = 128, cols = 128;
  std::vector<bf16> x = normal_tensor(rows * cols, 7);
  x[5 * cols + 9] = f32_to_bf16(3e6f);
  const TensorDecision per_tensor = decide(x, rows, cols, TensorRule{});
  EXPECT_EQ(per_tensor.choice, Choice::bf16);
  const float scale = fp32_scale(amax_of(x), kE4M3);
  EXPECT_NEAR(per_tensor.stat.mean(), mean_rel_error(x, kE4M3, [&](size_t) { return scale; }), 1e-6);
  std::vector<float> row_scale(rows);
  for (int64_t r = 0; r < rows; ++r) {
    double a = 0;
    for (int64_t c = 0; c < cols; ++c) a = std::max(a, std::fabs(double(bf16_to_f32(x[r * cols + c]))));
    row_scale[r] = fp32_scale(a, kE4M3);
  }
  const double ref = mean_rel_error(x, kE4M3, [&](size_t i) { return row_scale[i / cols]; });
  const TensorDecision per_row = decide(x, rows, cols, TensorRule{Scaling::channel, ScaleMode::amax});
  EXPECT_NEAR(per_row.stat.mean(), ref, ref * 1e-6);
  EXPECT_EQ(per_row.choice, ref < kDefaultE4M3Threshold ? Choice::fp8_e4m3 : Choice::bf16);
  EXPECT_EQ(per_row.choice, Choice::fp8_e4m3);
}

TEST(MorTensorRule, NanOrInfFallsBackToBf16AndSaysWhy) {
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    std::vector<bf16> x = normal_tensor(256, 11);
    x[100] = f32_to_bf16(bad);
    for (Scaling s : {Scaling::tensor, Scaling::channel}) {
      const TensorDecision d = decide(x, 2, 128, TensorRule{s, ScaleMode::amax, 0.5});
      EXPECT_EQ(d.choice, Choice::bf16);
      EXPECT_EQ(d.reason, Reason::nonfinite);
      EXPECT_TRUE(d.stat.nonfinite);
    }
  }
}

TEST(MorGam, ScalesEqualTheReferenceBitForBitAndNeverSaturate) {
  const int64_t rows = 256, cols = 384;
  std::vector<bf16> x = normal_tensor(rows * cols, 5);
  std::mt19937_64 rng(9);
  std::uniform_int_distribution<int> exp_pick(-30, 30);
  for (int64_t b = 0; b < 6; ++b) {  // each block its own magnitude
    const float mult = std::ldexp(1.0f + float(b) / 7.0f, exp_pick(rng));
    for (int64_t r = (b / 3) * 128; r < (b / 3 + 1) * 128; ++r)
      for (int64_t c = (b % 3) * 128; c < (b % 3 + 1) * 128; ++c)
        x[r * cols + c] = f32_to_bf16(bf16_to_f32(x[r * cols + c]) * mult);
  }
  std::vector<float> gam, amax_scales;
  ASSERT_TRUE(fp8_scales_ref(x.data(), rows, cols, fp8::Format::e4m3, Scaling::block, ScaleMode::gam, &gam).is_ok());
  ASSERT_TRUE(
      fp8_scales_ref(x.data(), rows, cols, fp8::Format::e4m3, Scaling::block, ScaleMode::amax, &amax_scales).is_ok());
  ASSERT_EQ(gam.size(), 6u);
  const float tensor_scale = fp32_scale(amax_of(x), kE4M3);
  int lowered = 0;
  for (size_t b = 0; b < 6; ++b) {
    double block_amax = 0;
    for (int64_t r = int64_t(b / 3) * 128; r < int64_t(b / 3 + 1) * 128; ++r)
      for (int64_t c = int64_t(b % 3) * 128; c < int64_t(b % 3 + 1) * 128; ++c)
        block_amax = std::max(block_amax, std::fabs(double(bf16_to_f32(x[r * cols + c]))));
    const float own = fp32_scale(block_amax, kE4M3);
    EXPECT_EQ(amax_scales[b], own);
    const float want = reference_gam(tensor_scale, own);
    uint32_t got_bits = 0, want_bits = 0;
    std::memcpy(&got_bits, &gam[b], 4);
    std::memcpy(&want_bits, &want, 4);
    EXPECT_EQ(got_bits, want_bits) << "block " << b;
    EXPECT_LE(double(block_amax) * double(gam[b]), 448.0 * (1 + 1e-7)) << "block " << b;
    EXPECT_EQ(gam_exponent_byte(gam[b]), uint8_t((want_bits >> 23) & 0xFF));
    int k_gam = 0, k_own = 0;
    std::frexp(double(gam[b]), &k_gam);
    std::frexp(double(own), &k_own);
    lowered += k_gam < k_own ? 1 : 0;
  }
  // Both branches of the rule ran: some blocks kept their exponent, some were lowered by one.
  EXPECT_GT(lowered, 0);
  EXPECT_LT(lowered, 6);
}

struct RefBlock {
  double e4 = 0, e5 = 0;
  bool nonfinite = false, fits = true;
};

RefBlock reference_block(const std::vector<bf16>& x, int64_t cols, int64_t br, int64_t bc) {
  double tensor_amax = 0, amax = 0, min_nz = INFINITY;
  for (size_t i = 0; i < x.size(); ++i) {
    const double a = std::fabs(double(bf16_to_f32(x[i])));
    if (std::isfinite(a)) tensor_amax = std::max(tensor_amax, a);
  }
  std::vector<bf16> block;
  RefBlock out;
  for (int64_t r = br * 128; r < br * 128 + 128; ++r)
    for (int64_t c = bc * 128; c < bc * 128 + 128; ++c) {
      const bf16 v = x[r * cols + c];
      const double a = std::fabs(double(bf16_to_f32(v)));
      if (!std::isfinite(a)) {
        out.nonfinite = true;
        continue;
      }
      block.push_back(v);
      amax = std::max(amax, a);
      if (a > 0) min_nz = std::min(min_nz, a);
    }
  const float s4 = reference_gam(fp32_scale(tensor_amax, kE4M3), fp32_scale(amax, kE4M3));
  const float s5 = reference_gam(fp32_scale(tensor_amax, kE5M2), fp32_scale(amax, kE5M2));
  out.e4 = mean_rel_error(block, kE4M3, [&](size_t) { return s4; });
  out.e5 = mean_rel_error(block, kE5M2, [&](size_t) { return s5; });
  out.fits = min_nz == INFINITY || amax / min_nz <= 57344.0 / std::ldexp(1.0, -14);
  return out;
}

TEST(MorBlockRule, TwoAndThreeWayDecisionsEqualTheFloat64Reference) {
  const int64_t cols = 384;
  const std::vector<bf16> x = six_blocks(cols);
  std::vector<BlockDecision> two, three;
  ASSERT_TRUE(decide_blocks_ref(x.data(), 256, cols, BlockRule{false, ScaleMode::gam, 0.045}, &two).is_ok());
  ASSERT_TRUE(decide_blocks_ref(x.data(), 256, cols, BlockRule{true, ScaleMode::gam, 0.045}, &three).is_ok());
  ASSERT_EQ(two.size(), 6u);
  std::vector<Choice> three_way_choices;
  for (int64_t b = 0; b < 6; ++b) {
    const RefBlock ref = reference_block(x, cols, b / 3, b % 3);
    SCOPED_TRACE(testing::Message() << "block " << b << " e4 " << ref.e4 << " e5 " << ref.e5);
    if (!ref.nonfinite) {
      EXPECT_NEAR(two[size_t(b)].e4m3.mean(), ref.e4, ref.e4 * 1e-6 + 1e-9);
      EXPECT_NEAR(three[size_t(b)].e5m2.mean(), ref.e5, ref.e5 * 1e-6 + 1e-9);
    }
    const Choice want_two = ref.nonfinite ? Choice::bf16 : ref.e4 < 0.045 ? Choice::fp8_e4m3 : Choice::bf16;
    const Choice want_three = ref.nonfinite     ? Choice::bf16
                              : ref.e4 < ref.e5 ? Choice::fp8_e4m3
                              : ref.fits        ? Choice::fp8_e5m2
                                                : Choice::bf16;
    EXPECT_EQ(two[size_t(b)].choice, want_two);
    EXPECT_EQ(three[size_t(b)].choice, want_three);
    three_way_choices.push_back(three[size_t(b)].choice);
  }
  // The blocks were made to reach every branch: normal and tiny-but-narrow E4M3, wide E5M2, zeros E5M2 (a tie
  // at zero error; the range fits), NaN BF16 (non-finite), and a 1e30 outlier over 1e-20 values BF16 (range).
  EXPECT_EQ(three_way_choices, (std::vector<Choice>{Choice::fp8_e4m3, Choice::fp8_e5m2, Choice::fp8_e5m2, Choice::bf16,
                                                    Choice::bf16, Choice::fp8_e4m3}));
  EXPECT_EQ(three[3].reason, Reason::nonfinite);
  EXPECT_EQ(three[4].reason, Reason::range);
  EXPECT_EQ(two[1].choice, Choice::bf16);
}

TEST(MorBlockRule, ShapesThatAreNotWholeBlocksAreRefused) {
  std::vector<bf16> x(size_t{128} * 100);
  std::vector<BlockDecision> out;
  const Status s = decide_blocks_ref(x.data(), 128, 100, BlockRule{}, &out);
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("multiples of 128"), std::string::npos) << s.message();
}

// The NVFP4 ladder's statistic over an NVFP4 row copy (mor_stat.h) against a float64 mean written here: the test's
// own E2M1 and E4M3 decoders, x_hat = e2m1 x scale x amax / (6 * 448). 1x16 blocks with RNE and with SR, 16x16
// tiles, and a tensor with a NaN and an Inf (counted, never averaged).
double nvfp4_value_ref(uint32_t code, uint8_t scale, float amax) {
  static const double kE2M1[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  const double e = (code & 8u ? -1.0 : 1.0) * kE2M1[code & 7u];
  const int exp = (scale >> 3) & 0xF, man = scale & 7;
  const double s = exp == 0 ? std::ldexp(man / 8.0, -6) : std::ldexp(1.0 + man / 8.0, exp - 7);
  return e * s * double(amax) / (6.0 * 448.0);
}

TEST(MorNvfp4Stat, EqualsTheFloat64MeanOverTheDequantizedRowCopy) {
  const int64_t rows = 48, cols = 96;
  std::mt19937_64 rng(5);
  std::student_t_distribution<float> heavy(3.0f);
  for (int variant = 0; variant < 4; ++variant) {
    SCOPED_TRACE(variant);
    std::vector<bf16> x(size_t(rows * cols));
    for (auto& v : x) v = f32_to_bf16(heavy(rng));
    x[7] = f32_to_bf16(0.0f);
    if (variant == 3) {
      x[11] = f32_to_bf16(std::numeric_limits<float>::quiet_NaN());
      x[200] = f32_to_bf16(std::numeric_limits<float>::infinity());
    }
    nvfp4::Options opt;
    opt.colwise = false;
    opt.sr = variant == 1;
    opt.two_d = variant == 2;
    opt.rng = RngKey{9, 1, 2};
    std::vector<uint8_t> data(size_t(rows * cols / 2)), scales(size_t(rows * cols / 16));
    float amax = 0;
    int bad = 0;
    nvfp4::QuantizedView v{rows, cols, data.data(), scales.data(), nullptr, nullptr, &amax, nullptr, &bad};
    ASSERT_TRUE(nvfp4::quantize_ref(x.data(), opt, v).is_ok());
    StatCell cell;
    add_nvfp4_stat_host(x.data(), rows, cols, data.data(), scales.data(), amax, &cell);
    double sum = 0;
    int64_t nonzero = 0, nonfinite = 0;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) {
        const double xv = bf16_to_f32(x[size_t(r * cols + c)]);
        if (!std::isfinite(xv)) {
          ++nonfinite;
          continue;
        }
        if (xv == 0.0) continue;
        const uint32_t code = (data[size_t((r * cols + c) / 2)] >> (4 * (c & 1))) & 0xFu;
        const double x_hat = nvfp4_value_ref(code, scales[size_t(r * (cols / 16) + c / 16)], amax);
        sum += std::min(1.0, std::fabs(xv - x_hat) / std::fabs(xv));
        ++nonzero;
      }
    EXPECT_EQ(int64_t(cell.nonzero), nonzero);
    EXPECT_EQ(int64_t(cell.nonfinite), nonfinite);
    if (variant == 3) {
      EXPECT_EQ(nonfinite, 2);
      EXPECT_TRUE(decide_from_stat(stat_of(cell), 0.999).choice == Choice::bf16);
      continue;  // the quantizer's amax is NaN: the codes are defined but not a meaningful copy
    }
    const double mean = sum / double(nonzero), got = stat_of(cell).mean();
    EXPECT_NEAR(got, mean, 1e-6) << "fixed-point mean " << got << " against the float64 mean " << mean;
    EXPECT_GT(mean, 0.01);  // NVFP4 on heavy tails is far from exact: the statistic sees it
  }
}

}  // namespace
}  // namespace nb::mor
