// Quantized layers without compute copies (ParamStore's master-only range): the layout, the optimizer's
// pieces, and a model trained that way matching, bit for bit, the same model keeping every compute copy.
#include <gtest/gtest.h>
#include "master_only_util.h"
#include "model/llama_model.h"
#include "model_test_util.h"

using namespace nb;
using nb::testing::tiny_config;

TEST(MasterOnly, StoreLayoutAndPieces) {
  LlamaConfig c = tiny_config();
  ParamStore all, holed;
  ASSERT_TRUE(all.allocate(c, Device::cpu).is_ok());
  ASSERT_TRUE(holed.allocate(c, Device::cpu, 1, 2).is_ok());  // layer 1's linears only
  const ParamInfo& q1 = holed.info("model.layers.1.self_attn.q_proj.weight");
  const ParamInfo& d1 = holed.info("model.layers.1.mlp.down_proj.weight");
  EXPECT_EQ(holed.master_only_elements(), d1.offset + d1.numel - q1.offset);
  EXPECT_EQ(all.bytes() - holed.bytes(), size_t(holed.master_only_elements()) * 4);  // FP32 compute on the cpu
  EXPECT_FALSE(holed.has_compute("model.layers.1.self_attn.v_proj.weight"));
  EXPECT_TRUE(holed.has_compute("model.layers.0.mlp.down_proj.weight"));
  EXPECT_TRUE(holed.has_compute("model.layers.1.input_layernorm.weight"));
  EXPECT_TRUE(holed.has_compute("lm_head.weight"));
  // Pieces tile [0, total): before, inside (no compute view), after; compute views stay contiguous.
  auto pieces = holed.compute_pieces(0, holed.total());
  ASSERT_EQ(pieces.size(), 3u);
  EXPECT_EQ(pieces[0].begin, 0);
  EXPECT_EQ(pieces[1].begin, q1.offset);
  EXPECT_EQ(pieces[1].compute.data, nullptr);
  EXPECT_EQ(pieces[2].end, holed.total());
  EXPECT_EQ(static_cast<float*>(pieces[2].compute.data), static_cast<float*>(pieces[0].compute.data) + q1.offset);
  const Tensor lm = holed.compute("lm_head.weight");
  EXPECT_EQ(static_cast<float*>(lm.data), static_cast<float*>(pieces[0].compute.data) +
                                              holed.info("lm_head.weight").offset - holed.master_only_elements());
  // A range that does not touch the hole is one piece.
  EXPECT_EQ(holed.compute_pieces(0, q1.offset).size(), 1u);
}

class MasterOnlyRecipe : public ::testing::TestWithParam<std::string> {};

TEST_P(MasterOnlyRecipe, TrainsExactlyLikeKeepingComputeCopies) {
  nb::testing::expect_master_only_trains_like_full(GetParam(), Device::cpu);
}

INSTANTIATE_TEST_SUITE_P(Recipes, MasterOnlyRecipe,
                         ::testing::Values("bf16_with_fp8_current_scaling_mixed", "bf16_with_nvfp4_mixed"));
