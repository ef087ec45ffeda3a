// MoR's block rule in training (CPU, --mor-granularity block): every step logs the share of 128x128 operand blocks in
// FP8 and writes each Linear's blocks per format; the threshold moves blocks between E4M3 and BF16 from the first step
// on (no lag); the three-way rule and each scaling train; a run resumes bit for bit; settings that do not apply to
// the block rule are refused before step 1. The NVFP4 ladder per block: its records and shares name all three rungs,
// an NVFP4 threshold below every error is the E4M3 block rule bit for bit, and it resumes bit for bit.
#include <gtest/gtest.h>
#include <string>
#include <vector>
#include "train/mor_train_util.h"

using namespace nb;

namespace {

TrainConfig block_job(double threshold) {
  TrainConfig c = test::tiny_job("cpu", "bf16_with_mor_fp8_mixed");
  c.mor_granularity = "block";
  c.mor_threshold = threshold;
  c.train_iters = 4;
  return c;
}

}  // namespace

TEST(MorBlockTrainCpu, EveryStepRecordsItsBlocksAndTheThresholdMovesThem) {
  const std::string dir = test::temp_folder("mor_block_threshold");
  std::vector<double> losses[2];
  int run = 0;
  for (double threshold : {1e-9, 0.999}) {
    TrainConfig job = block_job(threshold);
    job.save = dir + "/run";
    job.save_interval = 100;
    job.log_interval = 2;  // the per-Linear records come every log interval
    TrainSummary s;
    ASSERT_TRUE(run_training(job, &s).is_ok());
    losses[run++] = s.losses;
    const auto steps = test::metrics_records(job.save, "mor_fp8_blocks");
    ASSERT_EQ(steps.size(), 4u);
    for (const auto& st : steps) {
      if (threshold > 0.5)
        EXPECT_EQ(st["mor_fp8_blocks"], 1.0) << st.dump();
      else
        EXPECT_LT(st["mor_fp8_blocks"].get<double>(), 0.1) << "no lag: step 1 already decides" << st.dump();
      EXPECT_EQ(st["mor_e5m2_blocks"], 0.0);
      EXPECT_FALSE(st.contains("mor_fp8_operands"));
    }
    const auto linears = test::metrics_records(job.save, "mor_linear");
    ASSERT_EQ(linears.size(), 2u * 4u * 2u);  // steps 2 and 4, 2 layers of 4 Linears
    EXPECT_EQ(linears.front()["iteration"], 2);
    for (const auto& rec : linears)
      for (const char* role : {"input", "weight", "grad"}) {
        const auto& r = rec[role];
        EXPECT_EQ(r["format"], "blocks");
        const int64_t e4m3 = r["e4m3_blocks"], bf16 = r["bf16_blocks"];
        EXPECT_GT(e4m3 + bf16, 0) << rec.dump();
        if (threshold > 0.5) { EXPECT_EQ(bf16, 0) << rec.dump(); }
        EXPECT_GT(r["error"].get<double>(), 0.0) << rec.dump();
      }
    std::filesystem::remove_all(job.save);
  }
  EXPECT_NE(losses[0], losses[1]) << "the blocks' formats change the run";
  std::filesystem::remove_all(dir);
}

TEST(MorBlockTrainCpu, ThreeWayAndEachScalingTrain) {
  std::vector<std::vector<double>> all;
  for (const char* scaling : {"gam", "amax", "pow2"})
    for (bool three : {false, true}) {
      TrainConfig job = block_job(0.045);
      job.mor_scaling = scaling;
      job.mor_three_way = three;
      TrainSummary s;
      ASSERT_TRUE(run_training(job, &s).is_ok()) << scaling << three;
      ASSERT_EQ(s.losses.size(), 4u);
      for (double l : s.losses) EXPECT_TRUE(std::isfinite(l)) << scaling << three;
      all.push_back(s.losses);
    }
  EXPECT_NE(all[0], all[4]) << "gam and pow2 scales quantize differently";
}

// Each Linear's Wgrad reads its own input's blocks: without recompute the input's operand is kept from its forward
// (the Fprop copy is a workspace transient that later layers overwrite), under full recompute it is made again just
// before the backward. The three must agree bit for bit (a shared Fprop copy read by Wgrad made them differ).
TEST(MorBlockTrainCpu, EveryRecomputeTrainsAlike) { test::expect_every_recompute_alike(block_job(0.0226)); }

TEST(MorBlockTrainCpu, ResumesBitExactly) {
  const std::string dir = test::temp_folder("mor_block_resume");
  test::expect_bit_exact_resume("cpu", "bf16_with_mor_fp8_mixed", dir, test::write_random_dataset(dir, 256),
                                [](TrainConfig* c) {
                                  c->mor_granularity = "block";
                                  c->mor_threshold = 0.0226;  // both formats among the tiny model's blocks
                                });
}

TEST(MorBlockTrainCpu, SettingsThatDoNotApplyAreRefusedBeforeStepOne) {
  test::expect_refused_before_step_one(block_job(0.045),
                                       {{[](TrainConfig* c) { c->quant_stats = true; }, "--quant-stats"},
                                        {[](TrainConfig* c) { c->mor_interval = 4; }, "no lag"},
                                        {[](TrainConfig* c) {
                                           c->recipe = "bf16_with_mor_nvfp4_mixed";
                                           c->fp4_disable_2d = true;
                                         },
                                         "16x16 tiles"},
                                        {[](TrainConfig* c) { c->mor_scaling = "row"; }, "unknown mor-scaling"}});
}

namespace {

TrainConfig ladder_block_job(double nvfp4_threshold) {
  TrainConfig c = block_job(0.0226);
  c.recipe = "bf16_with_mor_nvfp4_mixed";
  c.mor_nvfp4_threshold = nvfp4_threshold;
  return c;
}

}  // namespace

TEST(MorBlockLadderTrainCpu, RecordsEveryRungAndWithoutNvfp4IsTheFp8BlockRule) {
  const std::string dir = test::temp_folder("mor_block_ladder");
  TrainConfig ladder = ladder_block_job(0.25);  // between the tiny model's inputs' and gradients' NVFP4 errors
  ladder.save = dir + "/ladder";
  ladder.log_interval = 2;
  TrainSummary s;
  ASSERT_TRUE(run_training(ladder, &s).is_ok());
  const auto steps = test::metrics_records(ladder.save, "mor_nvfp4_blocks");
  ASSERT_EQ(steps.size(), 4u);
  for (const auto& st : steps) {
    const double nv = st["mor_nvfp4_blocks"], fp8 = st["mor_fp8_blocks"];
    EXPECT_GT(nv, 0.0) << st.dump();
    EXPECT_GT(fp8, 0.0) << st.dump();
    EXPECT_LE(nv + fp8, 1.0) << st.dump();
  }
  int64_t rungs[3] = {0, 0, 0};  // NVFP4, E4M3, BF16 blocks over every record
  for (const auto& rec : test::metrics_records(ladder.save, "mor_linear"))
    for (const char* role : {"input", "weight", "grad"}) {
      const auto& r = rec[role];
      rungs[0] += r["nvfp4_blocks"].get<int64_t>();
      rungs[1] += r["e4m3_blocks"].get<int64_t>();
      rungs[2] += r["bf16_blocks"].get<int64_t>();
      EXPECT_GT(r["nvfp4_error"].get<double>(), r["error"].get<double>()) << rec.dump();
    }
  EXPECT_GT(rungs[0], 0);
  EXPECT_GT(rungs[1], 0);
  EXPECT_GT(rungs[2], 0);
  // Below every NVFP4 error no block keeps NVFP4 (an all-zero block would, with the same zeros): the E4M3 block rule.
  TrainConfig none = ladder_block_job(1e-9), fp8 = block_job(0.0226);
  TrainSummary a, b;
  ASSERT_TRUE(run_training(none, &a).is_ok());
  ASSERT_TRUE(run_training(fp8, &b).is_ok());
  EXPECT_EQ(a.losses, b.losses);
  EXPECT_NE(a.losses, s.losses) << "NVFP4 blocks change the run";
  std::filesystem::remove_all(dir);
}

TEST(MorBlockLadderTrainCpu, ResumesBitExactly) {
  const std::string dir = test::temp_folder("mor_block_ladder_resume");
  test::expect_bit_exact_resume("cpu", "bf16_with_mor_nvfp4_mixed", dir, test::write_random_dataset(dir, 256),
                                [](TrainConfig* c) {
                                  c->mor_granularity = "block";
                                  c->mor_threshold = 0.0226;
                                  c->mor_nvfp4_threshold = 0.25;  // all three rungs among the tiny model's blocks
                                });
}

// 1x16 NVFP4 blocks on X and dY (--mor-nvfp4-rows): a row and a column copy per role, each block decided in each; the
// input's column copy kept for Wgrad where every recompute mode keeps it; resume.
TEST(MorBlockLadderTrainCpu, RowBlocksRecordAllRungsRecomputeAlikeAndResume) {
  const std::string dir = test::temp_folder("mor_block_ladder_rows");
  TrainConfig job = ladder_block_job(0.2);  // between the tiny model's 1x16 inputs' and gradients' NVFP4 errors
  job.mor_nvfp4_rows = true;
  job.save = dir + "/rows";
  job.log_interval = 2;
  TrainSummary s;
  ASSERT_TRUE(run_training(job, &s).is_ok());
  int64_t rungs[3] = {0, 0, 0};
  for (const auto& rec : test::metrics_records(job.save, "mor_linear"))
    for (const char* role : {"input", "weight", "grad"}) {
      rungs[0] += rec[role]["nvfp4_blocks"].get<int64_t>();
      rungs[1] += rec[role]["e4m3_blocks"].get<int64_t>();
      rungs[2] += rec[role]["bf16_blocks"].get<int64_t>();
    }
  EXPECT_GT(rungs[0], 0);
  EXPECT_GT(rungs[1], 0);
  EXPECT_GT(rungs[2], 0);
  TrainConfig tiles = ladder_block_job(0.2);
  TrainSummary t;
  ASSERT_TRUE(run_training(tiles, &t).is_ok());
  EXPECT_NE(s.losses, t.losses) << "1x16 blocks are another quantization than 16x16 tiles";
  std::filesystem::remove_all(dir);
  TrainConfig alike = ladder_block_job(0.2);
  alike.mor_nvfp4_rows = true;
  test::expect_every_recompute_alike(alike);
  const std::string rdir = test::temp_folder("mor_block_ladder_rows_resume");
  test::expect_bit_exact_resume("cpu", "bf16_with_mor_nvfp4_mixed", rdir, test::write_random_dataset(rdir, 256),
                                [](TrainConfig* c) {
                                  c->mor_granularity = "block";
                                  c->mor_threshold = 0.0226;
                                  c->mor_nvfp4_threshold = 0.2;
                                  c->mor_nvfp4_rows = true;
                                });
}
