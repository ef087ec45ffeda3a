// CPU: bit-exact resume for bf16_mixed, FP8 delayed scaling and NVFP4 (RHT, 2D weights, stochastic
// rounding) on a Megatron dataset; and the resume rules (refusals that name the field and both values).
#include <gtest/gtest.h>
#include "train/checkpoint.h"
#include "train/resume_util.h"

using namespace nb;

class ResumeCpu : public ::testing::TestWithParam<const char*> {};

TEST_P(ResumeCpu, HalvesEqualTheWholeRunBitForBit) {
  const std::string dir = test::temp_folder(std::string("resume_") + GetParam());
  test::expect_bit_exact_resume("cpu", GetParam(), dir, test::write_random_dataset(dir, 256));
}

INSTANTIATE_TEST_SUITE_P(Recipes, ResumeCpu,
                         ::testing::Values("bf16_mixed", "bf16_with_fp8_delayed_scaling_mixed",
                                           "bf16_with_nvfp4_mixed"));

namespace {
// A saved 3-step run to resume from.
std::string saved_run(const std::string& name, TrainConfig* job) {
  const std::string dir = test::temp_folder(name);
  *job = test::resume_job("cpu", "bf16_mixed", test::write_random_dataset(dir, 256));
  job->train_iters = 3;
  job->save = dir + "/run";
  job->save_interval = 3;
  TrainSummary s;
  Status st = run_training(*job, &s);
  EXPECT_TRUE(st.is_ok()) << st.message();
  job->train_iters = 6;
  job->load = job->save;
  return dir;
}
}  // namespace

TEST(ResumeRules, RefusesAnotherModelShapeNamingBothValues) {
  TrainConfig job;
  saved_run("rules_shape", &job);
  job.num_layers = 3;
  TrainSummary s;
  Status st = run_training(job, &s);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("layers 2"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("has 3"), std::string::npos) << st.message();
}

TEST(ResumeRules, RefusesAnotherSequenceLengthButFinetuneAcceptsIt) {
  TrainConfig job;
  saved_run("rules_seq", &job);
  job.seq_length = 32;
  TrainSummary s;
  Status st = run_training(job, &s);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("--seq-length is 64 in the checkpoint but 32 now"), std::string::npos) << st.message();
  job.finetune = true;
  job.save = "";
  job.save_interval = 0;
  st = run_training(job, &s);
  ASSERT_TRUE(st.is_ok()) << st.message();
  EXPECT_EQ(s.start_iteration, 0);  // weights only
  EXPECT_EQ(s.steps, 6);
}

TEST(ResumeRules, RefusesARecipeWhoseStateDiffers) {
  TrainConfig job;
  saved_run("rules_recipe", &job);
  job.recipe = "bf16_with_fp8_delayed_scaling_mixed";
  TrainSummary s;
  Status st = run_training(job, &s);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("bf16_mixed"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("delayed-scaling"), std::string::npos) << st.message();
}

TEST(ResumeRules, AcceptsNewTrainItersAndIntervals) {
  TrainConfig job;
  saved_run("rules_accept", &job);
  job.train_iters = 5;
  job.eval_interval = 1;
  job.log_interval = 2;
  job.min_lr = 1e-4;
  job.async_save = false;  // and the synchronous writer saves the end checkpoint
  TrainSummary s;
  Status st = run_training(job, &s);
  ASSERT_TRUE(st.is_ok()) << st.message();
  EXPECT_EQ(s.start_iteration, 3);
  EXPECT_EQ(s.end_iteration, 5);
  CheckpointRef ref;
  ASSERT_TRUE(find_checkpoint(job.save, -1, &ref).is_ok());
  EXPECT_EQ(ref.iteration, 5);
}

TEST(ResumeRules, NoLoadOptimStartsFreshMomentsAndDiffers) {
  TrainConfig job;
  saved_run("rules_optim", &job);
  job.save = "";
  job.save_interval = 0;
  TrainSummary with, without;
  ASSERT_TRUE(run_training(job, &with).is_ok());
  job.no_load_optim = true;
  ASSERT_TRUE(run_training(job, &without).is_ok());
  EXPECT_EQ(without.start_iteration, 3);
  EXPECT_NE(with.losses[1], without.losses[1]);  // the first step after loading already updates differently
}

TEST(ResumeRules, SaveFlagsWithoutASaveFolderAreRefused) {
  TrainConfig c = test::resume_job("cpu", "bf16_mixed", "unused");
  c.mock_data = true;
  c.save_interval = 2;
  TrainSummary s;
  Status st = run_training(c, &s);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("--save DIR"), std::string::npos) << st.message();
}

TEST(EvalIters, CountGlobalBatchesAsMegatronDoes) {
  // Megatron: each evaluation reads eval_iters global batches of 4 samples. The checkpoint at iteration 6
  // follows the evaluations at 2 and 4 (the final one runs after the last save, as in Megatron): 2 x 2 x 4.
  const std::string dir = test::temp_folder("eval_iters");
  TrainConfig c = test::resume_job("cpu", "bf16_mixed", test::write_random_dataset(dir, 256));
  c.eval_iters = 2;
  c.save = dir + "/run";
  c.save_interval = 6;
  TrainSummary s;
  Status st = run_training(c, &s);
  ASSERT_TRUE(st.is_ok()) << st.message();
  nlohmann::json state;
  ASSERT_TRUE(read_checkpoint_state({dir + "/run/iter_0000006", 6}, &state).is_ok());
  EXPECT_EQ(state["consumed_valid_samples"].get<int64_t>(), 2 * 2 * 4);
  EXPECT_EQ(state["consumed_train_samples"].get<int64_t>(), 6 * 4);
}
