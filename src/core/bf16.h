// BF16 and FP16 storage types with bit-exact conversions usable on host and device.
// float -> bf16 rounds to nearest even; NaN stays NaN (quiet).
#pragma once
#include <cstdint>
#include <cstring>
#include "core/macros.h"

namespace nb {

NB_HD uint32_t f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
NB_HD float bits_f32(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

struct bf16 {
  uint16_t bits;
  static NB_HD bf16 from_bits(uint16_t b) {
    bf16 r;
    r.bits = b;
    return r;
  }
};

NB_HD bf16 f32_to_bf16(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16::from_bits(uint16_t((u >> 16) | 0x40));  // quiet NaN
  uint32_t lsb = (u >> 16) & 1u;
  u += 0x7fffu + lsb;
  return bf16::from_bits(uint16_t(u >> 16));
}
NB_HD float bf16_to_f32(bf16 h) { return bits_f32(uint32_t(h.bits) << 16); }
NB_HD float round_to_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

struct f16 {
  uint16_t bits;
};

// IEEE half -> float, exact (used for reading FP16 tensors; all FP16 values are FP32 values).
NB_HD float f16_to_f32(f16 h) {
  uint32_t sign = uint32_t(h.bits & 0x8000u) << 16;
  uint32_t exp = (h.bits >> 10) & 0x1fu;
  uint32_t man = h.bits & 0x3ffu;
  if (exp == 0x1f) return bits_f32(sign | 0x7f800000u | (man << 13));
  if (exp == 0) {
    if (man == 0) return bits_f32(sign);
    float v = float(man) * (1.0f / 16777216.0f);  // man * 2^-24, exact
    return sign ? -v : v;
  }
  return bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

}  // namespace nb
