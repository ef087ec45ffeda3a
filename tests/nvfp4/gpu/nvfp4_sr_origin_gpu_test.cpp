// SR origin on the GPU (Options::sr_origin, nvfp4.h): a row piece and a column piece of a whole tensor,
// quantized by quantize_cuda_with_amax with the whole tensor's amaxes and their origins, equal the CPU
// reference's bytes for the same piece and origin, and the whole tensor's GPU bytes for those elements:
// the fused kernel (sr, sr + rht) and the 4/6 kernel (sr + four_over_six, with and without rht). The
// pieces end in partial 64 x 128 tiles, so the fused kernel's edge guards run with an origin too. Column
// segments: every tensor-parallel rank's shard of a fused qkv / gate_up output (several column ranges of
// the whole), the same two ways.
#include <gtest/gtest.h>
#include <cuda_runtime.h>
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>
#include "common/gpu.h"
#include "formats/nvfp4/nvfp4.h"
#include "nvfp4/gpu/nvfp4_gpu_util.h"
#include "nvfp4/nvfp4_test_util.h"

namespace nb::nvfp4 {
namespace sr_origin_gpu_test {
using testing::HostQuantized;
using testing::quantize_with_amax_on_gpu;

// Bytes [inner0, inner0 + inner_n) of lines [outer0, outer0 + outer_n) of a [*, pitch] byte array.
std::vector<uint8_t> slice_of(const std::vector<uint8_t>& a, int64_t pitch, int64_t outer0, int64_t outer_n,
                              int64_t inner0, int64_t inner_n) {
  std::vector<uint8_t> s;
  for (int64_t o = outer0; o < outer0 + outer_n; ++o)
    s.insert(s.end(), a.begin() + o * pitch + inner0, a.begin() + o * pitch + inner0 + inner_n);
  return s;
}

size_t first_mismatch(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  for (size_t i = 0; i < a.size() && i < b.size(); ++i)
    if (a[i] != b[i]) return i;
  return a.size() == b.size() ? a.size() : std::min(a.size(), b.size());
}

#define NB_EXPECT_BYTES_EQ(got, want) \
  EXPECT_TRUE((got) == (want)) << #got << " differs from " << #want << " at byte " << first_mismatch(got, want)

// The piece at (row0, col0) of shape rows x cols of the whole W_r x W_c input x, on the GPU with its origin:
// against the reference of the same piece and against the whole tensor's GPU bytes of the piece's elements.
void check_piece(const std::vector<bf16>& x, int64_t whole_rows, int64_t whole_cols, const HostQuantized& whole_gpu,
                 const Options& mode, int64_t row0, int64_t col0, int64_t rows, int64_t cols, const std::string& what) {
  SCOPED_TRACE(what + " piece at (" + std::to_string(row0) + ", " + std::to_string(col0) + ") of " +
               std::to_string(rows) + " x " + std::to_string(cols));
  std::vector<bf16> piece(size_t(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(&piece[size_t(r * cols)], &x[size_t((row0 + r) * whole_cols + col0)], size_t(cols) * sizeof(bf16));
  Options o = mode;
  o.sr_origin = SrOrigin{row0, col0, whole_rows, whole_cols};
  const float amax[2] = {whole_gpu.row_amax, whole_gpu.col_amax};
  HostQuantized ref{rows, cols};
  ref.row_amax = amax[0];
  ref.col_amax = amax[1];
  ASSERT_TRUE(quantize_ref_with_amax(piece.data(), o, ref.view()));
  const HostQuantized gpu = quantize_with_amax_on_gpu(piece, rows, cols, o, amax);
  NB_EXPECT_BYTES_EQ(gpu.row_data, ref.row_data);
  NB_EXPECT_BYTES_EQ(gpu.row_scales, ref.row_scales);
  NB_EXPECT_BYTES_EQ(gpu.col_data, ref.col_data);
  NB_EXPECT_BYTES_EQ(gpu.col_scales, ref.col_scales);
  NB_EXPECT_BYTES_EQ(gpu.row_data, slice_of(whole_gpu.row_data, whole_cols / 2, row0, rows, col0 / 2, cols / 2));
  NB_EXPECT_BYTES_EQ(gpu.row_scales, slice_of(whole_gpu.row_scales, whole_cols / 16, row0, rows, col0 / 16, cols / 16));
  NB_EXPECT_BYTES_EQ(gpu.col_data, slice_of(whole_gpu.col_data, whole_rows / 2, col0, cols, row0 / 2, rows / 2));
  NB_EXPECT_BYTES_EQ(gpu.col_scales, slice_of(whole_gpu.col_scales, whole_rows / 16, col0, cols, row0 / 16, rows / 16));
}

// whole_rows x whole_cols, cut into two row pieces and two column pieces (second piece of each: the
// origin is not 0), and one piece offset in both dims.
void check_whole(int64_t whole_rows, int64_t whole_cols, uint32_t seed) {
  auto x = testing::random_normal_bf16(whole_rows * whole_cols, seed);
  for (size_t i = 11; i < x.size(); i += 89) x[i] = f32_to_bf16(bf16_to_f32(x[i]) * 40.0f);  // outliers
  for (const auto& [name, opts] : testing::sr_modes(RngKey{31, 7, 12})) {
    float amax[2] = {0, 0};
    compute_amax_ref(x.data(), whole_rows, whole_cols, opts.rht, &amax[0], &amax[1]);
    const HostQuantized whole = quantize_with_amax_on_gpu(x, whole_rows, whole_cols, opts, amax);
    const int64_t hr = whole_rows / 2, hc = whole_cols / 2;
    for (int64_t i = 0; i < 2; ++i) {
      check_piece(x, whole_rows, whole_cols, whole, opts, i * hr, 0, hr, whole_cols, name + " row");
      check_piece(x, whole_rows, whole_cols, whole, opts, 0, i * hc, whole_rows, hc, name + " column");
    }
    check_piece(x, whole_rows, whole_cols, whole, opts, hr, hc, hr, hc, name + " corner");
  }
}

TEST(Nvfp4SrOriginGpu, RowAndColumnPiecesMatchReferenceAndWholeTensor) {
  NB_REQUIRE_GPU();
  check_whole(192, 320, 5);  // pieces of 96 rows / 160 columns: partial 64 x 128 tiles
}

TEST(Nvfp4SrOriginGpu, RowAndColumnPiecesMatchAtALargerShape) {
  NB_REQUIRE_GPU();
  check_whole(2048, 1024, 6);  // many tiles per persistent CTA
}

// ---- column segments (tensor-parallel shards of fused projections) ----------------------------------
struct ColRange {
  int64_t start, width;  // whole tensor columns [start, start + width)
};

// Rank r of t's columns of a fused output: its range of each of the fused parts (widths in order).
std::vector<ColRange> shard_ranges(const std::vector<int64_t>& parts, int64_t t, int64_t r) {
  std::vector<ColRange> ranges;
  int64_t start = 0;
  for (int64_t w : parts) {
    ranges.push_back({start + r * w / t, w / t});
    start += w;
  }
  return ranges;
}

// The shard made of `ranges` (all rows), quantized on the GPU with its segments: against the reference of
// the same shard and against the whole tensor's GPU bytes of its columns, sliced here.
void check_shard(const std::vector<bf16>& x, int64_t whole_rows, int64_t whole_cols, const HostQuantized& whole_gpu,
                 const Options& mode, const std::vector<ColRange>& ranges, const std::string& what) {
  SCOPED_TRACE(what);
  const int64_t rows = whole_rows;
  std::vector<bf16> local;
  Options o = mode;
  o.sr_origin.whole_rows = whole_rows;
  o.sr_origin.whole_cols = whole_cols;
  for (int64_t r = 0; r < rows; ++r)
    for (const ColRange& g : ranges)
      local.insert(local.end(), x.begin() + (r * whole_cols + g.start),
                   x.begin() + (r * whole_cols + g.start + g.width));
  const int64_t cols = int64_t(local.size()) / rows;
  int64_t at = 0;
  for (const ColRange& g : ranges) {
    o.sr_origin.col_segments[o.sr_origin.n_col_segments++] = SrColSegment{at, g.start};
    at += g.width;
  }
  const float amax[2] = {whole_gpu.row_amax, whole_gpu.col_amax};
  HostQuantized ref{rows, cols};
  ref.row_amax = amax[0];
  ref.col_amax = amax[1];
  ASSERT_TRUE(quantize_ref_with_amax(local.data(), o, ref.view()));
  const HostQuantized gpu = quantize_with_amax_on_gpu(local, rows, cols, o, amax);
  NB_EXPECT_BYTES_EQ(gpu.row_data, ref.row_data);
  NB_EXPECT_BYTES_EQ(gpu.row_scales, ref.row_scales);
  NB_EXPECT_BYTES_EQ(gpu.col_data, ref.col_data);
  NB_EXPECT_BYTES_EQ(gpu.col_scales, ref.col_scales);
  std::vector<uint8_t> row_data, row_scales, col_data, col_scales;  // the whole's bytes of the shard
  for (int64_t r = 0; r < rows; ++r)
    for (const ColRange& g : ranges) {
      const auto rd = slice_of(whole_gpu.row_data, whole_cols / 2, r, 1, g.start / 2, g.width / 2);
      const auto rs = slice_of(whole_gpu.row_scales, whole_cols / 16, r, 1, g.start / 16, g.width / 16);
      row_data.insert(row_data.end(), rd.begin(), rd.end());
      row_scales.insert(row_scales.end(), rs.begin(), rs.end());
    }
  for (const ColRange& g : ranges) {
    const auto cd = slice_of(whole_gpu.col_data, whole_rows / 2, g.start, g.width, 0, whole_rows / 2);
    const auto cs = slice_of(whole_gpu.col_scales, whole_rows / 16, g.start, g.width, 0, whole_rows / 16);
    col_data.insert(col_data.end(), cd.begin(), cd.end());
    col_scales.insert(col_scales.end(), cs.begin(), cs.end());
  }
  NB_EXPECT_BYTES_EQ(gpu.row_data, row_data);
  NB_EXPECT_BYTES_EQ(gpu.row_scales, row_scales);
  NB_EXPECT_BYTES_EQ(gpu.col_data, col_data);
  NB_EXPECT_BYTES_EQ(gpu.col_scales, col_scales);
}

// Every rank's shard of a whole [rows, sum(parts)] fused output, for each of ranks_list, in every SR mode.
void check_fused(int64_t rows, const std::vector<int64_t>& parts, const std::vector<int64_t>& ranks_list,
                 uint32_t seed) {
  int64_t cols = 0;
  for (int64_t w : parts) cols += w;
  auto x = testing::random_normal_bf16(rows * cols, seed);
  for (size_t i = 13; i < x.size(); i += 83) x[i] = f32_to_bf16(bf16_to_f32(x[i]) * 40.0f);  // outliers
  for (const auto& [name, opts] : testing::sr_modes(RngKey{31, 7, 12})) {
    float amax[2] = {0, 0};
    compute_amax_ref(x.data(), rows, cols, opts.rht, &amax[0], &amax[1]);
    const HostQuantized whole = quantize_with_amax_on_gpu(x, rows, cols, opts, amax);
    for (int64_t t : ranks_list)
      for (int64_t r = 0; r < t; ++r)
        check_shard(x, rows, cols, whole, opts, shard_ranges(parts, t, r),
                    name + " rank " + std::to_string(r) + " of " + std::to_string(t));
  }
}

TEST(Nvfp4SrOriginGpu, QkvShardsMatchReferenceAndWholeTensor) {
  NB_REQUIRE_GPU();
  // q 640, kv 128: segment boundaries inside 128-column tiles (160, 192 with 4 ranks; 320, 384 with 2);
  // 96 rows: partial 64-row tiles.
  check_fused(96, {640, 128, 128}, {2, 4}, 7);
  check_fused(1024, {2048, 512, 512}, {4, 8}, 8);  // many tiles per persistent CTA
}

TEST(Nvfp4SrOriginGpu, GateUpShardsMatchReferenceAndWholeTensor) {
  NB_REQUIRE_GPU();
  check_fused(160, {352, 352}, {2}, 9);  // 176 columns each: boundary at 176, mid-tile
}

}  // namespace sr_origin_gpu_test
}  // namespace nb::nvfp4
