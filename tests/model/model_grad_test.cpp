// The tiny Llama on the CPU backend: gradients against central finite differences of the loss,
// and memorization of one fixed batch (the whole forward/backward/optimizer path learns).
#include <gtest/gtest.h>
#include <cmath>
#include <random>
#include <vector>
#include "model/llama_model.h"
#include "model_test_util.h"
#include "ops/adamw.h"
#include "ops/elementwise.h"
#include "recipe/recipe.h"

using namespace nb;
using nb::testing::fixed_batch;
using nb::testing::tiny_config;

namespace {

double loss_of(LlamaModel& m, const std::vector<int32_t>& tok, const std::vector<int32_t>& lab) {
  double sum = 0;
  EXPECT_TRUE(m.forward_loss(tok.data(), lab.data(), &sum).is_ok());
  return sum / double(tok.size());
}

}  // namespace

// Directional derivatives: for each parameter tensor, a random unit direction r; the analytic
// g.r against (L(w + h r) - L(w - h r)) / 2h. FP32 forward: the loss (about ln 256 = 5.5) carries
// ~1e-6 relative rounding, so with h = 1e-2 the difference quotient's noise is ~1e-4 absolute and
// its truncation error O(h^2 * L''') is smaller still; tolerance 2e-3 absolute + 2% relative.
TEST(TinyLlamaCpu, GradientsMatchFiniteDifferences) {
  LlamaConfig c = tiny_config();
  MicroBatchShape s{2, 16};
  LlamaModel m;
  ASSERT_TRUE(m.init(c, Device::cpu, s, Recompute::none, 7).is_ok());
  std::vector<int32_t> tok, lab;
  fixed_batch(c, s, 3, &tok, &lab);
  ParamStore& P = m.params();
  ops::fill(P.flat_grad(), 0.f, nullptr);
  double sum = 0;
  ASSERT_TRUE(m.forward_backward(tok.data(), lab.data(), 1.0f / float(tok.size()), &sum).is_ok());
  std::mt19937 rng(11);
  std::normal_distribution<float> nd;
  for (const auto& p : P.params()) {
    Tensor w = P.compute(p.name), g = P.grad(p.name);
    std::vector<float> r(size_t(p.numel));
    double nrm = 0;
    for (auto& x : r) {
      x = nd(rng);
      nrm += double(x) * x;
    }
    double analytic = 0;
    for (int64_t i = 0; i < p.numel; ++i) {
      r[i] = float(r[i] / std::sqrt(nrm));
      analytic += double(g.ptr<float>()[i]) * r[i];
    }
    const float h = 1e-2f;
    std::vector<float> w0(w.ptr<float>(), w.ptr<float>() + p.numel);
    for (int64_t i = 0; i < p.numel; ++i) w.ptr<float>()[i] = w0[i] + h * r[i];
    double lp = loss_of(m, tok, lab);
    for (int64_t i = 0; i < p.numel; ++i) w.ptr<float>()[i] = w0[i] - h * r[i];
    double lm = loss_of(m, tok, lab);
    std::copy(w0.begin(), w0.end(), w.ptr<float>());
    double numeric = (lp - lm) / (2.0 * h);
    EXPECT_NEAR(analytic, numeric, 2e-3 + 0.02 * std::fabs(numeric)) << p.name;
  }
}

// Full and selective recompute give the same gradients as keeping every activation.
TEST(TinyLlamaCpu, RecomputeModesAgree) {
  LlamaConfig c = tiny_config();
  MicroBatchShape s{2, 16};
  std::vector<int32_t> tok, lab;
  fixed_batch(c, s, 5, &tok, &lab);
  std::vector<float> ref;
  for (Recompute rc : {Recompute::none, Recompute::selective, Recompute::full}) {
    LlamaModel m;
    ASSERT_TRUE(m.init(c, Device::cpu, s, rc, 9).is_ok());
    double sum = 0;
    ASSERT_TRUE(m.forward_backward(tok.data(), lab.data(), 1.0f / float(tok.size()), &sum).is_ok());
    Tensor g = m.params().flat_grad();
    std::vector<float> got(g.ptr<float>(), g.ptr<float>() + g.numel());
    if (ref.empty()) {
      ref = got;
      continue;
    }
    for (size_t i = 0; i < ref.size(); ++i) ASSERT_EQ(ref[i], got[i]) << "element " << i;
  }
  EXPECT_LT(LlamaModel::plan_activation_bytes(c, Device::cpu, s, Recompute::full),
            LlamaModel::plan_activation_bytes(c, Device::cpu, s, Recompute::none));
}

// Quantized recipes under full recompute keep each linear's input column copy in a workspace slot shared by
// the layers (the recomputed forward rewrites it right before the layer's backward): the same gradients, bit
// for bit, as keeping one copy per linear.
TEST(TinyLlamaCpu, FullRecomputeSharesQuantizedInputCopies) {
  LlamaConfig c = tiny_config();
  MicroBatchShape s{2, 64};  // 128 tokens: every format's token multiple
  std::vector<int32_t> tok, lab;
  fixed_batch(c, s, 5, &tok, &lab);
  for (const char* name : {"bf16_with_fp8_current_scaling_mixed", "bf16_with_fp8_subchannel_scaling_mixed",
                           "bf16_with_mxfp8_mixed", "bf16_with_nvfp4_mixed"}) {
    SCOPED_TRACE(name);
    recipe::Recipe r;
    ASSERT_TRUE(recipe::recipe_preset(name, &r).is_ok());
    r.bf16_layers_at_start = r.bf16_layers_at_end = 0;
    std::vector<float> grads[2];
    size_t shared[2] = {0, 0};  // the first input_col slot's need
    for (int i = 0; i < 2; ++i) {
      LlamaModel m;
      ASSERT_TRUE(m.init(c, Device::cpu, s, i == 0 ? Recompute::none : Recompute::full, 9, r).is_ok());
      double sum = 0;
      ASSERT_TRUE(m.forward_backward(tok.data(), lab.data(), 1.0f / float(tok.size()), &sum).is_ok());
      Tensor g = m.params().flat_grad();
      grads[i].assign(g.ptr<float>(), g.ptr<float>() + g.numel());
      shared[i] = m.linear(0, 0).workspace()->need(recipe::LinearWorkspace::Slot::input_col0);
    }
    ASSERT_EQ(grads[0].size(), grads[1].size());
    for (size_t i = 0; i < grads[0].size(); ++i) ASSERT_EQ(grads[0][i], grads[1][i]) << "element " << i;
    EXPECT_EQ(shared[0], 0u) << "without recompute each linear owns its input column copy";
    EXPECT_GT(shared[1], 0u) << "full recompute should keep the input column copies in the shared slots";
  }
}

TEST(TinyLlamaCpu, MemorizesOneBatch) {
  LlamaConfig c = tiny_config();
  MicroBatchShape s{2, 32};
  LlamaModel m;
  ASSERT_TRUE(m.init(c, Device::cpu, s, Recompute::none, 1).is_ok());
  std::vector<int32_t> tok, lab;
  fixed_batch(c, s, 2, &tok, &lab);
  ParamStore& P = m.params();
  double first = 0, last = 0;
  for (int step = 0; step < 300; ++step) {
    ops::fill(P.flat_grad(), 0.f, nullptr);
    double sum = 0;
    ASSERT_TRUE(m.forward_backward(tok.data(), lab.data(), 1.0f / float(tok.size()), &sum).is_ok());
    last = sum / double(tok.size());
    if (step == 0) first = last;
    ops::AdamWParams ap{3e-3f, 0.9f, 0.95f, 1e-8f, 0.0f, step + 1, 1.0f};
    ops::adamw_update(P.flat_master(), P.flat_grad(), P.flat_m(), P.flat_v(), P.flat_compute(), ap, nullptr);
    if (last < 0.05) break;
  }
  EXPECT_NEAR(first, std::log(double(c.vocab)), 0.5);
  EXPECT_LT(last, 0.1) << "first loss " << first;
}
