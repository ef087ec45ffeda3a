// CPU: bit-exact resume for bf16_mixed, FP8 delayed scaling and NVFP4 (RHT, 2D weights, stochastic
// rounding) on a Megatron dataset; an evaluation of the weights its iteration has; and the resume rules (refusals that
// name the field, the checkpoint and both values, for every field of the saved configuration and model that fixes the
// run).
#include <gtest/gtest.h>
#include <filesystem>
#include "io/file_util.h"
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

// An evaluation reads the weights of its iteration: a run that stopped at its last step (--exit-interval) and resumes
// only to evaluate scores what the uninterrupted run scored. Before, an evaluation read the quantized weight copies
// of the step before the optimizer's update, so every quantized recipe's validation loss was one update behind (and
// differed here from a fresh process's, which quantizes the loaded weights).
class EvalAfterUpdateCpu : public ::testing::TestWithParam<const char*> {};

TEST_P(EvalAfterUpdateCpu, AResumeAtTheLastStepScoresAsTheWholeRun) {
  const std::string dir = test::temp_folder(std::string("eval_after_update_") + GetParam());
  const std::string data = test::write_random_dataset(dir, 256);
  auto job = [&](const std::string& save) {
    TrainConfig c = test::resume_job("cpu", GetParam(), data);
    if (std::string(GetParam()) == "bf16_with_mor_nvfp4_mixed") c.mor_granularity = "block";
    c.save = save;
    c.save_interval = 6;
    return c;
  };
  TrainSummary whole, stopped, resumed;
  Status st = run_training(job(dir + "/whole"), &whole);
  ASSERT_TRUE(st.is_ok()) << st.message();
  TrainConfig first = job(dir + "/halves");
  first.exit_interval = 6;  // saves at the last step and stops before the final evaluation
  st = run_training(first, &stopped);
  ASSERT_TRUE(st.is_ok()) << st.message();
  ASSERT_EQ(stopped.stopped_by, "exit-interval");
  TrainConfig second = job(dir + "/halves");
  second.load = second.save;
  st = run_training(second, &resumed);
  ASSERT_TRUE(st.is_ok()) << st.message();
  ASSERT_EQ(resumed.start_iteration, 6);
  ASSERT_TRUE(resumed.losses.empty());  // no step: the evaluation alone
  EXPECT_EQ(resumed.final_val_loss, whole.final_val_loss) << GetParam();
}

INSTANTIATE_TEST_SUITE_P(Recipes, EvalAfterUpdateCpu,
                         ::testing::Values("bf16_with_fp8_current_scaling_mixed", "bf16_with_nvfp4_mixed",
                                           "bf16_with_mor_nvfp4_mixed"));

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
  EXPECT_NE(st.message().find("was saved with --seq-length 64 but this run has --seq-length 32"), std::string::npos)
      << st.message();
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

// The LR schedule may change too (docs/CHECKPOINTS.md): it has no saved state, and the change is printed.
TEST(ResumeRules, AcceptsNewTrainItersIntervalsAndLrSchedule) {
  TrainConfig job;
  saved_run("rules_accept", &job);
  job.train_iters = 5;
  job.eval_interval = 1;
  job.log_interval = 2;
  job.min_lr = 1e-4;
  job.lr = 1e-3;
  job.lr_decay_style = "linear";
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

namespace {
// One saved 3-step run for every refusal below (each resume is refused while loading, before any step), made
// by the first test that asks.
const TrainConfig& mismatch_job() {
  static TrainConfig job;
  static const std::string dir = saved_run("rules_mismatch", &job);
  (void)dir;
  return job;
}
std::string mismatch_dir() { return std::filesystem::path(mismatch_job().save).parent_path().string(); }

struct ResumeFieldChange {
  const char* name;
  void (*change)(TrainConfig* job, const std::string& dir);
  const char* expect;  // the saved value and this run's, by flag
};
}  // namespace

class ResumeMismatch : public ::testing::TestWithParam<ResumeFieldChange> {};

TEST_P(ResumeMismatch, IsRefusedNamingTheFlagAndTheCheckpoint) {
  TrainConfig job = mismatch_job();
  GetParam().change(&job, mismatch_dir());
  TrainSummary s;
  const Status st = run_training(job, &s);
  ASSERT_FALSE(st.is_ok()) << GetParam().name;
  EXPECT_NE(st.message().find(GetParam().expect), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("the checkpoint " + job.load + "/iter_0000003"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("--finetune"), std::string::npos) << st.message();  // what to do instead
}

INSTANTIATE_TEST_SUITE_P(
    Fields, ResumeMismatch,
    ::testing::Values(ResumeFieldChange{"seed", [](TrainConfig* j, const std::string&) { j->seed = 7; },
                                        "saved with --seed 1234 but this run has --seed 7"},
                      ResumeFieldChange{"global_batch_size",
                                        [](TrainConfig* j, const std::string&) { j->global_batch_size = 8; },
                                        "saved with --global-batch-size 4 but this run has --global-batch-size 8"},
                      ResumeFieldChange{"mock_data",
                                        [](TrainConfig* j, const std::string&) {
                                          j->mock_data = true;
                                          j->data_path = "";
                                        },
                                        "saved with --mock-data false but this run has --mock-data true"},
                      ResumeFieldChange{"data_path",
                                        [](TrainConfig* j, const std::string& dir) {
                                          std::filesystem::create_directories(dir + "/other");
                                          j->data_path = test::write_random_dataset(dir + "/other", 256);
                                        },
                                        "/other/docs_text_document\""},
                      ResumeFieldChange{"split", [](TrainConfig* j, const std::string&) { j->split = "80,20,0"; },
                                        "saved with --split \"90,10,0\" but this run has --split \"80,20,0\""}),
    [](const auto& info) { return std::string(info.param.name); });

// The model's numerics are in trainer_state.json's "model" only; this run's come from its preset, so the
// checkpoint's (a copy of the shared one) is edited, its checksum made right again, to differ from them.
TEST(ResumeRules, AnotherRopeThetaOrNormEpsilonIsRefusedButFinetuneAcceptsIt) {
  namespace fs = std::filesystem;
  const std::pair<const char*, double> fields[] = {{"rope_theta", 500000.0}, {"norm_eps", 1e-6}};
  for (const auto& [field, value] : fields) {
    const std::string run = mismatch_dir() + "/" + field;
    fs::remove_all(run);
    fs::copy(mismatch_job().save, run, fs::copy_options::recursive);
    const std::string path = run + "/iter_0000003/trainer_state.json";
    auto state = nlohmann::json::parse(test::file_bytes(path));
    state["model"][field] = value;
    state.erase("state_crc32");  // the checksum covers the state as dumped without it
    const std::string canonical = state.dump();
    state["state_crc32"] = crc32_of(canonical.data(), canonical.size());
    std::ofstream(path, std::ios::trunc) << state.dump();
    TrainConfig job = mismatch_job();
    job.load = job.save = run;
    TrainSummary s;
    Status st = run_training(job, &s);
    ASSERT_FALSE(st.is_ok()) << field;
    const std::string want = std::string(field) == "rope_theta" ? "its model has RoPE theta 500000 but this run's "
                                                                  "model (tiny) has 10000"
                                                                : "its model has norm epsilon 9.99999997e-07";
    EXPECT_NE(st.message().find(want), std::string::npos) << st.message();
    EXPECT_NE(st.message().find(run + "/iter_0000003"), std::string::npos) << st.message();
  }
  TrainConfig job = mismatch_job();
  job.load = mismatch_dir() + "/rope_theta";
  job.save = "";
  job.save_interval = 0;
  job.finetune = true;
  job.train_iters = 1;
  TrainSummary s;
  const Status st = run_training(job, &s);
  ASSERT_TRUE(st.is_ok()) << st.message();
  EXPECT_EQ(s.start_iteration, 0);
}

// trainer_state.json keeps no second copy of configuration fields (seed, data, LR schedule) that a resume
// would not compare: the configuration and the model are recorded once, and compared whole.
TEST(ResumeRules, StateRepeatsNoConfigurationField) {
  nlohmann::json state;
  ASSERT_TRUE(read_checkpoint_state({mismatch_job().save + "/iter_0000003", 3}, &state).is_ok());
  EXPECT_FALSE(state.contains("data"));
  EXPECT_FALSE(state.contains("lr_schedule"));
  EXPECT_FALSE(state["rng"].contains("seed"));
  EXPECT_TRUE(state["rng"].contains("stochastic_rounding_step"));
  EXPECT_TRUE(state["config"].is_string());
  EXPECT_EQ(state["model"]["rope_theta"].get<double>(), 10000.0);
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
