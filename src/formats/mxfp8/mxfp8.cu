// MXFP8 CUDA quantizer: one kernel reads a 64x64 BF16 tile once into shared memory and writes the
// row-wise copy (blocks of 32 along cols) and the column-wise copy (blocks of 32 along rows, kept
// un-transposed) with their E8M0 scales. Per-element math is the NB_HD code of mxfp8.h and
// scalar_codecs.h, so the codes equal the CPU reference bit for bit (max is exact in any order).
#include "core/cuda_check.h"
#include "formats/mxfp8/mxfp8.h"

namespace nb::mxfp8 {
namespace {

constexpr int kTile = 64;      // tile edge: two 32-blocks per direction
constexpr int kThreads = 256;  // 8 warps, 8 rows (or columns) per warp

__device__ __forceinline__ float half_warp_max(float v) {
  // Lanes 0-15 and 16-31 reduce separately: each half covers one 32-element block (2 per lane).
  for (int o = 8; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// x [rows, cols] BF16; rows, cols multiples of 32 (each 32x32 sub-block of a tile is all in or all out).
__global__ void __launch_bounds__(kThreads) mxfp8_quantize_kernel(const bf16* __restrict__ x, int64_t rows, int64_t cols,
                                                                   bool rowwise, bool colwise, uint8_t* row_data,
                                                                   uint8_t* row_scales, uint8_t* col_data,
                                                                   uint8_t* col_scales, int32_t* nonfinite) {
  __shared__ float tile[kTile][kTile + 1];
  __shared__ float col_inv[2][kTile];
  const int64_t r0 = int64_t(blockIdx.y) * kTile, c0 = int64_t(blockIdx.x) * kTile;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  bool bad = false;
  for (int i = threadIdx.x; i < kTile * kTile / 2; i += kThreads) {
    int r = i / (kTile / 2), cp = i % (kTile / 2);
    float v0 = 0.0f, v1 = 0.0f;
    if (r0 + r < rows && c0 + 2 * cp < cols) {
      uint32_t w = *reinterpret_cast<const uint32_t*>(x + (r0 + r) * cols + c0 + 2 * cp);
      v0 = bits_f32(w << 16);
      v1 = bits_f32(w & 0xFFFF0000u);
      bad |= !isfinite(v0) || !isfinite(v1);
    }
    tile[r][2 * cp] = v0;
    tile[r][2 * cp + 1] = v1;
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0 && nonfinite) atomicOr(nonfinite, 1);

  const int half = lane / 16;  // which 32-block of the tile this lane's pair belongs to
  if (rowwise) {
    for (int k = 0; k < kTile / 8; ++k) {
      int r = warp * (kTile / 8) + k;
      float v0 = tile[r][2 * lane], v1 = tile[r][2 * lane + 1];
      float amax = half_warp_max(fmaxf(fabsf(v0), fabsf(v1)));
      uint32_t code = e8m0_scale_code(amax);
      float inv = e8m0_inverse_scale(code);
      if (r0 + r < rows && c0 + 2 * lane < cols) {
        uint16_t q = uint16_t(f32_to_e4m3_satfinite(v0 * inv) | (f32_to_e4m3_satfinite(v1 * inv) << 8));
        *reinterpret_cast<uint16_t*>(row_data + (r0 + r) * cols + c0 + 2 * lane) = q;
        if (lane % 16 == 0) row_scales[(r0 + r) * (cols / kBlock) + c0 / kBlock + half] = uint8_t(code);
      }
    }
  }
  if (colwise) {
    for (int k = 0; k < kTile / 8; ++k) {
      int c = warp * (kTile / 8) + k;
      float amax = half_warp_max(fmaxf(fabsf(tile[2 * lane][c]), fabsf(tile[2 * lane + 1][c])));
      uint32_t code = e8m0_scale_code(amax);
      if (lane % 16 == 0) {
        col_inv[half][c] = e8m0_inverse_scale(code);
        if (r0 + 32 * half < rows && c0 + c < cols) col_scales[(r0 / kBlock + half) * cols + c0 + c] = uint8_t(code);
      }
    }
    __syncthreads();
    for (int k = 0; k < kTile / 8; ++k) {
      int r = warp * (kTile / 8) + k;
      if (r0 + r < rows && c0 + 2 * lane < cols) {
        float v0 = tile[r][2 * lane] * col_inv[r / 32][2 * lane];
        float v1 = tile[r][2 * lane + 1] * col_inv[r / 32][2 * lane + 1];
        uint16_t q = uint16_t(f32_to_e4m3_satfinite(v0) | (f32_to_e4m3_satfinite(v1) << 8));
        *reinterpret_cast<uint16_t*>(col_data + (r0 + r) * cols + c0 + 2 * lane) = q;
      }
    }
  }
}

}  // namespace

Status quantize_cuda(const bf16* x, const Options& opt, const QuantizedView& out, Stream stream) {
  NB_TRY(check_shape(out.rows, out.cols));
  const int64_t grid_y = (out.rows + kTile - 1) / kTile, grid_x = (out.cols + kTile - 1) / kTile;
  if (grid_y > 65535 || grid_x > 0x7FFFFFFF)
    return errorf("MXFP8 quantize_cuda: %lldx%lld is too large for one launch (rows up to %d)", (long long)out.rows,
                  (long long)out.cols, 65535 * kTile);
  auto s = static_cast<cudaStream_t>(stream);
  if (out.nonfinite) CUDA_CHECK(cudaMemsetAsync(out.nonfinite, 0, sizeof(int32_t), s));
  mxfp8_quantize_kernel<<<dim3(unsigned(grid_x), unsigned(grid_y)), kThreads, 0, s>>>(
      x, out.rows, out.cols, opt.rowwise, opt.colwise, out.row_data, out.row_scales, out.col_data, out.col_scales,
      out.nonfinite);
  CUDA_CHECK_LAUNCH();
  return Status::ok();
}

}  // namespace nb::mxfp8
