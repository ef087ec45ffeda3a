// MXFP8 CPU reference: the specification the CUDA kernel must match bit for bit (see mxfp8.h).
#include <cmath>
#include "formats/mxfp8/mxfp8.h"

namespace nb::mxfp8 {

Status check_shape(int64_t rows, int64_t cols) {
  if (rows <= 0 || cols <= 0 || rows % kBlock != 0 || cols % kBlock != 0)
    return errorf("MXFP8 needs rows and cols divisible by 32 (blocks of 32 in both directions); got %lldx%lld",
                  (long long)rows, (long long)cols);
  return Status::ok();
}

// Quantizes `n` elements spaced `stride` apart as one block.
static void quantize_block(const bf16* x, int64_t stride, uint8_t* data, uint8_t* scale) {
  float amax = 0.0f;
  for (int i = 0; i < kBlock; ++i) amax = std::fmax(amax, std::fabs(bf16_to_f32(x[i * stride])));
  uint32_t code = e8m0_scale_code(amax);
  float inv = e8m0_inverse_scale(code);
  *scale = uint8_t(code);
  for (int i = 0; i < kBlock; ++i) data[i * stride] = uint8_t(f32_to_e4m3_satfinite(bf16_to_f32(x[i * stride]) * inv));
}

Status quantize_ref(const bf16* x, const Options& opt, const QuantizedView& out) {
  NB_TRY(check_shape(out.rows, out.cols));
  const int64_t rows = out.rows, cols = out.cols;
  if (out.nonfinite) {
    int32_t bad = 0;
    for (int64_t i = 0; i < rows * cols; ++i) bad |= !std::isfinite(bf16_to_f32(x[i]));
    *out.nonfinite = bad;
  }
  if (opt.rowwise)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t b = 0; b < cols / kBlock; ++b)
        quantize_block(x + r * cols + b * kBlock, 1, out.row_data + r * cols + b * kBlock,
                       out.row_scales + r * (cols / kBlock) + b);
  if (opt.colwise)
    for (int64_t b = 0; b < rows / kBlock; ++b)
      for (int64_t c = 0; c < cols; ++c)
        quantize_block(x + b * kBlock * cols + c, cols, out.col_data + b * kBlock * cols + c,
                       out.col_scales + b * cols + c);
  return Status::ok();
}

void dequantize_ref(const uint8_t* data, const uint8_t* scales, int64_t rows, int64_t cols, bool colwise, float* out) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      uint32_t code = colwise ? scales[(r / kBlock) * cols + c] : scales[r * (cols / kBlock) + c / kBlock];
      out[r * cols + c] = e4m3_to_f32(data[r * cols + c]) * e8m0_to_f32(code);
    }
}

#if !defined(NIBBLE_HAVE_CUDA)
Status quantize_cuda(const bf16*, const Options&, const QuantizedView&, Stream) {
  return errorf("MXFP8 quantize_cuda: this nibble was built without CUDA; use the CPU path (--device cpu)");
}
#endif

}  // namespace nb::mxfp8
