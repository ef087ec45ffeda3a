// FP8 sub-channel (1x128 / 128x128) CPU reference: the specification for the CUDA kernel.
#include <algorithm>
#include <cmath>
#include "formats/fp8/fp8_block.h"

namespace nb::fp8 {

int64_t block_scale_count(BlockKind kind, int64_t rows, int64_t cols, bool transposed) {
  if (transposed) std::swap(rows, cols);
  if (kind == BlockKind::vec128) return (cols / kSubBlock) * round4(rows);
  return (rows / kSubBlock) * round4(cols / kSubBlock);
}

Status check_block_shape(BlockKind kind, int64_t rows, int64_t cols) {
  if (rows <= 0 || cols <= 0 || rows % kSubBlock != 0 || cols % kSubBlock != 0)
    return errorf(
        "FP8 %s blocks need rows and cols divisible by 128 (the row and transposed copies both block "
        "by 128); got %lldx%lld",
        kind == BlockKind::vec128 ? "1x128" : "128x128", (long long)rows, (long long)cols);
  return Status::ok();
}

// Index of the scale of element (r, c) of a [rows, cols] copy whose blocks run along cols.
static int64_t scale_index(BlockKind kind, int64_t rows, int64_t cols, int64_t r, int64_t c) {
  if (kind == BlockKind::vec128) return (c / kSubBlock) * round4(rows) + r;
  return (r / kSubBlock) * round4(cols / kSubBlock) + c / kSubBlock;
}

Status quantize_block_ref(const bf16* x, const BlockOptions& opt, const BlockView& out) {
  NB_TRY(check_block_shape(opt.kind, out.rows, out.cols));
  const int64_t rows = out.rows, cols = out.cols;
  if (out.nonfinite) {
    int32_t bad = 0;
    for (int64_t i = 0; i < rows * cols; ++i) bad |= !std::isfinite(bf16_to_f32(x[i]));
    *out.nonfinite = bad;
  }
  auto val = [&](int64_t r, int64_t c) { return bf16_to_f32(x[r * cols + c]); };
  if (opt.rowwise)
    std::fill(out.row_scale_inv, out.row_scale_inv + block_scale_count(opt.kind, rows, cols, false), 0.0f);
  if (opt.colwise)
    std::fill(out.col_scale_inv, out.col_scale_inv + block_scale_count(opt.kind, rows, cols, true), 0.0f);

  // Each block is (rb*bh .. +bh) x (cb*bw .. +bw); vec128 uses 1x128 for the row copy and 128x1 for
  // the transposed copy, blk128x128 one 128x128 tile for both.
  auto quantize_blocks = [&](int64_t bh, int64_t bw, bool transposed) {
    for (int64_t r0 = 0; r0 < rows; r0 += bh)
      for (int64_t c0 = 0; c0 < cols; c0 += bw) {
        float amax = 0.0f;
        for (int64_t r = r0; r < r0 + bh; ++r)
          for (int64_t c = c0; c < c0 + bw; ++c) amax = std::fmax(amax, std::fabs(val(r, c)));
        float scale = scale_from_amax(amax, kE4M3Max, opt.pow2_scales);
        float scale_inv = 1.0f / scale;
        for (int64_t r = r0; r < r0 + bh; ++r)
          for (int64_t c = c0; c < c0 + bw; ++c) {
            uint8_t q = uint8_t(f32_to_e4m3_satfinite(val(r, c) * scale));
            if (!transposed)
              out.row_data[r * cols + c] = q;
            else
              out.col_data[c * rows + r] = q;
          }
        if (!transposed)
          out.row_scale_inv[scale_index(opt.kind, rows, cols, r0, c0)] = scale_inv;
        else
          out.col_scale_inv[scale_index(opt.kind, cols, rows, c0, r0)] = scale_inv;
      }
  };
  const bool vec = opt.kind == BlockKind::vec128;
  if (opt.rowwise) quantize_blocks(vec ? 1 : kSubBlock, kSubBlock, false);
  if (opt.colwise) quantize_blocks(kSubBlock, vec ? 1 : kSubBlock, true);
  return Status::ok();
}

void dequantize_block_ref(const uint8_t* data, const float* scale_inv, BlockKind kind, int64_t rows, int64_t cols,
                          bool transposed, float* out) {
  if (transposed) std::swap(rows, cols);  // the transposed copy is a [cols, rows] tensor blocked along its last dim
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      out[r * cols + c] = e4m3_to_f32(data[r * cols + c]) * scale_inv[scale_index(kind, rows, cols, r, c)];
}

#if !defined(NIBBLE_HAVE_CUDA)
Status quantize_block_cuda(const bf16*, const BlockOptions&, const BlockView&, Stream) {
  return errorf("FP8 quantize_block_cuda: this nibble was built without CUDA; use the CPU path (--device cpu)");
}
#endif

}  // namespace nb::fp8
