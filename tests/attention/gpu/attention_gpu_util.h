// Shared by the cuDNN attention tests (attention_cudnn_test.cpp, cp_ring_gpu_test.cpp): inputs that BF16 holds
// exactly (so the FP64 reference reads the values the GPU reads) and the relative L2 error of a result.
#pragma once
#include <algorithm>
#include <cmath>
#include <random>
#include <vector>
#include "core/bf16.h"

namespace nb::ops {

inline std::vector<float> random_bf16_values(size_t n, std::mt19937& rng) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> x(n);
  for (float& v : x) v = round_to_bf16(dist(rng));
  return x;
}

inline double rel_l2(const std::vector<float>& got, const std::vector<float>& want) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double d = double(got[i]) - double(want[i]);
    num += d * d;
    den += double(want[i]) * double(want[i]);
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

}  // namespace nb::ops
