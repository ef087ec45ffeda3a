// MoR's mixed-block operands and their GEMM (formats/mor/mixed.h) against the float64 reference of
// mor_reference.h: every dequantized element bit for bit (the reference's own rounding and GAM scales), and the
// GEMM against the float64 GEMM of the dequantized operands within FP32 accumulation's bound, as today's emulated
// GEMMs are checked. The operands' blocks reach all three formats, so E4M3, E5M2 and BF16 blocks meet in one GEMM.
#include <gtest/gtest.h>
#include <cmath>
#include <random>
#include <vector>
#include "formats/mor/mixed.h"
#include "formats/mor_reference.h"

namespace nb::mor {
namespace {

constexpr int64_t kRows = 256, kCols = 384;  // 2 x 3 blocks

// Six blocks of different characters, placed by `order` (block b holds kind order[b]): 0 normal, 1 two magnitudes
// 1e7 apart (E5M2 holds both), 2 zeros, 3 a 1e30 outlier over 1e-20 values (beyond E5M2's range: BF16), 4 tiny but
// narrow, 5 normal times 100.
std::vector<bf16> mixed_tensor(const std::vector<int>& order, uint64_t seed) {
  std::vector<bf16> x = normal_tensor(kRows * kCols, seed);
  std::mt19937_64 rng(seed + 1);
  std::normal_distribution<double> d(0.0, 1.0);
  for (int64_t r = 0; r < kRows; ++r)
    for (int64_t c = 0; c < kCols; ++c) {
      float v = bf16_to_f32(x[r * kCols + c]);
      switch (order[size_t((r / 128) * 3 + c / 128)]) {
        case 1: v = float((1.0 + std::fabs(d(rng)) / 8.0) * (c % 2 == 0 ? 1.0 : 1e-7)); break;
        case 2: v = 0.0f; break;
        case 3: v = (r % 128 == 72 && c % 128 == 12) ? 1e30f : v * 1e-20f; break;
        case 4: v *= 1e-30f; break;
        case 5: v *= 100.0f; break;
        default: break;
      }
      x[r * kCols + c] = f32_to_bf16(v);
    }
  return x;
}

MixedOperand quantize(const std::vector<bf16>& x, std::vector<BlockDecision>* decisions) {
  EXPECT_TRUE(decide_blocks_ref(x.data(), kRows, kCols, BlockRule{true, ScaleMode::gam, 0.045}, decisions).is_ok());
  MixedOperand op;
  EXPECT_TRUE(quantize_mixed_ref(x.data(), kRows, kCols, *decisions, ScaleMode::gam, &op).is_ok());
  return op;
}

// The reference's dequantized element: its own GAM scale of the block's format, its own rounding, FP32 values.
std::vector<double> reference_dequantized(const std::vector<bf16>& x, const std::vector<BlockDecision>& d) {
  std::vector<double> out(x.size());
  double block_amax[6] = {};
  for (int64_t r = 0; r < kRows; ++r)
    for (int64_t c = 0; c < kCols; ++c) {
      double& a = block_amax[(r / 128) * 3 + c / 128];
      a = std::max(a, std::fabs(double(bf16_to_f32(x[r * kCols + c]))));
    }
  const double tensor_amax = amax_of(x);
  for (int64_t r = 0; r < kRows; ++r)
    for (int64_t c = 0; c < kCols; ++c) {
      const int64_t b = (r / 128) * 3 + c / 128;
      const float v = bf16_to_f32(x[r * kCols + c]);
      const Choice ch = d[size_t(b)].choice;
      if (ch == Choice::bf16) {
        out[size_t(r * kCols + c)] = v;
        continue;
      }
      const Minifloat& f = ch == Choice::fp8_e5m2 ? kE5M2 : kE4M3;
      const float scale = reference_gam(fp32_scale(tensor_amax, f), fp32_scale(block_amax[b], f));
      const double q = round_minifloat(double(v * scale), f);
      out[size_t(r * kCols + c)] = double(float(q * double(1.0f / scale)));  // the FP32 product, exactly rounded
    }
  return out;
}

TEST(MorMixedGemm, OperandsDequantizeAsTheReferenceAndTheGemmEqualsTheFloat64Gemm) {
  const std::vector<bf16> xa = mixed_tensor({0, 1, 2, 3, 4, 5}, 31), xb = mixed_tensor({1, 3, 0, 5, 2, 4}, 32);
  std::vector<BlockDecision> da, db;
  const MixedOperand a = quantize(xa, &da), b = quantize(xb, &db);
  for (const auto* d : {&da, &db}) {  // every format is in each operand
    int seen[3] = {};
    for (const BlockDecision& blk : *d) ++seen[int(blk.choice)];
    EXPECT_GT(seen[int(Choice::fp8_e4m3)], 0);
    EXPECT_GT(seen[int(Choice::fp8_e5m2)], 0);
    EXPECT_GT(seen[int(Choice::bf16)], 0);
  }
  const std::vector<double> ra = reference_dequantized(xa, da), rb = reference_dequantized(xb, db);
  int64_t differ = 0;
  for (int64_t r = 0; r < kRows; ++r)
    for (int64_t c = 0; c < kCols; ++c) {
      differ += double(a.dequantized(r, c)) != ra[size_t(r * kCols + c)] ? 1 : 0;
      differ += double(b.dequantized(r, c)) != rb[size_t(r * kCols + c)] ? 1 : 0;
    }
  EXPECT_EQ(differ, 0) << "dequantized elements that differ from the reference";

  std::vector<float> y;
  ASSERT_TRUE(mixed_gemm_ref(a, b, &y).is_ok());
  // FP32 accumulation: K products summed in FP32 (128 per block, then one add per block) and two scale products per
  // block, each a relative error of at most 2^-24: bounded by (K + 4) 2^-24 times the sum of |a_k b_k|.
  double worst = 0;
  for (int64_t m = 0; m < kRows; ++m)
    for (int64_t n = 0; n < kRows; ++n) {
      double exact = 0, magnitude = 0;
      for (int64_t k = 0; k < kCols; ++k) {
        const double p = ra[size_t(m * kCols + k)] * rb[size_t(n * kCols + k)];
        exact += p;
        magnitude += std::fabs(p);
      }
      const double err = std::fabs(double(y[size_t(m * kRows + n)]) - exact);
      const double bound = double(kCols + 4) * std::ldexp(1.0, -24) * magnitude;
      ASSERT_LE(err, bound) << "y[" << m << ", " << n << "] " << y[size_t(m * kRows + n)] << " vs " << exact;
      if (magnitude > 0) worst = std::max(worst, err / magnitude);
    }
  EXPECT_GT(worst, 0.0);  // the FP32 path rounds somewhere: the comparison is not of one computation with itself
}

TEST(MorMixedGemm, MismatchedShapesAndDecisionsAreRefused) {
  const std::vector<bf16> x = mixed_tensor({0, 0, 0, 0, 0, 0}, 41);
  std::vector<BlockDecision> d(5);
  MixedOperand op;
  const Status few = quantize_mixed_ref(x.data(), kRows, kCols, d, ScaleMode::gam, &op);
  ASSERT_FALSE(few.is_ok());
  EXPECT_NE(few.message().find("5 block decisions"), std::string::npos) << few.message();
  d.resize(6);
  ASSERT_TRUE(quantize_mixed_ref(x.data(), kRows, kCols, d, ScaleMode::gam, &op).is_ok());
  MixedOperand narrow;
  ASSERT_TRUE(
      quantize_mixed_ref(x.data(), kRows * 3 / 2, 256, std::vector<BlockDecision>(6), ScaleMode::gam, &narrow).is_ok());
  std::vector<float> y;
  const Status k = mixed_gemm_ref(op, narrow, &y);
  ASSERT_FALSE(k.is_ok());
  EXPECT_NE(k.message().find("disagree on K"), std::string::npos) << k.message();
}

}  // namespace
}  // namespace nb::mor
