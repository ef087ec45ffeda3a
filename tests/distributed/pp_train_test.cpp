// Pipeline parallelism through the CLI (Gloo, CPU): `--pipeline-model-parallel-size P` against one rank with the
// same global batch. Each stage holds its layers' parameters, initialized as the whole model's; the schedule only
// reorders the micro-batches' passes, and each parameter's gradient still sums its micro-batches in order, so in
// BF16 step 1 and five steps agree with one rank to 1e-6 and 1e-5 relative (measured: identical digits in the
// log), and so does the validation loss. The messages overlap with compute (the default) in every layout but
// P2 and P2 V2, which post them on the compute stream. Covered: 1F1B at P2 (and P2 x D2 with the distributed optimizer
// and half its state offloaded to the host, P2 x T2 with sequence parallelism, P2 x C2), P4, the interleaved schedule
// at P4 V2 and at P2 V2 (a rank's two neighbours one rank), a --pipeline-model-parallel-layout of uneven and empty
// stages (P2 V2), NVFP4 (with full recompute at P2, with a quantized input
// slot per pass in flight at P4 V2) and its anneal to BF16, FP8 delayed scaling's histories saved from every stage,
// checkpoints saved at P4 and at T2 x P2 resuming at other layouts, LoRA at P4 V2 writing one rank's adapter (and at T2
// x P2 T2's), packed SFT rows at P2 and P4 V2, and a killed stage stopping the job.
#include <gtest/gtest.h>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>
#include "distributed/ddp_util.h"
#include "train/sft_reverse_data.h"

namespace nb {
namespace {

// Eight layers so that P4 x V2 gives every chunk one; a global batch of 8 is four micro-batches at one data rank.
const std::string kPpBase = kModelParallelBase + "--num-layers 8 ";
const std::string kPpJob = kPpBase + "--recipe bf16_mixed ";

std::vector<StepLog> pp_run(const std::string& flags, const std::string& dir, const std::string& base = kPpJob) {
  const test::CliRun r = test::run_nibble(base + flags + " --save " + dir);
  EXPECT_EQ(r.code, 0) << r.out;
  return read_metrics(dir);
}

// The last validation loss in a run's metrics.jsonl (-1: none).
double last_val_loss(const std::string& save) {
  double v = -1;
  std::ifstream in(save + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_object() && j.contains("val_loss")) v = j["val_loss"].get<double>();
  }
  return v;
}

// `job` (five steps and a validation after the last) in every layout against one rank's run of it, made once: one
// test rather than one per layout, for CI time. Each run's output must name `marker`.
void expect_layouts_reproduce_one_rank(const std::string& job, const std::vector<std::string>& layouts,
                                       const std::string& marker, const std::string& dir) {
  const auto ref = pp_run(job, dir + "/one");
  const double val = last_val_loss(dir + "/one");
  ASSERT_GT(val, 0);
  for (const std::string& layout : layouts) {
    SCOPED_TRACE(layout);
    const test::CliRun r = test::run_nibble(kPpJob + job + layout + " --save " + dir + "/pp");
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_NE(r.out.find(marker), std::string::npos) << r.out;
    expect_same_run(read_metrics(dir + "/pp"), ref, layout);
    EXPECT_NEAR(last_val_loss(dir + "/pp"), val, 1e-5 * val);
    std::filesystem::remove_all(dir + "/pp");
  }
}

// Five steps and a validation (the stages' forward passes only) after the last.
TEST(PipelineParallelCpuLayouts, ReproduceOneRankInBf16) {
  const std::string dir = test::temp_folder("pp_train");
  expect_layouts_reproduce_one_rank(
      "--train-iters 5 --eval-interval 5 --eval-iters 1 ",
      {"--nproc-per-node 2 --pipeline-model-parallel-size 2 --no-overlap-p2p-communication",
       "--nproc-per-node 4 --pipeline-model-parallel-size 2 --use-distributed-optimizer --optimizer-cpu-offload "
       "--optimizer-offload-fraction 0.5",
       "--nproc-per-node 4 --pipeline-model-parallel-size 4",
       "--nproc-per-node 4 --pipeline-model-parallel-size 4 --num-virtual-stages-per-pipeline-rank 2",
       "--nproc-per-node 2 --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 "
       "--no-overlap-p2p-communication",
       "--nproc-per-node 4 --pipeline-model-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel",
       "--nproc-per-node 4 --pipeline-model-parallel-size 2 --context-parallel-size 2",
       "--nproc-per-node 2 --pipeline-model-parallel-size 2 --pipeline-model-parallel-layout 'Ett*2|t*3||ttL'"},
      "peak memory, stage 1 (GiB)", dir);  // the summary lists every stage's peak
  std::filesystem::remove_all(dir);
}

// NVFP4 with stochastic rounding: every pass draws its bits with its own micro-batch's key, so a pipeline equals one
// rank; and so do the steps after precision annealing switches it to BF16 at step 3 (each stage rebuilds its own
// layers' Linears; measured: identical digits). Both ways a Linear keeps its quantized input until the backward
// under pipeline parallelism: with full recompute (P2: the forward runs again right before the backward, into a
// shared slot) and without it (P4 V2: up to eight passes in flight on rank 0, each with its own input slot,
// recipe::Linear::set_input_slots); and at P2 V2 under a layout of unequal chunks, whose slots differ in size and
// whose Linears keep only their own chunk's most passes in flight.
TEST(PipelineParallelCpuQuantized, Nvfp4AndItsAnnealToBf16EqualOneRank) {
  const std::string dir = test::temp_folder("pp_train_nvfp4");
  const std::string job =
      "--train-iters 4 --recipe bf16_with_nvfp4_mixed --num-layers-at-start-in-bf16 0 "
      "--num-layers-at-end-in-bf16 0 --anneal-start-fraction 0.5 --anneal-recipe bf16_mixed ";
  const auto a = pp_run(job, dir + "/one", kPpBase);
  ASSERT_EQ(a.size(), 4u);
  for (const std::string layout :
       {"--nproc-per-node 2 --pipeline-model-parallel-size 2 --recompute full",
        "--nproc-per-node 4 --pipeline-model-parallel-size 4 --num-virtual-stages-per-pipeline-rank 2",
        "--nproc-per-node 2 --pipeline-model-parallel-size 2 --pipeline-model-parallel-layout 'Etttt|ttt||tL'"}) {
    SCOPED_TRACE(layout);
    const auto b = pp_run(job + layout, dir + "/pp", kPpBase);
    ASSERT_EQ(b.size(), 4u);
    EXPECT_NEAR(b[0].loss, a[0].loss, 1e-6 * a[0].loss);
    EXPECT_NEAR(b[0].grad_norm, a[0].grad_norm, 1e-6 * a[0].grad_norm);
    for (size_t i = 1; i < 4; ++i) EXPECT_NEAR(b[i].loss, a[i].loss, 1e-5 * a[i].loss) << "step " << i + 1;
    std::filesystem::remove_all(dir + "/pp");
  }
  std::filesystem::remove_all(dir);
}

// FP8 delayed scaling: each stage keeps its own Linears' amax histories (reduced over its data ranks as without
// stages), and a save sums the stages' states into the whole model's list (Trainer::gather_pipeline_scaling): at
// step 2 every role's scale and history equal one rank's, and a checkpoint saved at P2 resumes at P2 and at one rank
// with the uninterrupted run's step-3 loss (that forward reads the restored weights and scales). Beyond step 2 the
// layouts are not compared: with every layer in FP8 the stages' gradients differ from one rank's by about 1e-8 already
// at step 1 (FP8 current scaling too: grad norm 5.418163073 against 5.418162985), and per-tensor scales taken from
// those gradients' amaxes carry it past 1e-5 in the loss by step 3. Without full recompute it is refused in one
// sentence (input slots would split a step's amax).
TEST(PipelineParallelCpuQuantized, Fp8DelayedScalingSavesEveryStagesHistories) {
  const std::string dir = test::temp_folder("pp_fp8_delayed");
  const std::string base = kModelParallelBase + "--num-layers 4 ";  // two layers a stage: FP8 is slow on the CPU
  const std::string job =
      "--train-iters 3 --recipe bf16_with_fp8_delayed_scaling_mixed --recompute full --save-interval 2 ";
  const std::string p2 = "--nproc-per-node 2 --pipeline-model-parallel-size 2 ";
  const auto whole = pp_run(job, dir + "/whole", base);
  const auto staged = pp_run(job + p2, dir + "/p2", base);
  ASSERT_EQ(whole.size(), 3u);
  ASSERT_EQ(staged.size(), 3u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_NEAR(staged[i].loss, whole[i].loss, 1e-6 * whole[i].loss) << "step " << i + 1;
    EXPECT_NEAR(staged[i].grad_norm, whole[i].grad_norm, 1e-6 * whole[i].grad_norm) << "step " << i + 1;
  }
  const auto scaling = [&](const std::string& run) {
    return nlohmann::json::parse(std::ifstream(dir + run + "/iter_0000002/trainer_state.json"))["fp8_delayed_scaling"];
  };
  EXPECT_GT(scaling("/whole").size(), 4u);
  EXPECT_EQ(scaling("/p2"), scaling("/whole"));
  for (const std::string& resumed_as : {p2, std::string()}) {
    const std::string out = dir + (resumed_as.empty() ? "/at_one" : "/at_p2");
    const test::CliRun r =
        test::run_nibble(base + job + resumed_as + "--ckpt-step 2 --load " + dir + "/p2 --save " + out);
    ASSERT_EQ(r.code, 0) << r.out;
    const auto resumed = read_metrics(out);
    ASSERT_EQ(resumed.size(), 1u);
    EXPECT_NEAR(resumed[0].loss, staged[2].loss, 1e-6 * staged[2].loss) << "resumed as [" << resumed_as << "]";
  }
  const test::CliRun refused = test::run_nibble(
      kPpBase + "--train-iters 1 --recipe bf16_with_fp8_delayed_scaling_mixed " + p2 + "--save " + dir + "/refused");
  EXPECT_NE(refused.code, 0);
  EXPECT_NE(refused.out.find("--recompute full"), std::string::npos) << refused.out;
  std::filesystem::remove_all(dir);
}

// Checkpoints hold whole tensors: saved at P4 after 2 steps, they resume at one rank and at P2 with the uninterrupted
// run's losses; saved at T2 x P2 (each stage's tensor-parallel ranks gather first), at T2 x P2 and at one rank.
TEST(PipelineParallelCpuResume, SavedAtP4ResumesAtOneRankAndAtP2) {
  const std::string dir = test::temp_folder("pp_resume");
  const auto whole = pp_run("--train-iters 4", dir + "/whole");
  ASSERT_EQ(whole.size(), 4u);
  const std::string p4 = "--nproc-per-node 4 --pipeline-model-parallel-size 4",
                    t2p2 = "--nproc-per-node 4 --pipeline-model-parallel-size 2 --tensor-model-parallel-size 2";
  const struct {
    std::string saved_as, resumed_as;
  } cases[] = {{p4, ""}, {p4, "--nproc-per-node 2 --pipeline-model-parallel-size 2"}, {t2p2, t2p2}, {t2p2, ""}};
  for (size_t k = 0; k < std::size(cases); ++k) {
    const std::string saved = dir + (cases[k].saved_as == p4 ? "/saved_p4" : "/saved_t2p2");
    const std::string out = dir + "/resumed_" + std::to_string(k);
    if (!std::filesystem::exists(saved)) {
      const test::CliRun s =
          test::run_nibble(kPpJob + "--train-iters 4 --exit-interval 2 " + cases[k].saved_as + " --save " + saved);
      ASSERT_EQ(s.code, 0) << s.out;
    }
    const std::string what = "saved as [" + cases[k].saved_as + "], resumed as [" + cases[k].resumed_as + "]";
    const test::CliRun r =
        test::run_nibble(kPpJob + "--train-iters 4 " + cases[k].resumed_as + " --load " + saved + " --save " + out);
    ASSERT_EQ(r.code, 0) << r.out;
    const auto resumed = read_metrics(out);
    ASSERT_EQ(resumed.size(), 2u) << what;
    for (size_t i = 0; i < 2; ++i)
      EXPECT_NEAR(resumed[i].loss, whole[i + 2].loss, 1e-5 * whole[i + 2].loss) << what << ", step " << i + 3;
  }
  std::filesystem::remove_all(dir);
}

// LoRA: each stage keeps its layers' frozen base and adapters (seeded as the whole model's, dropout keyed by each
// micro-batch), so P4 V2 writes the same PEFT adapter as one rank, byte for byte (measured: identical), with a BF16
// base and with an NVFP4 one (its held layers' frozen Linears quantized once, as one rank's). A frozen Linear keeps
// nothing of a micro-batch from its forward to its backward (no Wgrad), so a quantized base needs no full recompute.
TEST(PipelineParallelCpuLora, InterleavedWritesOneRanksAdapter) {
  for (const std::string base : {"--lora-base-precision bf16", "--lora-base-precision nvfp4 --recompute selective"}) {
    const std::string dir = test::temp_folder("pp_lora");
    const std::string job = "--train-iters 3 --peft lora --lora-rank 4 --lora-dropout 0.1 " + base + " ";
    const auto a = pp_run(job, dir + "/one", kPpBase);
    const auto b = pp_run(job +
                              "--nproc-per-node 4 --pipeline-model-parallel-size 4 "
                              "--num-virtual-stages-per-pipeline-rank 2",
                          dir + "/pp", kPpBase);
    expect_same_run(b, a, "LoRA at P4 V2, " + base);
    const std::string adapter = "/peft_adapter_iter_0000003/adapter_model.safetensors";
    const std::string one = test::file_bytes(dir + "/one" + adapter), pp = test::file_bytes(dir + "/pp" + adapter);
    EXPECT_FALSE(one.empty()) << base;
    EXPECT_TRUE(one == pp) << "the adapters differ, " << base;
    std::filesystem::remove_all(dir);
  }
}

// Beside tensor parallelism (sequence parallel), the stages add nothing to T2's numbers: T2 x P2 writes T2's adapter
// byte for byte, on an NVFP4 base (T2 itself differs from one rank after step 1 by the row-parallel sums' rounding,
// tp_lora_test.cpp).
TEST(PipelineParallelCpuLora, BesideTensorParallelismWritesItsAdapter) {
  const std::string dir = test::temp_folder("pp_tp_lora");
  const std::string job =
      "--train-iters 3 --peft lora --lora-rank 4 --lora-dropout 0.1 --lora-base-precision nvfp4 --recompute selective "
      "--tensor-model-parallel-size 2 --sequence-parallel ";
  const auto a = pp_run(job + "--nproc-per-node 2", dir + "/t2", kPpBase);
  const auto b = pp_run(job + "--nproc-per-node 4 --pipeline-model-parallel-size 2", dir + "/t2p2", kPpBase);
  ASSERT_EQ(a.size(), 3u);
  ASSERT_EQ(b.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(b[i].loss, a[i].loss) << "step " << i + 1;
  const std::string adapter = "/peft_adapter_iter_0000003/adapter_model.safetensors";
  const std::string t2 = test::file_bytes(dir + "/t2" + adapter);
  EXPECT_FALSE(t2.empty());
  EXPECT_TRUE(t2 == test::file_bytes(dir + "/t2p2" + adapter)) << "the adapters differ";
  std::filesystem::remove_all(dir);
}

// Megatron-FSDP over each stage's data ranks (P2 x D2): optim_grads and optim_grads_params equal one rank over five
// steps (each stage's store holds its own layers' groups, sharded over its two data ranks; every pass reduces its
// units' gradients), and a checkpoint saved at P2 x D2 under optim_grads_params resumes at one rank with the
// uninterrupted run's losses.
TEST(PipelineParallelCpuFsdp, StrategiesReproduceOneRankAndResumeAtOneRank) {
  const std::string dir = test::temp_folder("pp_fsdp");
  const auto ref = pp_run("--train-iters 5", dir + "/one");
  const std::string layout = "--nproc-per-node 4 --pipeline-model-parallel-size 2 --use-megatron-fsdp ";
  for (const std::string strategy : {"optim_grads", "optim_grads_params"}) {
    SCOPED_TRACE(strategy);
    const test::CliRun r = test::run_nibble(kPpJob + "--train-iters 5 " + layout +
                                            "--data-parallel-sharding-strategy " + strategy + " --save " + dir + "/pp");
    ASSERT_EQ(r.code, 0) << r.out;
    expect_same_run(read_metrics(dir + "/pp"), ref, strategy);
    std::filesystem::remove_all(dir + "/pp");
  }
  const test::CliRun s =
      test::run_nibble(kPpJob + "--train-iters 5 --exit-interval 3 " + layout +
                       "--data-parallel-sharding-strategy optim_grads_params --save " + dir + "/saved");
  ASSERT_EQ(s.code, 0) << s.out;
  const test::CliRun r =
      test::run_nibble(kPpJob + "--train-iters 5 --load " + dir + "/saved --save " + dir + "/resumed");
  ASSERT_EQ(r.code, 0) << r.out;
  const auto resumed = read_metrics(dir + "/resumed");
  ASSERT_EQ(resumed.size(), 2u);
  for (size_t i = 0; i < 2; ++i)
    EXPECT_NEAR(resumed[i].loss, ref[i + 3].loss, 1e-5 * ref[i + 3].loss) << "step " << i + 4;
  std::filesystem::remove_all(dir);
}

// Packed SFT rows (samples of different lengths, answer-only labels, each sample its own attention segment): every
// stage stages the step's rows with their segments from the data, as one rank does, so no shapes travel between
// the stages (rows are --seq-length long), and P2 and P4 V2 equal one rank over five steps and a validation.
TEST(PipelineParallelCpuSft, PackedRowsReproduceOneRank) {
  const std::string dir = test::temp_folder("pp_train_sft");
  const std::string data = test::write_reverse_sft_data(dir, 3, 4, 12);
  expect_layouts_reproduce_one_rank(
      "--sft --data-path " + data + " --train-iters 5 --eval-interval 5 --eval-iters 1 ",
      {"--nproc-per-node 2 --pipeline-model-parallel-size 2",
       "--nproc-per-node 4 --pipeline-model-parallel-size 4 --num-virtual-stages-per-pipeline-rank 2"},
      "packed", dir);
  std::filesystem::remove_all(dir);
}

TEST(PipelineParallelCpu, AKilledStageStopsTheJob) {
  expect_a_dead_rank_stops_rank0(kPpJob + "--pipeline-model-parallel-size 2 ", "pp_dead");
}

}  // namespace
}  // namespace nb

namespace nb {
namespace {

// The estimate before step 1 is the largest stage's (here the last: 6 of 8 layers and the head), but the end-of-run
// check compares rank 0's allocations with rank 0's own stage (2 layers and the embedding): within 10%, where the
// largest stage's estimate is more than twice rank 0's peak.
TEST(PipelineParallelCpu, TheEndOfRunCheckReadsThisRanksStage) {
  const std::string dir = test::temp_folder("pp_memory_check");
  const test::CliRun r = test::run_nibble(kPpJob +
                                          "--train-iters 2 --nproc-per-node 2 --pipeline-model-parallel-size 2 "
                                          "--decoder-first-pipeline-num-layers 2 --save " +
                                          dir);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("for pipeline rank 1's stage, the largest"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("estimate of pipeline rank 0's stage (this rank's)"), std::string::npos) << r.out;
  double largest = 0, estimate = 0, peak = 0;
  const size_t total = r.out.find("  total ");
  ASSERT_NE(total, std::string::npos);
  ASSERT_EQ(std::sscanf(r.out.c_str() + total, " total %lf", &largest), 1);
  const size_t check = r.out.find("memory check: estimate ");
  ASSERT_NE(check, std::string::npos) << r.out;
  ASSERT_EQ(std::sscanf(r.out.c_str() + check,
                        "memory check: estimate %lf GiB (nibble %*f + libraries %*f), "
                        "allocator peak %lf",
                        &estimate, &peak),
            2);
  EXPECT_NEAR(estimate, peak, 0.1 * peak);
  EXPECT_GT(largest, 2 * peak);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace nb
