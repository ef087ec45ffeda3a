// Shared helpers for the NVFP4 tests: host storage for both quantized copies and input generators.
#pragma once
#include <cstdint>
#include <random>
#include <string>
#include <vector>
#include "core/bf16.h"
#include "formats/nvfp4/nvfp4.h"

namespace nb::nvfp4::testing {

struct HostQuantized {
  int64_t rows, cols;
  std::vector<uint8_t> row_data, row_scales, col_data, col_scales;
  float row_amax = -1, col_amax = -1;
  int nonfinite = 0;
  HostQuantized(int64_t r, int64_t c)
      : rows(r),
        cols(c),
        row_data(size_t(r * c / 2)),
        row_scales(size_t(r * c / 16)),
        col_data(size_t(r * c / 2)),
        col_scales(size_t(r * c / 16)) {}
  QuantizedView view() {
    QuantizedView v;
    v.rows = rows;
    v.cols = cols;
    v.row_data = row_data.data();
    v.row_scales = row_scales.data();
    v.col_data = col_data.data();
    v.col_scales = col_scales.data();
    v.row_amax = &row_amax;
    v.col_amax = &col_amax;
    v.nonfinite = &nonfinite;
    return v;
  }
  // Code of element (r, c) of the row-wise copy, and of element (c, r) of the column-wise copy.
  uint32_t row_code(int64_t r, int64_t c) const {
    return (row_data[size_t(r * (cols / 2) + c / 2)] >> (4 * (c & 1))) & 0xF;
  }
  uint32_t col_code(int64_t c, int64_t r) const {
    return (col_data[size_t(c * (rows / 2) + r / 2)] >> (4 * (r & 1))) & 0xF;
  }
};

inline std::vector<bf16> random_normal_bf16(int64_t n, uint32_t seed, float stddev = 1.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<bf16> x(static_cast<size_t>(n));
  for (auto& v : x) v = f32_to_bf16(dist(gen));
  return x;
}

// Adversarial mix by 16-element block: outlier blocks, all-equal blocks, zero blocks, tiny (BF16
// subnormal and E4M3-scale-underflowing) blocks, huge values, ties on E2M1 boundaries.
inline std::vector<bf16> adversarial_bf16(int64_t rows, int64_t cols, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<bf16> x(static_cast<size_t>(rows * cols));
  for (int64_t i = 0; i < rows * cols; i += 16) {
    int kind = int(gen() % 8);
    float equal = normal(gen);
    for (int64_t j = i; j < i + 16; ++j) {
      float v = normal(gen);
      switch (kind) {
        case 0: v = (j == i + 3) ? 1000.0f * v : v; break;     // one outlier
        case 1: v = equal; break;                              // all equal
        case 2: v = 0.0f; break;                               // zeros
        case 3: v = v * 1e-39f; break;                         // BF16/FP32 subnormals
        case 4: v = v * 1e-6f; break;                          // block scale underflows E4M3
        case 5: v = float(int(gen() % 13) - 6) * 0.5f; break;  // exact halves: E2M1 ties
        case 6: v = v * 3e4f; break;                           // large
        default: break;
      }
      x[size_t(j)] = f32_to_bf16(v);
    }
  }
  return x;
}

// The stochastic-rounding variants the SR-origin tests run (CPU and GPU): SR alone, with the RHT, with 4/6, with
// both (4/6 scoring by squared error).
struct SrMode {
  std::string name;
  Options opts;
};
inline std::vector<SrMode> sr_modes(RngKey key) {
  Options o;
  o.sr = true;
  o.rng = key;
  std::vector<SrMode> m{{"sr", o}};
  o.rht = true;
  m.push_back({"sr+rht", o});
  o.rht = false;
  o.four_over_six = true;
  m.push_back({"sr+4/6", o});
  o.rht = true;
  o.err_mode = ErrMode::mse;
  m.push_back({"sr+rht+4/6 mse", o});
  return m;
}

}  // namespace nb::nvfp4::testing
