// SR origin's context-parallel row map (SrOrigin::cp, nvfp4.h): a rank's rows of whole sequences (chunks r and
// 2C-1-r of every sequence cut into 2C), quantized with the whole tensor's amaxes and the map, give exactly the
// whole tensor's bytes at those rows, in the row copy and the column (Wgrad) copy, with SR, SR + RHT and SR + 4/6,
// for C = 2 and 4 over two sequences; also with sequence parallelism's row offset inside the rank's rows and with
// column segments. Controls: without the map the SR bytes differ; the folded counters the CUDA kernels use
// (sr_block_index) follow the header's rule block by block; maps that do not fit are refused in one sentence.
#include <gtest/gtest.h>
#include <string>
#include <vector>
#include "formats/nvfp4/nvfp4.h"
#include "formats/nvfp4/nvfp4_math.h"
#include "nvfp4/nvfp4_sr_cp_util.h"
#include "nvfp4/nvfp4_test_util.h"

namespace nb::nvfp4 {
// A named namespace: the tests of this folder compile as unity sources, so helper names must not clash.
namespace sr_cp_test {
using testing::Cols;
using testing::CpLayout;
using testing::HostQuantized;

constexpr int64_t kBatch = 2, kSeq = 128, kCols = 96;  // C4: 16-token chunks, C2: 32

// Gaussian values with an outlier every 91 elements, so block scales vary and some blocks saturate.
std::vector<bf16> cp_input(int64_t rows, int64_t cols, uint32_t seed) {
  auto x = testing::random_normal_bf16(rows * cols, seed);
  for (size_t i = 3; i < x.size(); i += 91) x[i] = f32_to_bf16(bf16_to_f32(x[i]) * 50.0f);
  return x;
}

int64_t width_of(const std::vector<Cols>& cols) {
  int64_t w = 0;
  for (const Cols& g : cols) w += g.width;
  return w;
}

// Local rows [row0, row0 + rows) and columns `cols` of rank l.rank quantized with the whole's amaxes and `o`.
HostQuantized quantize_cp_piece(const std::vector<bf16>& x, const HostQuantized& whole, const Options& opts,
                                const CpLayout& l, int64_t row0, int64_t rows, const std::vector<Cols>& cols) {
  const std::vector<bf16> piece = testing::cp_piece(x, whole.cols, l, row0, rows, cols);
  HostQuantized q{rows, width_of(cols)};
  q.row_amax = whole.row_amax;
  q.col_amax = whole.col_amax;
  const Status st = quantize_ref_with_amax(piece.data(), opts, q.view());
  EXPECT_TRUE(st) << st.message();
  return q;
}

// Whether the piece's four arrays are the whole tensor's bytes at its rows and columns.
bool is_whole_bytes(const HostQuantized& whole, const HostQuantized& p, const CpLayout& l, int64_t row0,
                    const std::vector<Cols>& cols) {
  const int64_t wr = whole.rows, wc = whole.cols, rows = p.rows;
  return p.row_data == testing::cp_row_bytes(whole.row_data, wc, 2, l, row0, rows, cols) &&
         p.row_scales == testing::cp_row_bytes(whole.row_scales, wc, 16, l, row0, rows, cols) &&
         p.col_data == testing::cp_col_bytes(whole.col_data, wr, 2, l, row0, rows, cols) &&
         p.col_scales == testing::cp_col_bytes(whole.col_scales, wr, 16, l, row0, rows, cols);
}

// Every rank of C ranks, its rows whole and in `parts` pieces (sequence parallelism over `parts` ranks), the
// columns `cols` of the whole, in every SR mode.
void check_every_rank(int64_t ranks, int64_t parts, const std::vector<Cols>& cols, uint32_t seed) {
  const auto x = cp_input(kBatch * kSeq, kCols, seed);
  for (const testing::SrMode& mode : testing::sr_modes(RngKey{51, 3, 14})) {
    HostQuantized whole{kBatch * kSeq, kCols};
    ASSERT_TRUE(quantize_ref(x.data(), mode.opts, whole.view()));
    for (int64_t r = 0; r < ranks; ++r) {
      const CpLayout l{kBatch, kSeq, ranks, r};
      const int64_t rows = l.local_rows() / parts;
      for (int64_t part = 0; part < parts; ++part) {
        SCOPED_TRACE(mode.name + ", C" + std::to_string(ranks) + " rank " + std::to_string(r) + ", rows " +
                     std::to_string(part * rows) + "+" + std::to_string(rows) + ", " + std::to_string(cols.size()) +
                     " column runs");
        Options o = mode.opts;
        o.sr_origin = testing::cp_origin(l, kCols, part * rows, cols);
        EXPECT_TRUE(
            is_whole_bytes(whole, quantize_cp_piece(x, whole, o, l, part * rows, rows, cols), l, part * rows, cols));
      }
    }
  }
}

TEST(Nvfp4SrCp, RanksRowsGetTheWholeTensorsBytes) {
  for (int64_t ranks : {2, 4}) check_every_rank(ranks, 1, {{0, kCols}}, 7);
}

TEST(Nvfp4SrCp, SequenceParallelPiecesOfTheRanksRowsGetTheWholeTensorsBytes) {
  // T2 and T4 over a rank's tokens: C2's 128 local rows in 64 or 32, C4's 64 in 32 or 16 (a half chunk).
  for (int64_t ranks : {2, 4})
    for (int64_t parts : {2, 4}) check_every_rank(ranks, parts, {{0, kCols}}, 8);
}

TEST(Nvfp4SrCp, ColumnSegmentsAndCol0ComposeWithTheMap) {
  // A qkv-like shard (three runs) and one run at col0 16, with and without a row offset.
  for (int64_t ranks : {2, 4}) {
    check_every_rank(ranks, 1, {{16, 16}, {48, 16}, {80, 16}}, 9);
    check_every_rank(ranks, 2, {{16, 16}, {48, 16}, {80, 16}}, 9);
    check_every_rank(ranks, 2, {{16, 64}}, 10);
  }
}

TEST(Nvfp4SrCp, WithoutTheMapTheSrBytesDiffer) {
  const auto x = cp_input(kBatch * kSeq, kCols, 11);
  for (const testing::SrMode& mode : testing::sr_modes(RngKey{51, 3, 14})) {
    SCOPED_TRACE(mode.name);
    HostQuantized whole{kBatch * kSeq, kCols};
    ASSERT_TRUE(quantize_ref(x.data(), mode.opts, whole.view()));
    const CpLayout l{kBatch, kSeq, 2, 1};
    Options o = mode.opts;
    o.sr_origin = testing::cp_origin(l, kCols, 0, {{0, kCols}});
    o.sr_origin.cp = SrCpRows{};
    const HostQuantized p = quantize_cp_piece(x, whole, o, l, 0, l.local_rows(), {{0, kCols}});
    EXPECT_NE(p.row_data, testing::cp_row_bytes(whole.row_data, kCols, 2, l, 0, p.rows, {{0, kCols}}));
    EXPECT_NE(p.col_data, testing::cp_col_bytes(whole.col_data, whole.rows, 2, l, 0, p.rows, {{0, kCols}}));
    // RNE does not depend on places: the map changes nothing without SR.
    Options rne = o;
    rne.sr = false;
    const HostQuantized plain = quantize_cp_piece(x, whole, rne, l, 0, l.local_rows(), {{0, kCols}});
    rne.sr_origin.cp = l.map();
    const HostQuantized mapped = quantize_cp_piece(x, whole, rne, l, 0, l.local_rows(), {{0, kCols}});
    EXPECT_EQ(plain.row_data, mapped.row_data);
    EXPECT_EQ(plain.col_data, mapped.col_data);
  }
}

TEST(Nvfp4SrCp, KernelCountersFollowTheHeadersRule) {
  // sr_block_index (the CUDA kernels' folded form) against e / 16 of the rule, for every block of both copies:
  // C2 and C4 ranks, with row offsets and column segments.
  for (int64_t ranks : {2, 4})
    for (int64_t r = 0; r < ranks; ++r)
      for (const std::vector<Cols>& cols : {std::vector<Cols>{{0, kCols}}, std::vector<Cols>{{32, 32}, {80, 16}}}) {
        const CpLayout l{kBatch, kSeq, ranks, r};
        const int64_t rows = l.local_rows() / 2, row0 = rows, n = width_of(cols);
        const SrOrigin o = testing::cp_origin(l, kCols, row0, cols);
        ASSERT_TRUE(check_shape(rows, n, Options{.sr = true, .sr_origin = o}));
        std::vector<int64_t> whole_col;  // of each local column
        for (const Cols& g : cols)
          for (int64_t c = g.start; c < g.start + g.width; ++c) whole_col.push_back(c);
        const int64_t wr = kBatch * kSeq;
        const SrBlocks rb = sr_blocks(o, rows, n, false), cb = sr_blocks(o, rows, n, true);
        for (int64_t p = 0; p < rows; ++p)
          for (int64_t c = 0; c < n; c += 16)
            ASSERT_EQ(sr_block_index(rb, p, c / 16), (l.whole_row(row0 + p) * kCols + whole_col[size_t(c)]) / 16)
                << "C" << ranks << " rank " << r << " row " << p << ", column " << c;
        for (int64_t c = 0; c < n; ++c)
          for (int64_t p = 0; p < rows; p += 16)
            ASSERT_EQ(sr_block_index(cb, c, p / 16), (whole_col[size_t(c)] * wr + l.whole_row(row0 + p)) / 16)
                << "C" << ranks << " rank " << r << " column " << c << ", row " << p;
      }
}

TEST(Nvfp4SrCp, CheckShapeRefusesMapsThatDoNotFit) {
  const CpLayout l{kBatch, kSeq, 2, 0};
  Options good;
  good.sr = true;
  good.sr_origin = testing::cp_origin(l, kCols, 0, {{0, kCols}});
  EXPECT_TRUE(check_shape(l.local_rows(), kCols, good));
  auto refused = [&](const char* what, int64_t rows, auto edit) {
    Options bad = good;
    edit(bad.sr_origin);
    const Status st = check_shape(rows, kCols, bad);
    EXPECT_FALSE(st) << what;
    if (!st) {
      EXPECT_NE(st.message().find("context-parallel row map"), std::string::npos) << what << ": " << st.message();
      EXPECT_EQ(st.message().find(". "), std::string::npos) << what << ", one sentence: " << st.message();
    }
  };
  const int64_t rows = l.local_rows();
  refused("chunk not whole blocks", rows, [](SrOrigin& o) { o.cp.chunk = 8; });
  refused("negative chunk", rows, [](SrOrigin& o) { o.cp.chunk = -32; });
  refused("sequence not two chunks' multiple", rows, [](SrOrigin& o) { o.cp.seq = 96; });
  refused("no sequence", rows, [](SrOrigin& o) { o.cp.seq = 0; });
  refused("the same chunk twice", rows, [](SrOrigin& o) { o.cp.second = o.cp.first; });
  refused("a chunk past the sequence", rows, [](SrOrigin& o) { o.cp.second = 4; });
  refused("a negative chunk index", rows, [](SrOrigin& o) { o.cp.first = -1; });
  refused("rank's rows not whole sequences", rows - 32, [](SrOrigin& o) { o.whole_rows = 0; });
  refused("whole_rows not whole sequences", rows, [](SrOrigin& o) { o.whole_rows = 160; });
  // The quantizer refuses such a map too, with or without SR.
  Options bad = good;
  bad.sr = false;
  bad.sr_origin.cp.chunk = 24;
  const std::vector<bf16> x(size_t(rows * kCols));
  HostQuantized q{rows, kCols};
  q.row_amax = q.col_amax = 1.0f;
  EXPECT_FALSE(quantize_ref_with_amax(x.data(), bad, q.view()));
}

}  // namespace sr_cp_test
}  // namespace nb::nvfp4
