// Precision annealing (--anneal-start-fraction, --anneal-recipe, --anneal-fprop-only) on the CPU backend:
// the steps before the switch equal a run without annealing bit for bit and the later ones differ; the
// switch is logged once in metrics.jsonl; a run stopped before or after the switch resumes bit-exactly;
// an Fprop-only Linear computes y as a BF16 layer does while its backward stays the quantized one; the
// activation plan covers both recipes; and the settings annealing cannot honour are refused in one sentence.
#include <gtest/gtest.h>
#include <algorithm>
#include <fstream>
#include <random>
#include <string>
#include <vector>
#include "model/llama_model.h"
#include "recipe/linear.h"
#include "train/resume_util.h"

using namespace nb;

namespace {

// The tiny model (2 layers) in NVFP4 with no BF16 layers, so every Linear is quantized before the switch.
TrainConfig anneal_job(double fraction, const std::string& anneal_recipe, bool fprop_only = false) {
  TrainConfig c = test::tiny_job("cpu", "bf16_with_nvfp4_mixed");
  c.anneal_start_fraction = fraction;
  c.anneal_recipe = anneal_recipe;
  c.anneal_fprop_only = fprop_only;
  return c;
}

TrainSummary run_ok(const TrainConfig& c) {
  TrainSummary s;
  Status st = run_training(c, &s);
  EXPECT_TRUE(st.is_ok()) << st.message();
  return s;
}

// The metrics.jsonl records of the switch.
std::vector<nlohmann::json> anneal_records(const std::string& save) {
  std::vector<nlohmann::json> out;
  std::ifstream f(save + "/metrics.jsonl");
  for (std::string line; std::getline(f, line);)
    if (line.find("\"anneal\"") != std::string::npos) out.push_back(nlohmann::json::parse(line));
  return out;
}

std::string refusal(const TrainConfig& c) {
  TrainSummary s;
  Status st = run_training(c, &s);
  EXPECT_FALSE(st.is_ok());
  EXPECT_EQ(st.message().find('\n'), std::string::npos) << st.message();  // one sentence, one line
  return st.message();
}

}  // namespace

TEST(AnnealTrainCpu, StepsBeforeTheSwitchAreBitIdenticalAndTheSwitchIsRecordedOnce) {
  const std::string dir = test::temp_folder("anneal_switch");
  TrainConfig plain = anneal_job(0, "");
  TrainConfig annealed = anneal_job(0.5, "bf16_mixed");  // S = round(0.5 x 6) = 3
  annealed.save = dir + "/run";
  const TrainSummary a = run_ok(plain), b = run_ok(annealed);
  ASSERT_EQ(a.losses.size(), 6u);
  ASSERT_EQ(b.losses.size(), 6u);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(a.losses[i], b.losses[i]) << "step " << i + 1;  // exact doubles
  for (size_t i = 3; i < 6; ++i) EXPECT_NE(a.losses[i], b.losses[i]) << "step " << i + 1;
  const auto records = anneal_records(annealed.save);
  ASSERT_EQ(records.size(), 1u);
  EXPECT_EQ(records[0]["iteration"].get<int64_t>(), 3);
  EXPECT_EQ(records[0]["anneal"].get<std::string>(), "bf16_mixed");
  EXPECT_FALSE(records[0]["fprop_only"].get<bool>());
}

TEST(AnnealTrainCpu, HalvesRoundToTheNearestStepUp) {
  // 0.25 x 6 = 1.5 rounds to 2: steps 1-2 equal the plain run, step 3 differs.
  const TrainSummary a = run_ok(anneal_job(0, "")), b = run_ok(anneal_job(0.25, "bf16_mixed"));
  EXPECT_EQ(a.losses[1], b.losses[1]);
  EXPECT_NE(a.losses[2], b.losses[2]);
}

struct ResumeCase {
  const char* recipe;
  int64_t stop_at;
};

class AnnealResumeCpu : public ::testing::TestWithParam<ResumeCase> {};

// Stopped before the switch (it then happens in the resumed run) or after it (the resumed run starts in
// the anneal recipe, FP8 delayed scaling with the checkpoint's amax histories): equal to the whole run.
TEST_P(AnnealResumeCpu, ResumesAcrossTheSwitchBitForBit) {
  const ResumeCase rc = GetParam();
  const std::string dir = test::temp_folder("anneal_resume_" + std::to_string(rc.stop_at) + "_" + rc.recipe);
  TrainConfig whole = anneal_job(0.5, rc.recipe), first = whole, second = whole;
  whole.save = dir + "/whole";
  first.save = second.save = second.load = dir + "/halves";
  whole.save_interval = first.save_interval = second.save_interval = 6;
  first.exit_interval = rc.stop_at;
  const TrainSummary sw = run_ok(whole), s1 = run_ok(first), s2 = run_ok(second);
  ASSERT_EQ(s1.end_iteration, rc.stop_at);
  ASSERT_EQ(s2.start_iteration, rc.stop_at);
  std::vector<double> joined = s1.losses;
  joined.insert(joined.end(), s2.losses.begin(), s2.losses.end());
  EXPECT_EQ(joined, sw.losses);
  for (const char* f : {"model.safetensors", "optimizer.safetensors"})
    EXPECT_TRUE(test::file_bytes(whole.save + "/iter_0000006/" + f) ==
                test::file_bytes(first.save + "/iter_0000006/" + f))
        << f;
  // One switch, logged once: by the resumed run when it crossed S, else by the first run.
  const auto records = anneal_records(first.save);
  ASSERT_EQ(records.size(), 1u);
  EXPECT_EQ(records[0]["iteration"].get<int64_t>(), 3);
}

INSTANTIATE_TEST_SUITE_P(StopBeforeAndAfter, AnnealResumeCpu,
                         ::testing::Values(ResumeCase{"bf16_mixed", 2}, ResumeCase{"bf16_mixed", 4},
                                           ResumeCase{"bf16_with_fp8_delayed_scaling_mixed", 4}),
                         [](const ::testing::TestParamInfo<ResumeCase>& i) {
                           return std::string(i.param.recipe) + "_stop_at_" + std::to_string(i.param.stop_at);
                         });

TEST(AnnealResumeRules, AnnealKeysMustMatchTheCheckpoint) {
  const std::string dir = test::temp_folder("anneal_rules");
  TrainConfig first = anneal_job(0.5, "bf16_mixed");
  first.save = dir + "/run";
  first.exit_interval = 2;
  run_ok(first);
  TrainConfig second = anneal_job(0.5, "bf16_with_mxfp8_mixed");
  second.save = second.load = first.save;
  const std::string m = refusal(second);
  EXPECT_NE(m.find("saved with --anneal-recipe \"bf16_mixed\" but this run has --anneal-recipe "
                   "\"bf16_with_mxfp8_mixed\""),
            std::string::npos)
      << m;
}

TEST(AnnealTrainCpu, FpropOnlyDiffersFromBothTheMainAndTheFullAnneal) {
  const TrainSummary none = run_ok(anneal_job(0, "")), full = run_ok(anneal_job(0.5, "bf16_mixed"));
  const std::string dir = test::temp_folder("anneal_fprop");
  TrainConfig fprop_job = anneal_job(0.5, "bf16_mixed", /*fprop_only=*/true);
  fprop_job.save = dir + "/run";
  const TrainSummary fprop = run_ok(fprop_job);
  ASSERT_EQ(fprop.losses.size(), 6u);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(fprop.losses[i], none.losses[i]) << "step " << i + 1;
  // Step 4's loss comes from its forward alone: the weights of step 3 and a BF16 Fprop, as in the full
  // anneal. Its backward (still NVFP4 Dgrad and Wgrad) then makes the weights, and later losses, differ.
  EXPECT_EQ(fprop.losses[3], full.losses[3]);
  for (size_t i = 3; i < 6; ++i) EXPECT_NE(fprop.losses[i], none.losses[i]) << "step " << i + 1;
  for (size_t i = 4; i < 6; ++i) EXPECT_NE(fprop.losses[i], full.losses[i]) << "step " << i + 1;
  const auto records = anneal_records(fprop_job.save);
  ASSERT_EQ(records.size(), 1u);
  EXPECT_TRUE(records[0]["fprop_only"].get<bool>());
}

// A quantized Linear in Fprop-BF16 mode: y is the BF16 layer's y on the same x and w, bit for bit, while
// its backward (Dgrad, Wgrad on the kept quantized copies) equals the plain quantized Linear's.
TEST(AnnealLinear, FpropBf16GivesTheBf16LayersOutputAndKeepsTheQuantizedBackward) {
  constexpr int64_t M = 64, K = 128, N = 64;
  recipe::Recipe r;
  ASSERT_TRUE(recipe::recipe_preset("bf16_with_nvfp4_mixed", &r).is_ok());
  auto filled = [](int64_t rows, int64_t cols, uint32_t seed, float sigma) {
    Buffer b;
    EXPECT_TRUE(Buffer::allocate(&b, DType::f32, Device::cpu, {rows, cols}).is_ok());
    std::mt19937 rng(seed);
    std::normal_distribution<float> d(0.f, sigma);
    for (int64_t i = 0; i < rows * cols; ++i) b.ptr<float>()[i] = d(rng);
    return b;
  };
  Buffer x = filled(M, K, 1, 1.f), w = filled(N, K, 2, 0.05f), dy = filled(M, N, 3, 0.01f);
  recipe::Linear bf16, fprop, plain;
  ASSERT_TRUE(bf16.init(r, /*bf16_layer=*/true, "bf16", 1, M, K, N, Device::cpu).is_ok());
  ASSERT_TRUE(fprop.init(r, false, "fprop", 1, M, K, N, Device::cpu).is_ok());
  ASSERT_TRUE(plain.init(r, false, "plain", 1, M, K, N, Device::cpu).is_ok());
  ASSERT_TRUE(fprop.set_fprop_bf16(true).is_ok());
  Buffer y_bf16 = filled(M, N, 4, 0.f), y_fprop = filled(M, N, 4, 0.f), y_plain = filled(M, N, 4, 0.f);
  ASSERT_TRUE(bf16.forward(x.tensor(), w.tensor(), y_bf16.tensor(), 0.f, nullptr).is_ok());
  ASSERT_TRUE(fprop.forward(x.tensor(), w.tensor(), y_fprop.tensor(), 0.f, nullptr).is_ok());
  ASSERT_TRUE(plain.forward(x.tensor(), w.tensor(), y_plain.tensor(), 0.f, nullptr).is_ok());
  const auto values = [](const Buffer& b, int64_t n) { return std::vector<float>(b.ptr<float>(), b.ptr<float>() + n); };
  EXPECT_EQ(values(y_fprop, M * N), values(y_bf16, M * N));
  EXPECT_NE(values(y_fprop, M * N), values(y_plain, M * N));  // NVFP4's Fprop really differs
  Buffer dx_fprop = filled(M, K, 5, 0.f), dx_plain = filled(M, K, 5, 0.f);
  Buffer dw_fprop = filled(N, K, 6, 0.f), dw_plain = filled(N, K, 6, 0.f);
  ASSERT_TRUE(
      fprop.backward(dy.tensor(), x.tensor(), w.tensor(), dx_fprop.tensor(), 0.f, dw_fprop.tensor(), nullptr).is_ok());
  ASSERT_TRUE(
      plain.backward(dy.tensor(), x.tensor(), w.tensor(), dx_plain.tensor(), 0.f, dw_plain.tensor(), nullptr).is_ok());
  EXPECT_EQ(values(dx_fprop, M * K), values(dx_plain, M * K));
  EXPECT_EQ(values(dw_fprop, N * K), values(dw_plain, N * K));
}

// The activation plan keeps quantized inputs only in layers quantized under both recipes, and needs at
// least the bytes of either recipe's own plan; a model initialized without a planned switch refuses one.
TEST(AnnealModel, ActivationPlanCoversBothRecipesAndAnUnplannedSwitchIsRefused) {
  LlamaConfig cfg;
  ASSERT_TRUE(llama_preset("tiny", &cfg).is_ok());
  cfg.layers = 4;
  recipe::Recipe nvfp4, fp8;
  ASSERT_TRUE(recipe::recipe_preset("bf16_with_nvfp4_mixed", &nvfp4).is_ok());
  ASSERT_TRUE(recipe::recipe_preset("bf16_with_fp8_current_scaling_mixed", &fp8).is_ok());  // layers 0, 3 BF16
  nvfp4.bf16_layers_at_end = 0;
  const recipe::Recipe plan = LlamaModel::activation_plan_recipe(nvfp4, {fp8, false});
  for (int64_t l = 0; l < 4; ++l) EXPECT_EQ(plan.layer_in_bf16(l, 4), l == 0 || l == 3) << l;
  EXPECT_FALSE(LlamaModel::activation_plan_recipe(nvfp4, {recipe::Recipe{}, false}).quantized());
  EXPECT_EQ(LlamaModel::activation_plan_recipe(nvfp4, {recipe::Recipe{}, true}).bf16_layers_at_end, 0);  // fprop only
  const MicroBatchShape shape{2, 64};
  const int64_t both = LlamaModel::plan_activation_bytes(cfg, Device::cpu, shape, Recompute::none, plan);
  EXPECT_GE(both, LlamaModel::plan_activation_bytes(cfg, Device::cpu, shape, Recompute::none, nvfp4));
  EXPECT_GE(both, LlamaModel::plan_activation_bytes(cfg, Device::cpu, shape, Recompute::none, fp8));
  LlamaModel m;
  ASSERT_TRUE(m.init(cfg, Device::cpu, shape, Recompute::none, 1, nvfp4).is_ok());
  Status st = m.set_recipe(recipe::Recipe{}, false);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("planned_switch"), std::string::npos) << st.message();
  LlamaModel planned;
  planned.planned_switch = LlamaModel::RecipeSwitch{recipe::Recipe{}, false};
  ASSERT_TRUE(planned.init(cfg, Device::cpu, shape, Recompute::none, 1, nvfp4).is_ok());
  ASSERT_TRUE(planned.set_recipe(recipe::Recipe{}, false).is_ok());
  EXPECT_FALSE(planned.linear(1, 0).keeps_quantized_input());
  EXPECT_EQ(planned.recipe().name, "bf16_mixed");
}

TEST(AnnealRules, SettingsAnnealingCannotHonourAreRefusedInOneSentence) {
  EXPECT_NE(refusal(anneal_job(0.5, "")).find("needs --anneal-recipe"), std::string::npos);
  EXPECT_NE(refusal(anneal_job(0, "bf16_mixed")).find("no --anneal-start-fraction"), std::string::npos);
  EXPECT_NE(refusal(anneal_job(0, "", true)).find("--anneal-fprop-only applies to precision annealing"),
            std::string::npos);
  EXPECT_NE(refusal(anneal_job(0.5, "bf16_with_nvfp4_mixed")).find("not a higher precision"), std::string::npos);
  EXPECT_NE(refusal(anneal_job(0.5, "fp16")).find("--anneal-recipe must be one of bf16_mixed"), std::string::npos);
  EXPECT_NE(refusal(anneal_job(0.5, "bf16_with_fp8_current_scaling_mixed", true)).find("second set of quantized"),
            std::string::npos);
  EXPECT_NE(refusal(anneal_job(1.5, "bf16_mixed")).find("strictly between 0 and 1"), std::string::npos);
  // 0.05 x 6 rounds to 0 and 0.95 x 6 to 6: the switch must fall after step 1 to 5.
  EXPECT_NE(refusal(anneal_job(0.05, "bf16_mixed")).find("after step 1 to 5"), std::string::npos);
  EXPECT_NE(refusal(anneal_job(0.95, "bf16_mixed")).find("after step 6"), std::string::npos);
  TrainConfig lora = anneal_job(0.5, "bf16_mixed");
  lora.recipe = "bf16_mixed";
  lora.peft = "lora";
  EXPECT_NE(refusal(lora).find("LoRA base is frozen"), std::string::npos);
}
