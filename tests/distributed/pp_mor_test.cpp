// Mixture of Representations under pipeline parallelism through the CLI (Gloo, CPU). Each stage decides its own
// Linears from the whole model's statistics, which the stages sum (train/trainer_pp_mor.cpp), so a pipeline must
// decide as one rank does (P2, P4 V2; P2 x D2 as D2 does): every record (iteration, Linear, the three roles' formats)
// identical, the errors that chose them equal, the log line's shares the whole model's, the losses one rank's
// (expect_same_run: step 1 to 1e-6, later steps 1e-5, the gradient norm's summation order over the stages being the
// only difference). A checkpoint holds the whole model's decisions and statistics: one rank's resumes at P2, P2's at
// one rank, each continuing one rank's run. At threshold 0.0226 about a third of the E4M3 rule's operands go BF16, so a
// stage deciding from its own statistics alone, or a resume that put one stage's decisions on another's Linears,
// changes the records. No recompute: each Linear keeps its quantized inputs per micro-batch in flight (input slots; the
// ladder's E4M3 rung's copy too).
#include <gtest/gtest.h>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>
#include "distributed/ddp_util.h"

namespace nb {
namespace {

const std::string kPpMorJob = kModelParallelBase + "--num-layers 8 ";
const std::string kMorFp8 = "--recipe bf16_with_mor_fp8_mixed --mor-threshold 0.0226 ";

struct MorRecord {
  int64_t iteration;
  std::string linear, formats;
  double grad_error;
};

std::vector<MorRecord> mor_records(const std::string& save) {
  std::vector<MorRecord> out;
  for (const nlohmann::json& j : test::metrics_records(save, "mor_linear")) {
    std::string formats;
    for (const char* r : {"input", "weight", "grad"}) formats += j[r]["format"].get<std::string>() + " ";
    out.push_back({j["iteration"].get<int64_t>(), j["mor_linear"].get<std::string>(), formats,
                   j["grad"]["error"].is_null() ? -1.0 : j["grad"]["error"].get<double>()});
  }
  return out;
}

// The E4M3 shares of each step's log record.
std::vector<double> fp8_shares(const std::string& save) {
  std::vector<double> out;
  for (const nlohmann::json& j : test::metrics_records(save, "mor_fp8_operands"))
    if (j.contains("lm_loss")) out.push_back(j["mor_fp8_operands"].get<double>());
  return out;
}

std::string pp_mor_run(const std::string& flags, const std::string& save) {
  const test::CliRun r = test::run_nibble(kPpMorJob + flags + " --save " + save);
  EXPECT_EQ(r.code, 0) << r.out;
  return r.out;
}

void expect_same_decisions(const std::string& got, const std::string& ref, const std::string& what) {
  const auto a = mor_records(got), b = mor_records(ref);
  ASSERT_EQ(a.size(), b.size()) << what;
  ASSERT_FALSE(b.empty()) << what;
  for (size_t k = 0; k < a.size(); ++k) {
    EXPECT_EQ(a[k].iteration, b[k].iteration) << what << ", record " << k;
    EXPECT_EQ(a[k].linear, b[k].linear) << what << ", record " << k;
    EXPECT_EQ(a[k].formats, b[k].formats) << what << ", " << b[k].linear << " at " << b[k].iteration;
    EXPECT_NEAR(a[k].grad_error, b[k].grad_error, 1e-5 * b[k].grad_error) << what << ", " << b[k].linear;
  }
  EXPECT_EQ(fp8_shares(got), fp8_shares(ref)) << what;
  expect_same_run(read_metrics(got), read_metrics(ref), what);
}

TEST(PipelineParallelCpuMor, StagesDecideAndResumeAsOneRank) {
  const std::string dir = test::temp_folder("pp_mor");
  const std::string job = kMorFp8 + "--train-iters 5 --save-interval 3 ";
  pp_mor_run(job, dir + "/one");
  const auto one = mor_records(dir + "/one");
  size_t bf16 = 0;
  for (const MorRecord& r : one) bf16 += r.formats.find("bf16") != std::string::npos;
  EXPECT_GT(bf16, one.size() / 4) << "the threshold should send many operands to BF16";
  for (const std::string& layout : {std::string("--nproc-per-node 2 --pipeline-model-parallel-size 2"),
                                    std::string("--nproc-per-node 4 --pipeline-model-parallel-size 4 "
                                                "--num-virtual-stages-per-pipeline-rank 2")}) {
    SCOPED_TRACE(layout);
    const std::string out = pp_mor_run(job + layout, dir + "/pp");
    EXPECT_NE(out.find("pipeline parallel: "), std::string::npos) << out;
    expect_same_decisions(dir + "/pp", dir + "/one", layout);
    if (layout.find("size 2") != std::string::npos) std::filesystem::rename(dir + "/pp", dir + "/p2");
    std::filesystem::remove_all(dir + "/pp");
  }
  // P2 x D2: each stage sums over its data ranks first. Against D2 without stages, since data parallelism reduces the
  // gradients in another order than one rank, which E4M3 carries past 1e-5 by step 2 (measured: 6e-5).
  pp_mor_run(job + "--nproc-per-node 2 --use-distributed-optimizer", dir + "/d2");
  pp_mor_run(job + "--nproc-per-node 4 --pipeline-model-parallel-size 2 --use-distributed-optimizer", dir + "/p2d2");
  expect_same_decisions(dir + "/p2d2", dir + "/d2", "P2 x D2 against D2");
  // Steps 4 and 5 resumed from step 3: one rank's checkpoint at P2, P2's at one rank.
  const std::string rest = kMorFp8 + "--train-iters 5 --ckpt-step 3 ";
  pp_mor_run(rest + "--nproc-per-node 2 --pipeline-model-parallel-size 2 --load " + dir + "/one", dir + "/one_at_p2");
  pp_mor_run(rest + "--load " + dir + "/p2", dir + "/p2_at_one");
  for (const std::string resumed : {"one_at_p2", "p2_at_one"}) {
    SCOPED_TRACE(resumed);
    const auto got = read_metrics(dir + "/" + resumed), whole = read_metrics(dir + "/one");
    ASSERT_EQ(got.size(), 2u);
    ASSERT_EQ(whole.size(), 5u);
    for (size_t i = 0; i < 2; ++i) EXPECT_NEAR(got[i].loss, whole[3 + i].loss, 1e-5 * whole[3 + i].loss);
    std::vector<MorRecord> after, ref;
    for (const MorRecord& r : mor_records(dir + "/" + resumed)) after.push_back(r);
    for (const MorRecord& r : one)
      if (r.iteration > 3) ref.push_back(r);
    ASSERT_EQ(after.size(), ref.size());
    for (size_t k = 0; k < ref.size(); ++k) EXPECT_EQ(after[k].formats, ref[k].formats) << ref[k].linear;
  }
  std::filesystem::remove_all(dir);
}

// The NVFP4 ladder: six statistics per Linear (E4M3's and NVFP4's), decided over the stages as one rank.
TEST(PipelineParallelCpuMor, TheNvfp4LadderDecidesAsOneRank) {
  const std::string dir = test::temp_folder("pp_mor_ladder");
  const std::string job = "--recipe bf16_with_mor_nvfp4_mixed --train-iters 4 ";
  pp_mor_run(job, dir + "/one");
  pp_mor_run(job + "--nproc-per-node 2 --pipeline-model-parallel-size 2", dir + "/pp");
  expect_same_decisions(dir + "/pp", dir + "/one", "P2");
  std::filesystem::remove_all(dir);
}

// --mor-decide-now lets each quantization decide itself, which no stage could share: refused in one sentence.
TEST(PipelineParallelCpuMor, DecidingEachQuantizationAloneIsRefused) {
  const test::CliRun r = test::run_nibble(kPpMorJob + kMorFp8 +
                                          "--mor-decide-now --train-iters 1 --nproc-per-node 2 "
                                          "--pipeline-model-parallel-size 2");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("run it without --pipeline-model-parallel-size"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace nb
