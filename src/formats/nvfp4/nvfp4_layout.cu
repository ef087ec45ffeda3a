// CUDA dequantization and cuBLAS scale (un)swizzling for NVFP4; same formulas as nvfp4_ref.cpp
// (dequant_value and swizzle_offset_padded from nvfp4_math.h), so the same bits.
#include "core/cuda_check.h"
#include "formats/nvfp4/nvfp4.h"
#include "formats/nvfp4/nvfp4_math.h"

namespace nb::nvfp4 {
namespace {

// Thread = one 16-element block: 8 code bytes in, 16 floats out (four 16-byte stores).
__global__ void dequantize_kernel(const uint8_t* __restrict__ data, const uint8_t* __restrict__ scales,
                                  const float* __restrict__ amax, float bound, int64_t blocks,
                                  float* __restrict__ out) {
  const int64_t b = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (b >= blocks) return;
  const uint2 packed = *reinterpret_cast<const uint2*>(data + b * 8);
  const uint32_t s = scales[b];
  const float am = *amax;
  float v[16];
  NB_UNROLL
  for (int i = 0; i < 16; ++i)
    v[i] = dequant_value(((i < 8 ? packed.x : packed.y) >> (4 * (i % 8))) & 0xFu, s, am, bound);
  float4* dst = reinterpret_cast<float4*>(out + b * 16);
  NB_UNROLL
  for (int i = 0; i < 4; ++i) dst[i] = make_float4(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]);
}

// Thread = one byte of the padded swizzled layout (zero in the padding).
__global__ void swizzle_kernel(const uint8_t* __restrict__ scales, int64_t rows, int64_t scale_cols, int64_t rp,
                               int64_t kp, uint8_t* __restrict__ out) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= rp * kp) return;
  const int64_t r = i / kp, c = i % kp;
  out[swizzle_offset_padded(r, c, kp)] = (r < rows && c < scale_cols) ? scales[r * scale_cols + c] : 0;
}

__global__ void unswizzle_kernel(const uint8_t* __restrict__ swizzled, int64_t rows, int64_t scale_cols, int64_t kp,
                                 uint8_t* __restrict__ out) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= rows * scale_cols) return;
  out[i] = swizzled[swizzle_offset_padded(i / scale_cols, i % scale_cols, kp)];
}

int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }
unsigned blocks_for(int64_t n) { return unsigned((n + 255) / 256); }

}  // namespace

Status dequantize_cuda(const uint8_t* data, const uint8_t* scales, const float* amax, int64_t outer, int64_t inner,
                       float* out, Stream stream, bool four_over_six) {
  NB_TRY(check_shape(outer, inner, Options{}));
  const int64_t blocks = outer * inner / 16;
  dequantize_kernel<<<blocks_for(blocks), 256, 0, static_cast<cudaStream_t>(stream)>>>(
      data, scales, amax, e4m3_bound(four_over_six), blocks, out);
  CUDA_CHECK_LAUNCH();
  return Status::ok();
}

Status swizzle_scales_cuda(const uint8_t* scales, int64_t rows, int64_t scale_cols, uint8_t* out, Stream stream) {
  if (rows <= 0 || scale_cols <= 0)
    return errorf("cannot swizzle a %lld x %lld scale tensor: both dimensions must be positive", (long long)rows,
                  (long long)scale_cols);
  const int64_t rp = round_up(rows, 128), kp = round_up(scale_cols, 4);
  swizzle_kernel<<<blocks_for(rp * kp), 256, 0, static_cast<cudaStream_t>(stream)>>>(scales, rows, scale_cols, rp, kp,
                                                                                     out);
  CUDA_CHECK_LAUNCH();
  return Status::ok();
}

Status unswizzle_scales_cuda(const uint8_t* swizzled, int64_t rows, int64_t scale_cols, uint8_t* out, Stream stream) {
  if (rows <= 0 || scale_cols <= 0)
    return errorf("cannot unswizzle a %lld x %lld scale tensor: both dimensions must be positive", (long long)rows,
                  (long long)scale_cols);
  unswizzle_kernel<<<blocks_for(rows * scale_cols), 256, 0, static_cast<cudaStream_t>(stream)>>>(
      swizzled, rows, scale_cols, round_up(scale_cols, 4), out);
  CUDA_CHECK_LAUNCH();
  return Status::ok();
}

}  // namespace nb::nvfp4
