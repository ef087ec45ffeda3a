// MoR's NVFP4 ladder per 128x128 block (formats/mor/mor_block.h, apply_block_ladder_ref) against references written
// apart from it: an NVFP4 block's values are the NVFP4 quantizer's own (nvfp4::quantize_ref with 16x16 tiles, or with
// SR on a tensor whose 1x16 blocks share their tile's amax, so the 1D SR quantizer's codes are the tiles'; 1x16 and
// 16x1 blocks: its row-wise and column-wise copies), dequantized and rounded to BF16; its statistic is the float64 mean
// of those values' relative errors; each block's rung follows from that mean and from the E4M3 block rule's own
// decision (decide_blocks_ref); a non-finite block stays BF16.
#include <gtest/gtest.h>
#include <cmath>
#include <random>
#include <vector>
#include "core/bf16.h"
#include "formats/mor/mor.h"
#include "formats/mor/mor_block.h"
#include "formats/nvfp4/nvfp4.h"

namespace nb::mor {
namespace {

constexpr double kNvfp4Threshold = 0.3;

struct Ladder {
  std::vector<bf16> out;
  StatCell e4m3, nvfp4;
  BlockCounts counts;
};

Ladder apply_ladder(const std::vector<bf16>& x, int64_t rows, int64_t cols, const BlockLadder& top,
                    const BlockRule& rule = BlockRule{}) {
  Ladder l;
  l.out.resize(x.size());
  EXPECT_TRUE(
      apply_block_ladder_ref(x.data(), rows, cols, rule, top, l.out.data(), {&l.e4m3, &l.nvfp4, &l.counts}).is_ok());
  return l;
}

// The NVFP4 quantizer's values of x (row copy only): 16x16 tiles (two_d), or 1x16 blocks with SR.
std::vector<float> nvfp4_values(const std::vector<bf16>& x, int64_t rows, int64_t cols, bool sr, RngKey key) {
  nvfp4::Options o;
  o.colwise = false;
  o.two_d = !sr;
  o.sr = sr;
  o.rng = key;
  std::vector<uint8_t> data(size_t(rows * cols / 2)), scales(size_t(rows * cols / 16));
  float amax = 0.0f;
  nvfp4::QuantizedView v{rows, cols, data.data(), scales.data(), nullptr, nullptr, &amax, nullptr, nullptr};
  EXPECT_TRUE(nvfp4::quantize_ref(x.data(), o, v).is_ok());
  std::vector<float> out(x.size());
  nvfp4::dequantize_ref(data.data(), scales.data(), amax, rows, cols, out.data());
  return out;
}

// The float64 mean of min(1, |x - x_hat| / |x|) over a block's finite non-zero elements.
double mean_error(const std::vector<bf16>& x, const std::vector<float>& xhat, int64_t cols, int64_t br, int64_t bc) {
  double sum = 0.0;
  int64_t n = 0;
  for (int64_t r = br * 128; r < br * 128 + 128; ++r)
    for (int64_t c = bc * 128; c < bc * 128 + 128; ++c) {
      const double v = bf16_to_f32(x[size_t(r * cols + c)]);
      if (!std::isfinite(v) || v == 0.0) continue;
      sum += std::min(1.0, std::fabs(v - double(xhat[size_t(r * cols + c)])) / std::fabs(v));
      ++n;
    }
  return n ? sum / double(n) : 0.0;
}

// Six 128x128 blocks of different kinds: Gaussian, log-normal (sigma 1.5: NVFP4's tiles flush most of it, E4M3 holds
// it), magnitudes spread over 12 decades (E4M3's range does not hold them either), all zeros, a Gaussian far below the
// tensor's amax (its tile scales underflow E4M3 under the tensor's S_enc), Gaussian again.
std::vector<bf16> six_kinds(uint64_t seed) {
  const int64_t cols = 384;
  std::vector<bf16> x(size_t(256 * cols));
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> z(0.0, 1.0);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (int64_t r = 0; r < 256; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const int kind = int(r / 128) * 3 + int(c / 128);
      const double g = z(rng), sign = z(rng) < 0 ? -1.0 : 1.0;
      double v = g;
      if (kind == 1) v = sign * std::exp(1.5 * g);
      if (kind == 2) v = sign * std::pow(10.0, -12.0 * u(rng));
      if (kind == 3) v = 0.0;
      if (kind == 4) v = 1e-4 * g;
      x[size_t(r * cols + c)] = f32_to_bf16(float(v));
    }
  return x;
}

TEST(MorBlockLadder, EachBlockTakesTheRungItsOwnErrorsGive) {
  const int64_t rows = 256, cols = 384;
  const std::vector<bf16> x = six_kinds(5);
  const BlockLadder top{kNvfp4Threshold, false, {}};
  const Ladder got = apply_ladder(x, rows, cols, top);
  const std::vector<float> nv = nvfp4_values(x, rows, cols, false, {});
  std::vector<BlockDecision> fp8;
  ASSERT_TRUE(decide_blocks_ref(x.data(), rows, cols, BlockRule{}, &fp8).is_ok());
  std::vector<bf16> fp8_out(x.size());
  ASSERT_TRUE(apply_block_rule_ref(x.data(), rows, cols, BlockRule{}, fp8_out.data(), nullptr, nullptr).is_ok());
  BlockCounts want;
  int mismatches = 0;
  for (int64_t b = 0; b < 6; ++b) {
    const int64_t br = b / 3, bc = b % 3;
    const double e = mean_error(x, nv, cols, br, bc);
    ASSERT_GT(std::fabs(e - kNvfp4Threshold), 1e-3) << "block " << b << " sits on the threshold";
    const Choice choice = e < kNvfp4Threshold ? Choice::nvfp4 : fp8[size_t(b)].choice;
    want.nvfp4 += choice == Choice::nvfp4;
    want.e4m3 += choice == Choice::fp8_e4m3;
    want.bf16 += choice == Choice::bf16;
    for (int64_t r = br * 128; r < br * 128 + 128; ++r)
      for (int64_t c = bc * 128; c < bc * 128 + 128; ++c) {
        const size_t i = size_t(r * cols + c);
        const bf16 expect = choice == Choice::nvfp4 ? f32_to_bf16(nv[i]) : fp8_out[i];
        mismatches += got.out[i].bits != expect.bits;
      }
  }
  EXPECT_EQ(mismatches, 0);
  EXPECT_EQ(got.counts.nvfp4, want.nvfp4);
  EXPECT_EQ(got.counts.e4m3, want.e4m3);
  EXPECT_EQ(got.counts.bf16, want.bf16);
  EXPECT_EQ(got.counts.e5m2, 0u);
  // Every rung is taken (the kinds are made so): Gaussians and zeros NVFP4, the log-normal E4M3, the 12 decades BF16,
  // and the far-below Gaussian leaves NVFP4 too.
  EXPECT_EQ(want.nvfp4, 3u);
  EXPECT_GE(want.e4m3, 1u);
  EXPECT_GE(want.bf16, 1u);
}

TEST(MorBlockLadder, TheStatisticsAreTheWholeTensorsFloat64Means) {
  const int64_t rows = 256, cols = 384;
  const std::vector<bf16> x = six_kinds(6);
  const Ladder got = apply_ladder(x, rows, cols, BlockLadder{kNvfp4Threshold, false, {}});
  const std::vector<float> nv = nvfp4_values(x, rows, cols, false, {});
  double sum = 0.0;
  int64_t n = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double v = bf16_to_f32(x[i]);
    if (v == 0.0) continue;
    sum += std::min(1.0, std::fabs(v - double(nv[i])) / std::fabs(v));
    ++n;
  }
  const ErrorStat s = stat_of(got.nvfp4);
  EXPECT_EQ(s.nonzero, n);
  EXPECT_NEAR(s.mean(), sum / double(n), 1e-6 * sum / double(n));
  EXPECT_EQ(got.e4m3.nonzero, uint64_t(n)) << "both statistics count the same elements";
}

TEST(MorBlockLadder, ClippedBlocksAreTheTiledQuantizersValues) {
  const int64_t rows = 272, cols = 400;  // a last row of blocks 16 high, a last column 16 wide
  std::vector<bf16> x(size_t(rows * cols));
  std::mt19937_64 rng(7);
  std::normal_distribution<double> z(0.0, 1.0);
  for (auto& v : x) v = f32_to_bf16(float(z(rng)));
  const Ladder got = apply_ladder(x, rows, cols, BlockLadder{0.999, false, {}});
  const std::vector<float> nv = nvfp4_values(x, rows, cols, false, {});
  EXPECT_EQ(got.counts.nvfp4, 3u * 4u);
  int mismatches = 0;
  for (size_t i = 0; i < x.size(); ++i) mismatches += got.out[i].bits != f32_to_bf16(nv[i]).bits;
  EXPECT_EQ(mismatches, 0);
}

// SR: every 1x16 block holds its tile's largest magnitude, so the 1D quantizer's block scales are the tiles' and its
// SR codes (the same key, the same element indices) are the ladder's.
TEST(MorBlockLadder, StochasticRoundingDrawsTheNvfp4QuantizersBytes) {
  const int64_t rows = 128, cols = 256;
  std::vector<bf16> x(size_t(rows * cols));
  std::mt19937_64 rng(8);
  std::normal_distribution<double> z(0.0, 1.0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const double tile_max = 1.0 + double((r / 16) * 16 + c / 16);  // each tile its own
      const double v = c % 16 == 0 ? tile_max : std::clamp(z(rng), -0.9, 0.9) * tile_max;
      x[size_t(r * cols + c)] = f32_to_bf16(float(v));
    }
  const RngKey key{11, 3, 0x302};
  const Ladder sr = apply_ladder(x, rows, cols, BlockLadder{0.999, true, key});
  const Ladder rne = apply_ladder(x, rows, cols, BlockLadder{0.999, false, key});
  const std::vector<float> nv = nvfp4_values(x, rows, cols, true, key);
  int mismatches = 0, differs_from_rne = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    mismatches += sr.out[i].bits != f32_to_bf16(nv[i]).bits;
    differs_from_rne += sr.out[i].bits != rne.out[i].bits;
  }
  EXPECT_EQ(mismatches, 0);
  EXPECT_GT(differs_from_rne, int(x.size() / 10)) << "SR draws its own codes";
}

TEST(MorBlockLadder, ANonFiniteBlockStaysBf16AndIsCounted) {
  const int64_t rows = 256, cols = 256;
  std::vector<bf16> x(size_t(rows * cols));
  std::mt19937_64 rng(9);
  std::normal_distribution<double> z(0.0, 1.0);
  for (auto& v : x) v = f32_to_bf16(float(z(rng)));
  x[size_t(200 * cols + 17)] = f32_to_bf16(NAN);  // block (1, 0)
  const Ladder got = apply_ladder(x, rows, cols, BlockLadder{kNvfp4Threshold, false, {}});
  EXPECT_EQ(got.counts.nonfinite, 1u);
  EXPECT_EQ(got.counts.nvfp4, 0u) << "a NaN makes the tensor's NVFP4 amax NaN: no block keeps NVFP4 that step";
  EXPECT_EQ(got.counts.bf16 + got.counts.e4m3, 4u);
  for (int64_t r = 128; r < 256; ++r)
    for (int64_t c = 0; c < 128; ++c)
      ASSERT_EQ(got.out[size_t(r * cols + c)].bits, x[size_t(r * cols + c)].bits) << "the NaN block is BF16";
}

// 1x16 and 16x1 blocks: the NVFP4 quantizer's row-wise and column-wise copies (1D blocks), RNE and SR (the column
// copy's key is the row copy's with the stream's low bit flipped, as nvfp4.h keys them).
TEST(MorBlockLadder, RowAndColumnBlocksAreTheQuantizersCopies) {
  const int64_t rows = 272, cols = 400;
  std::vector<bf16> x(size_t(rows * cols));
  std::mt19937_64 rng(12);
  std::normal_distribution<double> z(0.0, 1.0);
  for (auto& v : x) v = f32_to_bf16(float(std::exp(z(rng)) * (z(rng) < 0 ? -1.0 : 1.0)));
  const RngKey key{13, 2, 0x704};
  for (bool sr : {false, true}) {
    SCOPED_TRACE(sr ? "sr" : "rne");
    nvfp4::Options o;
    o.sr = sr;
    o.rng = key;
    std::vector<uint8_t> rd(x.size() / 2), rs(x.size() / 16), cd(x.size() / 2), cs(x.size() / 16);
    float ra = 0.0f, ca = 0.0f;
    nvfp4::QuantizedView v{rows, cols, rd.data(), rs.data(), cd.data(), cs.data(), &ra, &ca, nullptr};
    ASSERT_TRUE(nvfp4::quantize_ref(x.data(), o, v).is_ok());
    std::vector<float> row(x.size()), colt(x.size());
    nvfp4::dequantize_ref(rd.data(), rs.data(), ra, rows, cols, row.data());
    nvfp4::dequantize_ref(cd.data(), cs.data(), ca, cols, rows, colt.data());  // [cols, rows]
    const Ladder by_row = apply_ladder(x, rows, cols, BlockLadder{0.999, sr, key, Nvfp4Blocks::rows});
    const RngKey col_key{key.seed, key.step, key.stream ^ 1u};
    const Ladder by_col = apply_ladder(x, rows, cols, BlockLadder{0.999, sr, col_key, Nvfp4Blocks::cols});
    EXPECT_EQ(by_row.counts.nvfp4, 3u * 4u);
    EXPECT_EQ(by_col.counts.nvfp4, 3u * 4u);
    int row_mismatches = 0, col_mismatches = 0, copies_differ = 0;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) {
        const size_t i = size_t(r * cols + c);
        row_mismatches += by_row.out[i].bits != f32_to_bf16(row[i]).bits;
        col_mismatches += by_col.out[i].bits != f32_to_bf16(colt[size_t(c * rows + r)]).bits;
        copies_differ += by_row.out[i].bits != by_col.out[i].bits;
      }
    EXPECT_EQ(row_mismatches, 0);
    EXPECT_EQ(col_mismatches, 0);
    EXPECT_GT(copies_differ, int(x.size() / 4)) << "the two directions are two quantizations";
  }
}

TEST(MorBlockLadder, PartialTilesAndThresholdsOutsideTheRangeAreRefused) {
  std::vector<bf16> x(size_t(24 * 32)), out(x.size());
  const Status tiles =
      apply_block_ladder_ref(x.data(), 24, 32, BlockRule{}, BlockLadder{0.3, false, {}}, out.data(), BlockTallies{});
  EXPECT_NE(tiles.message().find("multiples of 16"), std::string::npos) << tiles.message();
  const Status t =
      apply_block_ladder_ref(x.data(), 16, 32, BlockRule{}, BlockLadder{1.5, false, {}}, out.data(), BlockTallies{});
  EXPECT_NE(t.message().find("outside (0, 1)"), std::string::npos) << t.message();
}

}  // namespace
}  // namespace nb::mor
