// Tensor parallelism through the CLI (Gloo, CPU): `--tensor-model-parallel-size T` against one rank with the
// same global batch. Each rank holds its heads, FFN columns and vocabulary rows (model/tensor_parallel.h); the
// row-parallel outputs, the column-parallel input gradients, the embedding and the LM head's input gradient are
// summed over the group, and the loss is the vocabulary-parallel cross-entropy. In BF16 the only differences
// are FP32 rounding of those sums' order, so step 1's loss and gradient norm agree to 1e-6 relative and five
// steps' losses to 1e-5 (measured: equal in the printed digits). Combined with data parallelism (T2 x D2, with
// the distributed optimizer) and context parallelism (T2 x C2). A checkpoint saved at T2 x C2 (whole tensors)
// resumes at one rank and at D4 and continues one rank's losses. Sequence parallelism (norms and residuals on
// 1/T of the tokens, all-gathers and reduce-scatters) and --tp-comm-overlap (the input gradients' sums on a side
// stream, in order on the CPU) reproduce one rank the same way, with selective and full recompute, and so does
// Megatron-FSDP over the data ranks of T2 x D2 (BF16 weight gathers).
// Quantized recipes: the Linears reduce a sharded role's per-tensor amax over the group (weights always; the
// column-parallel gradient and the row-parallel input), so NVFP4 without stochastic rounding and MXFP8 equal one
// rank at step 1, NVFP4 under sequence parallelism too (the gathered input is quantized whole); FP8 current
// scaling within 1e-5 (an FP8 code flipped by the sums' rounding).
#include <gtest/gtest.h>
#include <filesystem>
#include <functional>
#include <string>
#include <utility>
#include <vector>
#include "distributed/ddp_util.h"
#include "train/sft_reverse_data.h"

namespace nb {
namespace {

const std::string& kTpBase = kModelParallelBase;
const std::string kTpJob = kTpBase + "--recipe bf16_mixed ";

// Five steps of each layout (its rank count and flags) against one rank's five steps, made once per test.
void expect_layouts_reproduce_one_rank(const std::string& name,
                                       const std::vector<std::pair<int, std::string>>& layouts) {
  const std::string dir = test::temp_folder("tp_train_" + name);
  test::CliRun r = test::run_nibble(kTpJob + "--train-iters 5 --save " + dir + "/one");
  ASSERT_EQ(r.code, 0) << r.out;
  const auto ref = read_metrics(dir + "/one");
  for (const auto& [ranks, flags] : layouts) {
    SCOPED_TRACE(flags);
    r = test::run_nibble(kTpJob + "--train-iters 5 --nproc-per-node " + std::to_string(ranks) + " " + flags +
                         " --save " + dir + "/tp");
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_NE(r.out.find("tensor parallel: "), std::string::npos) << r.out;
    expect_same_run(read_metrics(dir + "/tp"), ref, flags);
    std::filesystem::remove_all(dir + "/tp");
  }
  std::filesystem::remove_all(dir);
}

// The layout the ASan build runs too: two ranks with sequence parallelism, the overlapped collectives and selective
// recompute (four sanitized ranks on CI's two cores took 172 s; context parallelism has its own ASan test).
TEST(TensorParallelCpu, SmallLayoutsReproduceOneRankInBf16) {
  expect_layouts_reproduce_one_rank(
      "small", {{2, "--tensor-model-parallel-size 2 --sequence-parallel --tp-comm-overlap --recompute selective"}});
}

// ... and those the regular build alone runs (docs/HARDENING.md).
TEST(TensorParallelCpu, WiderLayoutsReproduceOneRankInBf16) {
  expect_layouts_reproduce_one_rank("wider", {{4, "--tensor-model-parallel-size 4"},
                                              {4, "--tensor-model-parallel-size 2 --use-distributed-optimizer"},
                                              {4, "--tensor-model-parallel-size 2 --context-parallel-size 2"},
                                              {2, "--tensor-model-parallel-size 2 --tp-comm-overlap"},
                                              {4,
                                               "--tensor-model-parallel-size 2 --context-parallel-size 2 "
                                               "--sequence-parallel --tp-comm-overlap --recompute selective"},
                                              {4,
                                               "--tensor-model-parallel-size 2 --sequence-parallel --use-megatron-fsdp "
                                               "--data-parallel-sharding-strategy optim_grads_params"}});
}

TEST(TensorParallelCpuQuantized, ShardedScalesAreOneGpusAtStepOne) {
  const std::string dir = test::temp_folder("tp_train_quantized");
  const std::string job = kTpBase + "--train-iters 1 --num-layers-at-start-in-bf16 0 --num-layers-at-end-in-bf16 0 ";
  struct Case {
    std::string flags;
    double loss_tol, norm_tol;
    std::string tp_only = "";  // flags of the tensor-parallel run only
    std::string layout = "--nproc-per-node 2 --tensor-model-parallel-size 2";
  };
  // NVFP4 with SR: each rank's gradient shard draws its random bits at its place in the whole gradient.
  for (const Case& c : {Case{"--recipe bf16_with_nvfp4_mixed", 1e-6, 1e-6},
                        Case{"--recipe bf16_with_nvfp4_mixed", 1e-6, 1e-6, "--sequence-parallel"},
                        Case{"--recipe bf16_with_nvfp4_mixed", 1e-6, 1e-6, "--sequence-parallel",
                             "--nproc-per-node 4 --tensor-model-parallel-size 4"},
                        Case{"--recipe bf16_with_nvfp4_mixed", 1e-6, 1e-6, "--sequence-parallel",
                             "--nproc-per-node 4 --tensor-model-parallel-size 2 --use-distributed-optimizer"},
                        // Megatron-FSDP's training-format gathers: each weight's amax over FSDP and TP ranks
                        Case{"--recipe bf16_with_nvfp4_mixed", 1e-6, 1e-6, "--sequence-parallel",
                             "--nproc-per-node 4 --tensor-model-parallel-size 2 --use-megatron-fsdp "
                             "--data-parallel-sharding-strategy optim_grads_params --fsdp-param-gather training"},
                        Case{"--recipe bf16_with_nvfp4_mixed --fp4-disable-sr", 1e-6, 1e-6, "--sequence-parallel"},
                        Case{"--recipe bf16_with_mxfp8_mixed", 1e-6, 1e-6},
                        Case{"--recipe bf16_with_mxfp8_mixed", 1e-6, 1e-6, "--sequence-parallel"},
                        Case{"--recipe bf16_with_fp8_current_scaling_mixed", 1e-6, 1e-5},
                        Case{"--recipe bf16_with_fp8_current_scaling_mixed", 1e-6, 1e-5, "--sequence-parallel"}}) {
    const std::string one = dir + "/one" + std::to_string(std::hash<std::string>{}(c.flags)), tp = dir + "/tp";
    test::CliRun r;
    if (!std::filesystem::exists(one)) {  // one rank's run of these flags, shared by their layouts
      r = test::run_nibble(job + c.flags + " --save " + one);
      ASSERT_EQ(r.code, 0) << r.out;
    }
    r = test::run_nibble(job + c.flags + " " + c.tp_only + " " + c.layout + " --save " + tp);
    ASSERT_EQ(r.code, 0) << r.out;
    if (!c.tp_only.empty()) {  // every layer's inputs gathered in its own format (recipe::Linear::forward_gathered)
      EXPECT_NE(r.out.find("sequence parallel: 4 of 4 column-parallel inputs and 4 of 4 row-parallel output "
                           "gradients all-gathered in their quantized"),
                std::string::npos)
          << r.out;
    }
    if (c.layout.find("--fsdp-param-gather training") != std::string::npos) {
      EXPECT_NE(r.out.find("Megatron-FSDP gathers 8 quantized linear weights in their training format"),
                std::string::npos)
          << r.out;
    }
    const auto a = read_metrics(one), b = read_metrics(tp);
    ASSERT_EQ(a.size(), 1u);
    ASSERT_EQ(b.size(), 1u);
    EXPECT_NEAR(b[0].loss, a[0].loss, c.loss_tol * a[0].loss) << c.flags << c.tp_only << c.layout;
    EXPECT_NEAR(b[0].grad_norm, a[0].grad_norm, c.norm_tol * a[0].grad_norm) << c.flags << c.tp_only << c.layout;
    std::filesystem::remove_all(tp);
  }
  std::filesystem::remove_all(dir);
}

// Precision annealing under tensor parallelism: the switch rebuilds every Linear with its tensor-parallel groups
// (amax groups, SR columns, quantized gathers), so the annealed steps equal one rank's too. (MXFP8: its blocks
// never cross a shard; FP8 current scaling drifts 2e-4 from one rank by step 2 on the CPU, as without annealing:
// the row-parallel sums' order moves a few values across an FP8 rounding boundary.)
TEST(TensorParallelCpuAnneal, AnnealedRunsEqualOneRank) {
  const std::string dir = test::temp_folder("tp_train_anneal");
  const std::string job = kTpBase + "--train-iters 4 --num-layers-at-start-in-bf16 0 --num-layers-at-end-in-bf16 0 ";
  for (const std::string& flags :
       {std::string("--recipe bf16_with_mxfp8_mixed --anneal-start-fraction 0.5 --anneal-recipe bf16_mixed"),
        std::string("--recipe bf16_with_mxfp8_mixed --anneal-start-fraction 0.5 --anneal-recipe bf16_mixed "
                    "--anneal-fprop-only")}) {
    test::CliRun r = test::run_nibble(job + flags + " --save " + dir + "/one");
    ASSERT_EQ(r.code, 0) << r.out;
    r = test::run_nibble(
        job + flags + " --nproc-per-node 2 --tensor-model-parallel-size 2 --sequence-parallel --save " + dir + "/tp");
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_NE(r.out.find("annealing: step 3 onwards runs bf16_mixed"), std::string::npos) << r.out;
    expect_same_run(read_metrics(dir + "/tp"), read_metrics(dir + "/one"), flags);
    std::filesystem::remove_all(dir);
  }
}

// SFT with packed rows (several samples per row, attention inside each) under tensor and sequence parallelism: every
// rank of a group runs the same rows, so the answer-token means and the validation loss are one rank's.
TEST(TensorParallelCpuSft, PackedAnswerLossIsOneRanks) {
  const std::string dir = test::temp_folder("tp_train_sft");
  const std::string data = test::write_reverse_sft_data(dir, 3, 4, 12);
  const std::string job =
      kTpBase + "--sft --data-path " + data + " --train-iters 2 --eval-interval 2 --eval-iters 1 --recipe bf16_mixed ";
  const test::CliRun one = test::run_nibble(job + "--save " + dir + "/one");
  ASSERT_EQ(one.code, 0) << one.out;
  auto validation = [](const std::string& out) {
    const size_t at = out.find("validation loss at iteration 2 | lm loss value: ");
    return at == std::string::npos ? -1.0 : std::stod(out.substr(at + 48));
  };
  ASSERT_GT(validation(one.out), 0) << one.out;
  for (const std::string& flags : {std::string(""), std::string("--sequence-parallel")}) {
    const test::CliRun tp =
        test::run_nibble(job + "--nproc-per-node 2 --tensor-model-parallel-size 2 " + flags + " --save " + dir + "/tp");
    ASSERT_EQ(tp.code, 0) << tp.out;
    EXPECT_NE(tp.out.find("packed"), std::string::npos) << tp.out;
    expect_same_run(read_metrics(dir + "/tp"), read_metrics(dir + "/one"), "sft " + flags);
    EXPECT_NEAR(validation(tp.out), validation(one.out), 1e-5 * validation(one.out)) << tp.out;
    std::filesystem::remove_all(dir + "/tp");
  }
}

TEST(TensorParallelCpuResume, SavedAtT2C2ResumesAtOneRankAndAtD4) {
  const std::string dir = test::temp_folder("tp_train_resume");
  test::CliRun r = test::run_nibble(kTpJob + "--train-iters 5 --save " + dir + "/one");
  ASSERT_EQ(r.code, 0) << r.out;
  const auto ref = read_metrics(dir + "/one");
  const std::string save = dir + "/tp";
  r = test::run_nibble(kTpJob +
                       "--train-iters 5 --exit-interval 3 --save-interval 3 --nproc-per-node 4 "
                       "--tensor-model-parallel-size 2 --context-parallel-size 2 --save " +
                       save);
  ASSERT_EQ(r.code, 0) << r.out;
  std::filesystem::copy(save, dir + "/tp_d4", std::filesystem::copy_options::recursive);
  for (const std::string& where : {std::string(" --save ") + save, " --nproc-per-node 4 --save " + dir + "/tp_d4"}) {
    const std::string folder = where.substr(where.rfind(' ') + 1);
    r = test::run_nibble(kTpJob + "--train-iters 5 --save-interval 5 --load " + folder + where);
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_NE(r.out.find("resuming after iteration 3"), std::string::npos) << r.out;
    const auto got = read_metrics(folder);  // steps 1-3 at T2 x C2, 4-5 resumed
    expect_same_run(got, ref, where);
  }
}

TEST(TensorParallelCpuRefusals, WhatCannotSplitIsRefusedInOneSentence) {
  test::CliRun r = test::run_nibble(kTpJob + "--train-iters 1 --nproc-per-node 3 --tensor-model-parallel-size 3");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("tensor parallelism 3 splits the attention heads, but tiny has 8"), std::string::npos) << r.out;
  r = test::run_nibble(kTpJob + "--train-iters 1 --nproc-per-node 2 --tensor-model-parallel-size 4");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("does not divide the 2 ranks"), std::string::npos) << r.out;
  r = test::run_nibble(kTpJob + "--train-iters 1 --sequence-parallel");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("--sequence-parallel splits tokens over the tensor-parallel ranks"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace nb
