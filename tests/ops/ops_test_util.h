// Helpers for the ops tests: seeded random host vectors, FP32 tensor views over them, and a central
// finite-difference gradient of a scalar loss computed in FP64 from an FP32 forward.
#pragma once
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <vector>
#include "core/tensor.h"

namespace nb::ops::testing {

inline std::vector<float> random_vec(size_t n, uint32_t seed, float lo = -1.f, float hi = 1.f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

inline Tensor host_f32(std::vector<float>& v, std::initializer_list<int64_t> dims) {
  return Tensor::make(v.data(), DType::f32, Device::cpu, dims);
}
inline Tensor host_i32(std::vector<int32_t>& v, std::initializer_list<int64_t> dims) {
  return Tensor::make(v.data(), DType::i32, Device::cpu, dims);
}

// d loss / d input[i] by central differences: (L(x + h e_i) - L(x - h e_i)) / 2h, restoring input[i].
// loss() reruns the FP32 forward and sums in FP64. h = 2^-6 is exact in FP32 for |x| < 2 and keeps the
// truncation error (h^2/6 * f''' ~ 4e-5 * f''') well below the tolerances used, while FP32 rounding
// noise of the forward (~6e-8 * |L| / h) stays near 1e-5 for the small losses of these tests.
inline std::vector<double> numeric_grad(std::vector<float>& input, const std::function<double()>& loss,
                                        float h = 0x1p-6f) {
  std::vector<double> g(input.size());
  for (size_t i = 0; i < input.size(); ++i) {
    float keep = input[i];
    input[i] = keep + h;
    double lp = loss();
    input[i] = keep - h;
    double lm = loss();
    input[i] = keep;
    g[i] = (lp - lm) / (2.0 * double(h));
  }
  return g;
}

inline double dot(const std::vector<float>& a, const std::vector<float>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += double(a[i]) * double(b[i]);
  return s;
}

}  // namespace nb::ops::testing

// Compares an analytic gradient with a numeric one: |a - n| <= tol * max(1, |n|).
#define EXPECT_GRAD_NEAR(analytic, numeric, tol)                                                         \
  do {                                                                                                   \
    ASSERT_EQ((analytic).size(), (numeric).size());                                                      \
    for (size_t i_ = 0; i_ < (numeric).size(); ++i_)                                                     \
      EXPECT_NEAR(double((analytic)[i_]), (numeric)[i_], (tol)*std::fmax(1.0, std::fabs((numeric)[i_]))) \
          << "element " << i_;                                                                           \
  } while (0)
