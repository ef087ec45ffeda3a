// Hand-computed vectors for MXFP8, FP8 per-tensor (current and delayed scaling) and FP8 sub-channel
// blocks, shape rejection, non-finite reporting, and exact round trips of representable tensors.
#include <gtest/gtest.h>
#include <cfloat>
#include <cmath>
#include <vector>
#include "formats/fp8/fp8.h"
#include "formats/fp8/fp8_block.h"
#include "formats/fp8_test_inputs.h"
#include "formats/mxfp8/mxfp8.h"

using namespace nb;

namespace {
std::vector<bf16> bf16s(const std::vector<float>& v) {
  std::vector<bf16> out;
  for (float f : v) out.push_back(f32_to_bf16(f));
  return out;
}

struct Mx {
  std::vector<uint8_t> rd, rs, cd, cs;
  int32_t nonfinite = -1;
  mxfp8::QuantizedView view(int64_t rows, int64_t cols) {
    rd.assign(rows * cols, 0xAA);
    cd.assign(rows * cols, 0xAA);
    rs.assign(rows * cols / 32, 0xAA);
    cs.assign(rows * cols / 32, 0xAA);
    return {rows, cols, rd.data(), rs.data(), cd.data(), cs.data(), &nonfinite};
  }
};
}  // namespace

TEST(Mxfp8, HandVectors) {
  // 32x32: row 0 = [1, 0, ...]; row 1 = [450, 448, -3, ...]; the rest 0.
  std::vector<float> f(32 * 32, 0.0f);
  f[0] = 1.0f;
  f[32] = 450.0f;
  f[33] = 448.0f;
  f[34] = -3.0f;
  auto x = bf16s(f);
  Mx m;
  auto v = m.view(32, 32);
  ASSERT_TRUE(mxfp8::quantize_ref(x.data(), {}, v).is_ok());
  EXPECT_EQ(m.nonfinite, 0);
  // Row 0: amax 1 -> 1/448 -> 2^ceil(log2) = 2^-8 -> code 119; 1 * 2^8 = 256 -> E4M3 0x78.
  EXPECT_EQ(m.rs[0], 119);
  EXPECT_EQ(m.rd[0], 0x78);
  EXPECT_EQ(m.rd[1], 0x00);
  // Row 1: amax 450 > 448 -> code 128 (scale 2): 450/2 = 225 -> 224 (0x76); 448/2 = 224; -3/2 = -1.5 (0xBC).
  EXPECT_EQ(m.rs[1], 128);
  EXPECT_EQ(m.rd[32], 0x76);
  EXPECT_EQ(m.rd[33], 0x76);
  EXPECT_EQ(m.rd[34], 0xBC);
  // Rows 2..31 are zero blocks: code 0 and zero elements.
  for (int r = 2; r < 32; ++r) EXPECT_EQ(m.rs[r], 0);
  // Column copy: column 0 holds {1, 450, 0...} -> code 128; 1/2 = 0.5 -> 0x30; column 3 is all zero.
  EXPECT_EQ(m.cs[0], 128);
  EXPECT_EQ(m.cd[0], 0x30);
  EXPECT_EQ(m.cd[32], 0x76);
  EXPECT_EQ(m.cs[2], 120);    // column 2 holds only -3: 3/448 -> 2^-7 -> code 120 (inverse 128)
  EXPECT_EQ(m.cd[34], 0xFC);  // -3 * 128 = -384 = -1.5 * 2^8 -> 0xFC
  EXPECT_EQ(m.cs[3], 0);
  std::vector<float> back(32 * 32);
  mxfp8::dequantize_ref(m.rd.data(), m.rs.data(), 32, 32, false, back.data());
  EXPECT_EQ(back[0], 1.0f);
  EXPECT_EQ(back[32], 448.0f);
  EXPECT_EQ(back[34], -3.0f);
  mxfp8::dequantize_ref(m.cd.data(), m.cs.data(), 32, 32, true, back.data());
  EXPECT_EQ(back[0], 1.0f);
  EXPECT_EQ(back[32], 448.0f);
}

TEST(Mxfp8, RejectsShapesAndReportsNonFinite) {
  Status s = mxfp8::check_shape(1000, 100);
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("1000x100"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("divisible by 32"), std::string::npos) << s.message();
  auto x = fmt_test::make_input(64, 64, fmt_test::Dist::normal, 1, true);
  Mx m;
  ASSERT_TRUE(mxfp8::quantize_ref(x.data(), {}, m.view(64, 64)).is_ok());
  EXPECT_EQ(m.nonfinite, 1);
}

TEST(Mxfp8, RepresentableTensorRoundTripsExactly) {
  // Every element a power of two within 2^8 of its block's max: exactly representable after scaling.
  std::vector<float> f(64 * 64);
  for (size_t i = 0; i < f.size(); ++i) f[i] = std::ldexp((i % 3) ? 1.0f : -1.5f, int(i % 7) - 3);
  auto x = bf16s(f);
  Mx m;
  auto v = m.view(64, 64);
  ASSERT_TRUE(mxfp8::quantize_ref(x.data(), {}, v).is_ok());
  std::vector<float> back(f.size());
  mxfp8::dequantize_ref(m.rd.data(), m.rs.data(), 64, 64, false, back.data());
  for (size_t i = 0; i < f.size(); ++i) ASSERT_EQ(back[i], f[i]) << i;
  mxfp8::dequantize_ref(m.cd.data(), m.cs.data(), 64, 64, true, back.data());
  for (size_t i = 0; i < f.size(); ++i) ASSERT_EQ(back[i], f[i]) << i;
}

TEST(Fp8PerTensor, CurrentScalingHandVectors) {
  auto x = bf16s({1.0f, -2.0f, 0.5f, 4.0f});
  uint8_t d[4], dt[4];
  float scale_inv = 0, amax = 0;
  int32_t bad = -1;
  fp8::TensorView v{2, 2, d, dt, &scale_inv, &amax, &bad};
  ASSERT_TRUE(fp8::quantize_current_ref(x.data(), fp8::Format::e4m3, false, v).is_ok());
  // amax 4 -> scale 448/4 = 112: 112 (0x6E), -224 (0xF6), 56 (0x66), 448 (0x7E).
  EXPECT_EQ(amax, 4.0f);
  EXPECT_EQ(scale_inv, 1.0f / 112.0f);
  EXPECT_EQ(bad, 0);
  EXPECT_EQ(d[0], 0x6E);
  EXPECT_EQ(d[1], 0xF6);
  EXPECT_EQ(d[2], 0x66);
  EXPECT_EQ(d[3], 0x7E);
  EXPECT_EQ(dt[0], 0x6E);
  EXPECT_EQ(dt[1], 0x66);
  EXPECT_EQ(dt[2], 0xF6);
  EXPECT_EQ(dt[3], 0x7E);
  // E5M2: scale 57344/4 = 14336 = 1.75 * 2^13 -> code (28 << 2) | 3 = 0x73.
  ASSERT_TRUE(fp8::quantize_current_ref(x.data(), fp8::Format::e5m2, false, v).is_ok());
  EXPECT_EQ(d[0], 0x73);
  EXPECT_EQ(d[3], 0x7B);
  // Power-of-two scales: 112 rounds down to 64; 4 * 64 = 256 (0x78).
  ASSERT_TRUE(fp8::quantize_current_ref(x.data(), fp8::Format::e4m3, true, v).is_ok());
  EXPECT_EQ(scale_inv, 1.0f / 64.0f);
  EXPECT_EQ(d[3], 0x78);
  // All zero: scale 1, codes 0.
  auto z = bf16s({0.0f, 0.0f, -0.0f, 0.0f});
  ASSERT_TRUE(fp8::quantize_current_ref(z.data(), fp8::Format::e4m3, false, v).is_ok());
  EXPECT_EQ(scale_inv, 1.0f);
  EXPECT_EQ(d[0], 0);
  EXPECT_EQ(d[2], 0x80);
  // A tiny amax gives an infinite quotient: the scale is clamped to FLT_MAX.
  EXPECT_EQ(fp8::scale_from_amax(0x1p-133f, 448.0f, false), FLT_MAX);
  EXPECT_EQ(fp8::scale_from_amax(INFINITY, 448.0f, false), 1.0f);
  EXPECT_EQ(fp8::scale_from_amax(NAN, 448.0f, false), 1.0f);
  // Non-finite input is reported, not hidden.
  auto n = bf16s({1.0f, NAN, 2.0f, 3.0f});
  ASSERT_TRUE(fp8::quantize_current_ref(n.data(), fp8::Format::e4m3, false, v).is_ok());
  EXPECT_EQ(bad, 1);
  EXPECT_EQ(amax, 3.0f);
  fp8::TensorView empty{0, 5, d, dt, &scale_inv, &amax, &bad};
  EXPECT_FALSE(fp8::quantize_current_ref(x.data(), fp8::Format::e4m3, false, empty).is_ok());
}

TEST(Fp8PerTensor, DelayedScalingHistory) {
  fp8::DelayedScaling d(fp8::Format::e4m3, 4);
  EXPECT_EQ(d.scale, 1.0f);
  d.update();  // amax 0: keep the previous scale
  EXPECT_EQ(d.scale, 1.0f);
  d.record(2.0f);
  d.update();
  EXPECT_EQ(d.scale, 224.0f);
  EXPECT_EQ(d.history, (std::vector<float>{0, 0, 0, 2}));
  d.record(1.0f);
  d.update();
  EXPECT_EQ(d.history, (std::vector<float>{0, 0, 2, 1}));
  d.record(0.5f);
  d.update();
  d.record(0.25f);
  d.update();
  EXPECT_EQ(d.scale, 224.0f);  // the 2 is still inside the window of 4 steps
  EXPECT_EQ(d.history, (std::vector<float>{0, 1, 0.5f, 0.25f}));
  d.record(0.25f);
  d.update();  // the 2 has left the window: amax 1
  EXPECT_EQ(d.scale, 448.0f);
  d.record(NAN);
  d.update();  // non-finite amax keeps the scale
  EXPECT_EQ(d.scale, 448.0f);
  fp8::DelayedScaling e5(fp8::Format::e5m2, 1024, 1);
  EXPECT_EQ(e5.history.size(), 1024u);
  e5.record(7.0f);
  e5.record(3.0f);  // max within a step
  e5.update();
  EXPECT_EQ(e5.scale, 57344.0f / 7.0f / 2.0f);
  EXPECT_EQ(e5.scale_inv(), 1.0f / (57344.0f / 7.0f / 2.0f));
}

TEST(Fp8Block, HandVectorsAndLayout) {
  std::vector<float> f(128 * 256, 0.0f);
  f[0] = 2.0f;               // row 0, col 0
  f[5 * 256 + 130] = -7.0f;  // row 5, col 130 (second column block)
  auto x = bf16s(f);
  for (auto kind : {fp8::BlockKind::vec128, fp8::BlockKind::blk128x128}) {
    std::vector<uint8_t> rd(f.size()), cd(f.size());
    std::vector<float> rs(fp8::block_scale_count(kind, 128, 256, false), -1.0f),
        cs(fp8::block_scale_count(kind, 128, 256, true), -1.0f);
    int32_t bad = -1;
    fp8::BlockOptions opt{kind};
    ASSERT_TRUE(
        fp8::quantize_block_ref(x.data(), opt, {128, 256, rd.data(), rs.data(), cd.data(), cs.data(), &bad}).is_ok());
    EXPECT_EQ(bad, 0);
    if (kind == fp8::BlockKind::vec128) {
      ASSERT_EQ(rs.size(), 2u * 128u);           // [cols/128, round4(rows)]
      ASSERT_EQ(cs.size(), 1u * 256u);           // [rows/128, round4(cols)]
      EXPECT_EQ(rs[0], 1.0f / 224.0f);           // block (row 0, k 0): amax 2 -> scale 224
      EXPECT_EQ(rs[1], 1.0f);                    // row 1 is zero: scale 1
      EXPECT_EQ(rs[1 * 128 + 5], 1.0f / 64.0f);  // block (row 5, k 1): amax 7 -> 448/7 = 64
      EXPECT_EQ(cs[0], 1.0f / 224.0f);           // transposed: column 0 of x
      EXPECT_EQ(cs[130], 1.0f / 64.0f);
      EXPECT_EQ(cs[1], 1.0f);
    } else {
      ASSERT_EQ(rs.size(), 4u);       // [rows/128, round4(cols/128)] = [1, 4]: 2 tiles + 2 padding
      ASSERT_EQ(cs.size(), 2u * 4u);  // [cols/128, round4(rows/128)]
      EXPECT_EQ(rs[0], 1.0f / 224.0f);
      EXPECT_EQ(rs[1], 1.0f / 64.0f);
      EXPECT_EQ(rs[2], 0.0f);
      EXPECT_EQ(rs[3], 0.0f);  // padding
      EXPECT_EQ(cs[0], 1.0f / 224.0f);
      EXPECT_EQ(cs[4], 1.0f / 64.0f);
      EXPECT_EQ(cs[1], 0.0f);
    }
    EXPECT_EQ(rd[0], 0x7E);              // 2 * 224 = 448
    EXPECT_EQ(rd[5 * 256 + 130], 0xFE);  // -7 * 64 = -448
    EXPECT_EQ(cd[0], 0x7E);
    EXPECT_EQ(cd[130 * 128 + 5], 0xFE);
    std::vector<float> back(f.size());
    fp8::dequantize_block_ref(rd.data(), rs.data(), kind, 128, 256, false, back.data());
    EXPECT_EQ(back[0], 2.0f);
    EXPECT_EQ(back[5 * 256 + 130], -7.0f);
    fp8::dequantize_block_ref(cd.data(), cs.data(), kind, 128, 256, true, back.data());
    EXPECT_EQ(back[130 * 128 + 5], -7.0f);
  }
  Status s = fp8::check_block_shape(fp8::BlockKind::vec128, 1000, 100);
  EXPECT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("1000x100"), std::string::npos) << s.message();
}

TEST(Fp8Block, PowerOfTwoScales) {
  std::vector<float> f(128 * 128, 0.0f);
  f[0] = 3.0f;  // 448/3 = 149.33 -> 128
  auto x = bf16s(f);
  std::vector<uint8_t> rd(f.size()), cd(f.size());
  std::vector<float> rs(128), cs(128);
  fp8::BlockOptions opt{fp8::BlockKind::vec128, true};
  ASSERT_TRUE(
      fp8::quantize_block_ref(x.data(), opt, {128, 128, rd.data(), rs.data(), cd.data(), cs.data(), nullptr}).is_ok());
  EXPECT_EQ(rs[0], 1.0f / 128.0f);
  EXPECT_EQ(rd[0], f32_to_e4m3_satfinite(384.0f));
}
