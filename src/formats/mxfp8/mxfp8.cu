// MXFP8 CUDA quantizer: one kernel reads a 32x256 BF16 tile once (16-byte loads) and writes the
// row-wise copy (blocks of 32 along cols) and the column-wise copy (blocks of 32 along rows, kept
// un-transposed) with their E8M0 scales (8-byte stores). Scales are the NB_HD code of mxfp8.h, so the
// codes equal the CPU reference bit for bit (max is exact in any order). The E4M3 encode is the
// hardware's RNE satfinite conversion (two values per instruction) in tiles whose inputs are all
// finite: there every product x * 2^k is finite and the hardware byte equals f32_to_e4m3_satfinite's.
// A tile holding Inf or NaN takes the software encode, whose NaN byte the hardware need not match.
#include "core/cuda_check.h"
#include "core/macros.h"
#include "formats/fp8/fp8_convert.cuh"
#include "formats/mxfp8/mxfp8.h"

namespace nb::mxfp8 {
namespace {

constexpr int kRows = 32;                         // one column block
constexpr int kCols = 256;                        // 8 row blocks
constexpr int kThreads = 256;                     // thread t: 8 consecutive columns (a 16-byte chunk) of 4 rows
constexpr int kChunks = kCols / 8;                // 32 chunks per tile row
constexpr int kRowsPerPass = kThreads / kChunks;  // 8 rows per load pass, 4 passes

__device__ __forceinline__ void unpack8(uint4 w, float* v) {
  const uint32_t u[4] = {w.x, w.y, w.z, w.w};
  for (int j = 0; j < 4; ++j) {
    v[2 * j] = bits_f32(u[j] << 16);
    v[2 * j + 1] = bits_f32(u[j] & 0xFFFF0000u);
  }
}

// The software encode, for tiles with non-finite inputs (inlined: a call would put v and inv on the stack).
__device__ __forceinline__ uint2 encode8_exact(const float* v, const float* inv) {
  uint32_t lo = 0, hi = 0;
  for (int j = 0; j < 4; ++j) lo |= f32_to_e4m3_satfinite(v[j] * inv[j]) << (8 * j);
  for (int j = 0; j < 4; ++j) hi |= f32_to_e4m3_satfinite(v[4 + j] * inv[4 + j]) << (8 * j);
  return make_uint2(lo, hi);
}

__device__ __forceinline__ uint2 encode8(const float* v, const float* inv, bool finite_tile) {
  if (!finite_tile) return encode8_exact(v, inv);
  uint32_t w[2];
  for (int h = 0; h < 2; ++h) {
    const float* a = v + 4 * h;
    const float* s = inv + 4 * h;
    w[h] = fp8::cvt_fp8x2<fp8::Format::e4m3>(a[0] * s[0], a[1] * s[1]) |
           (fp8::cvt_fp8x2<fp8::Format::e4m3>(a[2] * s[2], a[3] * s[3]) << 16);
  }
  return make_uint2(w[0], w[1]);
}

// x [rows, cols] BF16; rows, cols multiples of 32. A 32-column block of the tile is all in or all out.
__global__ void __launch_bounds__(kThreads)
    mxfp8_quantize_kernel(const bf16* __restrict__ x, int64_t rows, int64_t cols, bool rowwise, bool colwise,
                          uint8_t* row_data, uint8_t* row_scales, uint8_t* col_data, uint8_t* col_scales,
                          int32_t* nonfinite) {
  __shared__ uint16_t tile[kRows][kCols + 2];  // raw BF16; +2 shifts banks between rows
  __shared__ float col_inv[kCols];
  const int64_t r0 = int64_t(blockIdx.y) * kRows, c0 = int64_t(blockIdx.x) * kCols;
  const int chunk = threadIdx.x % kChunks, row_in_pass = threadIdx.x / kChunks;
  const bool chunk_in = c0 + 8 * chunk < cols;

  float v[4][8];
  bool bad = false;
  NB_UNROLL
  for (int p = 0; p < kRows / kRowsPerPass; ++p) {
    const int r = p * kRowsPerPass + row_in_pass;
    uint4 w = make_uint4(0, 0, 0, 0);
    if (chunk_in) w = *reinterpret_cast<const uint4*>(x + (r0 + r) * cols + c0 + 8 * chunk);
    unpack8(w, v[p]);
    for (int j = 0; j < 8; ++j) bad |= !isfinite(v[p][j]);
    const uint32_t u[4] = {w.x, w.y, w.z, w.w};
    for (int j = 0; j < 4; ++j) *reinterpret_cast<uint32_t*>(&tile[r][8 * chunk + 2 * j]) = u[j];
  }
  const bool finite_tile = !__syncthreads_or(bad);
  if (!finite_tile && threadIdx.x == 0 && nonfinite) atomicOr(nonfinite, 1);

  if (rowwise) {  // 4 neighbouring threads (lanes 4k..4k+3) hold one 32-element row block
    NB_UNROLL
    for (int p = 0; p < kRows / kRowsPerPass; ++p) {
      float a = 0.0f;
      for (int j = 0; j < 8; ++j) a = fmaxf(a, fabsf(v[p][j]));
      a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, 1));
      a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, 2));
      const uint32_t code = e8m0_scale_code(a);
      float inv[8];
      for (int j = 0; j < 8; ++j) inv[j] = e8m0_inverse_scale(code);
      if (chunk_in) {
        const int64_t r = r0 + p * kRowsPerPass + row_in_pass;
        *reinterpret_cast<uint2*>(row_data + r * cols + c0 + 8 * chunk) = encode8(v[p], inv, finite_tile);
        if (chunk % 4 == 0) row_scales[r * (cols / kBlock) + (c0 + 8 * chunk) / kBlock] = uint8_t(code);
      }
    }
  }
  if (colwise) {
    {  // thread t owns column t of the tile: amax over its 32 rows
      const int c = threadIdx.x;
      float a = 0.0f;
      for (int r = 0; r < kRows; ++r) a = fmaxf(a, fabsf(bits_f32(uint32_t(tile[r][c]) << 16)));
      const uint32_t code = e8m0_scale_code(a);
      col_inv[c] = e8m0_inverse_scale(code);
      if (c0 + c < cols) col_scales[(r0 / kBlock) * cols + c0 + c] = uint8_t(code);
    }
    __syncthreads();
    float inv[8];
    for (int j = 0; j < 8; ++j) inv[j] = col_inv[8 * chunk + j];
    NB_UNROLL
    for (int p = 0; p < kRows / kRowsPerPass; ++p) {
      if (!chunk_in) continue;
      const int64_t r = r0 + p * kRowsPerPass + row_in_pass;
      *reinterpret_cast<uint2*>(col_data + r * cols + c0 + 8 * chunk) = encode8(v[p], inv, finite_tile);
    }
  }
}

}  // namespace

Status quantize_cuda(const bf16* x, const Options& opt, const QuantizedView& out, Stream stream) {
  NB_TRY(check_shape(out.rows, out.cols));
  const int64_t grid_y = out.rows / kRows, grid_x = (out.cols + kCols - 1) / kCols;
  if (grid_y > 65535 || grid_x > 0x7FFFFFFF)
    return errorf("MXFP8 quantize_cuda: %lldx%lld is too large for one launch (rows up to %d)", (long long)out.rows,
                  (long long)out.cols, 65535 * kRows);
  auto s = static_cast<cudaStream_t>(stream);
  if (out.nonfinite) CUDA_CHECK(cudaMemsetAsync(out.nonfinite, 0, sizeof(int32_t), s));
  mxfp8_quantize_kernel<<<dim3(unsigned(grid_x), unsigned(grid_y)), kThreads, 0, s>>>(
      x, out.rows, out.cols, opt.rowwise, opt.colwise, out.row_data, out.row_scales, out.col_data, out.col_scales,
      out.nonfinite);
  CUDA_CHECK_LAUNCH();
  return Status::ok();
}

}  // namespace nb::mxfp8
