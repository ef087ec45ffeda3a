// MoR's block rule beside context parallelism (CPU, two ranks): with 128-token chunks a rank's 128-row blocks are
// whole blocks of the whole sequences, and each quantization takes the group's amaxes (GAM's shared mantissa, the
// ladder's S_enc), so at step 1 every Linear's blocks per format and statistics, summed over the two ranks, are one
// rank's, and so is the step: the E4M3 block rule, the NVFP4 ladder per block (without SR, whose draws follow each
// rank's own rows) with 16x16 tiles and with 1x16 blocks. What cannot keep that is refused in one sentence.
//
// Measured at step 1: the loss identical in all three, the gradient norm identical or 1.1e-7 off; the inputs' and
// weights' counts and errors exact; the gradients' errors within 8.2e-5 (the ring's backward sums in FP32), which
// moved one of the ladder's gradient blocks, at the E4M3 threshold, from E4M3 to BF16. So the gradients' counts are
// held to one block per format and Linear, their errors to 1e-3.
#include <gtest/gtest.h>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>
#include "distributed/ddp_util.h"

namespace nb {
namespace {

const std::string kCpBlockJob =
    " train --model tiny --device cpu --micro-batch-size 1 --global-batch-size 4 --lr 3e-3 "
    "--lr-warmup-iters 1 --log-interval 1 --train-iters 1 --num-layers-at-start-in-bf16 0 "
    "--num-layers-at-end-in-bf16 0 --mor-granularity block --mor-threshold 0.0226 ";

std::map<std::string, nlohmann::json> records_by_linear(const std::string& save) {
  std::map<std::string, nlohmann::json> out;
  for (const auto& r : test::metrics_records(save, "mor_linear")) out[r["mor_linear"].get<std::string>()] = r;
  return out;
}

void expect_blocks_as_one_rank(const std::string& dir, const std::string& recipe) {
  SCOPED_TRACE(recipe);
  const std::string job = kCpBlockJob + "--seq-length 512 --recipe " + recipe + " ";
  test::CliRun r = test::run_nibble(job + "--save " + dir + "/one");
  ASSERT_EQ(r.code, 0) << r.out;
  r = test::run_nibble(job + "--nproc-per-node 2 --context-parallel-size 2 --save " + dir + "/cp");
  ASSERT_EQ(r.code, 0) << r.out;
  const auto one = records_by_linear(dir + "/one"), cp = records_by_linear(dir + "/cp");
  ASSERT_EQ(one.size(), 8u);
  ASSERT_EQ(cp.size(), one.size());
  std::map<std::string, int64_t> chosen;
  for (const auto& [name, rec] : one) {
    for (const char* role : {"input", "weight", "grad"}) {
      const nlohmann::json &want = rec[role], &got = cp.at(name)[role];
      const bool grad = std::string(role) == "grad";
      for (const char* f : {"e4m3_blocks", "bf16_blocks", "nvfp4_blocks"}) {
        if (!want.contains(f)) continue;
        const int64_t w = want[f], g = got[f];
        chosen[f] += w;
        if (grad)
          EXPECT_LE(std::abs(g - w), 1) << name << " " << role << " " << f;
        else
          EXPECT_EQ(g, w) << name << " " << role << " " << f;
      }
      for (const char* e : {"error", "nvfp4_error"}) {
        if (!want.contains(e) || want[e].is_null()) continue;
        const double w = want[e], g = got[e];
        if (grad)
          EXPECT_NEAR(g, w, 1e-3 * w) << name << " " << role << " " << e;
        else
          EXPECT_EQ(g, w) << name << " " << role << " " << e;
      }
    }
  }
  EXPECT_GT(chosen["e4m3_blocks"], 0);
  EXPECT_GT(chosen["bf16_blocks"], 0);
  if (recipe.find("nvfp4") != std::string::npos) { EXPECT_GT(chosen["nvfp4_blocks"], 0); }
  const auto a = read_metrics(dir + "/cp"), b = read_metrics(dir + "/one");
  ASSERT_EQ(a.size(), 1u);
  EXPECT_NEAR(a[0].loss, b[0].loss, 1e-6 * b[0].loss);
  EXPECT_NEAR(a[0].grad_norm, b[0].grad_norm, 1e-5 * b[0].grad_norm);
  std::filesystem::remove_all(dir + "/one");
  std::filesystem::remove_all(dir + "/cp");
}

TEST(MorBlockContextParallelCpu, RanksDecideTheBlocksAsOneRank) {
  const std::string dir = test::temp_folder("mor_cp_blocks");
  expect_blocks_as_one_rank(dir, "bf16_with_mor_fp8_mixed");
  expect_blocks_as_one_rank(dir, "bf16_with_mor_nvfp4_mixed --fp4-disable-sr --mor-nvfp4-threshold 0.2");
  expect_blocks_as_one_rank(dir,
                            "bf16_with_mor_nvfp4_mixed --fp4-disable-sr --mor-nvfp4-threshold 0.2 --mor-nvfp4-rows");
  std::filesystem::remove_all(dir);
}

TEST(MorBlockContextParallelCpu, SplitsThatCutBlocksOrDrawSrAreRefused) {
  const std::string cp = "--nproc-per-node 2 --context-parallel-size 2 ";
  for (const auto& [flags, says] : std::vector<std::pair<std::string, std::string>>{
           {"--recipe bf16_with_mor_fp8_mixed --seq-length 256 ", "not whole 128-token blocks"},
           {"--recipe bf16_with_mor_nvfp4_mixed --seq-length 512 ", "--fp4-disable-sr"}}) {
    const test::CliRun r = test::run_nibble(kCpBlockJob + cp + flags);
    EXPECT_NE(r.code, 0) << flags;
    EXPECT_NE(r.out.find(says), std::string::npos) << r.out;
  }
}

}  // namespace
}  // namespace nb
