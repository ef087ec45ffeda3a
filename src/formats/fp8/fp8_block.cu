// FP8 sub-channel CUDA quantizer: one block of 256 threads reads a 128x128 BF16 tile once into shared
// memory (as raw BF16, 33 KB) and writes the row copy and the transposed copy with their FP32
// scale_inv in the GEMM-ready layout of fp8_block.h. vec128: one scale per 128-element row (row copy)
// or column (transposed copy) of the tile; blk128x128: one scale per tile, shared by both copies.
// The E4M3 encode is the hardware's RNE satfinite conversion (two values per instruction) in tiles whose
// inputs are all finite (every product is then finite or +-Inf, where the hardware byte equals
// f32_to_e4m3_satfinite's); a tile holding Inf or NaN takes the software encode.
#include "core/cuda_check.h"
#include "core/macros.h"
#include "formats/fp8/fp8_block.h"
#include "formats/fp8/fp8_convert.cuh"

namespace nb::fp8 {
namespace {

constexpr int kT = kSubBlock;  // 128
constexpr int kThreads = 256;
constexpr int kPitch = kT + 2;  // BF16 elements per shared row: keeps rows 4-byte aligned, shifts banks

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float bf16_bits_to_f32(uint16_t b) { return bits_f32(uint32_t(b) << 16); }

__device__ __forceinline__ uint32_t encode4_exact(const float* v, float scale) {
  uint32_t q = 0;
  for (int j = 0; j < 4; ++j) q |= f32_to_e4m3_satfinite(v[j] * scale) << (8 * j);
  return q;
}

// Four values to E4M3 bytes (v[0] in the low byte).
__device__ __forceinline__ uint32_t encode4(const float* v, float scale, bool finite_tile) {
  if (!finite_tile) return encode4_exact(v, scale);
  return cvt_fp8x2<Format::e4m3>(v[0] * scale, v[1] * scale) |
         (cvt_fp8x2<Format::e4m3>(v[2] * scale, v[3] * scale) << 16);
}

__global__ void __launch_bounds__(kThreads)
    block_quantize_kernel(const bf16* __restrict__ x, int64_t rows, int64_t cols, bool tile_scale, bool pow2,
                          bool rowwise, bool colwise, uint8_t* row_data, float* row_scale_inv, uint8_t* col_data,
                          float* col_scale_inv, int32_t* nonfinite) {
  __shared__ uint16_t tile[kT * kPitch];
  __shared__ float warp_amax[kThreads / 32];
  const int64_t r0 = int64_t(blockIdx.y) * kT, c0 = int64_t(blockIdx.x) * kT;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  float m = 0.0f;
  bool bad = false;
  // All of a thread's 16-byte chunks are loaded before any is used, so their loads are in flight together.
  constexpr int kChunks = kT * kT / 8 / kThreads;
  uint4 chunk[kChunks];
  NB_UNROLL
  for (int it = 0; it < kChunks; ++it) {
    const int i = threadIdx.x + it * kThreads, r = i / (kT / 8), c = 8 * (i % (kT / 8));
    chunk[it] = *reinterpret_cast<const uint4*>(x + (r0 + r) * cols + c0 + c);
  }
  NB_UNROLL
  for (int it = 0; it < kChunks; ++it) {
    const int i = threadIdx.x + it * kThreads, r = i / (kT / 8), c = 8 * (i % (kT / 8));
    const uint4 w = chunk[it];
    const uint32_t u[4] = {w.x, w.y, w.z, w.w};
    for (int j = 0; j < 4; ++j) {
      float v0 = bits_f32(u[j] << 16), v1 = bits_f32(u[j] & 0xFFFF0000u);
      m = fmaxf(m, fmaxf(fabsf(v0), fabsf(v1)));
      bad |= !isfinite(v0) || !isfinite(v1);
      *reinterpret_cast<uint32_t*>(&tile[r * kPitch + c + 2 * j]) = u[j];
    }
  }
  m = warp_max(m);
  if (lane == 0) warp_amax[warp] = m;
  const bool finite_tile = !__syncthreads_or(bad);
  if (!finite_tile && threadIdx.x == 0 && nonfinite) atomicOr(nonfinite, 1);
  float tile_amax = 0.0f;
  for (int w = 0; w < kThreads / 32; ++w) tile_amax = fmaxf(tile_amax, warp_amax[w]);
  const float tile_scale_value = scale_from_amax(tile_amax, kE4M3Max, pow2);
  if (tile_scale && threadIdx.x == 0) {
    float inv = 1.0f / tile_scale_value;
    if (rowwise) row_scale_inv[(r0 / kT) * round4(cols / kT) + c0 / kT] = inv;
    if (colwise) col_scale_inv[(c0 / kT) * round4(rows / kT) + r0 / kT] = inv;
  }

  if (rowwise) {  // warp w: tile rows 16w..16w+15; lane: 4 consecutive columns
    for (int k = 0; k < kT / 8; ++k) {
      int r = warp * (kT / 8) + k;
      float v[4];
      for (int j = 0; j < 4; ++j) v[j] = bf16_bits_to_f32(tile[r * kPitch + 4 * lane + j]);
      float scale = tile_scale_value;
      if (!tile_scale) {
        float a = warp_max(fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3]))));
        scale = scale_from_amax(a, kE4M3Max, pow2);
        if (lane == 0) row_scale_inv[(c0 / kT) * round4(rows) + r0 + r] = 1.0f / scale;
      }
      const uint32_t q = encode4(v, scale, finite_tile);
      *reinterpret_cast<uint32_t*>(row_data + (r0 + r) * cols + c0 + 4 * lane) = q;
    }
  }
  if (colwise) {  // warp w: tile columns 16w..16w+15; lane: 4 consecutive rows -> 4 bytes of data_t
    for (int k = 0; k < kT / 8; ++k) {
      int c = warp * (kT / 8) + k;
      float v[4];
      // Lane groups of 8 read their 4 rows in rotated order so the 32 lanes hit 32 distinct banks
      // (row pitch 65 words); the values are put back in row order with constant indices.
      const int g = lane / 8;
      float rot[4];
      for (int j = 0; j < 4; ++j) rot[j] = bf16_bits_to_f32(tile[(4 * lane + ((j + g) & 3)) * kPitch + c]);
      for (int k2 = 0; k2 < 4; ++k2)  // v[k2] = rot[(k2 - g) & 3]
        v[k2] = g == 0 ? rot[k2] : g == 1 ? rot[(k2 + 3) & 3] : g == 2 ? rot[(k2 + 2) & 3] : rot[(k2 + 1) & 3];
      float scale = tile_scale_value;
      if (!tile_scale) {
        float a = warp_max(fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3]))));
        scale = scale_from_amax(a, kE4M3Max, pow2);
        if (lane == 0) col_scale_inv[(r0 / kT) * round4(cols) + c0 + c] = 1.0f / scale;
      }
      const uint32_t q = encode4(v, scale, finite_tile);
      *reinterpret_cast<uint32_t*>(col_data + (c0 + c) * rows + r0 + 4 * lane) = q;
    }
  }
}

}  // namespace

Status quantize_block_cuda(const bf16* x, const BlockOptions& opt, const BlockView& out, Stream stream) {
  NB_TRY(check_block_shape(opt.kind, out.rows, out.cols));
  if (out.rows / kT > 65535)
    return errorf("FP8 quantize_block_cuda: %lld rows is too many for one launch (at most %d)", (long long)out.rows,
                  65535 * kT);
  auto s = static_cast<cudaStream_t>(stream);
  if (out.nonfinite) CUDA_CHECK(cudaMemsetAsync(out.nonfinite, 0, sizeof(int32_t), s));
  // Padding entries of the scale tensors are defined as 0.
  if (opt.rowwise)
    CUDA_CHECK(cudaMemsetAsync(out.row_scale_inv, 0,
                               sizeof(float) * block_scale_count(opt.kind, out.rows, out.cols, false), s));
  if (opt.colwise)
    CUDA_CHECK(cudaMemsetAsync(out.col_scale_inv, 0,
                               sizeof(float) * block_scale_count(opt.kind, out.rows, out.cols, true), s));
  dim3 grid(unsigned(out.cols / kT), unsigned(out.rows / kT));
  block_quantize_kernel<<<grid, kThreads, 0, s>>>(x, out.rows, out.cols, opt.kind == BlockKind::blk128x128,
                                                  opt.pow2_scales, opt.rowwise, opt.colwise, out.row_data,
                                                  out.row_scale_inv, out.col_data, out.col_scale_inv, out.nonfinite);
  CUDA_CHECK_LAUNCH();
  return Status::ok();
}

}  // namespace nb::fp8
