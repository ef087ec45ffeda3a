// The NVFP4 ladder in training (CPU): with every operand kept NVFP4 the run is bf16_with_nvfp4_mixed's bit for bit;
// thresholds move operands down the ladder and the run records it (shares per step, per-Linear records with both
// errors, --quant-stats formats); a run on all three rungs resumes bit for bit; bad settings are refused before
// step 1.
#include <gtest/gtest.h>
#include <string>
#include <vector>
#include "train/mor_train_util.h"
#include "train/sft_reverse_data.h"

using namespace nb;

namespace {

TrainConfig ladder_job(double nvfp4_threshold, double e4m3_threshold) {
  TrainConfig c = test::tiny_job("cpu", "bf16_with_mor_nvfp4_mixed");
  c.mor_nvfp4_threshold = nvfp4_threshold;
  c.mor_threshold = e4m3_threshold;
  c.train_iters = 3;
  return c;
}

}  // namespace

TEST(MorLadderTrainCpu, EveryOperandNvfp4IsTheNvfp4Recipe) {
  TrainSummary ladder, nvfp4;
  ASSERT_TRUE(run_training(ladder_job(0.999, 0.045), &ladder).is_ok());
  TrainConfig plain = test::tiny_job("cpu", "bf16_with_nvfp4_mixed");
  plain.num_layers_at_end_in_bf16 = 0;  // the ladder keeps no layer BF16 by position
  plain.train_iters = 3;
  ASSERT_TRUE(run_training(plain, &nvfp4).is_ok());
  EXPECT_EQ(ladder.losses, nvfp4.losses);
}

// Packed SFT (rows of prompt/answer samples, padding, per-sample attention): the ladder measures and decides from
// those rows, and with every operand kept NVFP4 it is still the NVFP4 recipe's SFT run bit for bit.
TEST(MorLadderTrainCpu, PackedSftKeepsEveryOperandNvfp4AsTheNvfp4Recipe) {
  const std::string dir = test::temp_folder("mor_ladder_sft");
  const std::string prefix = test::write_reverse_sft_data(dir, 5, 3, 10);
  const auto as_sft = [&](TrainConfig c, const std::string& save) {
    test::use_reverse_sft(&c, prefix);
    c.save = save;
    c.save_interval = 100;
    return c;
  };
  TrainSummary ladder, nvfp4;
  ASSERT_TRUE(run_training(as_sft(ladder_job(0.999, 0.045), dir + "/ladder"), &ladder).is_ok());
  TrainConfig plain = test::tiny_job("cpu", "bf16_with_nvfp4_mixed");
  plain.num_layers_at_end_in_bf16 = 0;
  plain.train_iters = 3;
  ASSERT_TRUE(run_training(as_sft(plain, dir + "/nvfp4"), &nvfp4).is_ok());
  ASSERT_EQ(ladder.losses.size(), 3u);
  EXPECT_EQ(ladder.losses, nvfp4.losses);
  const auto records = test::metrics_records(dir + "/ladder", "mor_linear");
  ASSERT_FALSE(records.empty()) << "the SFT run decided";
  for (const auto& rec : records)
    for (const char* role : {"input", "weight", "grad"}) {
      EXPECT_EQ(rec[role]["format"], "nvfp4") << rec.dump();
      EXPECT_GT(rec[role]["nonzero"].get<double>(), 0.0) << rec.dump();
    }
  std::filesystem::remove_all(dir);
}

TEST(MorLadderTrainCpu, ThresholdsMoveOperandsDownTheLadder) {
  const std::string dir = test::temp_folder("mor_ladder");
  struct Case {
    double nvfp4, e4m3;
    const char* format;  // every operand's rung after the first decision
    double nvfp4_share, fp8_share;
  };
  for (const Case& c : {Case{1e-9, 0.999, "e4m3", 0.0, 1.0}, Case{1e-9, 1e-9, "bf16", 0.0, 0.0}}) {
    TrainConfig job = ladder_job(c.nvfp4, c.e4m3);
    job.quant_stats = true;
    job.quant_stats_interval = 1;
    job.save = dir + "/run";
    job.save_interval = 100;
    TrainSummary s;
    ASSERT_TRUE(run_training(job, &s).is_ok());
    const auto steps = test::metrics_records(job.save, "mor_nvfp4_operands");
    ASSERT_EQ(steps.size(), 3u);
    EXPECT_EQ(steps[0]["mor_nvfp4_operands"], 1.0) << "before the first decision every operand is NVFP4";
    EXPECT_EQ(steps[0]["mor_fp8_operands"], 0.0);
    for (size_t i = 1; i < steps.size(); ++i) {
      EXPECT_EQ(steps[i]["mor_nvfp4_operands"], c.nvfp4_share) << c.format << " step " << i + 1;
      EXPECT_EQ(steps[i]["mor_fp8_operands"], c.fp8_share) << c.format << " step " << i + 1;
      EXPECT_EQ(steps[i]["mor_fp8_gemms"], c.fp8_share) << c.format << " step " << i + 1;
    }
    for (const auto& rec : test::metrics_records(job.save, "quant_stats"))
      for (const char* role : {"input", "weight", "grad"}) {
        const bool first = rec["iteration"] == 1;
        const std::string want = first ? "nvfp4" : std::string(c.format) == "e4m3" ? "fp8_e4m3" : "bf16";
        EXPECT_EQ(rec["roles"][role]["mor_format"], want) << rec.dump();
      }
    const auto linears = test::metrics_records(job.save, "mor_linear");
    ASSERT_EQ(linears.size(), 3u * 8u);
    for (const auto& rec : linears)
      for (const char* role : {"input", "weight", "grad"}) {
        EXPECT_EQ(rec[role]["format"], c.format) << rec.dump();
        EXPECT_GT(rec[role]["nvfp4_error"].get<double>(), rec[role]["error"].get<double>()) << rec.dump();
      }
    std::filesystem::remove_all(job.save);
  }
  std::filesystem::remove_all(dir);
}

// The default NVFP4 threshold with an E4M3 threshold inside the tiny model's spread: all three rungs in one run,
// saved between two decisions (every 2 steps), resumed bit for bit.
TEST(MorLadderTrainCpu, ResumesBitExactlyOnThreeRungs) {
  const std::string dir = test::temp_folder("mor_ladder_resume");
  test::expect_bit_exact_resume("cpu", "bf16_with_mor_nvfp4_mixed", dir, test::write_random_dataset(dir, 256),
                                [](TrainConfig* c) {
                                  c->mor_threshold = 0.0226;
                                  c->mor_interval = 2;
                                });
}

TEST(MorLadderTrainCpu, BadSettingsAreRefusedBeforeStepOne) {
  test::expect_refused_before_step_one(
      ladder_job(0.3, 0.045), {{[](TrainConfig* c) { c->mor_nvfp4_threshold = 1.0; }, "outside (0, 1)"},
                               {[](TrainConfig* c) { c->mor_decide_now = true; }, "mor-decide-now"},
                               {[](TrainConfig* c) { c->fp4_4over6 = "weights"; }, "4/6"},
                               {[](TrainConfig* c) { c->recipe = "bf16_with_mor_fp8_mixed"; }, "no NVFP4 rung"}});
}
