// The float64 reference of MoR's tests (mor_test.cpp, mor_gemm_test.cpp), written apart from the code it checks:
// its own E4M3/E5M2 rounding (frexp and nearbyint in double), TE's FP32 scale from an amax, and GAM's scales.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>
#include "core/bf16.h"

namespace nb::mor {

struct Minifloat {
  int mantissa_bits, min_exp;
  double max;
};
inline constexpr Minifloat kE4M3{3, -6, 448.0}, kE5M2{2, -14, 57344.0};

// Round to nearest even into a minifloat, saturating at its largest finite value.
inline double round_minifloat(double v, const Minifloat& f) {
  const double a = std::fabs(v);
  if (a == 0.0) return 0.0;
  int k = 0;
  std::frexp(a, &k);  // a = m * 2^k, m in [0.5, 1)
  const int e = std::max(k - 1, f.min_exp);
  const double quantum = std::ldexp(1.0, e - f.mantissa_bits);
  const double r = std::min(std::nearbyint(a / quantum) * quantum, f.max);
  return std::copysign(r, v);
}

inline float fp32_scale(double amax, const Minifloat& f) {  // TE's compute_scale_from_amax in FP32
  if (!(amax > 0.0) || !std::isfinite(amax)) return 1.0f;
  const float s = float(f.max) / float(amax);
  return std::isinf(s) ? std::numeric_limits<float>::max() : s;
}

inline double amax_of(const std::vector<bf16>& x) {
  double a = 0.0;
  for (bf16 v : x) a = std::max(a, std::fabs(double(bf16_to_f32(v))));
  return a;
}

inline std::vector<bf16> normal_tensor(int64_t n, uint64_t seed, double sigma = 1.0) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> d(0.0, sigma);
  std::vector<bf16> x(static_cast<size_t>(n));
  for (auto& v : x) v = f32_to_bf16(float(d(rng)));
  return x;
}

// The reference's GAM: the tensor scale's mantissa times 2 to the block scale's exponent, one lower when that
// would exceed the block's own scale.
inline float reference_gam(float tensor_scale, float block_scale) {
  int kt = 0, kb = 0;
  const double m = 2.0 * std::frexp(double(tensor_scale), &kt);  // [1, 2)
  std::frexp(double(block_scale), &kb);
  double s = std::ldexp(m, kb - 1);
  if (s > double(block_scale)) s = std::ldexp(m, kb - 2);
  return float(s);
}

// Six 128x128 blocks of different characters, each decided on its own (GAM scales, the tensor as the group).
inline std::vector<bf16> six_blocks(int64_t cols) {
  std::vector<bf16> x = normal_tensor(256 * cols, 21);
  std::mt19937_64 rng(22);
  std::normal_distribution<double> d(0.0, 1.0);
  for (int64_t r = 0; r < 256; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t b = (r / 128) * 3 + c / 128;
      float v = bf16_to_f32(x[r * cols + c]);
      switch (b) {
        case 1:  // two magnitudes 1e7 apart: E4M3 flushes the small half, E5M2 holds both
          v = float((1.0 + std::fabs(d(rng)) / 8.0) * (c % 2 == 0 ? 1.0 : 1e-7));
          break;
        case 2: v = 0.0f; break;  // zeros
        case 3: v = (r == 130 && c == 5) ? std::numeric_limits<float>::quiet_NaN() : v; break;
        case 4: v = (r == 200 && c == 140) ? 1e30f : v * 1e-20f; break;  // beyond E5M2's range
        case 5: v *= 1e-30f; break;                                      // tiny but narrow
        default: break;
      }
      x[r * cols + c] = f32_to_bf16(v);
    }
  return x;
}

}  // namespace nb::mor
