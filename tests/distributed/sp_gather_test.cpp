// Sequence parallelism's quantized all-gather, on the CPU: each of T ranks quantizes its rows of an
// activation with the whole tensor's all-reduced amax, the shards' bytes are gathered and the column-wise
// copies interleaved (distributed/sp_gather_layout.h); the result must equal the whole tensor's quantization
// byte for byte: FP8 current scaling (codes, transposed codes, scale_inv) and NVFP4 (row and column copies with
// the RHT, block scales, amaxes).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "core/bf16.h"
#include "distributed/sp_gather_layout.h"
#include "formats/fp8/fp8.h"
#include "formats/nvfp4/nvfp4.h"

namespace nb::dist {
namespace {

constexpr int64_t kRows = 128, kCols = 256;  // tokens x features

std::vector<bf16> activation(uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<bf16> x(size_t(kRows * kCols));
  for (size_t i = 0; i < x.size(); ++i) x[i] = f32_to_bf16(n(rng) * (i % 97 == 0 ? 8.0f : 1.0f));  // some outliers
  return x;
}

class SpGather : public ::testing::TestWithParam<int> {};

TEST_P(SpGather, Fp8CurrentScalingEqualsTheWholeTensor) {
  const int T = GetParam();
  const int64_t R = kRows / T;
  const std::vector<bf16> x = activation(3);
  std::vector<uint8_t> data(size_t(kRows * kCols)), data_t(data.size());
  float scale_inv = 0, amax = 0;
  fp8::TensorView w;
  w.rows = kRows;
  w.cols = kCols;
  w.data = data.data();
  w.data_t = data_t.data();
  w.scale_inv = &scale_inv;
  w.amax = &amax;
  ASSERT_TRUE(fp8::quantize_current_ref(x.data(), fp8::Format::e4m3, false, w).is_ok());
  float global = 0;  // the all-reduce (MAX) of the ranks' amaxes
  for (int r = 0; r < T; ++r)
    for (int64_t i = r * R * kCols; i < (r + 1) * R * kCols; ++i)
      global = std::max(global, std::fabs(bf16_to_f32(x[size_t(i)])));
  std::vector<uint8_t> g_data(data.size()), g_t(data.size()), whole_t(data.size());
  std::vector<float> shard_scale_inv(static_cast<size_t>(T));
  for (int r = 0; r < T; ++r) {
    fp8::TensorView v;
    v.rows = R;
    v.cols = kCols;
    v.data = g_data.data() + r * R * kCols;
    v.data_t = g_t.data() + r * R * kCols;
    v.scale_inv = &shard_scale_inv[size_t(r)];
    ASSERT_TRUE(fp8::quantize_with_amax_ref(x.data() + r * R * kCols, fp8::Format::e4m3, false, global, v).is_ok());
  }
  interleave_column_shards(g_t.data(), T, kCols, R, whole_t.data());
  EXPECT_EQ(g_data, data);
  EXPECT_EQ(whole_t, data_t);
  for (float s : shard_scale_inv) EXPECT_EQ(s, scale_inv);
}

TEST_P(SpGather, Nvfp4WithRhtEqualsTheWholeTensor) {
  const int T = GetParam();
  const int64_t R = kRows / T;
  const std::vector<bf16> x = activation(5);
  nvfp4::Options o;
  o.rht = true;  // the column-wise copy Wgrad reads, as the recipe makes an input's
  auto buffers = [](int64_t rows) {
    return std::vector<std::vector<uint8_t>>{
        std::vector<uint8_t>(size_t(rows * kCols / 2)), std::vector<uint8_t>(size_t(rows * kCols / 16)),
        std::vector<uint8_t>(size_t(rows * kCols / 2)), std::vector<uint8_t>(size_t(rows * kCols / 16))};
  };
  auto whole = buffers(kRows), gathered = buffers(kRows);
  float row_amax = 0, col_amax = 0;
  ASSERT_TRUE(nvfp4::quantize_ref(x.data(), o,
                                  {kRows, kCols, whole[0].data(), whole[1].data(), whole[2].data(), whole[3].data(),
                                   &row_amax, &col_amax, nullptr})
                  .is_ok());
  float g_row = 0, g_col = 0;  // the ranks' amaxes (the column one after the RHT), all-reduced with MAX
  for (int r = 0; r < T; ++r) {
    float a = 0, b = 0;
    nvfp4::compute_amax_ref(x.data() + r * R * kCols, R, kCols, true, &a, &b);
    g_row = std::max(g_row, a);
    g_col = std::max(g_col, b);
  }
  for (int r = 0; r < T; ++r) {
    float ra = g_row, ca = g_col;
    ASSERT_TRUE(
        nvfp4::quantize_ref_with_amax(
            x.data() + r * R * kCols, o,
            {R, kCols, gathered[0].data() + r * R * kCols / 2, gathered[1].data() + r * R * kCols / 16,
             gathered[2].data() + r * R * kCols / 2, gathered[3].data() + r * R * kCols / 16, &ra, &ca, nullptr})
            .is_ok());
  }
  std::vector<uint8_t> col(whole[2].size()), col_scales(whole[3].size());
  interleave_column_shards(gathered[2].data(), T, kCols, R / 2, col.data());
  interleave_column_shards(gathered[3].data(), T, kCols, R / 16, col_scales.data());
  EXPECT_EQ(g_row, row_amax);
  EXPECT_EQ(g_col, col_amax);
  EXPECT_EQ(gathered[0], whole[0]) << "row data";
  EXPECT_EQ(gathered[1], whole[1]) << "row scales";
  EXPECT_EQ(col, whole[2]) << "column data";
  EXPECT_EQ(col_scales, whole[3]) << "column scales";
  if (T > 1) EXPECT_NE(gathered[2], whole[2]) << "the gathered column copy needs the interleave (else vacuous)";
}

INSTANTIATE_TEST_SUITE_P(Ranks, SpGather, ::testing::Values(1, 2, 4));

}  // namespace
}  // namespace nb::dist
