// CUDA: the optimizer state streamed from page-locked host memory through the GPU's AdamW changes no bit
// of training (tests/train/offload_util.h): bf16_mixed, FP8 delayed scaling and NVFP4 at offload fractions
// 0.5 and 1.0, a save/resume across the switch, and 2 ranks with the distributed optimizer and with
// Megatron-FSDP (optim_grads_params; deterministic mode, so that only offload could change a bit) when the
// machine has two GPUs.
#include <gtest/gtest.h>
#include "common/gpu.h"
#include <cuda_runtime.h>
#include "train/offload_util.h"

using namespace nb;

class OffloadCuda : public ::testing::TestWithParam<const char*> {};

TEST_P(OffloadCuda, HalfAndAllOfTheStateOnTheHostAreBitIdentical) {
  NB_REQUIRE_GPU();
  const std::string dir = test::temp_folder(std::string("offload_gpu_") + GetParam());
  test::expect_offload_bit_exact("cuda", GetParam(), dir, test::write_random_dataset(dir, 256));
}

TEST_P(OffloadCuda, TwoRanksWithTheDistributedOptimizerAreBitIdentical) {
  NB_REQUIRE_GPU();
  if (test::visible_gpus() < 2) GTEST_SKIP() << "needs two GPUs; this machine has " << test::visible_gpus();
  test::expect_offload_bit_exact_ranks("cuda", GetParam(), 2,
                                       test::temp_folder(std::string("offload_gpu_ranks_") + GetParam()));
}

TEST_P(OffloadCuda, TwoRanksWithMegatronFsdpAreBitIdentical) {
  NB_REQUIRE_GPU();
  if (test::visible_gpus() < 2) GTEST_SKIP() << "needs two GPUs; this machine has " << test::visible_gpus();
  test::expect_offload_bit_exact_ranks(
      "cuda", GetParam(), 2, test::temp_folder(std::string("offload_gpu_fsdp_") + GetParam()),
      "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params --deterministic-mode");
}

INSTANTIATE_TEST_SUITE_P(Recipes, OffloadCuda,
                         ::testing::Values("bf16_mixed", "bf16_with_fp8_delayed_scaling_mixed",
                                           "bf16_with_nvfp4_mixed"));

TEST(OffloadCudaResume, SwitchingOffloadOnOffOnContinuesBitForBit) {
  NB_REQUIRE_GPU();
  const std::string dir = test::temp_folder("offload_gpu_switch");
  test::expect_offload_switch_resume("cuda", "bf16_with_nvfp4_mixed", dir, test::write_random_dataset(dir, 256));
}
