// FP8 sub-channel ("DeepSeek-style") block scaling, E4M3, one FP32 scale per block:
//   vec128     1x128 blocks (activations and gradients): the row copy has blocks along cols, the
//              transposed copy blocks along rows (i.e. along its own last dim)
//   blk128x128 128x128 tiles (weights): one scale per tile, shared by both copies, so W and W^T hold
//              bit-identical values
// Input: BF16 [rows, cols]; rows and cols must be multiples of 128 (rejected otherwise).
//
// Numerics (TransformerEngine Float8BlockQuantizer, compute_scale_from_amax with epsilon 0), FP32:
//   scale = 448 / block_amax (block_amax 0/Inf/NaN -> 1; infinite quotient -> FLT_MAX; with
//   pow2_scales rounded down to a power of two), scale_inv = 1/scale, q = e4m3_rne_satfinite(x*scale),
//   x_hat = e4m3_value(q) * scale_inv.
//
// Scale layout: the "GEMM-ready" layout TransformerEngine hands to cuBLASLt
// (Float8BlockQuantizer.get_scale_shape), FP32 scale_inv, padding entries written as 0:
//   vec128     row copy data [rows, cols], scale_inv [cols/128, round4(rows)]: entry (k, m) at k*round4(rows) + m
//              (the outer dim is contiguous, cuBLASLt's CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F)
//              transposed copy data [cols, rows], scale_inv [rows/128, round4(cols)]
//   blk128x128 row copy data [rows, cols], scale_inv [rows/128, round4(cols/128)]
//              (CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F)
//              transposed copy data [cols, rows], scale_inv [cols/128, round4(rows/128)]
// round4(n) = n rounded up to a multiple of 4 (16-byte aligned scale rows).
#pragma once
#include <cstdint>
#include "core/bf16.h"
#include "core/status.h"
#include "core/stream.h"
#include "formats/fp8/fp8.h"

namespace nb::fp8 {

enum class BlockKind : uint8_t { vec128, blk128x128 };
constexpr int kSubBlock = 128;

struct BlockOptions {
  BlockKind kind = BlockKind::vec128;
  bool pow2_scales = false;
  bool rowwise = true;
  bool colwise = true;  // the transposed copy
};

struct BlockView {
  int64_t rows = 0, cols = 0;
  uint8_t* row_data = nullptr;     // [rows, cols]
  float* row_scale_inv = nullptr;  // see header comment
  uint8_t* col_data = nullptr;     // [cols, rows] (transposed)
  float* col_scale_inv = nullptr;
  int32_t* nonfinite = nullptr;  // optional
};

NB_HD int64_t round4(int64_t n) { return (n + 3) / 4 * 4; }
// Number of FP32 scale_inv entries (padding included) of the row copy (transposed = false) or the
// transposed copy.
int64_t block_scale_count(BlockKind kind, int64_t rows, int64_t cols, bool transposed);
Status check_block_shape(BlockKind kind, int64_t rows, int64_t cols);

Status quantize_block_ref(const bf16* x, const BlockOptions& opt, const BlockView& out);
Status quantize_block_cuda(const bf16* x, const BlockOptions& opt, const BlockView& out, Stream stream = nullptr);

// x_hat of the row copy ([rows, cols]) or of the transposed copy ([cols, rows]).
void dequantize_block_ref(const uint8_t* data, const float* scale_inv, BlockKind kind, int64_t rows, int64_t cols,
                          bool transposed, float* out);

}  // namespace nb::fp8
