// CPU: the optimizer state in host memory (--optimizer-cpu-offload) changes no bit of training: 1 rank
// and 2 ranks with the distributed optimizer or Megatron-FSDP, in bf16_mixed, FP8 delayed scaling and NVFP4, at offload
// fractions 0.5 and 1.0, and across a save/resume that switches offload on -> off -> on. A host too small
// for the state is refused before step 1 in one sentence that names the fraction that fits.
#include <gtest/gtest.h>
#include <cstdlib>
#include <string>
#include "train/offload_util.h"

using namespace nb;

class OffloadCpu : public ::testing::TestWithParam<const char*> {};

TEST_P(OffloadCpu, HalfAndAllOfTheStateOnTheHostAreBitIdentical) {
  const std::string dir = test::temp_folder(std::string("offload_") + GetParam());
  test::expect_offload_bit_exact("cpu", GetParam(), dir, test::write_random_dataset(dir, 256));
}

TEST_P(OffloadCpu, TwoRanksWithTheDistributedOptimizerAreBitIdentical) {
  test::expect_offload_bit_exact_ranks("cpu", GetParam(), 2,
                                       test::temp_folder(std::string("offload_ranks_") + GetParam()));
}

TEST_P(OffloadCpu, TwoRanksWithMegatronFsdpAreBitIdentical) {
  test::expect_offload_bit_exact_ranks("cpu", GetParam(), 2,
                                       test::temp_folder(std::string("offload_fsdp_") + GetParam()),
                                       "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params");
}

TEST(OffloadCpuFsdp, OptimGradsTwoRanksAreBitIdentical) {
  test::expect_offload_bit_exact_ranks("cpu", "bf16_mixed", 2, test::temp_folder("offload_fsdp_optim_grads"),
                                       "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads");
}

INSTANTIATE_TEST_SUITE_P(Recipes, OffloadCpu,
                         ::testing::Values("bf16_mixed", "bf16_with_fp8_delayed_scaling_mixed",
                                           "bf16_with_nvfp4_mixed"));

TEST(OffloadCpuResume, SwitchingOffloadOnOffOnContinuesBitForBit) {
  const std::string dir = test::temp_folder("offload_switch");
  test::expect_offload_switch_resume("cpu", "bf16_with_nvfp4_mixed", dir, test::write_random_dataset(dir, 256));
}

namespace {
// Sets NIBBLE_HOST_MEMORY_GIB for one scope: the host size the offload check believes.
struct FakeHostMemory {
  explicit FakeHostMemory(const char* gib) { setenv("NIBBLE_HOST_MEMORY_GIB", gib, 1); }
  ~FakeHostMemory() { unsetenv("NIBBLE_HOST_MEMORY_GIB"); }
};
}  // namespace

TEST(OffloadCpuHost, TooSmallAHostIsRefusedBeforeStepOneNamingTheFractionThatFits) {
  const std::string dir = test::temp_folder("offload_host");
  TrainConfig c = test::tiny_job("cpu", "bf16_mixed");
  test::set_offload(&c, 1.0);
  c.save = dir + "/run";
  FakeHostMemory host("0.004");  // 4 MiB; the tiny model's state is about 16 MB
  TrainSummary s;
  Status st = run_training(c, &s);
  ASSERT_FALSE(st.is_ok());
  const std::string msg = st.message();
  EXPECT_NE(msg.find("page-locked host memory"), std::string::npos) << msg;
  EXPECT_NE(msg.find("0.00 GiB is available"), std::string::npos) << msg;
  const size_t at = msg.find("--optimizer-offload-fraction ");
  ASSERT_NE(at, std::string::npos) << msg;
  EXPECT_EQ(s.steps, 0);
  EXPECT_FALSE(std::filesystem::exists(c.save + "/metrics.jsonl")) << "the refusal came after training started";
  // The fraction the sentence names fits.
  const double fits = std::atof(msg.c_str() + at + std::string("--optimizer-offload-fraction ").size());
  ASSERT_GT(fits, 0.0) << msg;
  ASSERT_LT(fits, 1.0) << msg;
  c.optimizer_offload_fraction = fits;
  c.train_iters = 1;
  st = run_training(c, &s);
  EXPECT_TRUE(st.is_ok()) << st.message();
}

TEST(OffloadCpuHost, ImpossibleSettingsAreRefusedInOneSentence) {
  TrainConfig c = test::tiny_job("cpu", "bf16_mixed");
  test::set_offload(&c, 1.0);
  c.optimizer_offload_fraction = 1.5;
  TrainSummary s;
  Status st = run_training(c, &s);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("--optimizer-offload-fraction is the share"), std::string::npos) << st.message();
  c.optimizer_offload_fraction = 1.0;
  c.optimizer_state_offload_chunk_size_mb = 0;
  st = run_training(c, &s);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("--optimizer-state-offload-chunk-size-mb"), std::string::npos) << st.message();
}
