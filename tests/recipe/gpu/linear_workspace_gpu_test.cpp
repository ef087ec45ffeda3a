// GPU tests of LinearWorkspace: on cuda, three Linears sharing one workspace (model call order, 2 steps x
// 2 micro-batches) give bit-identical y, dx, dw to the same Linears with private workspaces, for every
// quantized preset, with and without allocate() (the growth path synchronizes before freeing); the bytes
// of one NVFP4 layer add up to what the Linear owned before the workspace existed.
#include <gtest/gtest.h>
#include <algorithm>
#include "common/gpu.h"
#include "recipe/workspace_test_util.h"

namespace nb::recipe {
namespace {

using namespace testing;
using Slot = LinearWorkspace::Slot;

class SharedWorkspaceGpuTest : public ::testing::TestWithParam<std::string> {};

TEST_P(SharedWorkspaceGpuTest, ChainMatchesPrivateWorkspacesBitForBit) {
  NB_REQUIRE_GPU();
  Recipe r;
  ASSERT_TRUE(preset_or_block(GetParam(), &r).is_ok());
  r.seed = 0x5eed;
  for (bool call_allocate : {true, false}) {
    ChainRun priv, shared;
    Status st = run_chain(r, Device::cuda, false, false, &priv);
    ASSERT_TRUE(st.is_ok()) << st.message();
    st = run_chain(r, Device::cuda, true, call_allocate, &shared);
    ASSERT_TRUE(st.is_ok()) << st.message();
    expect_bit_identical("y", priv.y, shared.y);
    expect_bit_identical("dx", priv.dx, shared.dx);
    expect_bit_identical("dw", priv.dw, shared.dw);
    const LinearWorkspace& ws = *shared.workspaces[0];
    size_t max_in = 0, max_grad = 0, sum = 0;
    for (const auto& p : priv.workspaces) {
      max_in = std::max(max_in, p->need(Slot::input_row));
      max_grad = std::max(max_grad, p->need(Slot::grad));
      sum += p->bytes();
    }
    EXPECT_EQ(ws.bytes(), max_in + max_grad);
    EXPECT_LT(ws.bytes(), sum);
    // What each Linear owns does not depend on where its transient copies live.
    for (int l = 0; l < 3; ++l) EXPECT_EQ(priv.linear_bytes[size_t(l)], shared.linear_bytes[size_t(l)]) << l;
  }
}

INSTANTIATE_TEST_SUITE_P(QuantizedPresets, SharedWorkspaceGpuTest, ::testing::ValuesIn(quantized_recipe_names()));

// NVFP4, M = in = out = 64. Before the workspace, bytes() counted every copy of the three roles:
//   3 roles x (2 copies x (data 2048 + scales 256) + state 28) = 3 x 4636 = 13908
// Now the Linear owns input column (2304) + its state (28), the 2D weight's row copy only (2304: Dgrad
// reads it as the column operand) + its state (28), grad state (28) = 4692 and its private workspace
// holds input row (2304) + grad both (4608) = 6912: the former 13908 less the weight column copy (2304).
TEST(LinearWorkspaceGpu, OwnedPlusWorkspaceBytesEqualTheFormerTotalLessTheWeightColumnCopy) {
  NB_REQUIRE_GPU();
  Recipe r;
  ASSERT_TRUE(recipe_preset("bf16_with_nvfp4_mixed", &r).is_ok());
  Linear lin;
  ASSERT_TRUE(lin.init(r, false, "l", 1, 64, 64, 64, Device::cuda).is_ok());
  EXPECT_EQ(lin.bytes(), 4692u);
  EXPECT_EQ(lin.workspace()->bytes(), 6912u);
  EXPECT_EQ(lin.bytes() + lin.workspace()->bytes(), 13908u - 2304u);
  // With 1D weights (--fp4-disable-2d) the weight keeps both copies again.
  RecipeKnobs k;
  k.fp4_disable_2d = true;
  ASSERT_TRUE(apply_knobs(k, &r).is_ok());
  Linear lin1d;
  ASSERT_TRUE(lin1d.init(r, false, "l", 1, 64, 64, 64, Device::cuda).is_ok());
  EXPECT_EQ(lin1d.bytes(), 6996u);
}

}  // namespace
}  // namespace nb::recipe
