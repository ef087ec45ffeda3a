// NeMo's Llama3-8B pretraining configuration (8 ranks, micro-batch 2, gradient accumulation 8, global batch
// 128, distributed optimizer, TP = PP = CP = 1) scaled down to what CI's CPUs run: 4 ranks, micro-batch 1,
// still 8 accumulation steps (global batch 32), the tiny model at seq 32, in all five of NeMo's precisions
// (BF16, FP8 current and delayed scaling, MXFP8, NVFP4). Each must reproduce one rank with the same global
// batch. The tolerances are ddp_test.cpp's: step 1 differs only in the order the FP32 gradients are summed
// (1e-6 relative); later steps may round a few quantized weights the other way, so step 2 gets a 1% check.
#include <gtest/gtest.h>
#include <cstdio>
#include <string>
#include "common/nibble_binary.h"
#include "distributed/ddp_util.h"

namespace nb {
namespace {

constexpr int kRanks = 4;
constexpr const char* kNemoRecipes[] = {"bf16_mixed", "bf16_with_fp8_current_scaling_mixed",
                                        "bf16_with_fp8_delayed_scaling_mixed", "bf16_with_mxfp8_mixed",
                                        "bf16_with_nvfp4_mixed"};

// One scaled-down NeMo job on `ranks` ranks; returns its save folder (metrics.jsonl).
std::string nemo_job(const std::string& dir, const std::string& recipe, int ranks) {
  const std::string save = dir + "/" + recipe + "_" + std::to_string(ranks);
  const test::CliRun r = test::run_nibble(
      " train --model tiny --device cpu --seq-length 32 --micro-batch-size 1 --global-batch-size 32 --lr 3e-3 "
      "--lr-warmup-iters 1 --log-interval 1 --train-iters 2 --use-distributed-optimizer "
      "--num-layers-at-start-in-bf16 0 --num-layers-at-end-in-bf16 0 --recipe " +
      recipe + " --nproc-per-node " + std::to_string(ranks) + " --save " + save);
  EXPECT_EQ(r.code, 0) << r.out;
  if (ranks == kRanks) {
    EXPECT_NE(r.out.find("data parallel: 4 ranks (gloo"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("8 micro-batches per rank per step"), std::string::npos) << r.out;
  }
  return save;
}

TEST(NemoConfigurationCpu, FourRanksReproduceOneRankInEveryPrecision) {
  const std::string dir = test::temp_folder("nemo_config");
  for (const char* recipe : kNemoRecipes) {
    const auto one = read_metrics(nemo_job(dir, recipe, 1));
    const auto four = read_metrics(nemo_job(dir, recipe, kRanks));
    ASSERT_EQ(one.size(), 2u) << recipe;
    ASSERT_EQ(four.size(), 2u) << recipe;
    EXPECT_NEAR(four[0].loss, one[0].loss, 1e-6 * one[0].loss) << recipe;
    EXPECT_NEAR(four[0].grad_norm, one[0].grad_norm, 1e-6 * one[0].grad_norm) << recipe;
    EXPECT_NEAR(four[1].loss, one[1].loss, 1e-2 * one[1].loss) << recipe;
    EXPECT_LT(four[1].loss, four[0].loss) << recipe << ": the loss did not fall";
    std::printf("%s: step 1 loss %.7f (1 rank) vs %.7f (4 ranks), step 2 %.7f vs %.7f\n", recipe, one[0].loss,
                four[0].loss, one[1].loss, four[1].loss);
  }
}

}  // namespace
}  // namespace nb
