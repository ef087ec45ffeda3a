// CPU reference tests of the NVFP4 quantizer (spec §1-4): hand-computed two-level scaling edge
// cases, non-finite detection, 2D weight tiles, RHT, stochastic rounding, swizzle layout, shapes.
#include <gtest/gtest.h>
#include <cmath>
#include <cstring>
#include "formats/hadamard/hadamard.h"
#include "formats/nvfp4/nvfp4.h"
#include "formats/nvfp4/nvfp4_math.h"
#include "formats/scalar_codecs.h"
#include "nvfp4/nvfp4_test_util.h"

namespace nb::nvfp4 {
namespace {
using testing::HostQuantized;

std::vector<bf16> from_floats(const std::vector<float>& f) {
  std::vector<bf16> x;
  for (float v : f) x.push_back(f32_to_bf16(v));
  return x;
}

TEST(Nvfp4Scale, GlobalEncodeScale) {
  EXPECT_EQ(global_encode_scale(2688.0f), 1.0f);
  EXPECT_EQ(global_encode_scale(1.0f), 2688.0f);
  EXPECT_EQ(global_encode_scale(0.0f), 1.0f);       // amax 0
  EXPECT_EQ(global_encode_scale(INFINITY), 1.0f);   // 2688/inf = 0
  EXPECT_EQ(global_encode_scale(NAN), 1.0f);        // non-finite
  EXPECT_EQ(global_encode_scale(1e-40f), FLT_MAX);  // 2688/subnormal = inf, clamped
}

// 16 x 16 tensor, row-wise only; tensor amax 2688 makes S_enc = 1 exactly.
struct EdgeCase : ::testing::Test {
  static constexpr int64_t n = 16;
  std::vector<float> f = std::vector<float>(n * n, 0.0f);
  HostQuantized q{n, n};
  Options opts;
  void SetUp() override {
    opts.colwise = false;
    // Row 0: the tensor amax 2688 and 448.  Row 1: zeros.  Row 2: block amax 0.001 (scale underflows).
    // Row 3: block amax 6.1875: 6.1875/6 = 1.03125 rounds to scale 1.0, so 6.1875 saturates to 6.
    f[0] = 2688.0f;
    f[1] = 448.0f;
    f[2] = -448.0f;
    f[3] = 100.0f;
    for (int j = 0; j < 16; ++j) f[2 * n + j] = (j % 2 ? -1.0f : 1.0f) * 0.001f;
    f[3 * n + 0] = 6.1875f;
    f[3 * n + 1] = 3.0f;
    f[3 * n + 2] = -1.25f;
    f[3 * n + 3] = 0.2f;
  }
};

TEST_F(EdgeCase, HandComputedCodesAndScales) {
  auto x = from_floats(f);
  ASSERT_TRUE(quantize_ref(x.data(), opts, q.view()));
  EXPECT_EQ(q.row_amax, 2688.0f);
  EXPECT_EQ(q.nonfinite, 0);
  // Row 0: s_b = e4m3(2688 / 6) = 448 = 0x7E; enc = 1/448: 2688 -> 6 (7), 448 -> 1 (2), -448 -> 10,
  // 100/448 = 0.223 -> 0 (positive: code 0).
  EXPECT_EQ(q.row_scales[0], 0x7E);
  EXPECT_EQ(q.row_code(0, 0), 7u);
  EXPECT_EQ(q.row_code(0, 1), 2u);
  EXPECT_EQ(q.row_code(0, 2), 10u);
  EXPECT_EQ(q.row_code(0, 3), 0u);
  // Row 1: zero block -> scale 0, codes 0.
  EXPECT_EQ(q.row_scales[1], 0);
  for (int j = 0; j < 16; ++j) EXPECT_EQ(q.row_code(1, j), 0u);
  // Row 2: 0.001 / 6 < 2^-10 (half the smallest E4M3 subnormal): s_b = 0, enc = FLT_MAX, codes saturate.
  EXPECT_EQ(q.row_scales[2], 0);
  EXPECT_EQ(q.row_code(2, 0), 7u);
  EXPECT_EQ(q.row_code(2, 1), 15u);
  // Row 3: s_b = 1.0 (0x38), enc = 1: 6.1875 saturates to 6 (7), 3 -> 5, -1.25 -> tie to even 1 (10), 0.2 -> 0.
  EXPECT_EQ(q.row_scales[3], 0x38);
  EXPECT_EQ(q.row_code(3, 0), 7u);
  EXPECT_EQ(q.row_code(3, 1), 5u);
  EXPECT_EQ(q.row_code(3, 2), 10u);
  EXPECT_EQ(q.row_code(3, 3), 0u);

  std::vector<float> deq(n * n);
  dequantize_ref(q.row_data.data(), q.row_scales.data(), q.row_amax, n, n, deq.data());
  EXPECT_EQ(deq[0], 2688.0f);  // 6 * 448 * 2688 / 2688
  EXPECT_EQ(deq[1], 448.0f);
  EXPECT_EQ(deq[2 * n], 0.0f);  // underflowed block dequantizes to 0
  EXPECT_EQ(deq[3 * n], 6.0f);  // saturated
  EXPECT_EQ(deq[3 * n + 1], 3.0f);
}

TEST_F(EdgeCase, SmallTensorAmaxScalesBlocksUp) {
  // amax 1: S_enc = 2688; the block holding 1.0 gets scale e4m3(1 * 448.00001) = 448; 1 -> 6, 0.5 -> 3.
  std::fill(f.begin(), f.end(), 0.0f);
  f[0] = 1.0f;
  f[1] = 0.5f;
  f[2] = -0.25f;
  auto x = from_floats(f);
  ASSERT_TRUE(quantize_ref(x.data(), opts, q.view()));
  EXPECT_EQ(q.row_amax, 1.0f);
  EXPECT_EQ(q.row_scales[0], 0x7E);
  EXPECT_EQ(q.row_code(0, 0), 7u);
  EXPECT_EQ(q.row_code(0, 1), 5u);
  EXPECT_EQ(q.row_code(0, 2), 11u);  // -0.25 * ~6 -> -1.5 (8 | 3)
}

TEST_F(EdgeCase, AllZeroTensor) {
  std::fill(f.begin(), f.end(), 0.0f);
  auto x = from_floats(f);
  ASSERT_TRUE(quantize_ref(x.data(), opts, q.view()));
  EXPECT_EQ(q.row_amax, 0.0f);
  EXPECT_EQ(q.nonfinite, 0);
  for (auto s : q.row_scales) EXPECT_EQ(s, 0);
  for (auto d : q.row_data) EXPECT_EQ(d, 0);
}

TEST_F(EdgeCase, InfAndNanSetTheNonfiniteFlag) {
  for (float bad : {INFINITY, -INFINITY, NAN}) {
    f[5 * n + 7] = bad;
    auto x = from_floats(f);
    HostQuantized r{n, n};
    Options both;
    ASSERT_TRUE(quantize_ref(x.data(), both, r.view()));
    EXPECT_EQ(r.nonfinite, 1) << bad;
    EXPECT_FALSE(amax_is_finite(r.row_amax)) << bad;
    if (std::isnan(bad))
      EXPECT_TRUE(std::isnan(r.row_amax));
    else
      EXPECT_EQ(r.row_amax, INFINITY);
  }
}

TEST(Nvfp4TwoD, RowAndColumnCopiesHoldIdenticalValues) {
  const int64_t rows = 48, cols = 64;
  for (int input = 0; input < 2; ++input) {
    auto x = input ? testing::adversarial_bf16(rows, cols, 7) : testing::random_normal_bf16(rows * cols, 7);
    HostQuantized q{rows, cols};
    Options opts;
    opts.two_d = true;
    ASSERT_TRUE(quantize_ref(x.data(), opts, q.view()));
    std::vector<float> row_deq(rows * cols), col_deq(rows * cols);
    dequantize_ref(q.row_data.data(), q.row_scales.data(), q.row_amax, rows, cols, row_deq.data());
    dequantize_ref(q.col_data.data(), q.col_scales.data(), q.col_amax, cols, rows, col_deq.data());
    int nonzero = 0;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) {
        ASSERT_EQ(q.row_code(r, c), q.col_code(c, r)) << r << "," << c;
        ASSERT_EQ(q.row_scales[r * (cols / 16) + c / 16], q.col_scales[c * (rows / 16) + r / 16]);
        ASSERT_EQ(f32_bits(row_deq[r * cols + c]), f32_bits(col_deq[c * rows + r]));
        nonzero += row_deq[r * cols + c] != 0.0f;
      }
    if (input == 0) { EXPECT_GT(nonzero, rows * cols / 2); }
    // One scale per tile: the tile's amax sets it, so a 1D quantization must differ somewhere.
    HostQuantized q1{rows, cols};
    ASSERT_TRUE(quantize_ref(x.data(), Options{}, q1.view()));
    EXPECT_NE(q1.row_scales, q.row_scales);
  }
}

TEST(Nvfp4Rht, IsOrthogonalWithTheSpecSigns) {
  // Rows of H: e_i * H = (1/4) s_i H16[i][:], H16[i][j] = (-1)^popcount(i & j).
  for (int i = 0; i < 16; ++i) {
    float v[16] = {};
    v[i] = 1.0f;
    hadamard::rht16_f32(v);
    float s = ((0xD7E8u >> i) & 1) ? -1.0f : 1.0f;
    for (int j = 0; j < 16; ++j) EXPECT_EQ(v[j], 0.25f * s * ((__builtin_popcount(i & j) & 1) ? -1.0f : 1.0f));
  }
  const float signs[16] = {1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1};
  for (int i = 0; i < 16; ++i) EXPECT_EQ(((hadamard::kSignMask16 >> i) & 1) ? -1.0f : 1.0f, signs[i]);
  auto x = testing::random_normal_bf16(16 * 64, 3);
  for (int c = 0; c < 64; ++c) {
    float v[16], orig[16];
    for (int j = 0; j < 16; ++j) orig[j] = v[j] = bf16_to_f32(x[c * 16 + j]);
    hadamard::rht16_f32(v);
    hadamard::rht16_inverse_f32(v);
    for (int j = 0; j < 16; ++j) EXPECT_NEAR(v[j], orig[j], 1e-6f * 8);
  }
}

TEST(Nvfp4Rht, QuantizingAfterRhtEqualsQuantizingTheTransformedTensor) {
  const int64_t rows = 64, cols = 32;
  // Values k/8 with |k| < 256: every FP32 partial sum of the transform is exact, so the explicit
  // matrix product (in double) rounded once to BF16 must equal the butterfly's result.
  std::mt19937 gen(11);
  std::vector<bf16> x(rows * cols);
  for (auto& v : x) v = f32_to_bf16(float(int(gen() % 511) - 255) / 8.0f);
  HostQuantized q{rows, cols};
  Options opts;
  opts.rht = true;
  ASSERT_TRUE(quantize_ref(x.data(), opts, q.view()));
  // Explicit transform of every 16-row chunk of every column, stored transposed: t[c][r].
  std::vector<bf16> t(rows * cols);
  for (int64_t c = 0; c < cols; ++c)
    for (int64_t r0 = 0; r0 < rows; r0 += 16)
      for (int j = 0; j < 16; ++j) {
        double sum = 0;
        for (int i = 0; i < 16; ++i) {
          double h = 0.25 * (((0xD7E8u >> i) & 1) ? -1 : 1) * ((__builtin_popcount(i & j) & 1) ? -1 : 1);
          sum += double(bf16_to_f32(x[(r0 + i) * cols + c])) * h;
        }
        t[c * rows + r0 + j] = f32_to_bf16(float(sum));
      }
  HostQuantized qt{cols, rows};
  Options rowonly;
  rowonly.colwise = false;
  ASSERT_TRUE(quantize_ref(t.data(), rowonly, qt.view()));
  EXPECT_EQ(q.col_amax, qt.row_amax);
  EXPECT_EQ(q.col_data, qt.row_data);
  EXPECT_EQ(q.col_scales, qt.row_scales);
  // The row-wise copy is untouched by RHT.
  HostQuantized plain{rows, cols};
  ASSERT_TRUE(quantize_ref(x.data(), Options{}, plain.view()));
  EXPECT_EQ(q.row_data, plain.row_data);
  EXPECT_NE(q.col_data, plain.col_data);
}

TEST(Nvfp4Sr, UnbiasedAndSeedDependent) {
  // Each 16-block: one element 2688 (tensor amax, S_enc = 1, scale 448) and 15 elements x with
  // x / 448 = y between 2 and 3; SR must average to y within 5 standard deviations + 8-bit resolution.
  const int64_t rows = 1024, cols = 64;
  const float x_val = round_to_bf16(448.0f * 2.3f);
  std::vector<bf16> x(rows * cols, f32_to_bf16(x_val));
  for (int64_t i = 0; i < rows * cols; i += 16) x[i] = f32_to_bf16(2688.0f);
  Options opts;
  opts.sr = true;
  opts.colwise = false;
  opts.rng = RngKey{42, 3, 8};
  HostQuantized q{rows, cols};
  ASSERT_TRUE(quantize_ref(x.data(), opts, q.view()));
  const float y = x_val * block_encode_scale(0x7E, 1.0f);
  double sum = 0;
  int64_t count = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      if (c % 16 == 0) continue;
      float v = e2m1_to_f32(q.row_code(r, c));
      ASSERT_TRUE(v == 2.0f || v == 3.0f);
      sum += v;
      ++count;
    }
  const double p = y - 2.0, sigma = std::sqrt(p * (1 - p) / double(count));
  EXPECT_NEAR(sum / double(count), y, 5 * sigma + 1.0 / 256);
  // Round to nearest gives 2 everywhere; a different seed gives different codes; the same seed the same.
  HostQuantized again{rows, cols}, other{rows, cols};
  ASSERT_TRUE(quantize_ref(x.data(), opts, again.view()));
  EXPECT_EQ(again.row_data, q.row_data);
  opts.rng.seed = 43;
  ASSERT_TRUE(quantize_ref(x.data(), opts, other.view()));
  EXPECT_NE(other.row_data, q.row_data);
}

TEST(Nvfp4Sr, RandomByteRuleMatchesTheHeader) {
  // Element (r, c) of the row copy uses byte (e % 16) of philox_block(key, e / 16), e = r*cols + c;
  // the column copy uses stream ^ 1 and e = c*rows + r. Checked element by element on one tensor.
  const int64_t rows = 32, cols = 48;
  auto x = testing::random_normal_bf16(rows * cols, 5);
  Options opts;
  opts.sr = true;
  opts.rng = RngKey{7, 1, 4};
  HostQuantized q{rows, cols};
  ASSERT_TRUE(quantize_ref(x.data(), opts, q.view()));
  float s_enc = global_encode_scale(q.row_amax);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      float v = bf16_to_f32(x[r * cols + c]);
      float enc_r = block_encode_scale(q.row_scales[r * (cols / 16) + c / 16], s_enc);
      int64_t e = r * cols + c;
      ASSERT_EQ(q.row_code(r, c), f32_to_e2m1_sr(v * enc_r, philox_byte(philox_block(opts.rng, e / 16), e % 16)));
      float enc_c = block_encode_scale(q.col_scales[c * (rows / 16) + r / 16], s_enc);
      int64_t ec = c * rows + r;
      RngKey kc = opts.rng;
      kc.stream ^= 1;
      ASSERT_EQ(q.col_code(c, r), f32_to_e2m1_sr(v * enc_c, philox_byte(philox_block(kc, ec / 16), ec % 16)));
    }
}

TEST(Nvfp4Swizzle, HandPickedOffsetsAndRoundTrip) {
  // scale_cols 6 pads to Kp = 8 (two 4-column tile columns).
  EXPECT_EQ(swizzled_offset(0, 0, 6), 0u);
  EXPECT_EQ(swizzled_offset(1, 0, 6), 16u);
  EXPECT_EQ(swizzled_offset(32, 0, 6), 4u);
  EXPECT_EQ(swizzled_offset(0, 1, 6), 1u);
  EXPECT_EQ(swizzled_offset(0, 4, 6), 512u);
  EXPECT_EQ(swizzled_offset(128, 0, 6), 1024u);
  EXPECT_EQ(swizzled_offset(37, 5, 6), 597u);  // a=1, b=5, j=1, d=1: 512 + 80 + 4 + 1
  EXPECT_EQ(swizzled_offset(255, 7, 6), 2047u);
  EXPECT_EQ(swizzled_scale_bytes(200, 6), 256u * 8u);
  const int64_t rows = 200, sc = 6;
  std::vector<uint8_t> s(rows * sc), sw(swizzled_scale_bytes(rows, sc), 0xAB), back(rows * sc);
  std::mt19937 gen(1);
  for (auto& v : s) v = uint8_t(1 + gen() % 255);
  swizzle_scales_ref(s.data(), rows, sc, sw.data());
  unswizzle_scales_ref(sw.data(), rows, sc, back.data());
  EXPECT_EQ(back, s);
  size_t zeros = 0;
  for (auto v : sw) zeros += v == 0;
  EXPECT_EQ(zeros, sw.size() - s.size());  // padding is zero, every real scale is non-zero
  EXPECT_EQ(sw[swizzled_offset(37, 5, sc)], s[37 * sc + 5]);
}

TEST(Nvfp4Shape, RejectsBadShapesWithClearMessages) {
  Status st = check_shape(17, 32, Options{});
  ASSERT_FALSE(st);
  EXPECT_NE(st.message().find("17 x 32"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("multiples of 16"), std::string::npos) << st.message();
  EXPECT_FALSE(check_shape(32, 8, Options{}));
  EXPECT_FALSE(check_shape(0, 16, Options{}));
  EXPECT_TRUE(check_shape(16, 48, Options{}));
  Options bad;
  bad.two_d = true;
  bad.sr = true;
  st = check_shape(32, 32, bad);
  ASSERT_FALSE(st);
  EXPECT_NE(st.message().find("stochastic rounding"), std::string::npos) << st.message();
  Options none;
  none.rowwise = none.colwise = false;
  EXPECT_FALSE(check_shape(32, 32, none));
  std::vector<bf16> x(17 * 32);
  HostQuantized q{16, 32};
  QuantizedView v = q.view();
  v.rows = 17;
  EXPECT_FALSE(quantize_ref(x.data(), Options{}, v));
}

}  // namespace
}  // namespace nb::nvfp4
