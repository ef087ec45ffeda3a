// `nibble train --dry-run` as a user runs it on a machine without a GPU: the 8B on one 80 GiB GPU does not
// fit and is told to offload; with offload it fits; the 70B LoRA fits two 141 GiB GPUs under FSDP; and over a
// grid of jobs every change a refusal suggests, applied, fits (exit 0), so no advice is untested.
#include <gtest/gtest.h>
#include <algorithm>
#include <regex>
#include <sstream>
#include <string>
#include <vector>
#include "common/nibble_binary.h"

using nb::test::run_nibble;

namespace {

// The "would fit:" lines' flags.
std::vector<std::string> suggestions(const std::string& out) {
  std::vector<std::string> flags;
  const std::regex line("would fit: (.*?)  \\(");
  for (auto it = std::sregex_iterator(out.begin(), out.end(), line); it != std::sregex_iterator(); ++it)
    flags.push_back((*it)[1]);
  return flags;
}

// `base` with the flags of `change` replacing the same flags there (a flag's value is the next word when that
// word is not a flag), then the rest of `change` appended: what a user does with a suggestion.
std::string apply_flags(const std::string& base, const std::string& change) {
  auto words = [](const std::string& s) {
    std::vector<std::string> w;
    std::istringstream in(s);
    for (std::string x; in >> x;) w.push_back(x);
    return w;
  };
  const std::vector<std::string> b = words(base), c = words(change);
  std::string out;
  for (size_t i = 0; i < b.size(); ++i) {
    const bool replaced = b[i].rfind("--", 0) == 0 && std::find(c.begin(), c.end(), b[i]) != c.end();
    if (replaced) {
      if (i + 1 < b.size() && b[i + 1].rfind("--", 0) != 0) ++i;
      continue;
    }
    out += b[i] + " ";
  }
  return out + change;
}

const char* kEightB =
    "train --dry-run --model llama3.1-8b --seq-length 4096 --global-batch-size 64 --micro-batch-size 2 "
    "--recompute selective --gpu-memory 80 --host-memory 512 --train-iters 10";

TEST(DryRun, EightBOnOneH100NeedsOffloadAndFitsWithIt) {
  const auto r = run_nibble(kEightB);
  EXPECT_EQ(r.code, 3) << r.out;
  EXPECT_NE(r.out.find("does NOT fit"), std::string::npos) << r.out;
  const auto s = suggestions(r.out);
  ASSERT_FALSE(s.empty()) << r.out;
  EXPECT_NE(s[0].find("--optimizer-cpu-offload"), std::string::npos) << r.out;
  const auto with = run_nibble(std::string(kEightB) + " --optimizer-cpu-offload");
  EXPECT_EQ(with.code, 0) << with.out;
  EXPECT_NE(with.out.find("this job fits"), std::string::npos) << with.out;
  EXPECT_NE(with.out.find("activations (arena)"), std::string::npos) << "the table names each part\n" << with.out;
}

TEST(DryRun, SeventyBLoraFitsTwoH200sWithFsdp) {
  const auto r = run_nibble(
      "finetune --dry-run --model llama3.1-70b --peft lora --seq-length 4096 --global-batch-size 32 "
      "--micro-batch-size 1 --recompute full --lora-base-precision nvfp4 --nproc-per-node 2 --use-megatron-fsdp "
      "--data-parallel-sharding-strategy optim_grads_params --gpu-memory 141 --host-memory 512 "
      "--data-path /nonexistent/sft_data");  // a dry run reads no data
  EXPECT_EQ(r.code, 0) << r.out;
}

TEST(DryRun, NeedsAGpuSizeWithoutAGpu) {
  const auto r = run_nibble("train --dry-run --model tiny --device cpu");
  // With a GPU here the local one is used; without, one sentence asks for --gpu-memory.
  if (r.code == 2) {
    EXPECT_NE(r.out.find("--gpu-memory"), std::string::npos) << r.out;
  } else {
    EXPECT_EQ(r.code, 0) << r.out;
  }
  const auto bad = run_nibble("train --model tiny --gpu-memory 80 --train-iters 1");
  EXPECT_EQ(bad.code, 2) << bad.out;
  EXPECT_NE(bad.out.find("add --dry-run"), std::string::npos) << bad.out;
}

TEST(DryRun, EverySuggestionFitsWhenApplied) {
  const std::vector<std::string> jobs = {
      "--model llama3.1-8b --seq-length 4096 --micro-batch-size 2 --gpu-memory 80",
      "--model llama3.1-8b --seq-length 65536 --micro-batch-size 1 --recompute full --optimizer-cpu-offload "
      "--gpu-memory 80",
      "--model llama3.1-8b --seq-length 8192 --micro-batch-size 4 --recipe bf16_with_fp8_current_scaling_mixed "
      "--gpu-memory 141",
      "--model llama3.2-3b --seq-length 16384 --micro-batch-size 4 --gpu-memory 80",
      "--model llama3.2-1b --seq-length 32768 --micro-batch-size 8 --recipe bf16_with_nvfp4_mixed --gpu-memory 80",
      "--model llama3.1-8b --seq-length 4096 --micro-batch-size 1 --nproc-per-node 2 --gpu-memory 80",
      // LoRA: tensor parallelism is offered too (adapters split as Megatron's), with a sharded base under FSDP
      "--model llama3.1-70b --peft lora --seq-length 8192 --micro-batch-size 1 --recompute selective "
      "--nproc-per-node 4 --gpu-memory 80",
  };
  int checked = 0, lora_tensor_parallel = 0;
  for (const std::string& job : jobs) {
    const std::string base = "train --dry-run --global-batch-size 64 --host-memory 512 --train-iters 10 " + job;
    const auto r = run_nibble(base);
    ASSERT_EQ(r.code, 3) << "each job of the grid should not fit as given\n" << r.out;
    for (const std::string& flags : suggestions(r.out)) {
      const auto applied = run_nibble(apply_flags(base, flags));
      EXPECT_EQ(applied.code, 0) << "suggested: " << flags << "\n" << applied.out;
      ++checked;
      lora_tensor_parallel += job.find("--peft lora") != std::string::npos &&
                              flags.find("--tensor-model-parallel-size") != std::string::npos;
    }
  }
  EXPECT_GE(checked, 8) << "the grid should exercise several suggestions";
  EXPECT_GE(lora_tensor_parallel, 1) << "a LoRA job should be offered tensor parallelism";
}

}  // namespace

namespace {

// The playbook's NVFP4 recipe keeps the last four layers in BF16: on the two-layer tiny model nothing is
// quantized, which the run says before step 1 and its summary says again.
TEST(RecipeAsRun, ARecipeThatQuantizesNothingSaysSo) {
  const auto r = run_nibble(
      "train --model tiny --device cpu --recipe bf16_with_nvfp4_mixed --train-iters 1 --global-batch-size 1 "
      "--micro-batch-size 1 --seq-length 64 --mock-data true --eval-interval 0");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("quantizes no Linear of this 2-layer model"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("bf16 (bf16_with_nvfp4_mixed keeps every layer"), std::string::npos) << r.out;
  const auto q = run_nibble(
      "train --model tiny --device cpu --recipe bf16_with_nvfp4_mixed --num-layers-at-end-in-bf16 0 --train-iters 1 "
      "--global-batch-size 1 --micro-batch-size 1 --seq-length 64 --mock-data true --eval-interval 0");
  ASSERT_EQ(q.code, 0) << q.out;
  EXPECT_EQ(q.out.find("quantizes no Linear"), std::string::npos) << q.out;
}

}  // namespace
