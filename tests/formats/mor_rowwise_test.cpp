// MoR's per-row ("per-channel") E4M3 statistic (mor_stat.h add_fp8_rowwise_stat_host), the study's measurement beside
// the per-tensor tensor rule, against a float64 reference written here: each row's amax (NaN skipped, Inf kept, as
// the FP8 quantizer's), its FP32 scale, mor_reference.h's own E4M3 rounding and the mean relative error in double.
#include <gtest/gtest.h>
#include <cmath>
#include <limits>
#include <vector>
#include "core/bf16.h"
#include "formats/fp8/fp8.h"
#include "formats/mor/mor.h"
#include "formats/mor/mor_stat.h"
#include "formats/mor_reference.h"

namespace nb::mor {
namespace {

struct RowwiseRef {
  double sum = 0.0;  // of the per-element errors, in double
  int64_t nonzero = 0, nonfinite = 0;
  double mean() const { return nonzero ? sum / double(nonzero) : 0.0; }
};

RowwiseRef rowwise_reference(const std::vector<bf16>& x, int64_t rows, int64_t cols) {
  RowwiseRef ref;
  for (int64_t r = 0; r < rows; ++r) {
    double amax = 0.0;
    for (int64_t c = 0; c < cols; ++c) {
      const double v = bf16_to_f32(x[size_t(r * cols + c)]);
      if (!std::isnan(v)) amax = std::max(amax, std::fabs(v));
    }
    const float scale = fp32_scale(amax, kE4M3);  // 1 for an all-zero row or an Inf
    for (int64_t c = 0; c < cols; ++c) {
      const float v = bf16_to_f32(x[size_t(r * cols + c)]);
      if (!std::isfinite(v)) {
        ++ref.nonfinite;
        continue;
      }
      if (v == 0.0f) continue;
      const double x_hat = round_minifloat(double(v * scale), kE4M3) * double(1.0f / scale);
      ref.sum += std::min(1.0, std::fabs(double(v) - x_hat) / std::fabs(double(v)));
      ++ref.nonzero;
    }
  }
  return ref;
}

StatCell rowwise(const std::vector<bf16>& x, int64_t rows, int64_t cols) {
  StatCell cell;
  add_fp8_rowwise_stat_host(x.data(), rows, cols, fp8::Format::e4m3, &cell);
  return cell;
}

StatCell per_tensor(const std::vector<bf16>& x) {
  StatCell cell;
  const auto n = int64_t(x.size());
  add_fp8_stat_from_amax_host(x.data(), n, fp8::amax_ref(x.data(), n, nullptr), fp8::Format::e4m3, &cell);
  return cell;
}

// Six rows of 40 (not a multiple of 8 or 16), each a case of the definition.
std::vector<bf16> crafted_rows(int64_t cols) {
  std::vector<bf16> x = normal_tensor(6 * cols, 31);
  const auto at = [&](int64_t r, int64_t c) -> bf16& { return x[size_t(r * cols + c)]; };
  at(0, 17) = f32_to_bf16(3e6f);  // an outlier: per-tensor scaling flushes every other row's values, per-row keeps them
  for (int64_t c = 0; c < cols; ++c) at(2, c) = f32_to_bf16(c % 3 ? 0.0f : -0.0f);  // all zero
  at(3, 5) = f32_to_bf16(std::numeric_limits<float>::quiet_NaN());                  // skipped by the amax
  at(4, 9) = f32_to_bf16(-std::numeric_limits<float>::infinity());                  // amax Inf: scale 1
  for (int64_t c = 1; c < cols; ++c)  // amax 1, the rest scaled into E4M3's subnormals (448 * 2^-16 < 2^-6)
    at(5, c) = f32_to_bf16(std::ldexp(1.0f + float(c % 8) / 8.0f, -16 - int(c % 3)) * (c % 2 ? -1.0f : 1.0f));
  at(5, 0) = f32_to_bf16(1.0f);
  return x;
}

TEST(MorRowwiseStat, CraftedRowsEqualTheFloat64Reference) {
  const int64_t rows = 6, cols = 40;
  const std::vector<bf16> x = crafted_rows(cols);
  const RowwiseRef ref = rowwise_reference(x, rows, cols);
  const StatCell cell = rowwise(x, rows, cols);
  EXPECT_EQ(int64_t(cell.nonzero), ref.nonzero);
  EXPECT_EQ(ref.nonzero, 5 * cols - 2);  // row 2 is all zero, rows 3 and 4 lose their non-finite element
  EXPECT_EQ(int64_t(cell.nonfinite), ref.nonfinite);
  EXPECT_EQ(ref.nonfinite, 2);
  EXPECT_NEAR(stat_of(cell).mean(), ref.mean(), ref.mean() * 1e-6);
  EXPECT_EQ(decide_from_stat(stat_of(cell), 0.999).choice, Choice::bf16);  // non-finite: never E4M3
  // Row by row: the sum is the rows' sums (each row alone is a one-row tensor, quantized as the quantizer would).
  StatCell by_rows;
  for (int64_t r = 0; r < rows; ++r) {
    const std::vector<bf16> row(x.begin() + r * cols, x.begin() + (r + 1) * cols);
    const StatCell one = rowwise(row, 1, cols);
    const RowwiseRef one_ref = rowwise_reference(row, 1, cols);
    EXPECT_NEAR(stat_of(one).mean(), one_ref.mean(), one_ref.mean() * 1e-6 + 1e-12) << "row " << r;
    by_rows.err_fixed += one.err_fixed;
    by_rows.nonzero += one.nonzero;
    by_rows.nonfinite += one.nonfinite;
  }
  EXPECT_EQ(by_rows.err_fixed, cell.err_fixed);
  // The subnormal row is not exact (E4M3's subnormals keep few bits), but it is measured, not flushed.
  const std::vector<bf16> sub(x.begin() + 5 * cols, x.end());
  EXPECT_GT(stat_of(rowwise(sub, 1, cols)).mean(), 0.0);
  EXPECT_LT(stat_of(rowwise(sub, 1, cols)).mean(), 0.5);
}

// Without the non-finite rows, the outlier's tensor: per-tensor scaling flushes every row but the outlier's (error 1
// each), per-row scaling keeps them at E4M3's floor and loses only the outlier's own row (39 of 2560 elements, 1.5%);
// finite data equals mor_ref's channel scaling bit for bit.
TEST(MorRowwiseStat, AnOutlierRowCostsPerTensorScalingEverythingAndPerRowScalingOneRow) {
  const int64_t rows = 64, cols = 40;
  std::vector<bf16> x = normal_tensor(rows * cols, 37);
  x[17] = f32_to_bf16(3e6f);
  const StatCell cell = rowwise(x, rows, cols);
  const RowwiseRef ref = rowwise_reference(x, rows, cols);
  EXPECT_NEAR(stat_of(cell).mean(), ref.mean(), ref.mean() * 1e-6);
  EXPECT_EQ(decide_from_stat(stat_of(cell), kDefaultE4M3Threshold).choice, Choice::fp8_e4m3);
  const ErrorStat tensor = stat_of(per_tensor(x));
  EXPECT_GT(tensor.mean(), 0.8);  // the other rows' values scale below E4M3's smallest subnormal
  EXPECT_EQ(decide_from_stat(tensor, kDefaultE4M3Threshold).choice, Choice::bf16);
  ErrorStat channel;
  ASSERT_TRUE(
      tensor_stat_ref(x.data(), rows, cols, TensorRule{Scaling::channel, ScaleMode::amax}, -1.0f, &channel).is_ok());
  EXPECT_EQ(channel.err_fixed, cell.err_fixed);
  EXPECT_EQ(channel.nonzero, int64_t(cell.nonzero));
}

// Rows whose magnitudes differ by orders of magnitude (1e-6 to 1e6): each row scaled on its own stays near E4M3's
// floor on Gaussian data (about 2.3%), one scale for all of them flushes the small rows.
TEST(MorRowwiseStat, RowsOfDifferentMagnitudesErrFarLessPerRowThanPerTensor) {
  const int64_t rows = 13, cols = 200;
  std::vector<bf16> x = normal_tensor(rows * cols, 41);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      bf16& v = x[size_t(r * cols + c)];
      v = f32_to_bf16(bf16_to_f32(v) * std::pow(10.0f, float(r - 6)));
    }
  const ErrorStat row = stat_of(rowwise(x, rows, cols)), tensor = stat_of(per_tensor(x));
  EXPECT_NEAR(row.mean(), rowwise_reference(x, rows, cols).mean(), row.mean() * 1e-6);
  EXPECT_LT(row.mean(), 0.03);
  EXPECT_GT(tensor.mean(), 0.3);
  EXPECT_LT(row.mean() * 10, tensor.mean());
  EXPECT_EQ(row.nonzero, tensor.nonzero);
}

}  // namespace
}  // namespace nb::mor
