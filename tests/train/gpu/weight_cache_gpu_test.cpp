// CUDA: --emulated-weight-cache (each MXFP8/NVFP4 weight dequantized to BF16 once per step instead of in
// every micro-batch's Fprop and Dgrad) trains bit for bit as the run without it: the emulated GEMMs read
// the same BF16 values in the same problems (the tiny model's GEMMs are never chunked).
#include <gtest/gtest.h>
#include "common/gpu.h"
#include "train/trainer.h"

using namespace nb;

class WeightCacheCuda : public ::testing::TestWithParam<const char*> {};

TEST_P(WeightCacheCuda, SameLossesWithAndWithoutTheCache) {
  NB_REQUIRE_GPU();
  TrainConfig c;
  c.device = "cuda";
  c.model = "tiny";
  c.recipe = GetParam();
  c.train_iters = 4;
  c.lr_warmup_iters = 1;
  c.micro_batch_size = 2;
  c.global_batch_size = 8;  // 4 micro-batches: the cache serves each step's 4 Fprops and Dgrads
  c.seq_length = 64;
  c.log_interval = 100;
  c.num_layers_at_start_in_bf16 = 0;
  c.num_layers_at_end_in_bf16 = 0;
  TrainConfig k = c;
  k.emulated_weight_cache = true;
  TrainSummary plain, kept;
  Status st = run_training(c, &plain);
  ASSERT_TRUE(st.is_ok()) << st.message();
  st = run_training(k, &kept);
  ASSERT_TRUE(st.is_ok()) << st.message();
  ASSERT_EQ(plain.losses.size(), 4u);
  EXPECT_EQ(plain.losses, kept.losses);
}

INSTANTIATE_TEST_SUITE_P(Recipes, WeightCacheCuda, ::testing::Values("bf16_with_nvfp4_mixed", "bf16_with_mxfp8_mixed"));
