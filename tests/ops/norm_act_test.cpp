// RMSNorm and SwiGLU CPU references: forward against the formula, backward against central finite
// differences of the forward (loss = sum(y * r) with fixed random r, so dy = r).
#include <gtest/gtest.h>
#include "ops/rmsnorm.h"
#include "ops/swiglu.h"
#include "ops_test_util.h"

using namespace nb;
using namespace nb::ops;
using namespace nb::ops::testing;

// Gradients here are O(1); FD error (see numeric_grad) is ~1e-4 at worst, so 1e-3 leaves margin while a
// wrong term (e.g. a missing rstd^3 factor) shows up as O(0.1).
constexpr double kGradTol = 1e-3;

TEST(RMSNorm, ForwardMatchesFormula) {
  const int64_t T = 3, H = 10;
  auto x = random_vec(T * H, 1), w = random_vec(H, 2, 0.5f, 1.5f);
  std::vector<float> y(T * H), rstd(T);
  rmsnorm_forward(host_f32(x, {T, H}), host_f32(w, {H}), 1e-5f, host_f32(y, {T, H}), host_f32(rstd, {T}), nullptr);
  for (int64_t t = 0; t < T; ++t) {
    double ss = 0;
    for (int64_t j = 0; j < H; ++j) ss += double(x[t * H + j]) * x[t * H + j];
    double r = 1.0 / std::sqrt(ss / H + 1e-5);
    EXPECT_NEAR(rstd[t], r, 1e-6 * r);
    for (int64_t j = 0; j < H; ++j) EXPECT_NEAR(y[t * H + j], x[t * H + j] * r * w[j], 1e-6);
  }
}

TEST(RMSNorm, BackwardMatchesFiniteDifferences) {
  const int64_t T = 4, H = 12;
  auto x = random_vec(T * H, 3), w = random_vec(H, 4, 0.5f, 1.5f), r = random_vec(T * H, 5);
  std::vector<float> y(T * H), rstd(T);
  auto loss = [&] {
    rmsnorm_forward(host_f32(x, {T, H}), host_f32(w, {H}), 1e-5f, host_f32(y, {T, H}), host_f32(rstd, {T}), nullptr);
    return dot(y, r);
  };
  auto nx = numeric_grad(x, loss);
  auto nw = numeric_grad(w, loss);
  loss();
  std::vector<float> dx(T * H), dw(H, 0.25f);  // dw starts non-zero: the op accumulates
  rmsnorm_backward(host_f32(x, {T, H}), host_f32(w, {H}), host_f32(rstd, {T}), host_f32(r, {T, H}),
                   host_f32(dx, {T, H}), host_f32(dw, {H}), nullptr);
  for (float& d : dw) d -= 0.25f;
  EXPECT_GRAD_NEAR(dx, nx, kGradTol);
  EXPECT_GRAD_NEAR(dw, nw, kGradTol);
}

TEST(SwiGLU, ForwardMatchesFormula) {
  const int64_t T = 2, F = 5;
  auto gu = random_vec(T * 2 * F, 6, -4.f, 4.f);
  std::vector<float> out(T * F);
  swiglu_forward(host_f32(gu, {T, 2 * F}), host_f32(out, {T, F}), nullptr);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < F; ++j) {
      double g = gu[t * 2 * F + j], u = gu[t * 2 * F + F + j];
      EXPECT_NEAR(out[t * F + j], g / (1 + std::exp(-g)) * u, 1e-5);
    }
}

TEST(SwiGLU, BackwardMatchesFiniteDifferences) {
  const int64_t T = 3, F = 7;
  auto gu = random_vec(T * 2 * F, 7, -3.f, 3.f), r = random_vec(T * F, 8);
  std::vector<float> out(T * F);
  auto loss = [&] {
    swiglu_forward(host_f32(gu, {T, 2 * F}), host_f32(out, {T, F}), nullptr);
    return dot(out, r);
  };
  auto n = numeric_grad(gu, loss);
  std::vector<float> dgu(T * 2 * F);
  swiglu_backward(host_f32(gu, {T, 2 * F}), host_f32(r, {T, F}), host_f32(dgu, {T, 2 * F}), nullptr);
  EXPECT_GRAD_NEAR(dgu, n, kGradTol);
  // In place (dgate_up aliasing gate_up) gives the same result.
  auto alias = gu;
  swiglu_backward(host_f32(alias, {T, 2 * F}), host_f32(r, {T, F}), host_f32(alias, {T, 2 * F}), nullptr);
  for (size_t i = 0; i < dgu.size(); ++i) EXPECT_EQ(alias[i], dgu[i]);
}

TEST(RMSNormDeathTest, DxMustNotAliasDy) {
  std::vector<float> x(8, 1.f), w(4, 1.f), rstd(2, 1.f), g(8, 1.f), dw(4);
  EXPECT_DEATH(rmsnorm_backward(host_f32(x, {2, 4}), host_f32(w, {4}), host_f32(rstd, {2}), host_f32(g, {2, 4}),
                                host_f32(g, {2, 4}), host_f32(dw, {4}), nullptr),
               "must not alias");
}
