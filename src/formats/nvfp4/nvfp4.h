// NVFP4 quantization (E2M1 elements in blocks of 16, one E4M3 scale per block, one FP32 amax per
// tensor copy), as defined in the precision spec §1-4. The CPU reference (`*_ref`) is the spec;
// the CUDA functions produce the same bytes bit for bit.
//
// Source: a rows x cols BF16 tensor, row-major. Two copies, each optional:
//   row-wise    : blocks of 16 along cols.  data [rows, cols/2] bytes, scales [rows, cols/16]
//   column-wise : the transposed tensor [cols, rows], blocks of 16 along rows (the token dim).
//                 data [cols, rows/2], scales [cols, rows/16]
// Packing: element 2i in the low nibble, 2i+1 in the high nibble. Scales are raw E4M3 bytes in this
// plain (unswizzled) layout; swizzle_scales_* produces cuBLAS's 128x4 tiled layout.
//
// Options: two_d = 16x16 weight tiles (one scale per tile, repeated into both copies so both hold
// bit-identical values); rht = random Hadamard transform on the column-wise copy only (result rounded
// to BF16, amax taken after the transform); sr = stochastic rounding of the elements of both copies.
// SR random byte of element e (flat row-major index inside its copy's [outer, inner] layout):
//   philox_byte(philox_block(key, e / 16), e % 16), key = opts.rng for the row-wise copy and
//   opts.rng with stream ^= 1 for the column-wise copy.
//
// Non-finite input: amax is the largest |x| by BF16 bit pattern, so a NaN anywhere makes amax NaN
// (stored as the quiet NaN 0x7FC00000) and an Inf makes it Inf. Such an amax sets *nonfinite = 1
// (never cleared here, so one flag can collect a whole step) and uses S_enc = 1; the quantizer still
// finishes with defined bytes (NaN elements get code 7, a NaN block gets scale byte 0x7F), identical
// on CPU and CUDA.
//
// 4/6 adaptive block scaling (four_over_six; "Four Over Six", arXiv 2512.02010, TransformerEngine's
// NVTE_NVFP4_4OVER6): S_enc uses the E4M3 bound 256 instead of 448 (S_enc = 6*256 / amax), and each
// block (each 16x16 tile with two_d) tries two scales, base = block_amax * (S_enc * (1/6)) ("map to 6")
// and base * 1.5 ("map to 4", E4M3 satfinite), keeping map-to-4 only when its squared error is strictly
// lower (nvfp4_math.h has the rule). The amax slots then hold the DECODE amax, amax * 1.75 (exact for a
// BF16 amax), so every reader's amax / (6*448) decodes the 256-bound scales unchanged. An amax whose
// decode amax overflows to Inf also sets *nonfinite.
#pragma once
#include <cstddef>
#include <cstdint>
#include "core/bf16.h"
#include "core/philox.h"
#include "core/status.h"
#include "core/stream.h"

namespace nb::nvfp4 {

constexpr int kBlock = 16;
constexpr float kE2M1MaxValue = 6.0f;
constexpr float kScaleMax = 6.0f * 448.0f;  // E2M1 max * E4M3 max
// RHT sign vector s (spec §3): bit i set where s_i = -1.
constexpr uint32_t kRhtSignMask = 0xD7E8u;

struct Options {
  bool rowwise = true;
  bool colwise = true;
  bool two_d = false;  // 16x16 weight tiles; cannot be combined with rht or sr
  bool rht = false;    // column-wise copy only
  bool sr = false;     // stochastic rounding of elements (scales stay RNE)
  // 4/6 adaptive block scaling of every copy written (the column copy is the RHT'd one with rht; a 2D
  // tile decides once for its 256 elements). Combines with rht, sr or two_d as plain NVFP4 does.
  bool four_over_six = false;
  RngKey rng{};
};

// Output pointers: host memory for *_ref, device memory for *_cuda. Pointers of a disabled copy are
// ignored (may be null).
struct QuantizedView {
  int64_t rows = 0, cols = 0;
  uint8_t* row_data = nullptr;    // [rows, cols/2]
  uint8_t* row_scales = nullptr;  // [rows, cols/16]
  uint8_t* col_data = nullptr;    // [cols, rows/2]
  uint8_t* col_scales = nullptr;  // [cols, rows/16]
  float* row_amax = nullptr;      // 1 float: amax of the source (x 1.75 with four_over_six)
  float* col_amax = nullptr;      // 1 float: same, or of the RHT'd source with rht (x 1.75 with four_over_six)
  int* nonfinite = nullptr;       // set to 1 when an amax is NaN/Inf; may be null
};

// OK when rows and cols are positive multiples of 16 and the options are compatible; otherwise one
// sentence naming the shape and the rule.
Status check_shape(int64_t rows, int64_t cols, const Options& opts);

// ---- CPU reference (the spec) --------------------------------------------------------------
Status quantize_ref(const bf16* x, const Options& opts, const QuantizedView& out);
// Amaxes as quantize_ref computes them (col_amax only meaningful with rht; else equals row_amax).
void compute_amax_ref(const bf16* x, int64_t rows, int64_t cols, bool rht, float* row_amax, float* col_amax);
// RHT of one 16-element chunk: y = round_bf16((1/4) * (x o s) * H16), fixed butterfly order.
void rht16_ref(const float* x, float* y);
// Crest factors max|x| / rms(x) of the column-wise blocks of x [rows, cols] (16 consecutive rows of one
// column: the blocks of the column-wise copy, 16 tokens of one feature) and of the same blocks after
// rht16_ref, summed over the blocks that are neither all zero nor non-finite; rows past the last whole 16
// are ignored. The RHT raises the FP4 error of blocks whose crest factor it lowers and lowers the error
// where it raises it (tests/nvfp4/rht_study_test.cpp).
struct CrestSums {
  double plain = 0, rht = 0;
  int64_t blocks = 0;
};
void add_column_block_crests(const bf16* x, int64_t rows, int64_t cols, CrestSums* sums);
// x_hat = e2m1(q) * float(s_b) * amax / (6*448); data [outer, inner/2], scales [outer, inner/16].
void dequantize_ref(const uint8_t* data, const uint8_t* scales, float amax, int64_t outer, int64_t inner, float* out);

// cuBLAS block-scale layout: scales padded to 128 rows x 4 columns (zeros), each 128x4 tile 512
// contiguous bytes; (r, c) -> ((r/128)*(Kp/4) + c/4)*512 + (r%32)*16 + ((r%128)/32)*4 + c%4.
size_t swizzled_scale_bytes(int64_t rows, int64_t scale_cols);
size_t swizzled_offset(int64_t r, int64_t c, int64_t scale_cols);
void swizzle_scales_ref(const uint8_t* scales, int64_t rows, int64_t scale_cols, uint8_t* out);
void unswizzle_scales_ref(const uint8_t* swizzled, int64_t rows, int64_t scale_cols, uint8_t* out);

// ---- CUDA (device pointers; bit-identical to the reference) ---------------------------------
// Pre-pass: amax of the source into *row_amax and (when rht) of the transformed source into
// *col_amax (without rht, *col_amax gets the source amax too; either pointer may be null).
Status compute_amax_cuda(const bf16* x, int64_t rows, int64_t cols, bool rht, float* row_amax, float* col_amax,
                         Stream stream);
// One fused pass writing both copies, reading the amaxes already stored in out.row_amax/out.col_amax.
// With opts.four_over_six it runs quantize_4over6_cuda_with_amax instead.
Status quantize_cuda_with_amax(const bf16* x, const Options& opts, const QuantizedView& out, Stream stream);
// The 4/6 quantizer (nvfp4_4over6.cu: a simple kernel, one thread per block or 2D tile, separate from
// the fused pass): reads the tensor amaxes from the slots of the enabled copies, then replaces them with
// the decode amaxes (amax * 1.75), so it must run once per amax pre-pass.
Status quantize_4over6_cuda_with_amax(const bf16* x, const Options& opts, const QuantizedView& out, Stream stream);
// compute_amax_cuda + quantize_cuda_with_amax.
Status quantize_cuda(const bf16* x, const Options& opts, const QuantizedView& out, Stream stream);
// amax is a device pointer (as produced by the quantizer).
Status dequantize_cuda(const uint8_t* data, const uint8_t* scales, const float* amax, int64_t outer, int64_t inner,
                       float* out, Stream stream);
Status swizzle_scales_cuda(const uint8_t* scales, int64_t rows, int64_t scale_cols, uint8_t* out, Stream stream);
Status unswizzle_scales_cuda(const uint8_t* swizzled, int64_t rows, int64_t scale_cols, uint8_t* out, Stream stream);

}  // namespace nb::nvfp4
