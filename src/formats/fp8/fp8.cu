// FP8 per-tensor CUDA quantizers. Current scaling = an amax pass, then one quantize pass that reads
// a BF16 tile once and writes the row copy and the transposed copy (64x128 tiles with vector loads
// and stores when rows and cols are multiples of 8, else 64x64 tiles element by element). The scale is derived from
// the device-side amax inside each block with the same NB_HD formula as the CPU reference, so no
// host round trip is needed and every block uses the identical FP32 scale.
#include <cuda_fp8.h>
#include "core/cuda_check.h"
#include "formats/fp8/fp8.h"

namespace nb::fp8 {
namespace {

constexpr int kTile = 64;
constexpr int kThreads = 256;

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Two values to FP8 (a in the low byte) with the hardware's round-to-nearest-even satfinite
// conversion (sm_89+), about 20x fewer instructions than the software encode(). Finite values and
// +-Inf give encode()'s bytes; NaN, where the hardware's NaN byte may differ, takes encode()'s.
__device__ __forceinline__ uint32_t encode2(float a, float b, Format fmt) {
  uint32_t q = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, fmt == Format::e4m3 ? __NV_E4M3 : __NV_E5M2);
  if (a != a) q = (q & 0xFF00u) | encode(a, fmt);
  if (b != b) q = (q & 0x00FFu) | (encode(b, fmt) << 8);
  return q;
}

// Block-wide max of non-negative floats, folded into *amax with an integer atomicMax (the bit
// patterns of non-negative floats, +Inf included, order like the values).
__device__ void block_amax_to_global(float v, float* amax) {
  __shared__ float partial[kThreads / 32];
  v = warp_max(v);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x < 32) {
    float w = threadIdx.x < kThreads / 32 ? partial[threadIdx.x] : 0.0f;
    w = warp_max(w);
    if (threadIdx.x == 0) atomicMax(reinterpret_cast<unsigned int*>(amax), f32_bits(w));
  }
}

// x: n BF16 values -> *amax (pre-zeroed), *nonfinite (pre-zeroed). 16-byte loads for the bulk
// (cudaMalloc'd pointers are 256-byte aligned), then the tail element by element.
__global__ void __launch_bounds__(kThreads) amax_kernel(const bf16* __restrict__ x, int64_t n, float* amax,
                                                        int32_t* nonfinite) {
  float m = 0.0f;
  bool bad = false;
  const bool aligned = (reinterpret_cast<uintptr_t>(x) & 15u) == 0;
  const int64_t nvec = aligned ? n / 8 : 0;
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < nvec; i += stride) {
    uint4 w = reinterpret_cast<const uint4*>(x)[i];
    const uint32_t u[4] = {w.x, w.y, w.z, w.w};
    for (int j = 0; j < 4; ++j) {
      float a = bits_f32(u[j] << 16), b = bits_f32(u[j] & 0xFFFF0000u);
      m = fmaxf(m, fmaxf(fabsf(a), fabsf(b)));
      bad |= !isfinite(a) || !isfinite(b);
    }
  }
  for (int64_t i = nvec * 8 + int64_t(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride) {
    float v = bf16_to_f32(x[i]);
    m = fmaxf(m, fabsf(v));
    bad |= !isfinite(v);
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0 && nonfinite) atomicOr(nonfinite, 1);
  block_amax_to_global(m, amax);
}

// x [rows, cols] -> data [rows, cols], data_t [cols, rows]. The scale is *scale, or computed from
// *amax_in when from_amax. record_amax: also fold this tile's amax into *amax_out.
__global__ void __launch_bounds__(kThreads) quantize_kernel(const bf16* __restrict__ x, int64_t rows, int64_t cols,
                                                            Format fmt, const float* scale_ptr, bool from_amax,
                                                            bool pow2, const float* amax_in, bool record_amax,
                                                            float* amax_out, int32_t* nonfinite, uint8_t* data,
                                                            uint8_t* data_t, float* scale_inv) {
  __shared__ float tile[kTile][kTile + 1];
  const int64_t r0 = int64_t(blockIdx.y) * kTile, c0 = int64_t(blockIdx.x) * kTile;
  const float scale = from_amax ? scale_from_amax(*amax_in, format_max(fmt), pow2) : *scale_ptr;
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0 && scale_inv) *scale_inv = 1.0f / scale;

  float m = 0.0f;
  bool bad = false;
  for (int i = threadIdx.x; i < kTile * kTile; i += kThreads) {
    int r = i / kTile, c = i % kTile;
    float v = 0.0f;
    if (r0 + r < rows && c0 + c < cols) {
      v = bf16_to_f32(x[(r0 + r) * cols + c0 + c]);
      m = fmaxf(m, fabsf(v));
      bad |= !isfinite(v);
      if (data) data[(r0 + r) * cols + c0 + c] = uint8_t(encode(v * scale, fmt));
    }
    tile[r][c] = v;
  }
  if (record_amax) {
    if (__syncthreads_or(bad) && threadIdx.x == 0 && nonfinite) atomicOr(nonfinite, 1);
    block_amax_to_global(m, amax_out);
  }
  __syncthreads();
  if (!data_t) return;
  for (int i = threadIdx.x; i < kTile * kTile; i += kThreads) {
    int tr = i / kTile, tc = i % kTile;  // transposed tile coordinates: column tr, row tc of x
    if (c0 + tr < cols && r0 + tc < rows)
      data_t[(c0 + tr) * rows + r0 + tc] = uint8_t(encode(tile[tc][tr] * scale, fmt));
  }
}

// Fast path for rows and cols multiples of 8: a 64x128 tile, 16-byte loads and 8-byte stores of
// both copies. Same scale and per-element math as quantize_kernel.
constexpr int kVR = 64, kVC = 128;
__global__ void __launch_bounds__(kThreads) quantize_vec_kernel(const bf16* __restrict__ x, int64_t rows, int64_t cols,
                                                                Format fmt, const float* scale_ptr, bool from_amax,
                                                                bool pow2, const float* amax_in, bool record_amax,
                                                                float* amax_out, int32_t* nonfinite, uint8_t* data,
                                                                uint8_t* data_t, float* scale_inv) {
  __shared__ uint16_t tile[kVR][kVC + 2];
  const int64_t r0 = int64_t(blockIdx.y) * kVR, c0 = int64_t(blockIdx.x) * kVC;
  const float scale = from_amax ? scale_from_amax(*amax_in, format_max(fmt), pow2) : *scale_ptr;
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0 && scale_inv) *scale_inv = 1.0f / scale;

  float m = 0.0f;
  bool bad = false;
  for (int i = threadIdx.x; i < kVR * kVC / 8; i += kThreads) {  // 16-byte chunks of the tile
    const int r = i / (kVC / 8), c = 8 * (i % (kVC / 8));
    uint4 w = make_uint4(0, 0, 0, 0);
    const bool in = r0 + r < rows && c0 + c < cols;
    if (in) w = *reinterpret_cast<const uint4*>(x + (r0 + r) * cols + c0 + c);
    const uint32_t u[4] = {w.x, w.y, w.z, w.w};
    uint32_t q[2] = {0, 0};
    for (int j = 0; j < 4; ++j) {
      float a = bits_f32(u[j] << 16), b = bits_f32(u[j] & 0xFFFF0000u);
      m = fmaxf(m, fmaxf(fabsf(a), fabsf(b)));
      bad |= !isfinite(a) || !isfinite(b);
      q[j / 2] |= encode2(a * scale, b * scale, fmt) << (16 * (j % 2));
      *reinterpret_cast<uint32_t*>(&tile[r][c + 2 * j]) = u[j];
    }
    if (in && data) *reinterpret_cast<uint2*>(data + (r0 + r) * cols + c0 + c) = make_uint2(q[0], q[1]);
  }
  if (record_amax) {
    if (__syncthreads_or(bad) && threadIdx.x == 0 && nonfinite) atomicOr(nonfinite, 1);
    block_amax_to_global(m, amax_out);
  }
  __syncthreads();
  if (!data_t) return;
  for (int i = threadIdx.x; i < kVC * kVR / 8; i += kThreads) {  // column c of x, rows r..r+7 -> 8 bytes of data_t
    const int c = i / (kVR / 8), r = 8 * (i % (kVR / 8));
    if (c0 + c >= cols || r0 + r >= rows) continue;
    uint32_t q[2] = {0, 0};
    for (int j = 0; j < 8; j += 2)
      q[j / 4] |= encode2(bits_f32(uint32_t(tile[r + j][c]) << 16) * scale,
                          bits_f32(uint32_t(tile[r + j + 1][c]) << 16) * scale, fmt) << (8 * (j % 4));
    *reinterpret_cast<uint2*>(data_t + (c0 + c) * rows + r0 + r) = make_uint2(q[0], q[1]);
  }
}

Status launch_quantize(const bf16* x, Format fmt, const float* scale, bool from_amax, bool pow2, const TensorView& out,
                       cudaStream_t s) {
  NB_TRY(check_shape(out.rows, out.cols));
  if (!out.amax) return errorf("FP8 quantize_cuda: the amax output pointer is required");
  const bool vec = out.rows % 8 == 0 && out.cols % 8 == 0 && (reinterpret_cast<uintptr_t>(x) & 15u) == 0;
  if (vec) {
    const int64_t grid_y = (out.rows + kVR - 1) / kVR, grid_x = (out.cols + kVC - 1) / kVC;
    if (grid_y > 65535) return errorf("FP8 quantize_cuda: %lld rows is too many for one launch (at most %d)",
                                      (long long)out.rows, 65535 * kVR);
    quantize_vec_kernel<<<dim3(unsigned(grid_x), unsigned(grid_y)), kThreads, 0, s>>>(
        x, out.rows, out.cols, fmt, scale, from_amax, pow2, out.amax, !from_amax, out.amax, out.nonfinite, out.data,
        out.data_t, out.scale_inv);
    CUDA_CHECK_LAUNCH();
    return Status::ok();
  }
  const int64_t grid_y = (out.rows + kTile - 1) / kTile, grid_x = (out.cols + kTile - 1) / kTile;
  if (grid_y > 65535) return errorf("FP8 quantize_cuda: %lld rows is too many for one launch (at most %d)",
                                    (long long)out.rows, 65535 * kTile);
  quantize_kernel<<<dim3(unsigned(grid_x), unsigned(grid_y)), kThreads, 0, s>>>(
      x, out.rows, out.cols, fmt, scale, from_amax, pow2, out.amax, !from_amax, out.amax, out.nonfinite, out.data,
      out.data_t, out.scale_inv);
  CUDA_CHECK_LAUNCH();
  return Status::ok();
}

}  // namespace

Status quantize_current_cuda(const bf16* x, Format fmt, bool pow2_scales, const TensorView& out, Stream stream) {
  NB_TRY(check_shape(out.rows, out.cols));
  if (!out.amax) return errorf("FP8 quantize_current_cuda: the amax output pointer is required");
  auto s = static_cast<cudaStream_t>(stream);
  CUDA_CHECK(cudaMemsetAsync(out.amax, 0, sizeof(float), s));
  if (out.nonfinite) CUDA_CHECK(cudaMemsetAsync(out.nonfinite, 0, sizeof(int32_t), s));
  const int64_t n = out.rows * out.cols;
  int64_t blocks = (n + kThreads * 8 - 1) / (kThreads * 8);
  if (blocks > 4096) blocks = 4096;
  amax_kernel<<<unsigned(blocks), kThreads, 0, s>>>(x, n, out.amax, out.nonfinite);
  CUDA_CHECK_LAUNCH();
  return launch_quantize(x, fmt, nullptr, true, pow2_scales, out, s);
}

Status quantize_with_scale_cuda(const bf16* x, Format fmt, const float* scale, const TensorView& out, Stream stream) {
  NB_TRY(check_shape(out.rows, out.cols));
  if (!out.amax) return errorf("FP8 quantize_with_scale_cuda: the amax output pointer is required");
  auto s = static_cast<cudaStream_t>(stream);
  CUDA_CHECK(cudaMemsetAsync(out.amax, 0, sizeof(float), s));
  if (out.nonfinite) CUDA_CHECK(cudaMemsetAsync(out.nonfinite, 0, sizeof(int32_t), s));
  return launch_quantize(x, fmt, scale, false, false, out, s);
}

}  // namespace nb::fp8
