// An independent CPU transcription of TransformerEngine's NVFP4 "4over6" reference quantizer
// (transformer_engine/pytorch/custom_recipes/reference_nvfp4.py: NVFP4QuantizerRef with
// nvfp4_use_4over6=True, nvfp4_e4m3_max=256, no RHT, no SR, fast-math error off), written from its
// published semantics and sharing no code with nibble's quantizer (its own E4M3 and E2M1 codecs), so that
// a mistake in nvfp4_math.h cannot hide in both. Per copy, TE quantizes a row-major matrix [m, n]:
//   amax   = max |x| over the matrix (the stored amax)
//   S_enc  = min((256 * 6) / amax, FLT_MAX), 1 where that is 0; S_dec = 1 / S_enc
//   base   = (block_amax / 6) * S_enc, block_amax over 1x16 (or the 16x16 tile)
//   s6     = e4m3(min(base, 448)), s4 = e4m3(min(base * 1.5, 448))       (RNE)
//   enc    = min(1 / (float(s) * S_dec), FLT_MAX); q = e2m1(clamp(x * enc, -6, 6))   (RNE)
//   err    = sum over the 16 elements in order of |d| (MAE) or d * d (MSE),
//            d = ((e2m1(q) * float(s)) * amax) / (6 * 256) - x
//   1x16   keep s4 iff err4 < err6;  16x16: the tile's 16 row errors summed pairwise
//            (row i + row i+8, then + 4, + 2, + 1), then the same strict comparison.
// The column-wise copy is the same procedure applied to the transposed tensor. All FP32, no FMA.
#pragma once
#include <algorithm>
#include <array>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <vector>

namespace nb::nvfp4::te_ref {

struct Copy {
  std::vector<uint8_t> data, scales;  // [m, n/2] codes (low nibble first), [m, n/16] E4M3 bytes
  float amax = 0;
};

// Value of a non-negative E4M3 code (0x00..0x7E): subnormals m * 2^-9, normals (1 + m/8) * 2^(e-7).
inline double e4m3_value(int code) {
  const int e = code >> 3, m = code & 7;
  return e == 0 ? m * std::ldexp(1.0, -9) : (1.0 + m / 8.0) * std::ldexp(1.0, e - 7);
}

// Round a non-negative finite float to E4M3 (nearest, ties to the even code), saturating at 448: the
// nearest of all 127 values by exhaustive search.
inline uint8_t e4m3_rne(float x) {
  static const std::array<double, 127> value = [] {
    std::array<double, 127> v{};
    for (int c = 0; c < 127; ++c) v[size_t(c)] = e4m3_value(c);
    return v;
  }();
  int best = 0;
  double best_dist = std::fabs(double(x));
  for (int c = 1; c <= 0x7E; ++c) {
    const double d = std::fabs(double(x) - value[size_t(c)]);
    if (d < best_dist || (d == best_dist && (c & 1) == 0)) {
      best = c;
      best_dist = d;
    }
  }
  return uint8_t(best);
}

// TE's cast_to_fp4x2 on a value already clamped to [-6, 6]: the thresholds of round-to-nearest-even
// on the grid {0, 0.5, 1, 1.5, 2, 3, 4, 6}; negative values (not -0.0) get the sign bit.
inline uint8_t e2m1_code(float y) {
  const float a = std::fabs(y);
  uint8_t m = a <= 0.25f   ? 0
              : a < 0.75f  ? 1
              : a <= 1.25f ? 2
              : a < 1.75f  ? 3
              : a <= 2.5f  ? 4
              : a < 3.5f   ? 5
              : a <= 5.0f  ? 6
                           : 7;
  return uint8_t(y < 0.0f ? 8 | m : m);
}

inline float e2m1_value(uint8_t code) {
  static const float mag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  return (code & 8) ? -mag[code & 7] : mag[code & 7];
}

// One copy: the matrix x [m, n] (BF16 values as floats), tiles of tile_rows x 16 (1 or 16).
inline Copy quantize_matrix(const std::vector<float>& x, int64_t m, int64_t n, int tile_rows, bool mse) {
  Copy out;
  out.data.assign(size_t(m * n / 2), 0);
  out.scales.assign(size_t(m * n / 16), 0);
  for (float v : x) out.amax = std::max(out.amax, std::fabs(v));
  float s_enc = std::min((256.0f * 6.0f) / out.amax, FLT_MAX);
  if (s_enc == 0.0f) s_enc = 1.0f;
  const float s_dec = 1.0f / s_enc;
  for (int64_t r0 = 0; r0 < m; r0 += tile_rows)
    for (int64_t b = 0; b < n / 16; ++b) {
      float tile_amax = 0.0f;
      for (int i = 0; i < tile_rows; ++i)
        for (int j = 0; j < 16; ++j) tile_amax = std::max(tile_amax, std::fabs(x[size_t((r0 + i) * n + b * 16 + j)]));
      const float base = (tile_amax / 6.0f) * s_enc;
      const uint8_t s[2] = {e4m3_rne(std::min(base, 448.0f)), e4m3_rne(std::min(base * 1.5f, 448.0f))};  // 6, 4
      uint8_t q[2][16][16];
      float row_err[2][16];
      for (int k = 0; k < 2; ++k) {
        const float sf = float(e4m3_value(s[k]));
        const float enc = std::min(1.0f / (sf * s_dec), FLT_MAX);
        for (int i = 0; i < tile_rows; ++i) {
          float err = 0.0f;
          for (int j = 0; j < 16; ++j) {
            const float v = x[size_t((r0 + i) * n + b * 16 + j)];
            q[k][i][j] = e2m1_code(std::clamp(v * enc, -6.0f, 6.0f));
            float val = e2m1_value(q[k][i][j]) * sf;
            val = val * out.amax;
            val = val / (6.0f * 256.0f);
            const float d = val - v;
            err = err + (mse ? d * d : std::fabs(d));
          }
          row_err[k][i] = err;
        }
      }
      float err6 = row_err[0][0], err4 = row_err[1][0];
      if (tile_rows == 16) {
        for (int half = 8; half >= 1; half /= 2)
          for (int i = 0; i < half; ++i)
            for (int k = 0; k < 2; ++k) row_err[k][i] = row_err[k][i] + row_err[k][i + half];
        err6 = row_err[0][0];
        err4 = row_err[1][0];
      }
      const int pick = err4 < err6 ? 1 : 0;  // ties (and NaN) keep map to 6
      for (int i = 0; i < tile_rows; ++i) {
        const int64_t r = r0 + i;
        out.scales[size_t(r * (n / 16) + b)] = s[pick];
        for (int j = 0; j < 16; j += 2)
          out.data[size_t(r * (n / 2) + b * 8 + j / 2)] = uint8_t(q[pick][i][j] | (q[pick][i][j + 1] << 4));
      }
    }
  return out;
}

// Both copies of a tensor x [rows, cols]: the row-wise copy, and the column-wise copy (the transpose).
inline void quantize(const std::vector<float>& x, int64_t rows, int64_t cols, bool two_d, bool mse, Copy* row,
                     Copy* col) {
  std::vector<float> t(x.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) t[size_t(c * rows + r)] = x[size_t(r * cols + c)];
  *row = quantize_matrix(x, rows, cols, two_d ? 16 : 1, mse);
  *col = quantize_matrix(t, cols, rows, two_d ? 16 : 1, mse);
}

}  // namespace nb::nvfp4::te_ref
