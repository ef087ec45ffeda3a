// Test inputs shared by the CPU and GPU format tests: random BF16 tensors of several distributions
// and adversarial ones (zero blocks, NaN/Inf, BF16 subnormals, values at the E4M3 and E8M0 edges).
#pragma once
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>
#include "core/bf16.h"

namespace nb::fmt_test {

enum class Dist { normal, lognormal, outliers, adversarial };

inline std::vector<bf16> make_input(int64_t rows, int64_t cols, Dist dist, uint64_t seed, bool with_nonfinite = false) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> pick(0, 15);
  std::vector<bf16> x(size_t(rows * cols));
  for (int64_t i = 0; i < rows * cols; ++i) {
    float v = normal(rng);
    switch (dist) {
      case Dist::normal: break;
      case Dist::lognormal: v = std::exp(3.0f * v) * (normal(rng) < 0 ? -1.0f : 1.0f); break;
      case Dist::outliers:
        if (pick(rng) == 0) v *= 1000.0f;
        break;
      case Dist::adversarial: {
        int64_t block = i / 32;  // vary the character per 32-element run
        switch (block % 8) {
          case 0: v = 0.0f; break;                                                        // zero block
          case 1: v = std::ldexp(v, -130); break;                                         // BF16 subnormals
          case 2: v = (pick(rng) < 8 ? 448.0f : 450.0f) * (v < 0 ? -1.0f : 1.0f); break;  // E4M3 max edge
          case 3: v = std::ldexp(v, 100); break;                                          // near the top
          case 4: v = std::ldexp(1.0f, pick(rng) - 8) * (v < 0 ? -1.0f : 1.0f); break;    // powers of two
          case 5: v = (i % 32 == 0) ? 1e30f : std::ldexp(v, -20); break;                  // one huge, rest tiny
          case 6: v = -0.0f; break;
          default: break;
        }
      }
    }
    x[size_t(i)] = f32_to_bf16(v);
  }
  if (with_nonfinite && rows * cols > 40) {
    x[7] = f32_to_bf16(NAN);
    x[size_t(rows * cols - 3)] = f32_to_bf16(-INFINITY);
  }
  return x;
}

}  // namespace nb::fmt_test
