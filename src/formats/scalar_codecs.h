// Scalar codecs for the low-precision element and scale types, shared by the CPU reference and the
// CUDA kernels (NB_HD: the same source, so the same bits on both).
//   E2M1  (NVFP4 element): values 0, .5, 1, 1.5, 2, 3, 4, 6; code = sign<<3 | magnitude code.
//   E4M3  (OCP "fn"): bias 7, max 448, subnormal quantum 2^-9, NaN 0x7F, no inf.
//   E5M2  : bias 15, max 57344, subnormal quantum 2^-16, inf 0x7C, NaN 0x7E.
//   E8M0  : 2^(code-127), code 255 = NaN.
// Encoders round to nearest even and saturate to the largest finite value ("satfinite"); NaN maps
// to the format's NaN where it has one. Callers that must not hide non-finite inputs check amax first.
#pragma once
#include <cmath>
#include <cstdint>
#include "core/bf16.h"
#include "core/macros.h"

namespace nb {

// 2^e as a float for e in the normal range [-126, 127].
NB_HD float pow2f(int e) { return bits_f32(uint32_t(e + 127) << 23); }

NB_HD float nb_rint(float x) {
#if defined(__CUDA_ARCH__)
  return rintf(x);
#else
  return std::nearbyint(x);  // default rounding mode: nearest, ties to even
#endif
}

// Magnitude code of a finite, non-negative float in a sign-magnitude minifloat with EB exponent
// bits, MB mantissa bits and the given bias, rounded to nearest even, clamped to max_mag.
template <int MB, int BIAS>
NB_HD uint32_t minifloat_encode_magnitude(float a, uint32_t max_mag) {
  if (!(a > 0.0f)) return 0;
  int exp = int((f32_bits(a) >> 23) & 0xFF) - 127;  // fp32 subnormals give -127: below every min_exp here
  constexpr int kMinExp = 1 - BIAS;
  if (exp > 64) return max_mag;  // far above every format's range; avoids overflow below
  int quantum_exp = (exp < kMinExp ? kMinExp : exp) - MB;
  uint32_t m = uint32_t(nb_rint(a * pow2f(-quantum_exp)));  // exact scaling by a power of two
  uint32_t code = exp < kMinExp ? m : (uint32_t(exp + BIAS) << MB) + (m - (1u << MB));
  return code > max_mag ? max_mag : code;
}

template <int MB, int BIAS>
NB_HD float minifloat_decode_magnitude(uint32_t mag) {
  uint32_t e = mag >> MB, m = mag & ((1u << MB) - 1);
  if (e == 0) return float(m) * pow2f(1 - BIAS - MB);
  return float((1u << MB) | m) * pow2f(int(e) - BIAS - MB);
}

// ---- E2M1 -----------------------------------------------------------------------------------
NB_HD float e2m1_to_f32(uint32_t code) {
  float v = minifloat_decode_magnitude<1, 1>(code & 7u);
  return (code & 8u) ? -v : v;
}

// Round to nearest even, saturating at 6. Sign as TE's reference assigns it: a negative value
// that rounds to zero gets code 8; an input of exactly -0.0 (not < 0) gets code 0.
NB_HD uint32_t f32_to_e2m1_rne(float x) {
  uint32_t mag = minifloat_encode_magnitude<1, 1>(std::fabs(x), 7u);
  return (x < 0.0f ? 8u : 0u) | mag;
}

// Stochastic rounding with 8 random bits (rand8 in 0..255): rounds |x| up to the next E2M1 value
// with probability (distance from the lower one) / spacing, in steps of 1/256.
NB_HD uint32_t f32_to_e2m1_sr(float x, uint32_t rand8) {
  float a = std::fabs(x);
  float u = float(rand8 & 0xFFu) * (1.0f / 256.0f);
  float step = a < 2.0f ? 0.5f : (a < 4.0f ? 1.0f : 2.0f);
  float t = a + u * step;  // u * step is exact, so FMA or not gives the same bits
  float step_t = t < 2.0f ? 0.5f : (t < 4.0f ? 1.0f : 2.0f);
  float q = std::floor(t / step_t) * step_t;
  if (q > 6.0f) q = 6.0f;
  // q is now an exact E2M1 value; its code by exact lookup.
  uint32_t mag = minifloat_encode_magnitude<1, 1>(q, 7u);
  return (x < 0.0f ? 8u : 0u) | mag;
}

// ---- E4M3 -----------------------------------------------------------------------------------
constexpr float kE4M3Max = 448.0f;
NB_HD float e4m3_to_f32(uint32_t code) {
  code &= 0xFFu;
  if ((code & 0x7Fu) == 0x7Fu) return bits_f32(0x7FC00000u | ((code & 0x80u) << 24));
  float v = minifloat_decode_magnitude<3, 7>(code & 0x7Fu);
  return (code & 0x80u) ? -v : v;
}
NB_HD uint32_t f32_to_e4m3_satfinite(float x) {
  uint32_t sign = (f32_bits(x) >> 24) & 0x80u;
  if (x != x) return 0x7Fu | sign;
  return sign | minifloat_encode_magnitude<3, 7>(std::fabs(x), 0x7Eu);
}

// ---- E5M2 -----------------------------------------------------------------------------------
constexpr float kE5M2Max = 57344.0f;
NB_HD float e5m2_to_f32(uint32_t code) {
  code &= 0xFFu;
  uint32_t mag = code & 0x7Fu;
  float v;
  if (mag == 0x7Cu)
    v = INFINITY;
  else if (mag > 0x7Cu)
    v = NAN;
  else
    v = minifloat_decode_magnitude<2, 15>(mag);
  return (code & 0x80u) ? -v : v;
}
NB_HD uint32_t f32_to_e5m2_satfinite(float x) {
  uint32_t sign = (f32_bits(x) >> 24) & 0x80u;
  if (x != x) return 0x7Eu | sign;
  return sign | minifloat_encode_magnitude<2, 15>(std::fabs(x), 0x7Bu);
}

// ---- E8M0 -----------------------------------------------------------------------------------
NB_HD float e8m0_to_f32(uint32_t code) {
  code &= 0xFFu;
  if (code == 0xFFu) return NAN;
  if (code == 0) return bits_f32(0x00400000u);  // 2^-127 is an fp32 subnormal
  return bits_f32(code << 23);
}

}  // namespace nb
