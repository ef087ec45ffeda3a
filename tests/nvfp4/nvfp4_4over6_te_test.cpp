// nibble's NVFP4 4/6 quantizer (quantize_ref with four_over_six, RHT and SR off) against an independent
// transcription of TransformerEngine's 4over6 reference (te_4over6_ref.h), byte for byte: codes, scales
// and the stored (true) amax of both copies, 1x16 and 16x16, MAE and MSE, on normal, outlier-heavy and
// lognormal tensors, plus structured 2D tiles whose decision depends on TE's error reduction order.
#include <gtest/gtest.h>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>
#include "formats/nvfp4/nvfp4.h"
#include "formats/nvfp4/nvfp4_math.h"
#include "nvfp4/nvfp4_test_util.h"
#include "nvfp4/te_4over6_ref.h"

namespace nb::nvfp4 {
namespace {
using testing::HostQuantized;

// The generators of `nibble quant --random --dist`: normal, outliers (1% of the values x100) and
// lognormal (exp(2 z) with a random sign), rounded to BF16.
std::vector<bf16> make_input(const std::string& dist, int64_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> unif(0.0f, 1.0f);
  std::vector<bf16> x(static_cast<size_t>(n));
  for (auto& v : x) {
    float f = normal(gen);
    if (dist == "lognormal")
      f = std::exp(2.0f * f) * (unif(gen) < 0.5f ? -1.0f : 1.0f);
    else if (dist == "outliers" && unif(gen) < 0.01f)
      f *= 100.0f;
    v = f32_to_bf16(f);
  }
  return x;
}

std::vector<float> to_float(const std::vector<bf16>& x) {
  std::vector<float> f;
  for (bf16 v : x) f.push_back(bf16_to_f32(v));
  return f;
}

size_t first_diff(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) return i;
  return a.size();
}

// quantize_ref (both copies) against the TE transcription; returns nibble's result.
HostQuantized expect_matches_te(const std::vector<bf16>& x, int64_t rows, int64_t cols, bool two_d, ErrMode mode) {
  Options o;
  o.two_d = two_d;
  o.four_over_six = true;
  o.err_mode = mode;
  HostQuantized q{rows, cols};
  EXPECT_TRUE(quantize_ref(x.data(), o, q.view()));
  te_ref::Copy row, col;
  te_ref::quantize(to_float(x), rows, cols, two_d, mode == ErrMode::mse, &row, &col);
  EXPECT_EQ(f32_bits(q.row_amax), f32_bits(row.amax));  // the true amax, not a scaled one
  EXPECT_EQ(f32_bits(q.col_amax), f32_bits(col.amax));
  EXPECT_TRUE(q.row_scales == row.scales) << "row scale " << first_diff(q.row_scales, row.scales);
  EXPECT_TRUE(q.row_data == row.data) << "row byte " << first_diff(q.row_data, row.data);
  EXPECT_TRUE(q.col_scales == col.scales) << "col scale " << first_diff(q.col_scales, col.scales);
  EXPECT_TRUE(q.col_data == col.data) << "col byte " << first_diff(q.col_data, col.data);
  EXPECT_EQ(q.nonfinite, 0);
  return q;
}

void run_distributions(bool two_d, ErrMode mode) {
  const int64_t shapes[][2] = {{256, 512}, {48, 80}};
  for (auto [rows, cols] : shapes)
    for (const char* dist : {"normal", "outliers", "lognormal"}) {
      SCOPED_TRACE(std::string(dist) + " " + std::to_string(rows) + "x" + std::to_string(cols) + " " +
                   err_mode_name(mode) + (two_d ? " 2d" : " 1d"));
      const auto x = make_input(dist, rows * cols, uint32_t(rows + cols));
      const HostQuantized q = expect_matches_te(x, rows, cols, two_d, mode);
      float amax = 0.0f;
      for (bf16 v : x) amax = std::max(amax, std::fabs(bf16_to_f32(v)));
      EXPECT_EQ(q.row_amax, amax);
    }
}

TEST(Nvfp4FourOverSixTe, OneDMaeMatchesTeReference) { run_distributions(false, ErrMode::mae); }
TEST(Nvfp4FourOverSixTe, OneDMseMatchesTeReference) { run_distributions(false, ErrMode::mse); }
TEST(Nvfp4FourOverSixTe, TwoDMaeMatchesTeReference) { run_distributions(true, ErrMode::mae); }
TEST(Nvfp4FourOverSixTe, TwoDMseMatchesTeReference) { run_distributions(true, ErrMode::mse); }

TEST(Nvfp4FourOverSixTe, MaeIsTheDefault) { EXPECT_EQ(Options{}.err_mode, ErrMode::mae); }

// TE divides the block amax by 6 before scaling, (b / 6) * S_enc; plain NVFP4's b * (S_enc * (1/6))
// rounds the other way for some (block amax, tensor amax) pairs, e.g. 9 BF16 block amaxes at tensor amax
// 4.375 (issue 31 found 35 of 8,192 scales of such a normal 256x512 tensor). A normal tensor with that
// amax: nibble matches TE, and the input holds blocks where the two expressions disagree.
TEST(Nvfp4FourOverSixTe, BlockScaleDividesBeforeScaling) {
  const int64_t rows = 256, cols = 512;
  auto x = make_input("normal", rows * cols, 11);
  for (auto& v : x)
    if (std::fabs(bf16_to_f32(v)) > 4.25f) v = f32_to_bf16(std::copysign(4.25f, bf16_to_f32(v)));
  x[7] = f32_to_bf16(-4.375f);
  const float s_enc = global_encode_scale_4over6(4.375f);
  int differ = 0;
  for (size_t b = 0; b < x.size(); b += 16) {
    float m = 0.0f;
    for (size_t j = b; j < b + 16; ++j) m = std::max(m, std::fabs(bf16_to_f32(x[j])));
    const float te = (m / 6.0f) * s_enc, plain = m * (s_enc * (1.0f / 6.0f));
    if (te_ref::e4m3_rne(std::min(te, 448.0f)) != te_ref::e4m3_rne(std::min(plain, 448.0f)) ||
        te_ref::e4m3_rne(std::min(te * 1.5f, 448.0f)) != te_ref::e4m3_rne(std::min(plain * 1.5f, 448.0f)))
      ++differ;
  }
  std::printf(
      "[4/6 TE] normal 256x512, amax 4.375: %d of 8192 blocks have a candidate scale that depends on "
      "the expression\n",
      differ);
  EXPECT_GT(differ, 0);
  for (ErrMode mode : {ErrMode::mae, ErrMode::mse}) {
    SCOPED_TRACE(err_mode_name(mode));
    const HostQuantized q = expect_matches_te(x, rows, cols, false, mode);
    EXPECT_EQ(q.row_amax, 4.375f);  // stored as it is (the former 4/6 stored 1.75x: 7.65625)
  }
}

// The old order: one sequential sum over the tile's 256 elements, row-major (map to 4 iff lower).
bool sequential_pick_map4(const std::vector<float>& x, int64_t cols, int64_t r0, int64_t c0, float amax, bool mse) {
  const float s_enc = std::min((256.0f * 6.0f) / amax, FLT_MAX);
  float m = 0.0f;
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 16; ++j) m = std::max(m, std::fabs(x[size_t((r0 + i) * cols + c0 + j)]));
  const float base = (m / 6.0f) * s_enc;
  float err[2] = {0.0f, 0.0f};
  for (int k = 0; k < 2; ++k) {
    const float sf = float(te_ref::e4m3_value(te_ref::e4m3_rne(std::min(k ? base * 1.5f : base, 448.0f))));
    const float enc = std::min(1.0f / (sf * (1.0f / s_enc)), FLT_MAX);
    for (int i = 0; i < 16; ++i)
      for (int j = 0; j < 16; ++j) {
        const float v = x[size_t((r0 + i) * cols + c0 + j)];
        const float d =
            te_ref::e2m1_value(te_ref::e2m1_code(std::clamp(v * enc, -6.0f, 6.0f))) * sf * amax / 1536.0f - v;
        err[k] = err[k] + (mse ? d * d : std::fabs(d));
      }
  }
  return err[1] < err[0];
}

// Tiles built to nearly tie: S_enc = 1 (tensor amax 1536), tile amax 6, and values whose two candidates
// err by exact amounts (4.5: 0.5 for map to 6, 0 for map to 4; 1 and 2: 0 and 0.25) among tiny values
// that err equally in both. The mix makes the exact totals tie often (MAE: one 4.5 per two 1s or 2s;
// MSE, squared: per four), and the tiny values (MAE ~2^-20..2^-27, MSE ~2^-8..2^-15, squared) make the
// FP32 totals depend on the order of the additions.
std::vector<bf16> near_tie_tiles(int64_t rows, int64_t cols, ErrMode mode) {
  std::mt19937 gen(7);
  const bool mse = mode == ErrMode::mse;
  std::vector<bf16> x(static_cast<size_t>(rows * cols));
  for (auto& e : x) {
    const uint32_t k = gen() % (mse ? 10 : 8);
    float v = k == 0 ? 4.5f : k <= (mse ? 2u : 1u) ? 1.0f : k <= (mse ? 4u : 2u) ? 2.0f : 0.0f;
    if (v == 0.0f) v = std::ldexp(1.0f + float(gen() % 128) / 128.0f, -int((mse ? 8 : 20) + gen() % 8));
    e = f32_to_bf16(gen() % 2 ? -v : v);
  }
  for (int64_t tr = 0; tr < rows / 16; ++tr)
    for (int64_t tc = 0; tc < cols / 16; ++tc)
      x[size_t((tr * 16 + gen() % 16) * cols + tc * 16 + gen() % 16)] = f32_to_bf16(6.0f);
  x[5] = f32_to_bf16(1536.0f);
  return x;
}

// The decision must follow TE's order in each copy (per line of the copy, then the pairwise tree): the
// byte comparison on tiles where that order matters, and a check that they are such tiles.
TEST(Nvfp4FourOverSixTe, TwoDDecisionFollowsTeReductionOrder) {
  const int64_t rows = 256, cols = 512;
  for (ErrMode mode : {ErrMode::mae, ErrMode::mse}) {
    SCOPED_TRACE(err_mode_name(mode));
    const std::vector<bf16> x = near_tie_tiles(rows, cols, mode);
    const std::vector<float> f = to_float(x);
    const HostQuantized q = expect_matches_te(x, rows, cols, true, mode);
    int row_col_differ = 0, sequential_differs = 0;
    for (int64_t tr = 0; tr < rows / 16; ++tr)
      for (int64_t tc = 0; tc < cols / 16; ++tc) {
        const uint8_t s_row = q.row_scales[size_t(tr * 16 * (cols / 16) + tc)];
        const uint8_t s_col = q.col_scales[size_t(tc * 16 * (rows / 16) + tr)];
        row_col_differ += s_row != s_col;
        const bool seq4 = sequential_pick_map4(f, cols, tr * 16, tc * 16, 1536.0f, mode == ErrMode::mse);
        sequential_differs += seq4 != (s_row == 0x3C);  // 0x3C = 1.5: map to 4 at tile amax 6
      }
    std::printf(
        "[4/6 TE] %s: of %lld tiles, %d decide differently in the two copies, %d differ from one "
        "row-major sum\n",
        err_mode_name(mode), (long long)(rows * cols / 256), row_col_differ, sequential_differs);
    EXPECT_GT(row_col_differ, 0);
    EXPECT_GT(sequential_differs, 0);
  }
}

}  // namespace
}  // namespace nb::nvfp4
