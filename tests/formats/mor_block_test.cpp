// MoR's block rule as training applies it (formats/mor/mor_block.h) against the sub-tensor rule's reference
// (decide_blocks_ref, fp8_scales_ref, fp8_fake_quantize_ref: mor.h, itself checked against float64 in mor_test.cpp):
// every block's choice, its output values, the E4M3 statistic and the counts; clipped blocks as zero-padded whole
// ones; and with pow2 scales, the FP8 blocks' values exact in BF16 against the float64 rounding of mor_reference.h.
#include <gtest/gtest.h>
#include <cmath>
#include <cstring>
#include <vector>
#include "core/bf16.h"
#include "formats/mor/mor.h"
#include "formats/mor/mor_block.h"
#include "formats/mor_reference.h"

namespace nb::mor {
namespace {

struct Applied {
  std::vector<bf16> out;
  StatCell stat;
  BlockCounts counts;
};

Applied apply(const std::vector<bf16>& x, int64_t rows, int64_t cols, const BlockRule& rule) {
  Applied a;
  a.out.resize(x.size());
  EXPECT_TRUE(apply_block_rule_ref(x.data(), rows, cols, rule, a.out.data(), &a.stat, &a.counts).is_ok());
  return a;
}

// x [rows, cols] zero-padded to whole 128x128 blocks: zeros change no amax, error, count or range.
std::vector<bf16> pad(const std::vector<bf16>& x, int64_t rows, int64_t cols, int64_t prows, int64_t pcols) {
  std::vector<bf16> p(size_t(prows * pcols), f32_to_bf16(0.0f));
  for (int64_t r = 0; r < rows; ++r) std::memcpy(&p[size_t(r * pcols)], &x[size_t(r * cols)], size_t(cols) * 2);
  return p;
}

// The applied rule on x [rows, cols] equals decide_blocks_ref on x padded to whole blocks, block for block.
void expect_equals_sub_tensor_rule(const std::vector<bf16>& x, int64_t rows, int64_t cols, const BlockRule& rule) {
  SCOPED_TRACE(testing::Message() << rows << "x" << cols << " " << scale_mode_name(rule.mode)
                                  << (rule.three_way ? " three-way" : " two-way"));
  const int64_t prows = (rows + 127) / 128 * 128, pcols = (cols + 127) / 128 * 128;
  const std::vector<bf16> p = pad(x, rows, cols, prows, pcols);
  std::vector<BlockDecision> want;
  ASSERT_TRUE(decide_blocks_ref(p.data(), prows, pcols, rule, &want).is_ok());
  std::vector<float> s4, s5, x4, x5;
  ASSERT_TRUE(fp8_scales_ref(p.data(), prows, pcols, fp8::Format::e4m3, Scaling::block, rule.mode, &s4).is_ok());
  ASSERT_TRUE(fp8_scales_ref(p.data(), prows, pcols, fp8::Format::e5m2, Scaling::block, rule.mode, &s5).is_ok());
  fp8_fake_quantize_ref(p.data(), prows, pcols, fp8::Format::e4m3, Scaling::block, s4, &x4);
  fp8_fake_quantize_ref(p.data(), prows, pcols, fp8::Format::e5m2, Scaling::block, s5, &x5);
  const Applied got = apply(x, rows, cols, rule);
  BlockCounts counts;
  ErrorStat e4m3;
  for (const BlockDecision& d : want) {
    counts.e4m3 += d.choice == Choice::fp8_e4m3;
    counts.e5m2 += d.choice == Choice::fp8_e5m2;
    counts.bf16 += d.choice == Choice::bf16;
    counts.nonfinite += d.e4m3.nonfinite;
    e4m3.add(d.e4m3);
  }
  EXPECT_EQ(got.counts.e4m3, counts.e4m3);
  EXPECT_EQ(got.counts.e5m2, counts.e5m2);
  EXPECT_EQ(got.counts.bf16, counts.bf16);
  EXPECT_EQ(got.counts.nonfinite, counts.nonfinite);
  EXPECT_EQ(got.stat.err_fixed, e4m3.err_fixed);
  EXPECT_EQ(got.stat.nonzero, uint64_t(e4m3.nonzero));
  EXPECT_EQ(got.stat.nonfinite > 0, e4m3.nonfinite);
  int mismatches = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const Choice ch = want[size_t((r / 128) * (pcols / 128) + c / 128)].choice;
      const size_t i = size_t(r * cols + c), pi = size_t(r * pcols + c);
      const bf16 expect = ch == Choice::bf16 ? x[i] : f32_to_bf16(ch == Choice::fp8_e4m3 ? x4[pi] : x5[pi]);
      mismatches += got.out[i].bits != expect.bits;
    }
  EXPECT_EQ(mismatches, 0);
}

TEST(MorBlockTraining, EqualsTheSubTensorRuleBlockForBlock) {
  const std::vector<bf16> x = six_blocks(384);
  for (ScaleMode mode : {ScaleMode::amax, ScaleMode::gam, ScaleMode::pow2})
    for (bool three : {false, true}) expect_equals_sub_tensor_rule(x, 256, 384, BlockRule{three, mode, 0.045});
}

TEST(MorBlockTraining, ClippedBlocksDecideAsZeroPaddedWholeOnes) {
  std::vector<bf16> x = normal_tensor(200 * 300, 5);
  for (size_t i = 0; i < x.size(); i += 997) x[i] = f32_to_bf16(bf16_to_f32(x[i]) * 3000.0f);  // outliers
  x[290] = f32_to_bf16(NAN);  // the first block row's clipped last block goes BF16
  for (ScaleMode mode : {ScaleMode::amax, ScaleMode::gam, ScaleMode::pow2})
    for (bool three : {false, true}) {
      expect_equals_sub_tensor_rule(x, 200, 300, BlockRule{three, mode, 0.045});
      expect_equals_sub_tensor_rule(x, 200, 300, BlockRule{three, mode, 0.02});
    }
}

// Power-of-two scales: an FP8 block's values are codes times 2^k, exact in BF16, so the operand the GEMMs read is the
// FP8 quantization itself, here against mor_reference.h's float64 rounding.
TEST(MorBlockTraining, Pow2BlocksAreExactFp8ValuesInBf16) {
  const std::vector<bf16> x = six_blocks(384);
  const Applied got = apply(x, 256, 384, BlockRule{true, ScaleMode::pow2, 0.045});
  std::vector<BlockDecision> want;
  ASSERT_TRUE(decide_blocks_ref(x.data(), 256, 384, BlockRule{true, ScaleMode::pow2, 0.045}, &want).is_ok());
  int checked = 0, wrong = 0;
  for (int64_t b = 0; b < 6; ++b) {
    const Choice ch = want[size_t(b)].choice;
    if (ch == Choice::bf16) continue;
    const Minifloat& f = ch == Choice::fp8_e4m3 ? kE4M3 : kE5M2;
    double amax = 0;
    for (int64_t r = (b / 3) * 128; r < (b / 3) * 128 + 128; ++r)
      for (int64_t c = (b % 3) * 128; c < (b % 3) * 128 + 128; ++c)
        amax = std::max(amax, std::fabs(double(bf16_to_f32(x[size_t(r * 384 + c)]))));
    int k = 0;
    std::frexp(double(fp32_scale(amax, f)), &k);
    const double scale = std::ldexp(1.0, k - 1);  // the FP32 scale rounded down to a power of two
    for (int64_t r = (b / 3) * 128; r < (b / 3) * 128 + 128; ++r)
      for (int64_t c = (b % 3) * 128; c < (b % 3) * 128 + 128; ++c) {
        const size_t i = size_t(r * 384 + c);
        const double want_v = round_minifloat(double(bf16_to_f32(x[i])) * scale, f) / scale;
        wrong += double(bf16_to_f32(got.out[i])) != want_v;
        ++checked;
      }
  }
  EXPECT_GT(checked, 3 * 128 * 128);
  EXPECT_EQ(wrong, 0);
}

TEST(MorBlockTraining, AnEmptyTensorIsRefused) {
  bf16 out{};
  const Status s = apply_block_rule_ref(nullptr, 0, 128, BlockRule{}, &out, nullptr, nullptr);
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("non-empty"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace nb::mor
