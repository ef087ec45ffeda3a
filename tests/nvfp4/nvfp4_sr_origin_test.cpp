// SR origin (Options::sr_origin, nvfp4.h): a piece of a whole tensor (a block of rows or of columns, as
// tensor and sequence parallelism cut it) quantized with the whole tensor's amaxes and its origin gives
// exactly the whole tensor's bytes for its elements, SR included, with RHT and with 4/6; the default
// origin gives different SR bytes (so the comparison is not vacuous); bad origins are refused.
#include <gtest/gtest.h>
#include <array>
#include <cstring>
#include <string>
#include <vector>
#include "formats/nvfp4/nvfp4.h"
#include "formats/nvfp4/nvfp4_math.h"
#include "formats/scalar_codecs.h"
#include "nvfp4/nvfp4_test_util.h"

namespace nb::nvfp4 {
// A named namespace: the tests of this folder compile as unity sources, so helper names must not clash.
namespace sr_origin_test {
using testing::HostQuantized;

constexpr int64_t kRows = 128, kCols = 256;

// Gaussian values with an outlier every 97 elements, so block scales vary and some blocks saturate.
std::vector<bf16> whole_input() {
  auto x = testing::random_normal_bf16(kRows * kCols, 41);
  for (size_t i = 5; i < x.size(); i += 97) x[i] = f32_to_bf16(bf16_to_f32(x[i]) * 60.0f);
  return x;
}

// The rows [row0, row0 + rows) x columns [col0, col0 + cols) of the whole row-major input.
std::vector<bf16> cut_piece(const std::vector<bf16>& x, int64_t row0, int64_t col0, int64_t rows, int64_t cols) {
  std::vector<bf16> p(size_t(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(&p[size_t(r * cols)], &x[size_t((row0 + r) * kCols + col0)], size_t(cols) * sizeof(bf16));
  return p;
}

// Bytes [inner0, inner0 + inner_n) of lines [outer0, outer0 + outer_n) of a [*, pitch] byte array: the
// part of one of the whole tensor's copies that belongs to a piece.
std::vector<uint8_t> slice_bytes(const std::vector<uint8_t>& a, int64_t pitch, int64_t outer0, int64_t outer_n,
                                 int64_t inner0, int64_t inner_n) {
  std::vector<uint8_t> s;
  for (int64_t o = outer0; o < outer0 + outer_n; ++o)
    s.insert(s.end(), a.begin() + o * pitch + inner0, a.begin() + o * pitch + inner0 + inner_n);
  return s;
}

// The piece at (row0, col0) of shape rows x cols quantized with the whole tensor's amaxes (whole.row_amax,
// whole.col_amax) under `opts` (whose sr_origin the caller sets, or leaves default).
HostQuantized quantize_piece(const std::vector<bf16>& x, const HostQuantized& whole, const Options& opts, int64_t row0,
                             int64_t col0, int64_t rows, int64_t cols) {
  const std::vector<bf16> piece = cut_piece(x, row0, col0, rows, cols);
  HostQuantized q{rows, cols};
  q.row_amax = whole.row_amax;
  q.col_amax = whole.col_amax;
  const Status st = quantize_ref_with_amax(piece.data(), opts, q.view());
  EXPECT_TRUE(st) << st.message();
  return q;
}

// Every byte of the piece's four arrays against the whole tensor's bytes of the piece's elements: the row
// copy's lines are rows (bytes of columns col0..), the column copy's lines are columns (bytes of rows row0..).
void expect_piece_matches(const HostQuantized& whole, const HostQuantized& p, int64_t row0, int64_t col0,
                          const std::string& what) {
  SCOPED_TRACE(what);
  const int64_t rows = p.rows, cols = p.cols;
  EXPECT_EQ(p.row_data, slice_bytes(whole.row_data, kCols / 2, row0, rows, col0 / 2, cols / 2));
  EXPECT_EQ(p.row_scales, slice_bytes(whole.row_scales, kCols / 16, row0, rows, col0 / 16, cols / 16));
  EXPECT_EQ(p.col_data, slice_bytes(whole.col_data, kRows / 2, col0, cols, row0 / 2, rows / 2));
  EXPECT_EQ(p.col_scales, slice_bytes(whole.col_scales, kRows / 16, col0, cols, row0 / 16, rows / 16));
}

// Cuts the whole tensor into a grid of row_pieces x col_pieces pieces and checks each one.
void check_grid(const std::vector<bf16>& x, const HostQuantized& whole, const testing::SrMode& mode, int64_t row_pieces,
                int64_t col_pieces) {
  const int64_t rows = kRows / row_pieces, cols = kCols / col_pieces;
  for (int64_t i = 0; i < row_pieces; ++i)
    for (int64_t j = 0; j < col_pieces; ++j) {
      Options o = mode.opts;
      o.sr_origin = SrOrigin{i * rows, j * cols, kRows, kCols};
      const HostQuantized p = quantize_piece(x, whole, o, i * rows, j * cols, rows, cols);
      expect_piece_matches(whole, p, i * rows, j * cols,
                           std::string(mode.name) + " piece (" + std::to_string(i) + ", " + std::to_string(j) +
                               ") of " + std::to_string(row_pieces) + " x " + std::to_string(col_pieces));
    }
}

TEST(Nvfp4SrOrigin, RowAndColumnPiecesReproduceTheWholeTensorsBytes) {
  const auto x = whole_input();
  for (const testing::SrMode& mode : testing::sr_modes(RngKey{2024, 3, 10})) {
    HostQuantized whole{kRows, kCols};
    ASSERT_TRUE(quantize_ref(x.data(), mode.opts, whole.view()));
    float row_amax = 0, col_amax = 0;
    compute_amax_ref(x.data(), kRows, kCols, mode.opts.rht, &row_amax, &col_amax);
    ASSERT_EQ(f32_bits(row_amax), f32_bits(whole.row_amax));
    ASSERT_EQ(f32_bits(col_amax), f32_bits(whole.col_amax));
    for (int64_t n : {2, 4}) {
      check_grid(x, whole, mode, n, 1);  // row pieces (sequence parallelism, column-parallel outputs)
      check_grid(x, whole, mode, 1, n);  // column pieces (row-parallel inputs)
    }
    check_grid(x, whole, mode, 2, 2);  // both at once
  }
}

TEST(Nvfp4SrOrigin, DefaultOriginGivesOtherBytesForAnOffsetPiece) {
  const auto x = whole_input();
  for (const testing::SrMode& mode : testing::sr_modes(RngKey{2024, 3, 10})) {
    HostQuantized whole{kRows, kCols};
    ASSERT_TRUE(quantize_ref(x.data(), mode.opts, whole.view()));
    // Second of two row pieces and second of two column pieces: both copies' SR indices move.
    for (auto [row0, col0, rows, cols] : {std::array<int64_t, 4>{kRows / 2, 0, kRows / 2, kCols},
                                          std::array<int64_t, 4>{0, kCols / 2, kRows, kCols / 2}}) {
      SCOPED_TRACE(std::string(mode.name) + " row0 " + std::to_string(row0) + " col0 " + std::to_string(col0));
      const HostQuantized p = quantize_piece(x, whole, mode.opts, row0, col0, rows, cols);
      EXPECT_NE(p.row_data, slice_bytes(whole.row_data, kCols / 2, row0, rows, col0 / 2, cols / 2));
      EXPECT_NE(p.col_data, slice_bytes(whole.col_data, kRows / 2, col0, cols, row0 / 2, rows / 2));
      // Without SR the origin is ignored and the piece matches the whole tensor either way.
      Options rne = mode.opts;
      rne.sr = false;
      HostQuantized whole_rne{kRows, kCols};
      ASSERT_TRUE(quantize_ref(x.data(), rne, whole_rne.view()));
      expect_piece_matches(whole_rne, quantize_piece(x, whole_rne, rne, row0, col0, rows, cols), row0, col0,
                           "RNE, default origin");
      rne.sr_origin = SrOrigin{row0, col0, kRows, kCols};
      expect_piece_matches(whole_rne, quantize_piece(x, whole_rne, rne, row0, col0, rows, cols), row0, col0,
                           "RNE, with origin");
    }
  }
}

TEST(Nvfp4SrOrigin, PieceFollowsTheHeadersIndexRule) {
  // Element (r, c) of a piece at (row0, col0) of a whole W_r x W_c tensor: row copy e = (row0 + r) * W_c +
  // col0 + c with the key, column copy e = (col0 + c) * W_r + row0 + r with stream ^ 1. Checked element by
  // element from the codec, independently of quantizing the whole tensor.
  const int64_t row0 = 32, col0 = 48, rows = 64, cols = 80;
  const auto whole_x = whole_input();
  const auto x = cut_piece(whole_x, row0, col0, rows, cols);
  Options opts;
  opts.sr = true;
  opts.rng = RngKey{7, 1, 4};
  opts.sr_origin = SrOrigin{row0, col0, kRows, kCols};
  HostQuantized q{rows, cols};
  compute_amax_ref(whole_x.data(), kRows, kCols, false, &q.row_amax, &q.col_amax);
  ASSERT_TRUE(quantize_ref_with_amax(x.data(), opts, q.view()));
  const float s_enc = global_encode_scale(q.row_amax);
  RngKey kc = opts.rng;
  kc.stream ^= 1;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const float v = bf16_to_f32(x[size_t(r * cols + c)]);
      const float enc_r = block_encode_scale(q.row_scales[size_t(r * (cols / 16) + c / 16)], s_enc);
      const int64_t e = (row0 + r) * kCols + col0 + c;
      ASSERT_EQ(q.row_code(r, c), f32_to_e2m1_sr(v * enc_r, philox_byte(philox_block(opts.rng, e / 16), e % 16)));
      const float enc_c = block_encode_scale(q.col_scales[size_t(c * (rows / 16) + r / 16)], s_enc);
      const int64_t ec = (col0 + c) * kRows + row0 + r;
      ASSERT_EQ(q.col_code(c, r), f32_to_e2m1_sr(v * enc_c, philox_byte(philox_block(kc, ec / 16), ec % 16)));
    }
}

TEST(Nvfp4SrOrigin, CheckShapeRefusesBadOrigins) {
  Options o;
  o.sr = true;
  EXPECT_TRUE(check_shape(64, 256, o));
  o.sr_origin = SrOrigin{64, 0, 128, 256};
  EXPECT_TRUE(check_shape(64, 256, o));
  o.sr_origin = SrOrigin{0, 128, 0, 256};  // whole_rows 0: the piece's own 64 rows
  EXPECT_TRUE(check_shape(64, 128, o));

  o.sr_origin = SrOrigin{8, 0, 128, 256};  // row0 not a multiple of 16
  Status st = check_shape(64, 256, o);
  ASSERT_FALSE(st);
  EXPECT_NE(st.message().find("row0 8"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("multiples of 16"), std::string::npos) << st.message();

  o.sr_origin = SrOrigin{80, 0, 128, 256};  // rows 80..143 of a 128-row tensor
  st = check_shape(64, 256, o);
  ASSERT_FALSE(st);
  EXPECT_NE(st.message().find("row0 + rows <= whole_rows"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("whole 128 x 256"), std::string::npos) << st.message();

  o.sr_origin = SrOrigin{0, 16, 64, 0};  // whole_cols 0 = the piece's own cols: no room for col0 16
  EXPECT_FALSE(check_shape(64, 256, o));
  o.sr_origin = SrOrigin{0, 0, 128, 264};  // whole tensor not a multiple of 16
  EXPECT_FALSE(check_shape(64, 256, o));
  o.sr_origin = SrOrigin{-16, 0, 128, 256};
  EXPECT_FALSE(check_shape(64, 256, o));
  o.sr = false;  // checked without SR too (then unused)
  o.sr_origin = SrOrigin{0, 8, 0, 512};
  EXPECT_FALSE(check_shape(64, 256, o));

  // The quantizer refuses it as well.
  const std::vector<bf16> x(size_t(64 * 256));
  HostQuantized q{64, 256};
  q.row_amax = q.col_amax = 1.0f;
  EXPECT_FALSE(quantize_ref_with_amax(x.data(), o, q.view()));
}

}  // namespace sr_origin_test
}  // namespace nb::nvfp4
