// CPU tests of the frozen-weight mode of recipe::Linear (linear.h): for every preset it runs, a frozen
// chain (freeze_weight once, no Wgrad, no w/x/dw arguments) gives the trained chain's y and dx bit for
// bit, with private or shared workspaces; the weight copies it keeps per format (a per-tensor FP8 weight's
// row copy holds the trained column copy's codes transposed); the shared weight_col slot's size; the
// refusals (delayed scaling, forward before freeze_weight, freeze_weight where it does not apply).
#include <gtest/gtest.h>
#include <algorithm>
#include "recipe/frozen_test_util.h"

namespace nb::recipe {
namespace {

using namespace testing;
using Slot = LinearWorkspace::Slot;

class FrozenPresetTest : public ::testing::TestWithParam<std::string> {};

// The bytes of a [rows, cols] copy in [cols, rows] order.
static std::vector<uint8_t> transpose_bytes(const std::vector<uint8_t>& a, int64_t rows, int64_t cols) {
  std::vector<uint8_t> t(a.size());
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) t[size_t(j * rows + i)] = a[size_t(i * cols + j)];
  return t;
}

TEST_P(FrozenPresetTest, SameYAndDxAsTheTrainedLinearAndNoWgrad) {
  Recipe r;
  ASSERT_TRUE(frozen_recipe(GetParam(), &r).is_ok());
  FrozenChainRun trained, frozen, frozen_shared;
  Status st = run_frozen_chain(r, Device::cpu, false, false, &trained);
  ASSERT_TRUE(st.is_ok()) << st.message();
  st = run_frozen_chain(r, Device::cpu, true, false, &frozen);
  ASSERT_TRUE(st.is_ok()) << st.message();
  st = run_frozen_chain(r, Device::cpu, true, true, &frozen_shared);
  ASSERT_TRUE(st.is_ok()) << st.message();
  expect_bit_identical("y", trained.y, frozen.y);
  expect_bit_identical("dx", trained.dx, frozen.dx);
  expect_bit_identical("y (shared workspace)", trained.y, frozen_shared.y);
  expect_bit_identical("dx (shared workspace)", trained.dx, frozen_shared.dx);
  EXPECT_TRUE(frozen.dw_untouched && frozen_shared.dw_untouched) << "a frozen Linear wrote dw";
  if (!r.quantized()) return;
  const bool per_tensor = r.weight.fmt == Fmt::fp8_e4m3 || r.weight.fmt == Fmt::fp8_e5m2;
  const bool two_d = r.weight.fmt == Fmt::nvfp4 && r.weight.two_d;
  for (int l = 0; l < 3; ++l) {
    SCOPED_TRACE("linear " + std::to_string(l));
    const QuantizedBytes &t = trained.weight[size_t(l)], &f = frozen.weight[size_t(l)];
    EXPECT_TRUE(t.row_data == f.row_data && t.row_scales == f.row_scales) << "weight row copies differ";
    EXPECT_EQ(t.row_amax, f.row_amax);
    EXPECT_EQ(t.scale_inv, f.scale_inv);
    if (per_tensor) {
      // The premise of the transient transpose: the trained column copy is the row copy's codes transposed.
      EXPECT_TRUE(f.col_data.empty()) << "a frozen per-tensor FP8 weight keeps its row copy only";
      EXPECT_TRUE(t.col_data == transpose_bytes(f.row_data, t.rows, t.cols));
    } else if (two_d) {
      EXPECT_TRUE(f.col_data.empty() && t.col_data.empty());
    } else {
      EXPECT_FALSE(f.col_data.empty());
      EXPECT_TRUE(t.col_data == f.col_data && t.col_scales == f.col_scales) << "weight column copies differ";
    }
  }
  // Only a per-tensor FP8 weight needs the transient transpose: the shared slot holds the largest weight.
  int64_t largest = 0;
  for (const ChainShape& c : kChain) largest = std::max(largest, c.in * c.out);
  const LinearWorkspace& ws = *frozen_shared.workspaces[0];
  EXPECT_EQ(ws.need(Slot::weight_col), per_tensor ? size_t(largest) : 0u);
  EXPECT_EQ(trained.workspaces[0]->need(Slot::weight_col), 0u);
  const LinearWorkspace& priv = *frozen.workspaces[0];
  EXPECT_EQ(priv.need(Slot::weight_col), per_tensor ? size_t(kChain[0].in * kChain[0].out) : 0u);
  // Frozen: no grad column copy in the workspace either.
  EXPECT_LT(priv.need(Slot::grad), trained.workspaces[0]->need(Slot::grad));
  EXPECT_EQ(priv.need(Slot::input_row), trained.workspaces[0]->need(Slot::input_row));
}

INSTANTIATE_TEST_SUITE_P(FrozenRecipes, FrozenPresetTest, ::testing::ValuesIn(frozen_recipe_names()),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           std::string s = info.param;
                           std::replace(s.begin(), s.end(), '+', '_');
                           return s;
                         });

// A BF16 layer of a quantized recipe, frozen: forward as usual, backward = Dgrad on the given w only.
TEST(Frozen, Bf16LayerRunsDgradOnly) {
  Recipe r;
  ASSERT_TRUE(recipe_preset("bf16_with_nvfp4_mixed", &r).is_ok());
  constexpr int64_t m = 32, k = 48, n = 24;  // a BF16 layer takes any shape
  Buffer x, w, y, dy, dx, dx_ref, y_ref, dw;
  ASSERT_TRUE(upload_values(&x, random_bf16_values(m * k, 1.0, 1), m, k, Device::cpu).is_ok());
  ASSERT_TRUE(upload_values(&w, random_bf16_values(n * k, 0.05, 2), n, k, Device::cpu).is_ok());
  ASSERT_TRUE(upload_values(&dy, random_bf16_values(m * n, 1e-3, 3), m, n, Device::cpu).is_ok());
  std::vector<float> zeros(size_t(n * k), 0.f);
  ASSERT_TRUE(upload_values(&dw, zeros, n, k, Device::cpu).is_ok());
  for (Buffer* b : {&y, &y_ref}) ASSERT_TRUE(Buffer::allocate(b, DType::f32, Device::cpu, {m, n}).is_ok());
  for (Buffer* b : {&dx, &dx_ref}) ASSERT_TRUE(Buffer::allocate(b, DType::f32, Device::cpu, {m, k}).is_ok());
  Linear trained, frozen;
  ASSERT_TRUE(trained.init(r, true, "l", 1, m, k, n, Device::cpu).is_ok());
  ASSERT_TRUE(frozen.init(r, true, "l", 1, m, k, n, Device::cpu, nullptr, true).is_ok());
  EXPECT_TRUE(frozen.frozen());
  EXPECT_FALSE(trained.frozen());
  Status st = frozen.freeze_weight(w.tensor(), nullptr);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("BF16"), std::string::npos) << st.message();
  ASSERT_TRUE(trained.forward(x.tensor(), w.tensor(), y_ref.tensor(), 0.f, nullptr).is_ok());
  ASSERT_TRUE(
      trained.backward(dy.tensor(), x.tensor(), w.tensor(), dx_ref.tensor(), 0.f, dw.tensor(), nullptr).is_ok());
  ASSERT_TRUE(frozen.forward(x.tensor(), w.tensor(), y.tensor(), 0.f, nullptr).is_ok());
  st = frozen.backward(dy.tensor(), Tensor{}, w.tensor(), dx.tensor(), 0.f, Tensor{}, nullptr);
  ASSERT_TRUE(st.is_ok()) << st.message();
  EXPECT_TRUE(std::equal(y.ptr<float>(), y.ptr<float>() + m * n, y_ref.ptr<float>()));
  EXPECT_TRUE(std::equal(dx.ptr<float>(), dx.ptr<float>() + m * k, dx_ref.ptr<float>()));
  // Its backward still needs the BF16 w (the Dgrad operand).
  st = frozen.backward(dy.tensor(), Tensor{}, Tensor{}, dx.tensor(), 0.f, Tensor{}, nullptr);
  EXPECT_FALSE(st.is_ok());
}

TEST(Frozen, DelayedScalingIsRefusedAtInit) {
  Recipe r;
  ASSERT_TRUE(recipe_preset("bf16_with_fp8_delayed_scaling_mixed", &r).is_ok());
  Linear lin;
  Status st = lin.init(r, false, "layers.0.attn.qkv", 1, 128, 256, 128, Device::cpu, nullptr, true);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("layers.0.attn.qkv"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("delayed"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("current scaling"), std::string::npos) << st.message();
  // A BF16 layer of that recipe scales nothing: it may be frozen.
  EXPECT_TRUE(lin.init(r, true, "layers.0.attn.qkv", 1, 128, 256, 128, Device::cpu, nullptr, true).is_ok());
}

TEST(Frozen, ForwardBeforeFreezeWeightAndFreezeOnATrainedLinearAreErrors) {
  Recipe r;
  ASSERT_TRUE(recipe_preset("bf16_with_fp8_current_scaling_mixed", &r).is_ok());
  constexpr int64_t m = 128, k = 256, n = 128;
  Buffer x, w, y, w_bad;
  ASSERT_TRUE(upload_values(&x, random_bf16_values(m * k, 1.0, 1), m, k, Device::cpu).is_ok());
  ASSERT_TRUE(upload_values(&w, random_bf16_values(n * k, 0.05, 2), n, k, Device::cpu).is_ok());
  ASSERT_TRUE(upload_values(&w_bad, random_bf16_values(n * k, 0.05, 2), k, n, Device::cpu).is_ok());
  ASSERT_TRUE(Buffer::allocate(&y, DType::f32, Device::cpu, {m, n}).is_ok());
  Linear frozen;
  ASSERT_TRUE(frozen.init(r, false, "l", 1, m, k, n, Device::cpu, nullptr, true).is_ok());
  Status st = frozen.forward(x.tensor(), w.tensor(), y.tensor(), 0.f, nullptr);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("freeze_weight"), std::string::npos) << st.message();
  st = frozen.freeze_weight(w_bad.tensor(), nullptr);  // [in, out]: the shape rules of forward's w apply
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("w is"), std::string::npos) << st.message();
  ASSERT_TRUE(frozen.freeze_weight(w.tensor(), nullptr).is_ok());
  ASSERT_TRUE(frozen.forward(x.tensor(), Tensor{}, y.tensor(), 0.f, nullptr).is_ok());
  frozen.new_step(1);  // keeps the frozen weight
  ASSERT_TRUE(frozen.forward(x.tensor(), Tensor{}, y.tensor(), 0.f, nullptr).is_ok());

  Linear trained;
  ASSERT_TRUE(trained.init(r, false, "l", 1, m, k, n, Device::cpu).is_ok());
  st = trained.freeze_weight(w.tensor(), nullptr);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("frozen = true"), std::string::npos) << st.message();
  Linear none;
  EXPECT_FALSE(none.freeze_weight(w.tensor(), nullptr).is_ok());
}

// A frozen backward reads only dy and the frozen weight (no Wgrad), so it needs no forward of its micro-batch
// (pipeline parallelism runs other micro-batches' forwards in between): the same dx with or without another
// forward before it; before freeze_weight it is refused.
TEST(Frozen, BackwardReadsOnlyTheGradientAndTheFrozenWeight) {
  Recipe r;
  ASSERT_TRUE(recipe_preset("bf16_with_mxfp8_mixed", &r).is_ok());
  constexpr int64_t m = 128, k = 256, n = 128;
  Buffer w, dy, dx;
  ASSERT_TRUE(upload_values(&w, random_bf16_values(n * k, 0.05, 2), n, k, Device::cpu).is_ok());
  ASSERT_TRUE(upload_values(&dy, random_bf16_values(m * n, 1e-3, 3), m, n, Device::cpu).is_ok());
  ASSERT_TRUE(Buffer::allocate(&dx, DType::f32, Device::cpu, {m, k}).is_ok());
  Linear frozen;
  ASSERT_TRUE(frozen.init(r, false, "l", 1, m, k, n, Device::cpu, nullptr, true).is_ok());
  Status st = frozen.backward(dy.tensor(), Tensor{}, Tensor{}, dx.tensor(), 0.f, Tensor{}, nullptr);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("before freeze_weight"), std::string::npos) << st.message();
  ASSERT_TRUE(frozen.freeze_weight(w.tensor(), nullptr).is_ok());
  ASSERT_TRUE(frozen.backward(dy.tensor(), Tensor{}, Tensor{}, dx.tensor(), 0.f, Tensor{}, nullptr).is_ok());
  const std::vector<float> alone(dx.ptr<float>(), dx.ptr<float>() + m * k);
  Buffer x, y;  // another micro-batch's forward, then the same backward in a fresh Linear (its SR counter at 0)
  ASSERT_TRUE(upload_values(&x, random_bf16_values(m * k, 1.0, 4), m, k, Device::cpu).is_ok());
  ASSERT_TRUE(Buffer::allocate(&y, DType::f32, Device::cpu, {m, n}).is_ok());
  Linear again;
  ASSERT_TRUE(again.init(r, false, "l", 1, m, k, n, Device::cpu, nullptr, true).is_ok());
  ASSERT_TRUE(again.freeze_weight(w.tensor(), nullptr).is_ok());
  ASSERT_TRUE(again.forward(x.tensor(), Tensor{}, y.tensor(), 0.f, nullptr).is_ok());
  std::fill(dx.ptr<float>(), dx.ptr<float>() + m * k, 0.f);
  ASSERT_TRUE(again.backward(dy.tensor(), Tensor{}, Tensor{}, dx.tensor(), 0.f, Tensor{}, nullptr).is_ok());
  EXPECT_EQ(std::vector<float>(dx.ptr<float>(), dx.ptr<float>() + m * k), alone);
}

// A lone frozen Linear against the FP64 model on its own operands (run_linear's check without Wgrad).
TEST(Frozen, FpropAndDgradMatchFp64OnTheQuantizedOperands) {
  for (const std::string& name : frozen_recipe_names()) {
    SCOPED_TRACE(name);
    Recipe r;
    ASSERT_TRUE(frozen_recipe(name, &r).is_ok());
    constexpr int64_t m = 128, k = 256, n = 128;
    std::vector<float> x = random_bf16_values(m * k, 1.0, 1), w = random_bf16_values(n * k, 0.05, 2),
                       dy = random_bf16_values(m * n, 1e-3, 3);
    LinearRun run;
    Status st = run_frozen_single(r, Device::cpu, m, k, n, x, w, dy, &run);
    ASSERT_TRUE(st.is_ok()) << st.message();
    const double dist = check_frozen_run(r, Device::cpu, m, k, n, x, w, dy, run);
    if (r.quantized()) { EXPECT_GT(dist, 1e-4) << "no quantization error at all"; }
    EXPECT_LT(dist, r.input.fmt == Fmt::nvfp4 ? 0.3 : 0.1);
    if (r.quantized()) {
      EXPECT_TRUE(run.q[0].col_data.empty() && run.q[0].col_scales.empty()) << "frozen: no input column copy";
      EXPECT_TRUE(run.q[2].col_data.empty() && run.q[2].col_scales.empty()) << "frozen: no grad column copy";
    }
    EXPECT_EQ(run.health.nonfinite, 0);
  }
}

}  // namespace
}  // namespace nb::recipe
