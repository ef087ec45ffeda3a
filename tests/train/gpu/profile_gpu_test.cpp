// CUDA: `nibble train --profile` on the proxy (llama3-8b-proxy, micro-batch 2 x 4096, 8 micro-batches, every
// layer in the recipe's format) in BF16, FP8 current scaling and NVFP4: the report is written (table, JSON,
// SVG), the phases' times add up to the measured step time within 3% (the unattributed row is at most 3% of
// the step), and every GEMM that carries a visible share of the step has a measured ceiling (the same call
// timed alone at the end of the run). How close each GEMM runs to that ceiling, and to `nibble bench gemm`'s
// figure for the same shape, is a speed figure, printed here for docs/PERFORMANCE.md and not asserted (speed
// targets belong to benchmarks, not to timed tests). Runs the binary (NIBBLE_BIN, or next to this test).
#include <gtest/gtest.h>
#include <unistd.h>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include "common/gpu.h"
#include "common/nibble_binary.h"

namespace {

struct Case {
  const char* recipe;
  const char* bench_format;  // nibble bench gemm --format
  const char* fprop_prefix;  // how the report names the recipe's Fprop GEMM
};

// "M x N x K" -> TFLOP/s from `bench gemm --markdown` rows "| name: M x N x K | T |".
std::map<std::string, double> bench_figures(const std::string& out) {
  std::map<std::string, double> f;
  size_t at = 0;
  while ((at = out.find('\n', at)) != std::string::npos) {
    const size_t end = out.find('\n', ++at);
    const std::string line = out.substr(at, end == std::string::npos ? std::string::npos : end - at);
    const size_t colon = line.rfind(": ");
    long long m = 0, n = 0, k = 0;
    double t = 0;
    if (line.rfind("| ", 0) == 0 && colon != std::string::npos &&
        std::sscanf(line.c_str() + colon + 2, "%lld x %lld x %lld | %lf", &m, &n, &k, &t) == 4)
      f[std::to_string(m) + "x" + std::to_string(n) + "x" + std::to_string(k)] = t;
  }
  return f;
}

class ProfileRoofline : public ::testing::TestWithParam<Case> {};

TEST_P(ProfileRoofline, PhasesSumToTheStepAndEveryGemmHasACeiling) {
  NB_REQUIRE_GPU();
  const Case c = GetParam();
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("nibble_roofline_" + std::to_string(getpid()) + "_" + c.recipe);
  const auto run = nb::test::run_nibble(
      std::string("train --model llama3-8b-proxy --recipe ") + c.recipe +
      " --num-layers-at-start-in-bf16 0 --num-layers-at-end-in-bf16 0 --micro-batch-size 2 --global-batch-size 16"
      " --seq-length 4096 --train-iters 4 --lr-warmup-iters 1 --log-interval 1 --eval-iters 1 --profile"
      " --profile-dir '" +
      dir.string() + "'");
  ASSERT_EQ(run.code, 0) << run.out;
  const size_t table = run.out.find("roofline of the step");
  ASSERT_NE(table, std::string::npos) << run.out;
  std::printf("%s\n", run.out.substr(table).c_str());
  std::ifstream jf(dir / "roofline.json");
  ASSERT_TRUE(jf.good());
  const auto j = nlohmann::json::parse(jf);
  ASSERT_TRUE(fs::is_regular_file(dir / "roofline.svg"));
  const double step = j["step_ms"].get<double>(), phases = j["phases_ms"].get<double>();
  EXPECT_LE(std::fabs(step - phases), 0.03 * step) << "phases " << phases << " ms of a " << step << " ms step";

  const auto bench = nb::test::run_nibble(std::string("bench gemm --markdown --format ") + c.bench_format);
  ASSERT_EQ(bench.code, 0) << bench.out;
  const auto figures = bench_figures(bench.out);
  ASSERT_FALSE(figures.empty()) << bench.out;
  int matched = 0;
  for (const auto& g : j["gemms"]) {
    const std::string name = g["name"].get<std::string>();
    const double tflops = g["tflops"].get<double>(), ceiling = g["ceiling_tflops"].get<double>();
    if (g["ms"].get<double>() >= 0.01 * step) {  // the GEMMs that weigh: against the same call timed alone
      ASSERT_GT(ceiling, 0) << name;
      std::printf("[ figure   ] %s in %s: %.3f of its ceiling\n", name.c_str(), g["parent"].get<std::string>().c_str(),
                  tflops / ceiling);
    }
    // the Fprop GEMMs (C written, not accumulated) against `bench gemm`'s figure for the shape
    const std::string prefix = std::string("gemm ") + c.fprop_prefix + " ";
    if (name.rfind(prefix, 0) != 0 || name.find("+=") != std::string::npos) continue;
    const std::string shape = name.substr(prefix.size(), name.find(' ', prefix.size()) - prefix.size());
    const auto it = figures.find(shape);
    if (it == figures.end()) continue;
    ++matched;
    std::printf("[ figure   ] %s: %.1f TFLOP/s in the step, %.1f in bench gemm (%.3f)\n", name.c_str(), tflops,
                it->second, tflops / it->second);
  }
  EXPECT_GE(matched, 2) << "no Fprop GEMM of the run matched a `bench gemm` shape\n" << bench.out;
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Proxy, ProfileRoofline,
                         ::testing::Values(Case{"bf16_mixed", "bf16", "bf16 NT"},
                                           Case{"bf16_with_fp8_current_scaling_mixed", "fp8", "fp8_e4m3 x fp8_e4m3"},
                                           Case{"bf16_with_nvfp4_mixed", "nvfp4", "nvfp4 x nvfp4"}),
                         [](const auto& info) { return std::string(info.param.recipe); });

}  // namespace
