// LoRA under tensor parallelism through the CLI (Gloo, CPU): the adapters follow their bases (Megatron's LoRA):
// A of qkv and fc1 and B of proj and fc2 whole on every rank, the other halves split with the base's rows or
// columns; a row-parallel adapter's output joins the base's partial sum before its reduction, a column-parallel
// one's input gradient the base's before its sum, and the whole halves' gradients are summed over the group once
// per step (counted once in the gradient norm).
//
// Tolerances, against one rank of the same global batch: in a BF16 base only the FP32 summation order differs, so
// step 1's loss and gradient norm agree to 1e-6 relative and five steps' losses to 1e-5; the PEFT adapters within
// 1e-2 x steps x lr (AdamW's first steps move an element whose gradient cancels to nearly zero by an amount that
// the order of that cancellation decides), as fsdp_lora_test.cpp. An NVFP4 base (every layer quantized, SR on the
// gradients) equals one rank at step 1 within 1e-6 and its step-2 loss within 1e-5; later the row-parallel sums'
// rounding moves a few activations across an FP4 threshold (2.5e-4 off at step 3, measured), as under tensor
// parallelism without LoRA (docs/DISTRIBUTED.md). Checkpoints are whole tensors: a T2 save resumes at one rank
// with one rank's losses, and its adapter written by a one-rank load is the T2 run's byte for byte.
#include <gtest/gtest.h>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include "distributed/ddp_util.h"
#include "io/hf_llama.h"
#include "io/peft_adapter.h"

namespace nb {
namespace {

const std::string kTpLoraJob = kModelParallelBase + "--peft lora --lora-rank 8 --lora-alpha 16 --eval-interval 0 ";
const std::string kT2 = " --nproc-per-node 2 --tensor-model-parallel-size 2";

// One LoRA run; its save folder.
std::string tp_lora_run(const std::string& dir, const std::string& name, int iters, const std::string& extra,
                        std::string* out = nullptr) {
  const std::string save = dir + "/" + name;
  const test::CliRun r =
      test::run_nibble(kTpLoraJob + "--train-iters " + std::to_string(iters) + " --save " + save + " " + extra);
  EXPECT_EQ(r.code, 0) << r.out;
  if (out) *out = r.out;
  return save;
}

std::string peft_folder(const std::string& save, int iteration) {
  char folder[48];
  std::snprintf(folder, sizeof(folder), "/peft_adapter_iter_%07d", iteration);
  return save + folder;
}

// The largest difference between two runs' PEFT adapters of the tiny model.
double tp_adapter_difference(const std::string& a_save, const std::string& b_save, int iteration) {
  LlamaConfig tiny;
  EXPECT_TRUE(llama_preset("tiny", &tiny).is_ok());
  LoraAdapter a, b;
  EXPECT_TRUE(read_peft_adapter(peft_folder(a_save, iteration), tiny, &a).is_ok()) << a_save;
  EXPECT_TRUE(read_peft_adapter(peft_folder(b_save, iteration), tiny, &b).is_ok()) << b_save;
  EXPECT_EQ(a.linears.size(), b.linears.size());
  double worst = 0;
  for (size_t i = 0; i < a.linears.size() && i < b.linears.size(); ++i) {
    EXPECT_EQ(a.linears[i].a.size(), b.linears[i].a.size());
    EXPECT_EQ(a.linears[i].b.size(), b.linears[i].b.size());
    for (size_t k = 0; k < a.linears[i].a.size() && k < b.linears[i].a.size(); ++k)
      worst = std::max(worst, double(std::fabs(a.linears[i].a[k] - b.linears[i].a[k])));
    for (size_t k = 0; k < a.linears[i].b.size() && k < b.linears[i].b.size(); ++k)
      worst = std::max(worst, double(std::fabs(a.linears[i].b[k] - b.linears[i].b[k])));
  }
  return worst;
}

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << path;
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// A BF16 base with LoRA dropout (a row-parallel adapter draws one GPU's mask on its columns): T2, T2 with sequence
// parallelism, the side stream and selective recompute, and T2 x D2 with sequence parallelism and Megatron-FSDP
// sharding the frozen base.
TEST(TensorParallelLoraCpu, Bf16BaseReproducesOneRank) {
  const std::string dir = test::temp_folder("tp_lora_bf16");
  const int kIters = 5;
  const std::string drop = "--lora-dropout 0.1";
  const std::string one = tp_lora_run(dir, "one", kIters, drop);
  const auto ref = read_metrics(one);
  for (const std::string& flags :
       {kT2, kT2 + " --sequence-parallel --tp-comm-overlap --recompute selective",
        std::string(" --nproc-per-node 4 --tensor-model-parallel-size 2 --sequence-parallel --use-megatron-fsdp "
                    "--data-parallel-sharding-strategy optim_grads_params")}) {
    std::string log;
    const std::string tp = tp_lora_run(dir, "tp", kIters, drop + flags, &log);
    EXPECT_NE(log.find("on each tensor-parallel rank (A of qkv and fc1, B of proj and fc2 whole"), std::string::npos)
        << log;
    expect_same_run(read_metrics(tp), ref, flags);
    EXPECT_LE(tp_adapter_difference(one, tp, kIters), 1e-2 * kIters * kLr) << flags;
    std::filesystem::remove_all(tp);
  }
  std::filesystem::remove_all(dir);
}

// An NVFP4 base, every layer quantized with the recipe's SR on the gradients: the frozen weights scale with the
// whole weight's amax (the group's MAX, also when Megatron-FSDP shards the base), the column-parallel gradient
// shards draw SR at the whole layer's columns.
TEST(TensorParallelLoraCpu, Nvfp4BaseEqualsOneRankAtStepOne) {
  const std::string dir = test::temp_folder("tp_lora_nvfp4");
  const std::string base = "--lora-base-precision nvfp4 --num-layers-at-start-in-bf16 0 --num-layers-at-end-in-bf16 0";
  const std::string one = tp_lora_run(dir, "one", 2, base);
  for (const std::string& flags : {kT2 + " --sequence-parallel",
                                   std::string(" --nproc-per-node 4 --tensor-model-parallel-size 2 --use-megatron-fsdp "
                                               "--data-parallel-sharding-strategy optim_grads_params")}) {
    std::string log;
    const std::string tp = tp_lora_run(dir, "tp", 2, base + flags, &log);
    if (flags.find("--sequence-parallel") != std::string::npos) {
      EXPECT_NE(log.find("a LoRA run's frozen base gathers BF16"), std::string::npos) << log;
    }
    expect_same_run(read_metrics(tp), read_metrics(one), flags);
    std::filesystem::remove_all(tp);
  }
  std::filesystem::remove_all(dir);
}

// A base from --load-hf: every rank reads each whole tensor and keeps its part.
TEST(TensorParallelLoraCpu, HfBaseLoadsEachRanksPart) {
  const std::string dir = test::temp_folder("tp_lora_hf");
  LlamaConfig cfg;
  ASSERT_TRUE(llama_preset("tiny", &cfg).is_ok());
  auto source = [](const HfTensor& t, float* dst) {
    const bool norm = t.shape.size() == 1;
    for (int64_t i = 0; i < t.numel; ++i)
      dst[i] = norm ? 1.0f + 0.1f * float(std::sin(0.7 * double(i))) : 0.05f * float(std::sin(0.37 * double(i) + 1.3));
    return Status::ok();
  };
  HfExportOptions opt;
  opt.dtype = "fp32";
  ASSERT_TRUE(write_hf_folder(dir + "/hf", cfg, hf_expected_tensors(cfg), source, opt).is_ok());
  const std::string from = "--load-hf " + dir + "/hf";
  const auto ref = read_metrics(tp_lora_run(dir, "one", 1, from));
  expect_same_run(read_metrics(tp_lora_run(dir, "tp", 1, from + kT2)), ref, "--load-hf at T2");
  std::filesystem::remove_all(dir);
}

// Saved at T2 with sequence parallelism after 2 of 4 steps, resumed at one rank: one rank's four losses. A one-rank
// load of that checkpoint writes the adapter the T2 run wrote from its gathered parts, byte for byte.
TEST(TensorParallelLoraCpu, CheckpointSavedAtT2ResumesAtOneRank) {
  const std::string dir = test::temp_folder("tp_lora_resume");
  const auto ref = read_metrics(tp_lora_run(dir, "one", 4, ""));
  const std::string tp = tp_lora_run(dir, "tp", 4, "--exit-interval 2 --save-interval 2 --sequence-parallel" + kT2);
  std::filesystem::copy(tp, dir + "/reload", std::filesystem::copy_options::recursive);
  std::filesystem::remove_all(peft_folder(dir + "/reload", 2));
  std::string log;
  tp_lora_run(dir, "reload", 2, "--load " + dir + "/reload", &log);
  EXPECT_NE(log.find("resuming after iteration 2"), std::string::npos) << log;
  EXPECT_EQ(file_bytes(peft_folder(dir + "/reload", 2) + "/adapter_model.safetensors"),
            file_bytes(peft_folder(tp, 2) + "/adapter_model.safetensors"));
  tp_lora_run(dir, "tp", 4, "--load " + dir + "/tp", &log);
  EXPECT_NE(log.find("resuming after iteration 2"), std::string::npos) << log;
  expect_same_run(read_metrics(tp), ref, "saved at T2, resumed at one rank");
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace nb
