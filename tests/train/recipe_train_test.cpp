// Every precision recipe trains the tiny Llama end to end on the CPU backend (the loss falls), and
// --disable-fp4 reproduces a bf16_mixed run exactly.
#include <gtest/gtest.h>
#include <string>
#include "recipe/recipe.h"
#include "train/trainer.h"

using namespace nb;

namespace {
TrainConfig tiny_job(const std::string& recipe) {
  TrainConfig c;
  c.device = "cpu";
  c.model = "tiny";
  c.recipe = recipe;
  c.train_iters = 25;
  c.lr = 3e-3;
  c.min_lr = 3e-4;
  c.lr_warmup_iters = 2;
  c.micro_batch_size = 2;
  c.global_batch_size = 4;
  c.seq_length = 64;
  c.log_interval = 100;
  c.num_layers_at_start_in_bf16 = 0;
  c.num_layers_at_end_in_bf16 = 0;  // every layer quantized
  return c;
}
}  // namespace

// One test per recipe, so that CTest spreads them over its jobs (together they are the suite's longest test).
class EveryRecipe : public ::testing::TestWithParam<std::string> {};

TEST_P(EveryRecipe, TrainsTheTinyModel) {
  const std::string& name = GetParam();
  TrainSummary s;
  Status st = run_training(tiny_job(name), &s);
  ASSERT_TRUE(st.is_ok()) << name << ": " << st.message();
  EXPECT_LT(s.final_loss, s.first_loss - 1.0) << name;
  EXPECT_EQ(s.skipped, 0) << name;
}

INSTANTIATE_TEST_SUITE_P(RecipeTraining, EveryRecipe, ::testing::ValuesIn(recipe::recipe_names()),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

TEST(RecipeTraining, DisableFp4ReproducesBf16Mixed) {
  TrainConfig a = tiny_job("bf16_mixed");
  a.num_layers_at_start_in_bf16 = -1;
  a.num_layers_at_end_in_bf16 = -1;
  TrainConfig b = tiny_job("bf16_with_nvfp4_mixed");
  b.num_layers_at_start_in_bf16 = -1;
  b.num_layers_at_end_in_bf16 = -1;
  b.disable_fp4 = true;
  TrainSummary sa, sb;
  ASSERT_TRUE(run_training(a, &sa).is_ok());
  ASSERT_TRUE(run_training(b, &sb).is_ok());
  EXPECT_EQ(sa.losses, sb.losses);
  // And NVFP4 itself differs from BF16 (the quantization is really applied).
  TrainConfig c = tiny_job("bf16_with_nvfp4_mixed");
  TrainSummary sc;
  ASSERT_TRUE(run_training(c, &sc).is_ok());
  EXPECT_NE(sa.losses, sc.losses);
}

TEST(RecipeTraining, LayerCountsSelectTheIntendedLayers) {
  recipe::Recipe r;
  ASSERT_TRUE(recipe::recipe_preset("bf16_with_nvfp4_mixed", &r).is_ok());
  EXPECT_EQ(r.bf16_layers_at_end, 4);  // the Llama 3.1 8B playbook's default
  for (int64_t l = 0; l < 32; ++l) EXPECT_EQ(r.layer_in_bf16(l, 32), l >= 28) << l;
  recipe::RecipeKnobs k;
  k.layers_at_start_bf16 = 2;
  k.layers_at_end_bf16 = 8;  // the paper's 12B setting
  ASSERT_TRUE(recipe::apply_knobs(k, &r).is_ok());
  for (int64_t l = 0; l < 32; ++l) EXPECT_EQ(r.layer_in_bf16(l, 32), l < 2 || l >= 24) << l;
  TrainConfig bad = tiny_job("bf16_with_fp8_current_scaling_mixed");
  bad.fp4_disable_rht = true;  // an NVFP4 knob on an FP8 recipe would silently do nothing
  TrainSummary s;
  EXPECT_FALSE(run_training(bad, &s).is_ok());
}

// --emulated-weight-cache speeds up emulated MXFP8/NVFP4 GEMMs; on a recipe without such weights it would
// do nothing, so it is refused in one sentence. On the CPU reference it changes nothing.
TEST(RecipeTraining, EmulatedWeightCacheNeedsAnEmulatedRecipe) {
  TrainConfig a = tiny_job("bf16_with_fp8_current_scaling_mixed");
  a.emulated_weight_cache = true;
  a.train_iters = 2;
  TrainSummary s;
  Status st = run_training(a, &s);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("--emulated-weight-cache"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("fp8_e4m3 weights"), std::string::npos) << st.message();
  TrainConfig b = tiny_job("bf16_with_nvfp4_mixed"), c = b;
  b.train_iters = c.train_iters = 3;
  c.emulated_weight_cache = true;
  TrainSummary sb, sc;
  ASSERT_TRUE(run_training(b, &sb).is_ok());
  ASSERT_TRUE(run_training(c, &sc).is_ok());
  EXPECT_EQ(sb.losses, sc.losses);
}
