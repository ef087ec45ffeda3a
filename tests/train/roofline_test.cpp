// The step roofline's arithmetic on the CPU: work formulas from the shapes, GEMM work and names, the
// report's sums and lost shares, and well-formed JSON and SVG (train/roofline.h, model/step_work.h).
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>
#include "gemm/gemm_call.h"
#include "model/step_work.h"
#include "train/roofline.h"
#include "train/train_config.h"

namespace nb {
namespace {

TEST(StepWork, FormulasFromTheShapes) {
  const int64_t t = 8192, h = 4096, f = 14336;
  // RMSNorm forward: x read, y written (BF16), the weight read, 1/rms written (FP32)
  EXPECT_DOUBLE_EQ(work::rmsnorm_forward(t, h).bytes, 2.0 * (2.0 * t * h + h) + 4.0 * t);
  EXPECT_DOUBLE_EQ(work::swiglu_forward(t, f).bytes, 2.0 * 3.0 * t * f);
  EXPECT_DOUBLE_EQ(work::swiglu_backward(t, f).bytes, 2.0 * 5.0 * t * f);
  EXPECT_DOUBLE_EQ(work::copy(t, h).bytes, 4.0 * t * h);
  EXPECT_DOUBLE_EQ(work::rope(t, 4096, 1024).bytes, 2.0 * 2.0 * t * 6144);
  // causal attention of the proxy's micro-batch (2 x 4096, 32 heads of 128): 2 b heads s^2 hd forward
  const double fwd = 2.0 * 2 * 32 * 4096.0 * 4096.0 * 128;
  EXPECT_DOUBLE_EQ(work::attention_forward(2, 4096, 32, 8, 128).flops, fwd);
  EXPECT_DOUBLE_EQ(work::attention_backward(2, 4096, 32, 8, 128).flops, 2.5 * fwd);
  // ... which is Megatron's 6 L d_q s per token split 1 : 2 between forward and a backward without recompute
  EXPECT_DOUBLE_EQ(fwd, 2.0 * 4096 * 4096 * double(2 * 4096));
  EXPECT_DOUBLE_EQ(work::grad_norm_adamw(1000).bytes, 34000.0);
  const work::Work sum = work::rmsnorm_backward(t, h) + work::add(t, h);
  EXPECT_DOUBLE_EQ(sum.flops, 9.0 * t * h);
}

TEST(GemmCallWork, Bf16AndQuantizedCounts) {
  gemm::GemmArgs nt;
  nt.trans_b = true;
  const auto bf = gemm::GemmCall::bf16(8192, 6144, 4096, nt, DType::bf16);
  EXPECT_EQ(bf.key(), "bf16 NT 8192x6144x4096 C=bf16");
  EXPECT_DOUBLE_EQ(bf.flops(), 2.0 * 8192 * 6144 * 4096);
  EXPECT_DOUBLE_EQ(bf.bytes(), 2.0 * (8192.0 * 4096 + 6144.0 * 4096) + 2.0 * 8192 * 6144);
  gemm::GemmArgs tn;
  tn.trans_a = true;
  tn.beta = 1.f;
  const auto wgrad = gemm::GemmCall::bf16(128256, 4096, 8192, tn, DType::f32);
  EXPECT_EQ(wgrad.key(), "bf16 TN 128256x4096x8192 C=f32+=");
  EXPECT_DOUBLE_EQ(wgrad.bytes(), 2.0 * (128256.0 * 8192 + 4096.0 * 8192) + 2 * 4.0 * 128256 * 4096);

  gemm::QOperand a, b;
  a.format = b.format = gemm::QFormat::nvfp4;
  a.rows = 8192;
  b.rows = 4096;
  a.k = b.k = 4096;
  int dummy = 0;
  b.dequantized = &dummy;
  const auto q = gemm::GemmCall::quant(a, b, DType::bf16, {1.f, false});
  EXPECT_EQ(q.key(), "nvfp4 x nvfp4(bf16) 8192x4096x4096 C=bf16+=");
  EXPECT_DOUBLE_EQ(q.bytes(), 8192.0 * 4096 * (0.5 + 1.0 / 16) + 4096.0 * 4096 * 2 + 2 * 2.0 * 8192 * 4096);
  a.format = b.format = gemm::QFormat::fp8_e4m3;
  b.dequantized = nullptr;
  EXPECT_EQ(gemm::GemmCall::quant(a, b, DType::bf16, {0.f, true}).key(),
            "fp8_e4m3 x fp8_e4m3 8192x4096x4096 C=bf16 fast");
}

// Phase "layer" (10 ms): its GEMM child 8 ms with 8 TFLOP at a 1000 TFLOP/s ceiling (ideal 8 ms) and 3 GB of its
// own at 3000 GB/s (1 ms): 1 ms lost. Phase "elementwise" (5 ms, 6 GB): memory bound, 2 ms ideal, 3 lost.
// Step 20 ms: 5 ms unattributed.
roofline::Report sample_report() {
  std::vector<profile::Entry> e = {
      {"layer", "", 10.0, 4, 0.0, 3e9},
      {"gemm bf16 NT 8x8x8 C=bf16", "layer", 8.0, 4, 8e12, 1e9},
      {"elementwise & <friends>", "", 5.0, 8, 1e9, 6e9},
  };
  roofline::Ceilings c;
  c.copy_gbs = 3000;
  c.tensor_tflops = 800;
  c.gemm_tflops["gemm bf16 NT 8x8x8 C=bf16"] = 1000;
  roofline::Report r = roofline::build(e, 20.0, c);
  r.title = "test";
  r.steps = 3;
  return r;
}

TEST(Roofline, RowsSumToTheStepAndLostSharesFollowTheCeilings) {
  const roofline::Report r = sample_report();
  ASSERT_EQ(r.phases.size(), 3u);
  EXPECT_EQ(r.phases[0].name, "layer");
  EXPECT_EQ(r.phases.back().name, roofline::kUnattributed);
  double sum = 0;
  for (const auto& p : r.phases) sum += p.ms;
  EXPECT_DOUBLE_EQ(sum, 20.0);
  EXPECT_DOUBLE_EQ(r.phases_ms(), 15.0);
  EXPECT_DOUBLE_EQ(r.phases.back().ms, 5.0);
  const auto& layer = r.phases[0];
  EXPECT_EQ(layer.bound, "GEMM");
  EXPECT_DOUBLE_EQ(layer.flops, 8e12);
  EXPECT_DOUBLE_EQ(layer.bytes, 4e9);
  EXPECT_NEAR(layer.ideal_ms, 9.0, 1e-9);
  EXPECT_NEAR(layer.lost_share, 1.0 / 20.0, 1e-12);
  EXPECT_NEAR(layer.ceiling_tflops, 1000.0, 1e-9);
  const auto& ew = r.phases[1];
  EXPECT_EQ(ew.bound, "memory");
  EXPECT_NEAR(ew.ideal_ms, 2.0, 1e-9);
  EXPECT_NEAR(ew.lost_ms, 3.0, 1e-9);
  EXPECT_NEAR(ew.gbs(), 1200.0, 1e-9);
  ASSERT_EQ(r.gemms.size(), 1u);
  EXPECT_NEAR(r.gemms[0].tflops(), 1000.0, 1e-9);
  EXPECT_NEAR(r.gemms[0].lost_ms, 0.0, 1e-9);
  // lost = (1 + 3 + 5 unattributed) / 20; the step at its ceilings = 9 + 2 ms
  EXPECT_NEAR(r.lost_share(), 9.0 / 20.0, 1e-12);
  EXPECT_NEAR(r.ideal_ms(), 11.0, 1e-9);
}

TEST(Roofline, AGemmWithoutACeilingLosesNothingAndSaysSo) {
  std::vector<profile::Entry> e = {{"p", "", 4.0, 1, 0, 0}, {"gemm x", "p", 4.0, 1, 1e12, 1e9}};
  const roofline::Report r = roofline::build(e, 4.0, roofline::Ceilings{});
  EXPECT_NEAR(r.phases[0].lost_ms, 0.0, 1e-12);
  EXPECT_NE(roofline::format_table(r).find("GEMM (not measured)"), std::string::npos);
}

TEST(Roofline, TableAndJsonCarryEveryRow) {
  const roofline::Report r = sample_report();
  const std::string table = roofline::format_table(r);
  EXPECT_NE(table.find(roofline::kUnattributed), std::string::npos);
  EXPECT_NE(table.find("bf16 NT 8x8x8 C=bf16"), std::string::npos);
  const auto j = nlohmann::json::parse(roofline::to_json(r));
  EXPECT_DOUBLE_EQ(j["step_ms"].get<double>(), 20.0);
  double sum = 0;
  for (const auto& p : j["phases"]) sum += p["ms"].get<double>();
  EXPECT_DOUBLE_EQ(sum, 20.0);
  EXPECT_EQ(j["gemms"].size(), 1u);
  EXPECT_DOUBLE_EQ(j["ceilings"]["gemm_tflops"]["gemm bf16 NT 8x8x8 C=bf16"].get<double>(), 1000.0);
}

// Every element opened is closed in order (a minimal XML check: tags, self-closing tags, no stray '<' or '&').
bool well_formed(const std::string& s, std::string* why) {
  std::vector<std::string> stack;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '&') {
      const size_t semi = s.find(';', i);
      const std::string ent = s.substr(i, semi == std::string::npos ? 1 : semi - i + 1);
      if (ent != "&amp;" && ent != "&lt;" && ent != "&gt;" && ent != "&quot;") return *why = "entity " + ent, false;
      continue;
    }
    if (s[i] != '<') continue;
    const size_t close = s.find('>', i);
    if (close == std::string::npos) return *why = "unclosed tag", false;
    const std::string tag = s.substr(i + 1, close - i - 1);
    if (tag.find('<') != std::string::npos) return *why = "'<' inside a tag", false;
    i = close;
    if (tag[0] == '?') continue;
    if (tag[0] == '/') {
      if (stack.empty() || stack.back() != tag.substr(1)) return *why = "mismatched </" + tag.substr(1) + ">", false;
      stack.pop_back();
      continue;
    }
    if (tag.back() == '/') continue;
    stack.push_back(tag.substr(0, tag.find_first_of(" \n")));
  }
  if (!stack.empty()) return *why = "unclosed <" + stack.back() + ">", false;
  return true;
}

TEST(Roofline, SvgIsWellFormedAndEscapesNames) {
  const std::string svg = roofline::to_svg(sample_report());
  std::string why;
  EXPECT_TRUE(well_formed(svg, &why)) << why;
  EXPECT_EQ(svg.rfind("<?xml", 0), 0u);
  EXPECT_NE(svg.find("<svg xmlns=\"http://www.w3.org/2000/svg\""), std::string::npos);
  EXPECT_NE(svg.find("elementwise &amp; &lt;friends&gt;"), std::string::npos);
  EXPECT_NE(svg.find("<circle"), std::string::npos);  // the phases with FLOPs are on the plot
  std::string bad;
  EXPECT_FALSE(well_formed("<svg><g></svg>", &bad));
}

TEST(Roofline, ProfileIsAConfigKey) {
  TrainConfig c;
  ASSERT_TRUE(apply_config_text("profile = true\nprofile-dir = \"prof\"\n", "job.toml", c).is_ok());
  EXPECT_TRUE(c.profile);
  EXPECT_EQ(c.profile_dir, "prof");
}

}  // namespace
}  // namespace nb
