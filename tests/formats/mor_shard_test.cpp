// MoR's decision of a tensor split by rows over ranks (Megatron-FSDP's and the distributed optimizer's shards):
// each shard's statistic, taken with the whole tensor's amax and summed through the doubles an all-reduce adds,
// equals the whole tensor's exactly, so every rank decides a weight alike and as one GPU does. In-process: the
// shards are row ranges of one tensor and the all-reduce is a sum of the doubles.
#include <gtest/gtest.h>
#include <array>
#include <vector>
#include "formats/mor/mor.h"
#include "formats/mor_reference.h"

namespace nb::mor {
namespace {

// A [512, 256] weight whose rows differ in magnitude (so per-channel and per-block scales differ from the tensor's)
// with a few outliers, and the error that decides near the threshold for per-tensor scaling.
std::vector<bf16> weight(int64_t rows, int64_t cols) {
  std::vector<bf16> x = normal_tensor(rows * cols, 51);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      float v = bf16_to_f32(x[r * cols + c]) * (1.0f + float(r % 37));
      if ((r * cols + c) % 9973 == 0) v *= 300.0f;
      x[r * cols + c] = f32_to_bf16(v);
    }
  return x;
}

ErrorStat sharded_stat(const std::vector<bf16>& x, int64_t rows, int64_t cols, int ranks, const TensorRule& rule) {
  const int64_t per = rows / ranks;
  float whole_amax = 0.0f;  // the MAX all-reduce of the shards' amaxes
  for (int r = 0; r < ranks; ++r) {
    int32_t nonfinite = 0;
    whole_amax = std::max(whole_amax, fp8::amax_ref(x.data() + r * per * cols, per * cols, &nonfinite));
  }
  std::array<double, 4> sum{};
  for (int r = 0; r < ranks; ++r) {
    ErrorStat s;
    EXPECT_TRUE(tensor_stat_ref(x.data() + r * per * cols, per, cols, rule, whole_amax, &s).is_ok());
    const std::array<double, 4> d = stat_to_sum(s);
    for (size_t i = 0; i < 4; ++i) sum[i] += d[i];  // the SUM all-reduce
  }
  return stat_from_sum(sum);
}

TEST(MorShards, RowShardsSumToTheWholeTensorsStatisticAndDecision) {
  const int64_t rows = 512, cols = 256;
  const std::vector<bf16> x = weight(rows, cols);
  for (Scaling scaling : {Scaling::tensor, Scaling::channel, Scaling::block})
    for (ScaleMode mode : {ScaleMode::amax, ScaleMode::gam}) {
      TensorRule rule{scaling, mode, kDefaultE4M3Threshold};
      TensorDecision whole;
      ASSERT_TRUE(decide_tensor_ref(x.data(), rows, cols, rule, &whole).is_ok());
      // A threshold just above the whole tensor's error (a few fixed-point units): a rank whose sum differed by
      // that much would decide BF16.
      rule.threshold = whole.stat.mean() * (1 + 1e-12);
      for (int ranks : {2, 4}) {
        SCOPED_TRACE(testing::Message() << scaling_name(scaling) << "/" << scale_mode_name(mode) << " at " << ranks
                                        << " ranks, error " << whole.stat.mean());
        const ErrorStat summed = sharded_stat(x, rows, cols, ranks, rule);
        EXPECT_EQ(summed.err_fixed, whole.stat.err_fixed);
        EXPECT_EQ(summed.nonzero, whole.stat.nonzero);
        EXPECT_FALSE(summed.nonfinite);
        const TensorDecision d = decide_from_stat(summed, rule.threshold);
        EXPECT_EQ(d.choice, Choice::fp8_e4m3);
        EXPECT_EQ(decide_from_stat(summed, whole.stat.mean() * (1 - 1e-9)).choice, Choice::bf16);
      }
    }
}

// Without the whole tensor's amax a shard's per-tensor scale is its own, and the summed statistic differs: what
// the reduction of the amaxes first is for.
TEST(MorShards, ShardsWithTheirOwnAmaxesWouldDisagree) {
  const int64_t rows = 512, cols = 256;
  const std::vector<bf16> x = weight(rows, cols);
  const TensorRule rule{Scaling::tensor, ScaleMode::amax, kDefaultE4M3Threshold};
  TensorDecision whole;
  ASSERT_TRUE(decide_tensor_ref(x.data(), rows, cols, rule, &whole).is_ok());
  std::array<double, 4> sum{};
  for (int r = 0; r < 2; ++r) {
    ErrorStat s;
    ASSERT_TRUE(tensor_stat_ref(x.data() + int64_t{r} * 256 * cols, 256, cols, rule, -1.0f, &s).is_ok());
    const std::array<double, 4> d = stat_to_sum(s);
    for (size_t i = 0; i < 4; ++i) sum[i] += d[i];
  }
  EXPECT_NE(stat_from_sum(sum).err_fixed, whole.stat.err_fixed);
}

TEST(MorShards, TheSumsDoublesCarryTheLowHalvesAndTheFlag) {
  ErrorStat a, b;
  a.err_fixed = (uint64_t(3) << 32) + 0xFFFFFFF0u;
  a.nonzero = 7;
  b.err_fixed = 0x20u;
  b.nonzero = 2;
  b.nonfinite = true;
  std::array<double, 4> sum = stat_to_sum(a);
  const std::array<double, 4> other = stat_to_sum(b);
  for (size_t i = 0; i < 4; ++i) sum[i] += other[i];
  const ErrorStat s = stat_from_sum(sum);
  EXPECT_EQ(s.err_fixed, a.err_fixed + b.err_fixed);
  EXPECT_EQ(s.nonzero, 9);
  EXPECT_TRUE(s.nonfinite);
  EXPECT_EQ(decide_from_stat(s, 0.5).reason, Reason::nonfinite);
}

}  // namespace
}  // namespace nb::mor
