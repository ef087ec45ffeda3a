// CUDA: bit-exact resume (N steps, save, resume, N more = 2N uninterrupted) for bf16_mixed, FP8 delayed
// scaling and NVFP4 with stochastic rounding, on a Megatron dataset (see tests/train/resume_util.h).
#include <gtest/gtest.h>
#include "common/gpu.h"
#include "train/resume_util.h"

using namespace nb;

class ResumeCuda : public ::testing::TestWithParam<const char*> {};

TEST_P(ResumeCuda, HalvesEqualTheWholeRunBitForBit) {
  NB_REQUIRE_GPU();
  const std::string dir = test::temp_folder(std::string("resume_gpu_") + GetParam());
  test::expect_bit_exact_resume("cuda", GetParam(), dir, test::write_random_dataset(dir, 256));
}

INSTANTIATE_TEST_SUITE_P(Recipes, ResumeCuda,
                         ::testing::Values("bf16_mixed", "bf16_with_fp8_delayed_scaling_mixed",
                                           "bf16_with_nvfp4_mixed"));
