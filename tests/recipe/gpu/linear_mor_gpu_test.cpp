// GPU tests of Mixture of Representations inside recipe::Linear: the CUDA statistics (one atomic pass per
// quantization, mor_stat.cu) equal the CPU Linear's bit for bit for every role, and with any one role decided BF16
// the three GEMMs (FP8 x BF16 through the mixed emulated path, or FP8 x FP8 on tensor cores) match the FP64 model
// of their operands within the FP32-accumulation bound and BF16 outputs.
#include <gtest/gtest.h>
#include <string>
#include "common/gpu.h"
#include "formats/mor/mor.h"
#include "recipe/mor_test_util.h"

namespace nb::recipe {
namespace {

using namespace testing;

constexpr int64_t kMorM = 512, kMorK = 384, kMorN = 256;

struct MorRun {
  LinearRun run;
  mor::ErrorStat stats[3];
};

// forward and backward of one MoR Linear on `dev` with role `bf16_role` (-1: none) decided BF16.
Status run_mor(Device dev, int bf16_role, const std::vector<float>& x, const std::vector<float>& w,
               const std::vector<float>& dy, MorRun* out) {
  Recipe r;
  NB_TRY(recipe_preset("bf16_with_mor_fp8_mixed", &r));
  return run_linear(
      r, dev, kMorM, kMorK, kMorN, x, w, dy, &out->run, 5, 2,
      [bf16_role](Linear& lin) { return bf16_role >= 0 ? lin.set_mor_fp8(bf16_role, false) : Status::ok(); },
      [out](Linear& lin) { return lin.mor_stats(out->stats); });
}

// --mor-channel-statistic on the GPU: all six cells equal the CPU Linear's bit for bit (the per-row pass,
// add_fp8_rowwise_stat_cuda, from the source pointer), and the outputs are the GPU run's without it, bit for bit.
TEST(LinearMorGpu, ChannelStatisticEqualsTheCpusAndChangesNoOutput) {
  NB_REQUIRE_GPU();
  const auto x = random_bf16_values(kMorM * kMorK, 1.0, 41), w = random_bf16_values(kMorN * kMorK, 0.05, 42),
             dy = random_bf16_values(kMorM * kMorN, 1e-3, 43);
  Recipe plain, channel;
  ASSERT_TRUE(recipe_preset("bf16_with_mor_fp8_mixed", &plain).is_ok());
  channel = plain;
  channel.mor.channel_stat = true;
  mor::ErrorStat cpu[6], gpu[6], gpu_plain[3];
  LinearRun run_cpu, run_gpu, run_plain;
  const auto read = [](mor::ErrorStat* into) { return [into](Linear& lin) { return lin.mor_stats(into); }; };
  Status st = run_linear(channel, Device::cpu, kMorM, kMorK, kMorN, x, w, dy, &run_cpu, 5, 2, {}, read(cpu));
  ASSERT_TRUE(st.is_ok()) << st.message();
  st = run_linear(channel, Device::cuda, kMorM, kMorK, kMorN, x, w, dy, &run_gpu, 5, 2, {}, read(gpu));
  ASSERT_TRUE(st.is_ok()) << st.message();
  st = run_linear(plain, Device::cuda, kMorM, kMorK, kMorN, x, w, dy, &run_plain, 5, 2, {}, read(gpu_plain));
  ASSERT_TRUE(st.is_ok()) << st.message();
  for (int i = 0; i < 6; ++i) {
    EXPECT_EQ(gpu[i].err_fixed, cpu[i].err_fixed) << "cell " << i;
    EXPECT_EQ(gpu[i].nonzero, cpu[i].nonzero) << "cell " << i;
    EXPECT_EQ(gpu[i].nonfinite, cpu[i].nonfinite) << "cell " << i;
    EXPECT_GT(gpu[i].nonzero, 0) << "cell " << i;
    if (i < 3) EXPECT_EQ(gpu[i].err_fixed, gpu_plain[i].err_fixed) << "cell " << i;
  }
  EXPECT_EQ(run_gpu.y, run_plain.y);
  EXPECT_EQ(run_gpu.dx, run_plain.dx);
  EXPECT_EQ(run_gpu.dw, run_plain.dw);
}

TEST(LinearMorGpu, StatisticsEqualTheCpusAndMixedGemmsStayWithinTheBound) {
  NB_REQUIRE_GPU();
  const auto x = random_bf16_values(kMorM * kMorK, 1.0, 31), w = random_bf16_values(kMorN * kMorK, 0.05, 32),
             dy = random_bf16_values(kMorM * kMorN, 1e-3, 33);
  for (int role = -1; role < 3; ++role) {
    MorRun cpu, gpu;
    Status st = run_mor(Device::cpu, role, x, w, dy, &cpu);
    ASSERT_TRUE(st.is_ok()) << st.message();
    st = run_mor(Device::cuda, role, x, w, dy, &gpu);
    ASSERT_TRUE(st.is_ok()) << st.message();
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ(gpu.stats[i].err_fixed, cpu.stats[i].err_fixed) << "role " << i;
      EXPECT_EQ(gpu.stats[i].nonzero, cpu.stats[i].nonzero) << "role " << i;
      EXPECT_EQ(gpu.stats[i].nonfinite, cpu.stats[i].nonfinite) << "role " << i;
      EXPECT_GT(gpu.stats[i].nonzero, 0);
    }
    const MixedModel ref = mixed_model(role, x, w, dy, gpu.run.q, kMorM, kMorK, kMorN);
    // Both operands FP8: tensor cores (fast accumulation in Fprop, split accumulation elsewhere); a BF16 operand:
    // the BF16 GEMM with FP32 accumulation.
    const bool fprop_fp8 = role != 0 && role != 1, dgrad_fp8 = role != 2 && role != 1,
               wgrad_fp8 = role != 2 && role != 0;
    const std::string what = " (bf16 role " + std::to_string(role) + ")";
    expect_close(("y" + what).c_str(), gpu.run.y, ref.y, ref.mag_y, kMorK, Bound{false, fprop_fp8, true, false},
                 ref.exact_y);
    expect_close(("dx" + what).c_str(), gpu.run.dx, ref.dx, ref.mag_dx, kMorN, Bound{false, false, true, dgrad_fp8},
                 ref.exact_dx);
    expect_close(("dw" + what).c_str(), gpu.run.dw, ref.dw, ref.mag_dw, kMorM, Bound{false, false, false, wgrad_fp8},
                 ref.exact_dw);
  }
}

// --mor-decide-now on the GPU: each quantization's statistic comes back at once and decides its own role's GEMMs
// (lag 0). An input with one outlier 1e5 times its typical size (its other elements E4M3 subnormals or zero) goes
// BF16 in the step that measured it, as on the CPU; the GEMMs that read it are then the mixed model's, with the
// input BF16. Without decide-now the same step still runs every operand E4M3 (the decision lags one step).
TEST(LinearMorGpu, DecideNowDecidesEachQuantizationInItsOwnStep) {
  NB_REQUIRE_GPU();
  std::vector<float> x = random_bf16_values(kMorM * kMorK, 1.0, 51);
  x[77] = bf16_to_f32(f32_to_bf16(1e5f));  // the amax: the others land near or below E4M3's smallest subnormal
  const auto w = random_bf16_values(kMorN * kMorK, 0.05, 52), dy = random_bf16_values(kMorM * kMorN, 1e-3, 53);
  bool fp8[2][2][3] = {};  // [lag 0?][cuda?][role] after the step
  for (int now = 0; now < 2; ++now)
    for (int cuda = 0; cuda < 2; ++cuda) {
      Recipe r;
      ASSERT_TRUE(recipe_preset("bf16_with_mor_fp8_mixed", &r).is_ok());
      r.mor.decide_now = now == 1;
      LinearRun run;
      const Status st = run_linear(r, cuda ? Device::cuda : Device::cpu, kMorM, kMorK, kMorN, x, w, dy, &run, 5, 2, {},
                                   [&](Linear& lin) {
                                     for (int i = 0; i < 3; ++i) fp8[now][cuda][i] = lin.mor_fp8(i);
                                     return Status::ok();
                                   });
      ASSERT_TRUE(st.is_ok()) << st.message();
      if (!(now && cuda)) continue;
      const MixedModel ref = mixed_model(0, x, w, dy, run.q, kMorM, kMorK, kMorN);
      expect_close("y (decided now)", run.y, ref.y, ref.mag_y, kMorK, Bound{false, false, true, false}, ref.exact_y);
      expect_close("dw (decided now)", run.dw, ref.dw, ref.mag_dw, kMorM, Bound{false, false, false, false},
                   ref.exact_dw);
    }
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(fp8[1][1][i], fp8[1][0][i]) << "role " << i << ": the GPU decided unlike the CPU";
    EXPECT_TRUE(fp8[0][1][i]) << "role " << i << ": with the lag, no role changes within its first step";
  }
  EXPECT_FALSE(fp8[1][1][0]) << "the outlier's input stays E4M3 within its own step";
  EXPECT_TRUE(fp8[1][1][1]);
  EXPECT_TRUE(fp8[1][1][2]);
}

}  // namespace
}  // namespace nb::recipe
