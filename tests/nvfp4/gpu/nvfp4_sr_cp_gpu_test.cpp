// SR origin's context-parallel row map on the GPU (SrOrigin::cp, nvfp4.h): every rank's rows of whole sequences
// (chunks r and 2C-1-r of 2C), quantized by quantize_cuda_with_amax with the whole tensor's amaxes and the map,
// equal the CPU reference's bytes for the same rows and map and the whole tensor's GPU bytes at those rows: the
// fused kernel (sr, sr + rht) and the 4/6 kernel (sr + 4/6, with and without rht), C = 2 and 4 over two
// sequences, with sequence parallelism's row offsets and with column segments. 16-token chunks put a chunk
// boundary inside every 64-row tile of the fused kernel; the larger shape gives many tiles per persistent CTA.
#include <gtest/gtest.h>
#include <algorithm>
#include <string>
#include <vector>
#include "common/gpu.h"
#include "formats/nvfp4/nvfp4.h"
#include "nvfp4/gpu/nvfp4_gpu_util.h"
#include "nvfp4/nvfp4_sr_cp_util.h"
#include "nvfp4/nvfp4_test_util.h"

namespace nb::nvfp4 {
namespace sr_cp_gpu_test {
using testing::Cols;
using testing::CpLayout;
using testing::HostQuantized;

size_t first_difference(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  for (size_t i = 0; i < a.size() && i < b.size(); ++i)
    if (a[i] != b[i]) return i;
  return a.size() == b.size() ? a.size() : std::min(a.size(), b.size());
}

#define NB_EXPECT_SAME_BYTES(got, want) \
  EXPECT_TRUE((got) == (want)) << #got << " differs from " << #want << " at byte " << first_difference(got, want)

// Local rows [row0, row0 + rows) and columns `cols` of rank l.rank, on the GPU with the map: against the reference
// of the same piece and against the whole tensor's GPU bytes at its rows and columns.
void check_cp_piece(const std::vector<bf16>& x, const HostQuantized& whole_gpu, const Options& mode, const CpLayout& l,
                    int64_t row0, int64_t rows, const std::vector<Cols>& cols, const std::string& what) {
  SCOPED_TRACE(what + ", C" + std::to_string(l.ranks) + " rank " + std::to_string(l.rank) + ", rows " +
               std::to_string(row0) + "+" + std::to_string(rows) + ", " + std::to_string(cols.size()) + " column runs");
  const std::vector<bf16> piece = testing::cp_piece(x, whole_gpu.cols, l, row0, rows, cols);
  const int64_t n = int64_t(piece.size()) / rows;
  Options o = mode;
  o.sr_origin = testing::cp_origin(l, whole_gpu.cols, row0, cols);
  const float amax[2] = {whole_gpu.row_amax, whole_gpu.col_amax};
  HostQuantized ref{rows, n};
  ref.row_amax = amax[0];
  ref.col_amax = amax[1];
  ASSERT_TRUE(quantize_ref_with_amax(piece.data(), o, ref.view()));
  const HostQuantized gpu = testing::quantize_with_amax_on_gpu(piece, rows, n, o, amax);
  NB_EXPECT_SAME_BYTES(gpu.row_data, ref.row_data);
  NB_EXPECT_SAME_BYTES(gpu.row_scales, ref.row_scales);
  NB_EXPECT_SAME_BYTES(gpu.col_data, ref.col_data);
  NB_EXPECT_SAME_BYTES(gpu.col_scales, ref.col_scales);
  const int64_t wr = whole_gpu.rows, wc = whole_gpu.cols;
  NB_EXPECT_SAME_BYTES(gpu.row_data, testing::cp_row_bytes(whole_gpu.row_data, wc, 2, l, row0, rows, cols));
  NB_EXPECT_SAME_BYTES(gpu.row_scales, testing::cp_row_bytes(whole_gpu.row_scales, wc, 16, l, row0, rows, cols));
  NB_EXPECT_SAME_BYTES(gpu.col_data, testing::cp_col_bytes(whole_gpu.col_data, wr, 2, l, row0, rows, cols));
  NB_EXPECT_SAME_BYTES(gpu.col_scales, testing::cp_col_bytes(whole_gpu.col_scales, wr, 16, l, row0, rows, cols));
}

// Two sequences of `seq` tokens, `cols` columns: every rank of C2 and C4, its rows whole and halved (sequence
// parallelism at T2), all columns and a three-run shard, in every SR mode.
void check_cp_whole(int64_t seq, int64_t cols, uint32_t seed) {
  const int64_t batch = 2, whole_rows = batch * seq;
  auto x = testing::random_normal_bf16(whole_rows * cols, seed);
  for (size_t i = 17; i < x.size(); i += 79) x[i] = f32_to_bf16(bf16_to_f32(x[i]) * 40.0f);  // outliers
  const std::vector<Cols> all{{0, cols}}, shard{{16, 32}, {cols / 2, 16}, {cols - 48, 48}};
  for (const auto& [name, opts] : testing::sr_modes(RngKey{23, 9, 4})) {
    float amax[2] = {0, 0};
    compute_amax_ref(x.data(), whole_rows, cols, opts.rht, &amax[0], &amax[1]);
    const HostQuantized whole = testing::quantize_with_amax_on_gpu(x, whole_rows, cols, opts, amax);
    for (int64_t ranks : {2, 4})
      for (int64_t r = 0; r < ranks; ++r) {
        const CpLayout l{batch, seq, ranks, r};
        const int64_t local = l.local_rows();
        check_cp_piece(x, whole, opts, l, 0, local, all, name);
        check_cp_piece(x, whole, opts, l, local / 2, local / 2, all, name);
        check_cp_piece(x, whole, opts, l, 0, local / 2, shard, name);
      }
  }
}

TEST(Nvfp4SrCpGpu, RanksRowsMatchReferenceAndWholeTensor) {
  NB_REQUIRE_GPU();
  check_cp_whole(128, 320, 31);  // C4: 16-token chunks; 320 columns: partial 128-column tiles
}

TEST(Nvfp4SrCpGpu, RanksRowsMatchAtALargerShape) {
  NB_REQUIRE_GPU();
  check_cp_whole(1024, 768, 32);  // C2: 256-token chunks, C4: 128; many tiles per persistent CTA
}

}  // namespace sr_cp_gpu_test
}  // namespace nb::nvfp4
