// CPU tests of LinearWorkspace: Linears sharing one workspace give bit-identical outputs to the same
// Linears with private workspaces (every quantized preset, model call order, 2 steps x 2 micro-batches),
// the shared slots are sized by the largest need (not the sum), lazy allocation and growth, and the bytes
// of one NVFP4 layout computed by hand.
#include <gtest/gtest.h>
#include <algorithm>
#include "recipe/workspace_test_util.h"

namespace nb::recipe {
namespace {

using namespace testing;
using Slot = LinearWorkspace::Slot;

class SharedWorkspaceTest : public ::testing::TestWithParam<std::string> {};

TEST_P(SharedWorkspaceTest, ChainMatchesPrivateWorkspacesBitForBit) {
  Recipe r;
  ASSERT_TRUE(preset_or_block(GetParam(), &r).is_ok());
  r.seed = 0x5eed;
  for (bool call_allocate : {true, false}) {
    ChainRun priv, shared;
    Status st = run_chain(r, Device::cpu, false, false, &priv);
    ASSERT_TRUE(st.is_ok()) << st.message();
    st = run_chain(r, Device::cpu, true, call_allocate, &shared);
    ASSERT_TRUE(st.is_ok()) << st.message();
    expect_bit_identical("y", priv.y, shared.y);
    expect_bit_identical("dx", priv.dx, shared.dx);
    expect_bit_identical("dw", priv.dw, shared.dw);

    // One object shared; its slots hold the largest private need, not the sum.
    ASSERT_EQ(shared.workspaces.size(), 3u);
    ASSERT_TRUE(shared.workspaces[0] && shared.workspaces[0] == shared.workspaces[2]);
    const LinearWorkspace& ws = *shared.workspaces[0];
    ASSERT_EQ(priv.workspaces.size(), 3u);
    ASSERT_TRUE(priv.workspaces[0] && priv.workspaces[1] && priv.workspaces[2]);
    ASSERT_TRUE(priv.workspaces[0] != priv.workspaces[1] && priv.workspaces[1] != priv.workspaces[2]);
    size_t max_in = 0, max_grad = 0, sum = 0;
    for (const auto& p : priv.workspaces) {
      max_in = std::max(max_in, p->need(Slot::input_row));
      max_grad = std::max(max_grad, p->need(Slot::grad));
      EXPECT_EQ(p->bytes(), p->need(Slot::input_row) + p->need(Slot::grad));
      sum += p->bytes();
    }
    EXPECT_EQ(ws.need(Slot::input_row), max_in);
    EXPECT_EQ(ws.need(Slot::grad), max_grad);
    EXPECT_EQ(ws.bytes(), max_in + max_grad);
    EXPECT_LT(ws.bytes(), sum);
    // The maxima come from different Linears (C's input row, B's grad), so this checks per-slot maxima.
    EXPECT_EQ(max_in, priv.workspaces[2]->need(Slot::input_row));
    EXPECT_EQ(max_grad, priv.workspaces[1]->need(Slot::grad));
    EXPECT_GT(priv.workspaces[1]->need(Slot::grad), priv.workspaces[2]->need(Slot::grad));
    if (r.mor.blocks)  // the block rule's input keeps one copy, its column piece: no transient row copy at all
      EXPECT_EQ(max_in, 0u);
    else
      EXPECT_GT(priv.workspaces[2]->need(Slot::input_row), priv.workspaces[1]->need(Slot::input_row));
  }
}

INSTANTIATE_TEST_SUITE_P(QuantizedPresets, SharedWorkspaceTest, ::testing::ValuesIn(quantized_recipe_names()));

// NVFP4, M = in = out = 64: every piece is a multiple of 256 bytes, so the slots carry no alignment padding.
//   per role and copy: data 64*64/2 = 2048, scales 64*64/16 = 256; state block 5 floats + 2 ints = 28
//   input_row slot: 2048 + 256 = 2304        grad slot: 2 * (2048 + 256) = 4608
TEST(LinearWorkspace, NeedsOfOneNvfp4LayerComputedByHand) {
  Recipe r;
  ASSERT_TRUE(recipe_preset("bf16_with_nvfp4_mixed", &r).is_ok());
  Linear lin;
  ASSERT_TRUE(lin.init(r, false, "l", 1, 64, 64, 64, Device::cpu).is_ok());
  ASSERT_TRUE(lin.workspace());
  EXPECT_EQ(lin.workspace()->need(Slot::input_row), 2304u);
  EXPECT_EQ(lin.workspace()->need(Slot::grad), 4608u);
  EXPECT_EQ(lin.workspace()->bytes(), 6912u) << "a private workspace is allocated at init";
  EXPECT_EQ(lin.bytes(), 0u) << "bytes() counts device memory only";
  Linear bf;
  ASSERT_TRUE(bf.init(r, true, "l", 2, 64, 64, 64, Device::cpu).is_ok());
  EXPECT_FALSE(bf.workspace()) << "a BF16 layer has no quantized copies";
}

// Model-like use without allocate(): the slot is allocated on first use and grows when a larger Linear
// joins later; the smaller Linear keeps producing what it produces with a private workspace.
TEST(LinearWorkspace, GrowsOnFirstUseAndForALargerLinear) {
  Recipe r;
  ASSERT_TRUE(recipe_preset("bf16_with_nvfp4_mixed", &r).is_ok());
  const int64_t m = 64;
  auto ws = std::make_shared<LinearWorkspace>(Device::cpu);
  auto run = [&](Linear& lin, int64_t in, int64_t out, uint32_t seed, std::vector<double>* res) -> Status {
    Buffer x, w, y, dy, dx, dw;
    NB_TRY(upload_values(&x, random_bf16_values(m * in, 1.0, seed), m, in, Device::cpu));
    NB_TRY(upload_values(&w, random_bf16_values(out * in, 0.05, seed + 1), out, in, Device::cpu));
    NB_TRY(upload_values(&dy, random_bf16_values(m * out, 1e-3, seed + 2), m, out, Device::cpu));
    NB_TRY(upload_values(&dw, std::vector<float>(size_t(out * in), 0.f), out, in, Device::cpu));
    NB_TRY(Buffer::allocate(&y, DType::f32, Device::cpu, {m, out}));
    NB_TRY(Buffer::allocate(&dx, DType::f32, Device::cpu, {m, in}));
    lin.new_step(1);
    NB_TRY(lin.forward(x.tensor(), w.tensor(), y.tensor(), 0.f, nullptr));
    NB_TRY(lin.backward(dy.tensor(), x.tensor(), w.tensor(), dx.tensor(), 0.f, dw.tensor(), nullptr));
    std::vector<double> a, b, c;
    NB_TRY(download_values(y, &a));
    NB_TRY(download_values(dx, &b));
    NB_TRY(download_values(dw, &c));
    res->clear();
    for (auto* v : {&a, &b, &c}) res->insert(res->end(), v->begin(), v->end());
    return Status::ok();
  };
  Linear small, big, small_private;
  ASSERT_TRUE(small.init(r, false, "small", 1, m, 64, 64, Device::cpu, ws).is_ok());
  EXPECT_EQ(ws->bytes(), 0u) << "a shared workspace waits for allocate() or first use";
  std::vector<double> first, again, priv, ignored;
  ASSERT_TRUE(run(small, 64, 64, 5, &first).is_ok());
  EXPECT_EQ(ws->bytes(), 2304u + 4608u);
  ASSERT_TRUE(big.init(r, false, "big", 2, m, 128, 96, Device::cpu, ws).is_ok());
  EXPECT_EQ(ws->bytes(), 2304u + 4608u) << "init only registers";
  ASSERT_TRUE(run(big, 128, 96, 9, &ignored).is_ok());
  // big: input row 64*128 -> 4096 + 512; grad 64*96 -> 2 * (3072 + 384 -> 512)
  EXPECT_EQ(ws->need(Slot::input_row), 4608u);
  EXPECT_EQ(ws->need(Slot::grad), 7168u);
  EXPECT_EQ(ws->bytes(), 4608u + 7168u);
  ASSERT_TRUE(run(small, 64, 64, 5, &again).is_ok());
  ASSERT_TRUE(small_private.init(r, false, "small", 1, m, 64, 64, Device::cpu).is_ok());
  ASSERT_TRUE(run(small_private, 64, 64, 5, &priv).is_ok());
  EXPECT_TRUE(first == priv);
  EXPECT_TRUE(again == priv);
  EXPECT_EQ(ws->bytes(), 4608u + 7168u) << "a smaller need does not shrink the slots";
}

TEST(LinearWorkspace, RejectsAWorkspaceOnAnotherDevice) {
  Recipe r;
  ASSERT_TRUE(recipe_preset("bf16_with_mxfp8_mixed", &r).is_ok());
  Linear lin;
  Status st = lin.init(r, false, "layers.0.attn.qkv", 1, 64, 64, 64, Device::cpu,
                       std::make_shared<LinearWorkspace>(Device::cuda));
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("layers.0.attn.qkv"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace nb::recipe
