// 16-point random Hadamard transform (spec §3) used on the column-wise NVFP4 copies of the Wgrad
// operands: y = x * H with H = (1/4) * diag(s) * H16, H16 the Sylvester Hadamard matrix (+-1, symmetric,
// H16[i][j] = (-1)^popcount(i & j)) and s the fixed sign vector (bit i of kRhtSignMask set: s_i = -1).
// H is orthogonal (H * H^T = I), so both Wgrad operands transformed by the same H keep dY^T X.
//
// Precision: inputs are BF16 values held in floats. They are scaled by +-1/4 first (exact, like TE's
// +-0.25 matrix entries), summed in FP32 by a fixed radix-2 butterfly (the same order on CPU and CUDA,
// so the same bits), and each output is rounded to BF16 (TE rounds the RHT output to BF16 too).
#pragma once
#include <cstdint>
#include "core/bf16.h"
#include "core/macros.h"

namespace nb::hadamard {

constexpr uint32_t kSignMask16 = 0xD7E8u;  // s = [1,1,1,-1,1,-1,-1,-1,-1,-1,-1,1,-1,1,-1,-1]

// In place: v[0..15] <- v * diag(s) * H16 / 4 in FP32 (not yet rounded).
NB_HD void rht16_f32(float* v, uint32_t sign_mask = kSignMask16) {
  NB_UNROLL
  for (int i = 0; i < 16; ++i) v[i] = ((sign_mask >> i) & 1u) ? v[i] * -0.25f : v[i] * 0.25f;
  NB_UNROLL
  for (int h = 1; h < 16; h <<= 1) {
    NB_UNROLL
    for (int i = 0; i < 16; ++i) {
      if (i & h) continue;
      float a = v[i], b = v[i + h];
      v[i] = a + b;
      v[i + h] = a - b;
    }
  }
}

// In place: the transform followed by rounding each output to BF16 (what the quantizer consumes).
// CUDA rounds two values per instruction (cvt.rn.bf16x2.f32): the same RNE bits as f32_to_bf16 for
// every non-NaN value; a NaN may carry a different payload (it stays a NaN, which is all callers use).
NB_HD void rht16_bf16(float* v, uint32_t sign_mask = kSignMask16) {
  rht16_f32(v, sign_mask);
#if defined(__CUDA_ARCH__)
  NB_UNROLL
  for (int i = 0; i < 16; i += 2) {
    uint32_t packed;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(v[i + 1]), "f"(v[i]));
    v[i] = __uint_as_float(packed << 16);
    v[i + 1] = __uint_as_float(packed & 0xFFFF0000u);
  }
#else
  for (int i = 0; i < 16; ++i) v[i] = round_to_bf16(v[i]);
#endif
}

// The inverse H^T = (1/4) * H16 * diag(s), in FP32 without rounding (for tests and for undoing the
// transform): v <- v * H^T.
NB_HD void rht16_inverse_f32(float* v, uint32_t sign_mask = kSignMask16) {
  NB_UNROLL
  for (int h = 1; h < 16; h <<= 1) {
    NB_UNROLL
    for (int i = 0; i < 16; ++i) {
      if (i & h) continue;
      float a = v[i], b = v[i + h];
      v[i] = a + b;
      v[i + h] = a - b;
    }
  }
  NB_UNROLL
  for (int i = 0; i < 16; ++i) v[i] = ((sign_mask >> i) & 1u) ? v[i] * -0.25f : v[i] * 0.25f;
}

}  // namespace nb::hadamard
