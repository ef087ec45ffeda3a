// CPU reference tests of NVFP4 4/6 adaptive block scaling (Options::four_over_six; the rule is in
// nvfp4_math.h): hand-computed blocks and tiles, the per-block guarantee against the map-to-6
// candidate (with RHT, SR, 2D; MAE and MSE), the whole-tensor MSE against plain NVFP4, the GEMM alpha
// of the true amax against the former decode amax, and the non-finite flag. The byte comparison with
// TransformerEngine's definition is nvfp4_4over6_te_test.cpp.
#include <gtest/gtest.h>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <random>
#include "formats/nvfp4/nvfp4.h"
#include "formats/nvfp4/nvfp4_math.h"
#include "formats/scalar_codecs.h"
#include "gemm/gemm_quantized.h"
#include "nvfp4/nvfp4_test_util.h"

namespace nb::nvfp4 {
namespace {
using testing::HostQuantized;

std::vector<bf16> to_bf16(const std::vector<float>& f) {
  std::vector<bf16> x;
  for (float v : f) x.push_back(f32_to_bf16(v));
  return x;
}

// A 16-column row of 6 followed by fifteen copies of `rest`, at columns c0..c0+15 of row r.
void fill_block(std::vector<float>& f, int64_t cols, int64_t r, int64_t c0, float rest) {
  f[size_t(r * cols + c0)] = 6.0f;
  for (int j = 1; j < 16; ++j) f[size_t(r * cols + c0 + j)] = rest;
}

// Tensor amax 1536 makes S_enc = 6*256 / 1536 = 1 exactly: a block's base is block_amax / 6 and a
// decoded value is e2m1 * scale (e * s * 1536 / 1536). The same decisions under MAE and MSE.
void hand_computed_blocks(ErrMode mode) {
  SCOPED_TRACE(err_mode_name(mode));
  const int64_t n = 16;
  std::vector<float> f(n * n, 0.0f);
  f[0] = 1536.0f;                // row 0: the tensor amax alone
  fill_block(f, n, 1, 0, 4.5f);  // row 1: values at 0.75 of the block max
  fill_block(f, n, 2, 0, 1.0f);  // row 2: values at 1/6 of the block max
  auto x = to_bf16(f);
  Options o;
  o.colwise = false;
  o.four_over_six = true;
  o.err_mode = mode;
  HostQuantized q{n, n};
  ASSERT_TRUE(quantize_ref(x.data(), o, q.view()));
  EXPECT_EQ(q.row_amax, 1536.0f);  // the true amax
  EXPECT_EQ(q.nonfinite, 0);
  // Row 0: base 1536/6 = 256. Map to 6: scale 256 (0x78), 1536/256 = 6 (code 7), exact. Map to 4: scale
  // 384 (0x7C), 1536/384 = 4 (code 6), decodes 4 * 384 = 1536, exact too: the tie keeps map to 6.
  EXPECT_EQ(q.row_scales[0], 0x78);
  EXPECT_EQ(q.row_code(0, 0), 7u);
  // Row 1: base 6/6 = 1. Map to 6: scale 1.0 (0x38), enc 1: 6 -> 6, 4.5 -> 4 (|x| <= 5 rounds to 4),
  // error 15 * 0.5 = 7.5 (MAE) or 15 * 0.5^2 = 3.75 (MSE). Map to 4: scale 1.5 (0x3C), enc 1/1.5: 6 -> 4
  // (code 6, decodes 4 * 1.5 = 6), 4.5 -> 3 (code 5, decodes 3 * 1.5 = 4.5), error 0: map to 4 wins.
  EXPECT_EQ(q.row_scales[1], 0x3C);
  EXPECT_EQ(q.row_code(1, 0), 6u);
  for (int j = 1; j < 16; ++j) EXPECT_EQ(q.row_code(1, j), 5u);
  // Row 2: map to 6: 6 -> 6, 1 -> 1, error 0. Map to 4: 1/1.5 = 0.667 -> 0.5 (|x| < 0.75), decodes
  // 0.5 * 1.5 = 0.75, error 15 * 0.25 (MAE) or 15 * 0.25^2 (MSE): map to 6 wins.
  EXPECT_EQ(q.row_scales[2], 0x38);
  EXPECT_EQ(q.row_code(2, 0), 7u);
  EXPECT_EQ(q.row_code(2, 1), 2u);

  // Decoded with the stored amax over 6*256: e * s * 1536 / 1536.
  std::vector<float> deq(n * n);
  dequantize_ref(q.row_data.data(), q.row_scales.data(), q.row_amax, n, n, deq.data(), /*four_over_six=*/true);
  EXPECT_EQ(deq[0], 1536.0f);
  EXPECT_EQ(deq[n], 6.0f);
  for (int j = 1; j < 16; ++j) EXPECT_EQ(deq[n + j], 4.5f);
  EXPECT_EQ(deq[2 * n], 6.0f);
  EXPECT_EQ(deq[2 * n + 1], 1.0f);

  // Plain NVFP4 (448 bound): S_enc = 2688/1536 = 1.75, row 1 gets scale 1.75 and its 4.5s decode as
  // 4 (4 * 1.75 * 1536 / 2688), the same 0.5 error per 4.5 as map to 6.
  Options plain = o;
  plain.four_over_six = false;
  HostQuantized p{n, n};
  ASSERT_TRUE(quantize_ref(x.data(), plain, p.view()));
  dequantize_ref(p.row_data.data(), p.row_scales.data(), p.row_amax, n, n, deq.data());
  EXPECT_EQ(deq[n + 1], 4.0f);
}

TEST(Nvfp4FourOverSix, HandComputedBlocks) {
  for (ErrMode mode : {ErrMode::mae, ErrMode::mse}) hand_computed_blocks(mode);
}

// 2D: one decision per 16x16 tile and copy. Tile (0,0) holds row 1's pattern in all 16 rows (map to 4:
// error 0 against 16 * 7.5 = 120 by MAE), tile (0,1) only the amax 1536 (a tie: map to 6). Both copies
// decide alike here (no near-tie).
TEST(Nvfp4FourOverSix, HandComputedTwoDTiles) {
  const int64_t rows = 16, cols = 32;
  std::vector<float> f(rows * cols, 0.0f);
  for (int64_t r = 0; r < rows; ++r) fill_block(f, cols, r, 0, 4.5f);
  f[16] = 1536.0f;
  auto x = to_bf16(f);
  Options o;
  o.two_d = true;
  o.four_over_six = true;
  HostQuantized q{rows, cols};
  ASSERT_TRUE(quantize_ref(x.data(), o, q.view()));
  EXPECT_EQ(q.row_amax, 1536.0f);
  EXPECT_EQ(q.col_amax, 1536.0f);
  for (int64_t r = 0; r < rows; ++r) {
    EXPECT_EQ(q.row_scales[size_t(r * 2)], 0x3C);
    EXPECT_EQ(q.row_scales[size_t(r * 2 + 1)], 0x78);
    EXPECT_EQ(q.row_code(r, 0), 6u);
    EXPECT_EQ(q.row_code(r, 5), 5u);
  }
  for (int64_t c = 0; c < 16; ++c) EXPECT_EQ(q.col_scales[size_t(c)], 0x3C);
  for (int64_t c = 16; c < 32; ++c) EXPECT_EQ(q.col_scales[size_t(c)], 0x78);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) ASSERT_EQ(q.row_code(r, c), q.col_code(c, r));
}

// Heavy tails: a standard normal divided by a uniform(0.05, 1) (occasional 20x values) with random signs.
std::vector<bf16> heavy_tailed_bf16(int64_t count, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> u(0.05f, 1.0f);
  std::vector<bf16> x(static_cast<size_t>(count));
  for (auto& v : x) v = f32_to_bf16(normal(gen) / u(gen));
  return x;
}

// The values a copy quantizes, [outer, inner] row-major: the source (row copy) or its transpose,
// RHT'd per 16-element chunk (column copy with rht).
std::vector<float> copy_source(const std::vector<bf16>& x, int64_t rows, int64_t cols, bool col, bool rht) {
  std::vector<float> s(x.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      s[size_t(col ? c * rows + r : r * cols + c)] = bf16_to_f32(x[size_t(r * cols + c)]);
  if (col && rht)
    for (size_t i = 0; i < s.size(); i += 16) {
      float y[16];
      rht16_ref(&s[i], y);
      std::copy(y, y + 16, &s[i]);
    }
  return s;
}

struct Candidate6 {  // the map-to-6 candidate of one block, recomputed with the scalar codecs
  uint32_t scale, scale4;
  float err;
};

// The error of a block (lines of 16 values, 1 or 16 of them) in the rule's order: each line's |d| or d * d
// summed in element order, then the lines pairwise (tree_sum16) for a 16x16 tile.
float block_error(const float* v, const float* d, int lines, ErrMode mode) {
  float line_err[16];
  for (int l = 0; l < lines; ++l) {
    line_err[l] = 0.0f;
    for (int j = 0; j < 16; ++j) {
      const float e = d[l * 16 + j] - v[l * 16 + j];
      line_err[l] = line_err[l] + (mode == ErrMode::mse ? e * e : std::fabs(e));
    }
  }
  return lines == 16 ? tree_sum16(line_err) : line_err[0];
}

// Map to 6 at the 256 bound for the `lines` x 16 elements v (a 1x16 block, or a 16x16 tile row-major in the
// copy's orientation), SR bytes from `rand_of(i)` when sr: its FP32 error.
template <typename Rand>
Candidate6 map6_candidate(const float* v, int lines, float amax, ErrMode mode, bool sr, Rand rand_of) {
  const int count = lines * 16;
  const float s_enc = fminf(1536.0f / amax, FLT_MAX);
  float m = 0.0f;
  for (int i = 0; i < count; ++i) m = std::max(m, std::fabs(v[i]));
  const float base = (m / 6.0f) * s_enc;
  Candidate6 c{f32_to_e4m3_satfinite(base), f32_to_e4m3_satfinite(base * 1.5f), 0.0f};
  const float enc = fminf(1.0f / (e4m3_to_f32(c.scale) * (1.0f / s_enc)), FLT_MAX);
  float d[256];
  for (int i = 0; i < count; ++i) {
    const uint32_t q = sr ? f32_to_e2m1_sr(v[i] * enc, rand_of(i)) : f32_to_e2m1_rne(v[i] * enc);
    d[i] = e2m1_to_f32(q) * e4m3_to_f32(c.scale) * amax / 1536.0f;
  }
  c.err = block_error(v, d, lines, mode);
  return c;
}

// Per block (tile with 2D) of one copy: the stored amax is the copy's true amax, the stored scale is the
// map-to-6 or map-to-4 code, and the stored block's FP32 error (decoded by dequantize_ref over 6*256) is
// at most the map-to-6 candidate's. Returns the share of blocks that took map to 4.
double check_copy(const std::vector<float>& src, int64_t outer, int64_t inner, const uint8_t* data,
                  const uint8_t* scales, float stored_amax, const Options& o, RngKey key) {
  float amax = 0.0f;
  for (float v : src) amax = std::max(amax, std::fabs(v));
  EXPECT_EQ(f32_bits(stored_amax), f32_bits(amax));
  std::vector<float> deq(src.size());
  dequantize_ref(data, scales, stored_amax, outer, inner, deq.data(), /*four_over_six=*/true);
  const int block_rows = o.two_d ? 16 : 1;
  int64_t fours = 0, blocks = 0;
  for (int64_t o0 = 0; o0 < outer; o0 += block_rows)
    for (int64_t b = 0; b < inner / 16; ++b, ++blocks) {
      float v[256], d[256];
      for (int64_t i = 0; i < block_rows; ++i)
        for (int j = 0; j < 16; ++j) {
          v[i * 16 + j] = src[size_t((o0 + i) * inner + b * 16 + j)];
          d[i * 16 + j] = deq[size_t((o0 + i) * inner + b * 16 + j)];
        }
      const uint64_t flat = uint64_t(o0 * (inner / 16) + b);  // SR: 1x16 blocks only
      const Candidate6 c6 = map6_candidate(v, block_rows, amax, o.err_mode, o.sr,
                                           [&](int i) { return philox_byte(philox_block(key, flat), i); });
      const float err = block_error(v, d, block_rows, o.err_mode);
      const uint32_t s = scales[size_t(o0 * (inner / 16) + b)];
      EXPECT_TRUE(s == c6.scale || s == c6.scale4) << "block " << blocks;
      if (s != c6.scale) {
        ++fours;
        EXPECT_LT(err, c6.err) << "block " << blocks;  // map to 4 only when strictly better
      } else {
        EXPECT_EQ(err, c6.err) << "block " << blocks;  // map to 6 is the candidate itself
      }
    }
  return double(fours) / double(blocks);
}

std::vector<std::pair<const char*, Options>> modes_4over6(ErrMode mode) {
  std::vector<std::pair<const char*, Options>> m;
  Options o;
  o.four_over_six = true;
  o.err_mode = mode;
  m.push_back({"rne", o});
  Options r = o;
  r.rht = true;
  m.push_back({"rht", r});
  Options s = o;
  s.sr = true;
  s.rng = RngKey{5, 7, 9};
  m.push_back({"sr", s});
  s.rht = true;
  m.push_back({"rht+sr", s});
  Options t = o;
  t.two_d = true;
  m.push_back({"2d", t});
  return m;
}

TEST(Nvfp4FourOverSix, NeverWorseThanMapToSixPerBlock) {
  const int64_t shapes[][2] = {{64, 96}, {128, 48}};
  for (auto [rows, cols] : shapes) {
    const std::pair<const char*, std::vector<bf16>> inputs[] = {
        {"gaussian", testing::random_normal_bf16(rows * cols, uint32_t(rows + cols))},
        {"heavy-tailed", heavy_tailed_bf16(rows * cols, uint32_t(rows * cols))}};
    for (const auto& [iname, x] : inputs)
      for (ErrMode mode : {ErrMode::mae, ErrMode::mse})
        for (const auto& [mname, o] : modes_4over6(mode)) {
          SCOPED_TRACE(std::string(iname) + " " + mname + " " + err_mode_name(mode) + " " + std::to_string(rows) + "x" +
                       std::to_string(cols));
          HostQuantized q{rows, cols};
          ASSERT_TRUE(quantize_ref(x.data(), o, q.view()));
          EXPECT_EQ(q.nonfinite, 0);
          const double row4 = check_copy(copy_source(x, rows, cols, false, false), rows, cols, q.row_data.data(),
                                         q.row_scales.data(), q.row_amax, o, o.rng);
          // The column copy's tiles (2D) decide in their own orientation: check_copy sees the transpose.
          const double col4 = check_copy(copy_source(x, rows, cols, true, o.rht), cols, rows, q.col_data.data(),
                                         q.col_scales.data(), q.col_amax, o, colwise_key(o.rng));
          // Both candidates must actually occur on such data (else the test proves little).
          // (2D tiles rarely take map to 4 on such data: a 256-element tile's max is far above most values.)
          if (!o.two_d) { EXPECT_TRUE(row4 > 0.05 && row4 < 0.95) << row4; }
          std::printf("[4/6] %-12s %-7s %s %3lldx%-3lld map-to-4 share: row %.2f col %.2f\n", iname, mname,
                      err_mode_name(mode), (long long)rows, (long long)cols, row4, col4);
        }
  }
}

// Mean squared error of a row copy against the source, in double.
double row_mse(const std::vector<bf16>& x, const HostQuantized& q, bool four_over_six) {
  std::vector<float> deq(x.size());
  dequantize_ref(q.row_data.data(), q.row_scales.data(), q.row_amax, q.rows, q.cols, deq.data(), four_over_six);
  double e = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double d = double(deq[i]) - double(bf16_to_f32(x[i]));
    e += d * d;
  }
  return e / double(x.size());
}

// "Plain NVFP4" here is the unchanged quantizer (448 bound, one scale per block): per block it is not
// a candidate of 4/6 (different S_enc), so the comparison is over the whole tensor.
TEST(Nvfp4FourOverSix, LowerTensorMseThanPlainNvfp4OnGaussianData) {
  const int64_t rows = 256, cols = 512;
  for (uint32_t seed : {1u, 2u, 3u}) {
    auto x = testing::random_normal_bf16(rows * cols, seed);
    for (bool two_d : {false, true})
      for (ErrMode mode : {ErrMode::mae, ErrMode::mse}) {
        Options plain;
        plain.colwise = false;
        plain.two_d = two_d;
        Options fos = plain;
        fos.four_over_six = true;
        fos.err_mode = mode;
        HostQuantized qp{rows, cols}, qf{rows, cols};
        ASSERT_TRUE(quantize_ref(x.data(), plain, qp.view()));
        ASSERT_TRUE(quantize_ref(x.data(), fos, qf.view()));
        const double mp = row_mse(x, qp, false), mf = row_mse(x, qf, true);
        std::printf("[4/6] gaussian seed %u %s %s: MSE plain %.4e, 4/6 %.4e (ratio %.3f)\n", seed, two_d ? "2d" : "1d",
                    err_mode_name(mode), mp, mf, mf / mp);
        // 1x16 blocks: below plain by either metric. 16x16 tiles rarely take map to 4 and sit at the 256
        // bound instead of 448, so they land within ~0.3% of plain on either side: reported, not asserted.
        if (!two_d) { EXPECT_LT(mf, mp) << "seed " << seed; }
      }
  }
  auto h = heavy_tailed_bf16(rows * cols, 9);
  Options plain;
  plain.colwise = false;
  Options fos = plain;
  fos.four_over_six = true;
  HostQuantized qp{rows, cols}, qf{rows, cols};
  ASSERT_TRUE(quantize_ref(h.data(), plain, qp.view()));
  ASSERT_TRUE(quantize_ref(h.data(), fos, qf.view()));
  std::printf("[4/6] heavy-tailed: MSE plain %.4e, 4/6 (MAE) %.4e (reported, not asserted)\n", row_mse(h, qp, false),
              row_mse(h, qf, true));
}

// 4/6 used to store the decode amax 1.75 * amax and decode over 6*448; it now stores the true amax and
// the GEMMs decode a 4/6 operand over 6*256 (as TransformerEngine). Same training numerics: for every
// positive finite BF16 amax a (8 significant bits) and a spread of b, the alpha of the true amaxes equals
// the former one bit for bit, with either or both operands 4/6 (1.75 a and 1.75 a * 1.75 b are exact,
// and 448 = 1.75 * 256, so both roundings are of the same real number), wherever nothing overflows.
TEST(Nvfp4FourOverSix, TrueAmaxGemmAlphaEqualsTheFormerDecodeAmaxAlpha) {
  int64_t checked = 0;
  for (uint32_t ba = 1; ba < 0x7F80u; ++ba)
    for (uint32_t bb = 0x0101u; bb < 0x7F80u; bb += 0x07F3u) {
      const float a = bf16_to_f32(bf16::from_bits(uint16_t(ba))), b = bf16_to_f32(bf16::from_bits(uint16_t(bb)));
      const float a_dec = a * 1.75f, b_dec = b * 1.75f;
      if (std::isinf(a_dec * b_dec) || a * b == 0.0f) continue;  // overflow, or underflow to 0 either way
      ASSERT_EQ(f32_bits(gemm::nvfp4_global_alpha(a, b, true, false)), f32_bits(gemm::nvfp4_global_alpha(a_dec, b)));
      ASSERT_EQ(f32_bits(gemm::nvfp4_global_alpha(a, b, true, true)), f32_bits(gemm::nvfp4_global_alpha(a_dec, b_dec)));
      ++checked;
    }
  EXPECT_GT(checked, 400000);
}

// NaN/Inf input sets the flag; a huge finite amax no longer does (the true amax is stored, nothing
// is scaled by 1.75 any more).
TEST(Nvfp4FourOverSix, NonFiniteAmaxSetsTheFlag) {
  const int64_t rows = 32, cols = 48;
  Options o;
  o.four_over_six = true;
  for (float bad : {NAN, INFINITY, 2.5e38f}) {
    auto x = testing::random_normal_bf16(rows * cols, 4);
    x[100] = f32_to_bf16(bad);
    HostQuantized q{rows, cols};
    ASSERT_TRUE(quantize_ref(x.data(), o, q.view()));
    EXPECT_EQ(q.nonfinite, std::isfinite(bad) ? 0 : 1) << bad;
    if (std::isnan(bad)) {
      EXPECT_EQ(f32_bits(q.row_amax), 0x7FC00000u);
    } else {
      EXPECT_EQ(q.row_amax, bf16_to_f32(x[100])) << bad;
    }
  }
  auto x = testing::random_normal_bf16(rows * cols, 4);
  HostQuantized q{rows, cols};
  ASSERT_TRUE(quantize_ref(x.data(), o, q.view()));
  EXPECT_EQ(q.nonfinite, 0);
}

}  // namespace
}  // namespace nb::nvfp4
