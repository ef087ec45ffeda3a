// Cross-entropy, AdamW and the elementwise helpers on the CPU reference.
#include <gtest/gtest.h>
#include <cmath>
#include "core/bf16.h"
#include "ops/adamw.h"
#include "ops/cross_entropy.h"
#include "ops/elementwise.h"
#include "ops_test_util.h"

using namespace nb;
using namespace nb::ops;
using namespace nb::ops::testing;

TEST(CrossEntropy, MatchesDirectLogSoftmaxAndGradient) {
  const int64_t T = 4, V = 11;
  auto logits = random_vec(T * V, 21, -5.f, 5.f);
  logits[1 * V + 3] = 40.f;  // a large logit: the max subtraction must keep exp finite
  std::vector<int32_t> tgt = {2, 3, -1, 10};
  auto grad = logits;
  std::vector<float> loss(T);
  const float scale = 0.25f;
  cross_entropy_fwd_bwd(host_f32(grad, {T, V}), host_i32(tgt, {T}), scale, host_f32(loss, {T}), nullptr);
  for (int64_t t = 0; t < T; ++t) {
    if (tgt[t] < 0) {
      EXPECT_EQ(loss[t], 0.f);
      for (int64_t j = 0; j < V; ++j) EXPECT_EQ(grad[t * V + j], 0.f);
      continue;
    }
    // Direct log-softmax in long double without any shift (safe for these magnitudes).
    long double z = 0;
    for (int64_t j = 0; j < V; ++j) z += std::exp((long double)logits[t * V + j]);
    double logp = double((long double)logits[t * V + tgt[t]] - std::log(z));
    EXPECT_NEAR(loss[t], -logp, 1e-6 * std::fmax(1.0, std::fabs(logp)));
    for (int64_t j = 0; j < V; ++j) {
      double p = double(std::exp((long double)logits[t * V + j]) / z);
      EXPECT_NEAR(grad[t * V + j], (p - (j == tgt[t] ? 1.0 : 0.0)) * scale, 1e-7);
    }
  }
  // The gradient is d(sum of losses * scale)/d logits: check by finite differences too.
  auto work = logits;
  std::vector<float> l2(T);
  auto n = numeric_grad(logits, [&] {
    work = logits;
    cross_entropy_fwd_bwd(host_f32(work, {T, V}), host_i32(tgt, {T}), 1.f, host_f32(l2, {T}), nullptr);
    double s = 0;
    for (float v : l2) s += double(v) * scale;
    return s;
  });
  EXPECT_GRAD_NEAR(grad, n, 1e-3);
}

TEST(AdamW, OneStepMatchesHandComputation) {
  // Step 1: m = (1-b1) g, v = (1-b2) g^2, so m_hat = g, v_hat = g^2 and the update is
  // lr * g / (|g| + eps) after the decoupled decay p * (1 - lr * wd).
  std::vector<float> p = {1.0f, -2.0f, 0.5f, 3.0f}, g = {0.5f, -0.25f, 0.0f, 4.0f};
  std::vector<float> m(4, 0.f), v(4, 0.f), copy(4);
  AdamWParams prm{};
  prm.lr = 0.1f;
  prm.beta1 = 0.9f;
  prm.beta2 = 0.95f;
  prm.eps = 1e-8f;
  prm.weight_decay = 0.5f;
  prm.step = 1;
  prm.grad_scale = 2.0f;  // the effective gradient is 2 g
  adamw_update(host_f32(p, {4}), host_f32(g, {4}), host_f32(m, {4}), host_f32(v, {4}), host_f32(copy, {4}), prm,
               nullptr);
  const double expect_p[4] = {1.0 * 0.95 - 0.1 * 1.0 / (1.0 + 1e-8), -2.0 * 0.95 + 0.1 * 0.5 / (0.5 + 1e-8), 0.5 * 0.95,
                              3.0 * 0.95 - 0.1 * 8.0 / (8.0 + 1e-8)};
  const double eff_g[4] = {1.0, -0.5, 0.0, 8.0};
  // Tolerances: a few FP32 ulps of each value (the betas themselves are FP32, 0.9f != 0.9).
  for (int i = 0; i < 4; ++i) {
    EXPECT_NEAR(p[i], expect_p[i], 1e-6) << i;
    EXPECT_NEAR(m[i], 0.1 * eff_g[i], 4e-7 * std::fmax(1.0, std::fabs(eff_g[i]))) << i;
    EXPECT_NEAR(v[i], 0.05 * eff_g[i] * eff_g[i], 4e-7 * std::fmax(1.0, eff_g[i] * eff_g[i])) << i;
    EXPECT_EQ(copy[i], p[i]);
  }
  // Step 2 with bias correction: m_hat = m / (1 - 0.81), v_hat = v / (1 - 0.9025).
  std::vector<float> g2 = {-1.0f, 0.0f, 0.0f, 0.0f};
  prm.step = 2;
  prm.weight_decay = 0.f;
  prm.grad_scale = 1.f;
  float p0 = p[0];
  adamw_update(host_f32(p, {4}), host_f32(g2, {4}), host_f32(m, {4}), host_f32(v, {4}), Tensor{}, prm, nullptr);
  double m2 = 0.9 * 0.1 + 0.1 * -1.0, v2 = 0.95 * 0.05 + 0.05 * 1.0;
  double upd = 0.1 * (m2 / (1 - 0.81)) / (std::sqrt(v2 / (1 - 0.9025)) + 1e-8);
  EXPECT_NEAR(m[0], m2, 1e-7);
  EXPECT_NEAR(v[0], v2, 1e-7);
  EXPECT_NEAR(p[0], p0 - upd, 1e-6);
}

TEST(Elementwise, CastAddFillScaleFiniteSumSquares) {
  std::vector<float> a = {1.0f, 1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, -2.5f, 1e30f};
  std::vector<bf16> b(5);
  Tensor tb = Tensor::make(b.data(), DType::bf16, Device::cpu, {5});
  cast(host_f32(a, {5}), tb, nullptr);
  EXPECT_EQ(b[0].bits, 0x3F80);
  EXPECT_EQ(b[1].bits, 0x3F80);  // tie to even
  EXPECT_EQ(b[2].bits, 0x3F82);
  std::vector<float> back(5);
  cast(tb, host_f32(back, {5}), nullptr);
  EXPECT_EQ(back[3], -2.5f);

  std::vector<float> y = {1, 2, 3}, x = {0.5f, -2, 10};
  add_inplace(host_f32(y, {3}), host_f32(x, {3}), nullptr);
  EXPECT_EQ(y, (std::vector<float>{1.5f, 0, 13}));
  scale_inplace(host_f32(y, {3}), 2.f, nullptr);
  EXPECT_EQ(y, (std::vector<float>{3, 0, 26}));
  float ss = 1.f;
  sum_squares_accumulate(host_f32(y, {3}), &ss, nullptr);
  EXPECT_EQ(ss, 1.f + 9 + 676);
  EXPECT_TRUE(all_finite(host_f32(y, {3}), nullptr));
  y[1] = NAN;
  EXPECT_FALSE(all_finite(host_f32(y, {3}), nullptr));
  y[1] = -INFINITY;
  EXPECT_FALSE(all_finite(host_f32(y, {3}), nullptr));
  fill(host_f32(y, {3}), 7.f, nullptr);
  EXPECT_EQ(y, (std::vector<float>{7, 7, 7}));
}
