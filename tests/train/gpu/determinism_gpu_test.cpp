// CUDA: --deterministic-mode repeats a run bit for bit. The same `nibble train` command runs twice, as
// two processes, in every recipe (recompute and packed SFT rows in some cases, two ranks when the machine
// has two GPUs); metrics.jsonl must hold the same values (timing and memory fields left out) and the final
// checkpoint the same bytes. Both runs write to the same --save path (the first one's folder is moved
// aside), so config.toml and trainer_state.json, which record it, can be compared whole too.
// Rows are 256 tokens (the tiny model's context): attention's backward then sums dQ over several key tiles,
// where the default mode's atomics make runs drift (the default mode is run too, and whether it differed is
// printed, not asserted).
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>
#include <vector>
#include <nlohmann/json.hpp>
#include "common/gpu.h"
#include "common/nibble_binary.h"
#include "train/resume_util.h"
#include "train/sft_reverse_data.h"

namespace nb {
namespace {

namespace fs = std::filesystem;

// The tiny model, every layer in the recipe, 3 steps of 4 micro-batches, a checkpoint at the end.
const std::string kJob =
    " train --model tiny --device cuda --seq-length 256 --micro-batch-size 2 --global-batch-size 8 --train-iters 3 "
    "--lr 3e-3 --lr-warmup-iters 1 --log-interval 1 --save-interval 3 --num-layers-at-start-in-bf16 0 "
    "--num-layers-at-end-in-bf16 0 ";

// Figures of a metrics.jsonl record that measure the machine, not the training: left out of the comparison.
bool timing_field(const std::string& key) {
  static const char* kTiming[] = {"tokens_per_s_per_gpu", "tflops_per_gpu", "mfu", "peak_mem_gib", "eta_s"};
  for (const char* k : kTiming)
    if (key == k) return true;
  return key.size() > 3 && key.compare(key.size() - 3, 3, "_ms") == 0;  // step_ms, data_wait_ms, ...
}

// metrics.jsonl with the timing fields removed, one canonical JSON text per record.
std::vector<std::string> training_records(const std::string& save) {
  std::ifstream in(save + "/metrics.jsonl");
  std::vector<std::string> out;
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) {
      out.push_back("unparsable: " + line);
      continue;
    }
    for (auto it = j.begin(); it != j.end();) it = timing_field(it.key()) ? j.erase(it) : std::next(it);
    out.push_back(j.dump());
  }
  return out;
}

// Every file of a run folder (relative path -> bytes) except metrics.jsonl, compared as records instead.
std::vector<std::pair<std::string, std::string>> run_files(const std::string& save) {
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& e : fs::recursive_directory_iterator(save)) {
    if (!e.is_regular_file()) continue;
    const std::string rel = fs::relative(e.path(), save).string();
    if (rel != "metrics.jsonl") out.emplace_back(rel, test::file_bytes(e.path().string()));
  }
  std::sort(out.begin(), out.end());
  return out;
}

// "" when the two run folders hold the same records and bytes, else the first difference.
std::string first_difference(const std::string& a, const std::string& b) {
  const auto ra = training_records(a), rb = training_records(b);
  if (ra.size() != rb.size())
    return "metrics.jsonl has " + std::to_string(ra.size()) + " vs " + std::to_string(rb.size()) + " records";
  for (size_t i = 0; i < ra.size(); ++i)
    if (ra[i] != rb[i]) return "metrics.jsonl record " + std::to_string(i + 1) + ":\n  " + ra[i] + "\n  " + rb[i];
  const auto fa = run_files(a), fb = run_files(b);
  if (fa.size() != fb.size()) return "the run folders hold different files";
  for (size_t i = 0; i < fa.size(); ++i) {
    if (fa[i].first != fb[i].first) return "file " + fa[i].first + " vs " + fb[i].first;
    if (fa[i].second != fb[i].second) return fa[i].first + " differs";
  }
  return "";
}

// Runs `nibble <kJob><flags>` twice into dir/<name>-1 and dir/<name>-2 (each through dir/<name> first)
// and returns the first difference ("" when none). Fails the test if a run fails or saves no checkpoint.
std::string run_twice(const std::string& dir, const std::string& name, const std::string& flags) {
  const std::string save = dir + "/" + name;
  for (int i = 1; i <= 2; ++i) {
    fs::remove_all(save);
    const test::CliRun r = test::run_nibble(kJob + "--save " + save + " " + flags);
    EXPECT_EQ(r.code, 0) << flags << "\n" << r.out;
    EXPECT_TRUE(fs::exists(save + "/iter_0000003/model.safetensors")) << r.out;
    EXPECT_GE(training_records(save).size(), 3u) << r.out;
    fs::remove_all(save + "-" + std::to_string(i));
    fs::rename(save, save + "-" + std::to_string(i));
  }
  return first_difference(save + "-1", save + "-2");
}

struct Case {
  const char* name;
  const char* flags;
  int ranks;
};

// Packed SFT rows: 400 samples of 10..59 prompt tokens, a separator and the reversed prompt as the answer
// (up to about 120 tokens each), so a 256-token row packs two to several segments of one or more key tiles.
std::string write_long_sft_data(const std::string& dir) { return test::write_reverse_sft_data(dir, 5, 10, 50); }

class DeterministicCuda : public ::testing::TestWithParam<Case> {};

TEST_P(DeterministicCuda, TwoRunsAreBitIdentical) {
  NB_REQUIRE_GPU();
  const Case& c = GetParam();
  if (test::visible_gpus() < c.ranks)
    GTEST_SKIP() << "skipped: needs " << c.ranks << " GPUs, found " << test::visible_gpus();
  const std::string dir = test::temp_folder(std::string("deterministic_gpu_") + c.name);
  std::string flags = c.flags;
  if (c.ranks > 1) flags += " --nproc-per-node " + std::to_string(c.ranks);
  if (flags.find("--sft") != std::string::npos) flags += " --data-path " + write_long_sft_data(dir);
  const std::string diff = run_twice(dir, "deterministic", flags + " --deterministic-mode");
  EXPECT_EQ(diff, "") << c.name << " in --deterministic-mode: " << diff;
  // For the record, not an assertion: whether the default mode differed on this machine.
  const std::string plain = run_twice(dir, "default", flags);
  std::cout << "[ info     ] " << c.name << ", default mode: "
            << (plain.empty() ? "identical this time" : "differs (" + plain.substr(0, plain.find('\n')) + ")")
            << std::endl;
  if (!HasFailure()) fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(
    Recipes, DeterministicCuda,
    ::testing::Values(
        Case{"bf16", "--recipe bf16_mixed", 1},
        Case{"fp8_current_selective", "--recipe bf16_with_fp8_current_scaling_mixed --recompute selective", 1},
        Case{"fp8_delayed_full", "--recipe bf16_with_fp8_delayed_scaling_mixed --recompute full", 1},
        Case{"fp8_subchannel", "--recipe bf16_with_fp8_subchannel_scaling_mixed", 1},
        Case{"mxfp8", "--recipe bf16_with_mxfp8_mixed", 1}, Case{"nvfp4", "--recipe bf16_with_nvfp4_mixed", 1},
        Case{"nvfp4_packed_sft", "--recipe bf16_with_nvfp4_mixed --sft --split 90,10,0 --eval-iters 1", 1},
        Case{"bf16_packed_sft_selective",
             "--recipe bf16_mixed --sft --split 90,10,0 --eval-iters 1 --recompute selective", 1},
        // Mixture of Representations at a threshold inside the tiny model's errors: operands of both formats, decided
        // from statistics that GPU atomics add (integers: any order gives the same sums).
        Case{"mor_fp8", "--recipe bf16_with_mor_fp8_mixed --mor-threshold 0.0226", 1},
        // The NVFP4 ladder with all three rungs (the default NVFP4 threshold sends some operands to E4M3; 0.0226 some
        // of those on to BF16), SR on NVFP4 gradients.
        Case{"mor_nvfp4", "--recipe bf16_with_mor_nvfp4_mixed --mor-threshold 0.0226", 1},
        // The block rule: each block decided inside its quantization on the GPU (GAM's amax pass, integer sums).
        Case{"mor_fp8_block", "--recipe bf16_with_mor_fp8_mixed --mor-granularity block --mor-threshold 0.0226", 1},
        // The NVFP4 ladder per block: all three rungs (0.25 between the tiny model's NVFP4 errors), SR on gradients.
        Case{"mor_nvfp4_block",
             "--recipe bf16_with_mor_nvfp4_mixed --mor-granularity block --mor-threshold 0.0226 "
             "--mor-nvfp4-threshold 0.25",
             1},
        // With 1x16 NVFP4 blocks on X and dY: a row and a column copy each (0.2 between their NVFP4 errors).
        Case{"mor_nvfp4_block_rows",
             "--recipe bf16_with_mor_nvfp4_mixed --mor-granularity block --mor-nvfp4-rows --mor-threshold 0.0226 "
             "--mor-nvfp4-threshold 0.2",
             1},
        Case{"bf16_two_ranks", "--recipe bf16_mixed", 2},
        Case{"mor_fp8_two_ranks", "--recipe bf16_with_mor_fp8_mixed --mor-threshold 0.0226", 2},
        Case{"fp8_delayed_two_ranks_distopt_overlap",
             "--recipe bf16_with_fp8_delayed_scaling_mixed --use-distributed-optimizer "
             "--overlap-grad-reduce --overlap-param-gather",
             2},
        Case{"nvfp4_two_ranks_fsdp_training_format_gathers",
             "--recipe bf16_with_nvfp4_mixed --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params",
             2}),
    [](const ::testing::TestParamInfo<Case>& i) { return std::string(i.param.name); });

}  // namespace
}  // namespace nb
