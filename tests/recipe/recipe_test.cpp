// CPU tests of the recipe data: presets, knobs (--disable-fp4, 4/6, layer counts), GEMM descriptions and
// GPU support checks.
#include <gtest/gtest.h>
#include "recipe/recipe.h"

namespace nb::recipe {
namespace {

std::vector<int64_t> bf16_layers(const Recipe& r, int64_t n) {
  std::vector<int64_t> out;
  for (int64_t l = 0; l < n; ++l)
    if (r.layer_in_bf16(l, n)) out.push_back(l);
  return out;
}

TEST(Presets, EveryNameLoadsAndUnknownNamesAreRejected) {
  for (const std::string& n : recipe_names()) {
    Recipe r;
    ASSERT_TRUE(recipe_preset(n, &r).is_ok()) << n;
    EXPECT_EQ(r.name, n);
    EXPECT_EQ(r.quantized(), n != "bf16_mixed") << n;
  }
  Recipe r;
  Status st = recipe_preset("bf16_with_fp4_mixed", &r);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("bf16_with_nvfp4_mixed"), std::string::npos) << st.message();
}

TEST(Presets, OperandFormatsFollowTheSpecTable) {
  Recipe r;
  ASSERT_TRUE(recipe_preset("bf16_with_nvfp4_mixed", &r).is_ok());
  EXPECT_TRUE(r.input.fmt == Fmt::nvfp4 && r.input.rht && !r.input.sr && !r.input.two_d);
  EXPECT_TRUE(r.weight.fmt == Fmt::nvfp4 && r.weight.two_d && !r.weight.rht && !r.weight.sr);
  EXPECT_TRUE(r.grad.fmt == Fmt::nvfp4 && r.grad.rht && r.grad.sr);
  EXPECT_EQ(bf16_layers(r, 32), (std::vector<int64_t>{28, 29, 30, 31}));
  ASSERT_TRUE(recipe_preset("bf16_with_fp8_current_scaling_mixed", &r).is_ok());
  EXPECT_TRUE(r.input.fmt == Fmt::fp8_e4m3 && r.weight.fmt == Fmt::fp8_e4m3 && r.grad.fmt == Fmt::fp8_e5m2);
  EXPECT_EQ(r.fp8_scaling, Fp8Scaling::current);
  ASSERT_TRUE(recipe_preset("bf16_with_fp8_delayed_scaling_mixed", &r).is_ok());
  EXPECT_EQ(r.fp8_scaling, Fp8Scaling::delayed);
  EXPECT_EQ(r.amax_history_len, 1024);
  ASSERT_TRUE(recipe_preset("bf16_with_fp8_subchannel_scaling_mixed", &r).is_ok());
  EXPECT_TRUE(r.input.fmt == Fmt::fp8_block128 && r.weight.fmt == Fmt::fp8_block128x128 &&
              r.grad.fmt == Fmt::fp8_block128);
  ASSERT_TRUE(recipe_preset("bf16_with_mxfp8_mixed", &r).is_ok());
  EXPECT_TRUE(r.input.fmt == Fmt::mxfp8 && r.weight.fmt == Fmt::mxfp8 && r.grad.fmt == Fmt::mxfp8);
  ASSERT_TRUE(recipe_preset("bf16_mixed", &r).is_ok());
  EXPECT_EQ(bf16_layers(r, 4).size(), 4u);
}

TEST(Knobs, DisableFp4RunsTheJobInBf16Mixed) {
  Recipe r;
  ASSERT_TRUE(recipe_preset("bf16_with_nvfp4_mixed", &r).is_ok());
  RecipeKnobs k;
  k.disable_fp4 = true;
  ASSERT_TRUE(apply_knobs(k, &r).is_ok());
  EXPECT_EQ(r.name, "bf16_mixed");
  EXPECT_FALSE(r.quantized());
}

TEST(Knobs, Fp4SwitchesActOnNvfp4RolesAndAreRejectedElsewhere) {
  Recipe r;
  ASSERT_TRUE(recipe_preset("bf16_with_nvfp4_mixed", &r).is_ok());
  RecipeKnobs k;
  k.fp4_disable_rht = k.fp4_disable_sr = k.fp4_disable_2d = true;
  ASSERT_TRUE(apply_knobs(k, &r).is_ok());
  EXPECT_FALSE(r.input.rht || r.grad.rht || r.grad.sr || r.weight.two_d);
  ASSERT_TRUE(recipe_preset("bf16_with_mxfp8_mixed", &r).is_ok());
  Status st = apply_knobs(k, &r);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("bf16_with_mxfp8_mixed"), std::string::npos) << st.message();
}

TEST(Knobs, FourOverSixActsOnNvfp4WeightsAndActivationsOnly) {
  auto with = [](const char* preset, const char* v, Recipe* r) {
    EXPECT_TRUE(recipe_preset(preset, r).is_ok());
    RecipeKnobs k;
    k.fp4_4over6 = v;
    return apply_knobs(k, r);
  };
  Recipe r;
  ASSERT_TRUE(with("bf16_with_nvfp4_mixed", "none", &r).is_ok());
  EXPECT_FALSE(r.input.four_over_six || r.weight.four_over_six || r.grad.four_over_six);
  ASSERT_TRUE(with("bf16_with_nvfp4_mixed", "weights", &r).is_ok());
  EXPECT_TRUE(r.weight.four_over_six && !r.input.four_over_six && !r.grad.four_over_six);
  ASSERT_TRUE(with("bf16_with_nvfp4_mixed", "activations", &r).is_ok());
  EXPECT_TRUE(r.input.four_over_six && !r.weight.four_over_six && !r.grad.four_over_six);
  ASSERT_TRUE(with("bf16_with_nvfp4_mixed", "all", &r).is_ok());
  EXPECT_TRUE(r.input.four_over_six && r.weight.four_over_six && !r.grad.four_over_six);  // gradients never
  EXPECT_EQ(describe_gemms(r, false, 9, 0),
            "Fprop nvfp4+4/6 x nvfp4+2d+4/6 (emulated) | Dgrad nvfp4+sr x nvfp4+2d+4/6 (emulated) | "
            "Wgrad nvfp4+rht+sr x nvfp4+rht+4/6 (emulated) fp32 accumulate");
  Status st = with("bf16_with_nvfp4_mixed", "gradients", &r);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("none, weights, activations or all"), std::string::npos) << st.message();
  st = with("bf16_with_mxfp8_mixed", "weights", &r);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("bf16_with_mxfp8_mixed"), std::string::npos) << st.message();
  EXPECT_TRUE(with("bf16_with_mxfp8_mixed", "none", &r).is_ok());
  // NVFP4 weights but BF16 activations: "weights" works, "activations" and "all" are refused.
  Recipe w;
  w.name = "nvfp4_weights_only";
  w.weight.fmt = Fmt::nvfp4;
  RecipeKnobs k;
  k.fp4_4over6 = "activations";
  st = apply_knobs(k, &w);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("activations"), std::string::npos) << st.message();
  k.fp4_4over6 = "all";
  EXPECT_FALSE(apply_knobs(k, &w).is_ok());
  k.fp4_4over6 = "weights";
  ASSERT_TRUE(apply_knobs(k, &w).is_ok());
  EXPECT_TRUE(w.weight.four_over_six);
}

// 4/6's error metric: MAE by default (as TransformerEngine), MSE on request, set on the 4/6 roles only;
// an unknown metric, or mse while 4/6 is off, is refused.
TEST(Knobs, FourOverSixErrModeDefaultsToMae) {
  Recipe r;
  ASSERT_TRUE(recipe_preset("bf16_with_nvfp4_mixed", &r).is_ok());
  RecipeKnobs k;
  k.fp4_4over6 = "all";
  ASSERT_TRUE(apply_knobs(k, &r).is_ok());
  EXPECT_EQ(r.input.four_over_six_err, nvfp4::ErrMode::mae);
  EXPECT_EQ(r.weight.four_over_six_err, nvfp4::ErrMode::mae);
  ASSERT_TRUE(recipe_preset("bf16_with_nvfp4_mixed", &r).is_ok());
  k.fp4_4over6 = "weights";
  k.fp4_4over6_err_mode = "mse";
  ASSERT_TRUE(apply_knobs(k, &r).is_ok());
  EXPECT_EQ(r.weight.four_over_six_err, nvfp4::ErrMode::mse);
  EXPECT_FALSE(r.input.four_over_six);
  EXPECT_EQ(describe_gemms(r, false, 9, 0),
            "Fprop nvfp4 x nvfp4+2d+4/6(mse) (emulated) | Dgrad nvfp4+sr x nvfp4+2d+4/6(mse) (emulated) | "
            "Wgrad nvfp4+rht+sr x nvfp4+rht (emulated) fp32 accumulate");
  ASSERT_TRUE(recipe_preset("bf16_with_nvfp4_mixed", &r).is_ok());
  k.fp4_4over6_err_mode = "rmse";
  Status st = apply_knobs(k, &r);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("mae or mse"), std::string::npos) << st.message();
  k.fp4_4over6 = "none";
  k.fp4_4over6_err_mode = "mse";
  st = apply_knobs(k, &r);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("fp4-4over6 is none"), std::string::npos) << st.message();
}

TEST(Knobs, LayerCountsSelectExactlyTheIntendedLayers) {
  Recipe r;
  ASSERT_TRUE(recipe_preset("bf16_with_nvfp4_mixed", &r).is_ok());
  RecipeKnobs k;
  k.layers_at_start_bf16 = 2;
  k.layers_at_end_bf16 = 8;
  ASSERT_TRUE(apply_knobs(k, &r).is_ok());
  EXPECT_EQ(bf16_layers(r, 32), (std::vector<int64_t>{0, 1, 24, 25, 26, 27, 28, 29, 30, 31}));
  ASSERT_TRUE(recipe_preset("bf16_with_mxfp8_mixed", &r).is_ok());
  EXPECT_TRUE(bf16_layers(r, 16).empty());
  RecipeKnobs fl;
  fl.first_last_layers_bf16 = true;
  ASSERT_TRUE(apply_knobs(fl, &r).is_ok());
  EXPECT_EQ(bf16_layers(r, 16), (std::vector<int64_t>{0, 15}));
  RecipeKnobs zero;
  zero.layers_at_end_bf16 = 0;
  ASSERT_TRUE(recipe_preset("bf16_with_nvfp4_mixed", &r).is_ok());
  ASSERT_TRUE(apply_knobs(zero, &r).is_ok());
  EXPECT_TRUE(bf16_layers(r, 32).empty());
  RecipeKnobs bad;
  bad.layers_at_start_bf16 = -3;
  EXPECT_FALSE(apply_knobs(bad, &r).is_ok());
}

TEST(Describe, NamesEveryOperandOfTheThreeGemms) {
  Recipe r;
  ASSERT_TRUE(recipe_preset("bf16_with_nvfp4_mixed", &r).is_ok());
  EXPECT_EQ(describe_gemms(r, false, 9, 0),
            "Fprop nvfp4 x nvfp4+2d (emulated) | Dgrad nvfp4+sr x nvfp4+2d (emulated) | "
            "Wgrad nvfp4+rht+sr x nvfp4+rht (emulated) fp32 accumulate");
  EXPECT_EQ(describe_gemms(r, true, 9, 0),
            "Fprop bf16 x bf16 (cublaslt bf16) | Dgrad bf16 x bf16 (cublaslt bf16) | "
            "Wgrad bf16 x bf16 (cublaslt bf16) fp32 accumulate");
  ASSERT_TRUE(recipe_preset("bf16_with_fp8_current_scaling_mixed", &r).is_ok());
  std::string d = describe_gemms(r, false, 0, 0);
  EXPECT_NE(d.find("Fprop fp8_e4m3 x fp8_e4m3 (cpu reference, fast accum)"), std::string::npos) << d;
  EXPECT_NE(d.find("Dgrad fp8_e5m2 x fp8_e4m3"), std::string::npos) << d;
}

TEST(Supported, EachGpuGetsAClearAnswer) {
  Recipe r;
  ASSERT_TRUE(recipe_preset("bf16_with_fp8_current_scaling_mixed", &r).is_ok());
  Status st = check_supported(r, 8, 0);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("sm_89"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("sm_80"), std::string::npos) << st.message();
  EXPECT_TRUE(check_supported(r, 8, 9).is_ok());
  EXPECT_TRUE(check_supported(r, 9, 0).is_ok());
  ASSERT_TRUE(recipe_preset("bf16_with_fp8_subchannel_scaling_mixed", &r).is_ok());
  EXPECT_TRUE(check_supported(r, 9, 0).is_ok());
  st = check_supported(r, 10, 0);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("Hopper"), std::string::npos) << st.message();
  ASSERT_TRUE(recipe_preset("bf16_with_nvfp4_mixed", &r).is_ok());
  EXPECT_TRUE(check_supported(r, 9, 0).is_ok());
  EXPECT_TRUE(check_supported(r, 0, 0).is_ok());  // the CPU reference runs everything
  ASSERT_TRUE(recipe_preset("bf16_mixed", &r).is_ok());
  EXPECT_FALSE(check_supported(r, 7, 5).is_ok());
}

// Applying `knobs` to `recipe` is refused with a message that contains `needle`.
void expect_knobs_refused(const char* recipe, const RecipeKnobs& knobs, const char* needle) {
  Recipe x;
  ASSERT_TRUE(recipe_preset(recipe, &x).is_ok());
  Status st = apply_knobs(knobs, &x);
  ASSERT_FALSE(st.is_ok()) << needle;
  EXPECT_NE(st.message().find(needle), std::string::npos) << st.message();
}

// bf16_with_mor_fp8_mixed: every role E4M3 per tensor with current scaling and MoR on, no BF16 layers by position;
// its knobs apply, and every bad value or misplaced knob is refused in one sentence.
TEST(MorRecipe, PresetKnobsAndRefusals) {
  Recipe r;
  ASSERT_TRUE(recipe_preset("bf16_with_mor_fp8_mixed", &r).is_ok());
  EXPECT_TRUE(r.mor.on);
  EXPECT_EQ(r.mor.threshold, 0.045);
  EXPECT_EQ(r.mor.interval, 1);
  EXPECT_EQ(r.input.fmt, Fmt::fp8_e4m3);
  EXPECT_EQ(r.weight.fmt, Fmt::fp8_e4m3);
  EXPECT_EQ(r.grad.fmt, Fmt::fp8_e4m3);
  EXPECT_EQ(r.fp8_scaling, Fp8Scaling::current);
  EXPECT_EQ(r.bf16_layers_at_start + r.bf16_layers_at_end, 0);
  RecipeKnobs k;
  k.mor_threshold = 0.08;
  k.mor_interval = 10;
  ASSERT_TRUE(apply_knobs(k, &r).is_ok());
  EXPECT_EQ(r.mor.threshold, 0.08);
  EXPECT_EQ(r.mor.interval, 10);
  const std::string d = describe_gemms(r, false, 9, 0);
  EXPECT_NE(d.find("e4m3|bf16"), std::string::npos) << d;
  EXPECT_NE(d.find("8%"), std::string::npos) << d;
  for (double t : {0.0, 1.0, 1.5}) {
    RecipeKnobs bad;
    bad.mor_threshold = t;
    expect_knobs_refused("bf16_with_mor_fp8_mixed", bad, "outside (0, 1)");
  }
  RecipeKnobs zero_interval;
  zero_interval.mor_interval = 0;
  expect_knobs_refused("bf16_with_mor_fp8_mixed", zero_interval, "at least 1");
  // The ladder per block: every role one BF16 operand of decided blocks, the gradient's NVFP4 blocks with SR, nine
  // cells per Linear; with mor-nvfp4-rows the input and gradient take a copy per direction.
  RecipeKnobs block;
  block.mor_granularity = "block";
  Recipe ladder;
  ASSERT_TRUE(recipe_preset("bf16_with_mor_nvfp4_mixed", &ladder).is_ok());
  ASSERT_TRUE(apply_knobs(block, &ladder).is_ok());
  EXPECT_TRUE(ladder.mor.ladder && ladder.mor.blocks);
  EXPECT_EQ(ladder.mor.cells_per_linear(), 9);
  for (const RoleSpec* role : {&ladder.input, &ladder.weight, &ladder.grad}) {
    EXPECT_EQ(role->fmt, Fmt::mor_block);
    EXPECT_FALSE(role->rht || role->nvfp4_rows);
  }
  EXPECT_TRUE(ladder.grad.sr);
  EXPECT_FALSE(ladder.input.sr || ladder.weight.sr);
  block.mor_nvfp4_rows = true;
  ASSERT_TRUE(recipe_preset("bf16_with_mor_nvfp4_mixed", &ladder).is_ok());
  ASSERT_TRUE(apply_knobs(block, &ladder).is_ok());
  EXPECT_TRUE(ladder.input.nvfp4_rows && ladder.grad.nvfp4_rows && !ladder.weight.nvfp4_rows);
  RecipeKnobs on_fp8;
  on_fp8.mor_threshold = 0.05;
  expect_knobs_refused("bf16_with_fp8_current_scaling_mixed", on_fp8, "no Mixture of Representations");
}

// bf16_with_mor_nvfp4_mixed: the NVFP4 recipe's roles under the ladder, no BF16 layers by position; its NVFP4 threshold
// applies, and what the ladder cannot take is refused.
TEST(MorRecipe, LadderPresetKnobsAndRefusals) {
  Recipe r, nv;
  ASSERT_TRUE(recipe_preset("bf16_with_mor_nvfp4_mixed", &r).is_ok());
  ASSERT_TRUE(recipe_preset("bf16_with_nvfp4_mixed", &nv).is_ok());
  EXPECT_TRUE(r.mor.on && r.mor.ladder);
  EXPECT_EQ(r.mor.nvfp4_threshold, kDefaultNvfp4Threshold);
  for (auto [a, b] : {std::pair{&r.input, &nv.input}, {&r.weight, &nv.weight}, {&r.grad, &nv.grad}}) {
    EXPECT_EQ(a->fmt, b->fmt);
    EXPECT_EQ(a->rht, b->rht);
    EXPECT_EQ(a->sr, b->sr);
    EXPECT_EQ(a->two_d, b->two_d);
  }
  EXPECT_EQ(r.bf16_layers_at_start + r.bf16_layers_at_end, 0);
  RecipeKnobs k;
  k.mor_nvfp4_threshold = 0.25;
  ASSERT_TRUE(apply_knobs(k, &r).is_ok());
  EXPECT_EQ(r.mor.nvfp4_threshold, 0.25);
  const std::string d = describe_gemms(r, false, 9, 0);
  EXPECT_NE(d.find("nvfp4|e4m3|bf16"), std::string::npos) << d;
  EXPECT_NE(d.find("25%"), std::string::npos) << d;
  RecipeKnobs bad;
  bad.mor_nvfp4_threshold = 0.0;
  expect_knobs_refused("bf16_with_mor_nvfp4_mixed", bad, "outside (0, 1)");
  RecipeKnobs on_e4m3;
  on_e4m3.mor_nvfp4_threshold = 0.3;
  expect_knobs_refused("bf16_with_mor_fp8_mixed", on_e4m3, "no NVFP4 rung");
  RecipeKnobs now;
  now.mor_decide_now = true;
  expect_knobs_refused("bf16_with_mor_nvfp4_mixed", now, "mor-decide-now");
  RecipeKnobs four_six;
  four_six.fp4_4over6 = "all";
  expect_knobs_refused("bf16_with_mor_nvfp4_mixed", four_six, "4/6");
}

// --mor-channel-statistic: on the E4M3 tensor rule it adds three cells per Linear (the per-row scaled statistic) and
// changes nothing else; the ladder, the block rule, mor-decide-now and a recipe without MoR refuse it.
TEST(MorRecipe, ChannelStatisticKnobAndRefusals) {
  Recipe r, plain;
  ASSERT_TRUE(recipe_preset("bf16_with_mor_fp8_mixed", &r).is_ok());
  plain = r;
  EXPECT_FALSE(r.mor.channel_stat);
  EXPECT_EQ(r.mor.cells_per_linear(), 3);
  RecipeKnobs k;
  k.mor_channel_stat = true;
  ASSERT_TRUE(apply_knobs(k, &r).is_ok());
  EXPECT_TRUE(r.mor.channel_stat);
  EXPECT_EQ(r.mor.cells_per_linear(), 6);
  EXPECT_EQ(r.mor.threshold, plain.mor.threshold);
  EXPECT_EQ(r.input.fmt, plain.input.fmt);
  EXPECT_EQ(describe_gemms(r, false, 9, 0), describe_gemms(plain, false, 9, 0));
  expect_knobs_refused("bf16_with_mor_nvfp4_mixed", k, "NVFP4 ladder");
  RecipeKnobs block = k;
  block.mor_granularity = "block";
  expect_knobs_refused("bf16_with_mor_fp8_mixed", block, "block rule");
  RecipeKnobs now = k;
  now.mor_decide_now = true;
  expect_knobs_refused("bf16_with_mor_fp8_mixed", now, "mor-decide-now");
  expect_knobs_refused("bf16_with_fp8_current_scaling_mixed", k, "no Mixture of Representations");
}

}  // namespace
}  // namespace nb::recipe
