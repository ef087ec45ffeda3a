// Quantized layers without compute copies on CUDA: training matches keeping every compute copy, bit for bit.
#include <gtest/gtest.h>
#include "../master_only_util.h"
#include "common/gpu.h"

using namespace nb;

class MasterOnlyCuda : public ::testing::TestWithParam<std::string> {};

TEST_P(MasterOnlyCuda, TrainsExactlyLikeKeepingComputeCopies) {
  NB_REQUIRE_GPU();
  nb::testing::expect_master_only_trains_like_full(GetParam(), Device::cuda);
}

INSTANTIATE_TEST_SUITE_P(Recipes, MasterOnlyCuda,
                         ::testing::Values("bf16_with_fp8_current_scaling_mixed", "bf16_with_fp8_delayed_scaling_mixed",
                                           "bf16_with_nvfp4_mixed"));
