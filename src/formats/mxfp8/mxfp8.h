// MXFP8 (OCP microscaling FP8): E4M3 elements in blocks of 32 along one dimension, one E8M0
// (power-of-two) scale per block. Input: BF16 [rows, cols], row-major.
//
// Layout (both copies quantized independently from the BF16 source; the CUDA kernel makes both in
// one pass over the input):
//   row_data   [rows, cols]      E4M3, blocks of 32 along cols
//   row_scales [rows, cols/32]   E8M0
//   col_data   [rows, cols]      E4M3, blocks of 32 along rows. Kept un-transposed, as
//                                TransformerEngine keeps its MXFP8 column-wise copy
//   col_scales [rows/32, cols]   E8M0 (scale of block (rows 32*i..32*i+31, column j) at [i, j])
// Shapes: rows and cols must both be multiples of 32 (rejected otherwise).
//
// Numerics follow TransformerEngine's MXFP8 cast (common/util/ptx.cuh float_to_e8m0 and
// exp2f_rcp, and the software path of tests/cpp/test_common.h), all in FP32:
//   code    = float_to_e8m0(block_amax * (1/448))  -- exponent of the FP32 product rounded UP
//             (any non-zero mantissa bumps the exponent), except an FP32 subnormal <= 2^-127 stays
//             code 0; code 254 never bumps (saturates); amax 0 -> code 0; NaN -> 255; Inf -> 254.
//             This equals 2^ceil(log2(block_amax / 448)) clamped to the E8M0 range.
//   inverse = 2^(127 - code) as an FP32 (code 254 -> 2^-127, an FP32 subnormal; 255 -> NaN)
//   q       = e4m3_rne_satfinite(x * inverse)
//   x_hat   = e4m3_value(q) * 2^(code - 127)
// A block of zeros gets code 0 and element codes 0. Non-finite inputs are reported through the
// `nonfinite` flag (the codes are then meaningless; the caller decides what to do).
#pragma once
#include <cstdint>
#include "core/bf16.h"
#include "core/macros.h"
#include "core/status.h"
#include "core/stream.h"
#include "formats/scalar_codecs.h"

namespace nb::mxfp8 {

constexpr int kBlock = 32;

struct Options {
  bool rowwise = true;
  bool colwise = true;
};

// Buffers owned by the caller: host memory for the *_ref functions, device memory for *_cuda.
// A copy that is not requested may leave its pointers null.
struct QuantizedView {
  int64_t rows = 0, cols = 0;
  uint8_t* row_data = nullptr;    // [rows, cols]
  uint8_t* row_scales = nullptr;  // [rows, cols/32]
  uint8_t* col_data = nullptr;    // [rows, cols]
  uint8_t* col_scales = nullptr;  // [rows/32, cols]
  int32_t* nonfinite = nullptr;   // optional: set to 1 if any input is NaN or Inf, else 0
};

// TE's float_to_e8m0 (software path), applied to amax * (1/448).
NB_HD uint32_t e8m0_scale_code(float block_amax) {
  constexpr float kRcpMax = 1.0f / kE4M3Max;  // TE: Quantized_Limits<fp8e4m3>::max_norm_rcp
  float v = block_amax * kRcpMax;
  if (v != v) return 0xFFu;
  if (v == INFINITY) return 0xFEu;
  if (v == 0.0f) return 0u;
  uint32_t bits = f32_bits(v);
  uint32_t exponent = (bits >> 23) & 0xFFu;
  uint32_t mantissa = bits & 0x7FFFFFu;
  if (mantissa > 0 && exponent != 0xFEu && !(exponent == 0 && mantissa <= 0x400000u)) ++exponent;
  return exponent;
}

// TE's exp2f_rcp: the multiplier that maps a block into E4M3 range.
NB_HD float e8m0_inverse_scale(uint32_t code) {
  if (code == 0xFFu) return bits_f32(0x7FFFFFFFu);
  if (code == 0xFEu) return bits_f32(0x00400000u);  // 2^-127
  return bits_f32((254u - code) << 23);
}

Status check_shape(int64_t rows, int64_t cols);

Status quantize_ref(const bf16* x, const Options& opt, const QuantizedView& out);
// One kernel reads each BF16 element once and writes the requested copies. Asynchronous on `stream`.
Status quantize_cuda(const bf16* x, const Options& opt, const QuantizedView& out, Stream stream = nullptr);

// x_hat [rows, cols] (FP32) from either copy: colwise selects the [rows/32, cols] scale layout.
void dequantize_ref(const uint8_t* data, const uint8_t* scales, int64_t rows, int64_t cols, bool colwise, float* out);

}  // namespace nb::mxfp8
