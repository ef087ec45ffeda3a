// Pipeline parallelism over NCCL on two GPUs, through the real CLI: 1F1B at P2 and the interleaved schedule at
// P2 V2 (where a rank's two neighbours are one rank), each with the messages overlapped with compute on their own
// streams (the default) and posted on the compute stream (--no-overlap-p2p-communication), against one GPU, in BF16 and
// NVFP4 (NVFP4 without recompute: each Linear keeps a quantized input per pass in flight). The CPU tests (Gloo) run the
// same schedules, but there a stream is the host's order, so only a GPU shows a pass reading a buffer before its
// receive finished or a send reading a slot a later pass already took. Skipped with the reason on a machine with fewer
// GPUs; run with NCCL_NVLS_ENABLE=0 on the shared machines.
//
// Tolerances as fsdp_two_gpu_test.cpp: step 1's loss to 1e-6 relative (the stages run one GPU's kernels on the
// same values), step 1's gradient norm to 1e-4 (summed per stage, then over the stages; a gradient sent before
// its pass finished moves it by far more), losses over four steps to 1e-3 (the kernels' run-to-run noise).
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <filesystem>
#include "common/gpu.h"
#include "distributed/ddp_util.h"

namespace nb {
namespace {

// Eight layers so that P2 x V2 gives every chunk two; a global batch of 16 is eight micro-batches per step.
const std::string kPpGpuJob =
    " train --model tiny --num-layers 8 --device cuda --seq-length 128 --micro-batch-size 2 "
    "--global-batch-size 16 --lr 3e-3 --lr-warmup-iters 1 --log-interval 1 --train-iters 4 "
    "--num-layers-at-start-in-bf16 0 --num-layers-at-end-in-bf16 0 --eval-interval 0 ";

std::vector<StepLog> pp_gpu_run(const std::string& dir, const std::string& name, const std::string& flags) {
  const std::string save = dir + "/" + name;
  const test::CliRun r = test::run_nibble(kPpGpuJob + "--save " + save + " " + flags);
  EXPECT_EQ(r.code, 0) << r.out;
  if (flags.find("--pipeline-model-parallel-size") != std::string::npos) {
    const bool overlapped = flags.find("--no-overlap-p2p-communication") == std::string::npos;
    EXPECT_NE(r.out.find(overlapped ? "messages overlapped with compute" : "posted between passes"), std::string::npos)
        << r.out;
  }
  return read_metrics(save);
}

class PipelineTwoGpus : public ::testing::TestWithParam<const char*> {};

TEST_P(PipelineTwoGpus, SchedulesMatchOneGpu) {
  NB_REQUIRE_GPU();
  if (test::visible_gpus() < 2) GTEST_SKIP() << "skipped: needs two GPUs, found " << test::visible_gpus();
  const std::string recipe = GetParam(), dir = test::temp_folder("pp_two_gpus_" + recipe);
  const std::string job = "--recipe " + recipe + " ";
  const auto one = pp_gpu_run(dir, "one_gpu", job);
  ASSERT_EQ(one.size(), 4u);
  const std::string pp = job + "--nproc-per-node 2 --pipeline-model-parallel-size 2 ";
  for (const std::string& layout :
       {std::string("--no-overlap-p2p-communication"), std::string(""),
        std::string("--num-virtual-stages-per-pipeline-rank 2"),
        std::string("--num-virtual-stages-per-pipeline-rank 2 --no-overlap-p2p-communication")}) {
    SCOPED_TRACE(layout.empty() ? "1F1B, overlapped" : layout);
    const auto r = pp_gpu_run(dir, "pp", pp + layout);
    ASSERT_EQ(r.size(), 4u);
    EXPECT_NEAR(r[0].loss, one[0].loss, 1e-6 * one[0].loss);
    EXPECT_NEAR(r[0].grad_norm, one[0].grad_norm, 1e-4 * one[0].grad_norm);
    for (size_t i = 0; i < 4; ++i) EXPECT_NEAR(r[i].loss, one[i].loss, 1e-3 * one[i].loss) << "step " << i + 1;
    std::filesystem::remove_all(dir + "/pp");
  }
}

INSTANTIATE_TEST_SUITE_P(Recipes, PipelineTwoGpus, ::testing::Values("bf16_mixed", "bf16_with_nvfp4_mixed"));

}  // namespace
}  // namespace nb
