// GPU side of mor_stat.h: one grid-stride pass over x and its FP8 codes (8 elements per thread and iteration where
// the sizes and pointers allow, 6 blocks per SM), for quantizations that did not compute it while encoding
// (fp8::TensorView::mor_stat does, on the quantizer's tiled path); each block sums its threads' integers and adds them
// into the cell with one atomic per field. Integer sums do not depend on the order, so the result equals
// add_fp8_stat_host's bit for bit (the per-element float expression is element_error_fixed's, IEEE division).
// Also the per-row ("per-channel") statistic, a row per warp or per block: its amax, then its terms (the study's
// measurement beside the per-tensor rule, add_fp8_rowwise_stat_host's bit for bit).
#include <cuda_runtime.h>
#include <algorithm>
#include "core/cuda_check.h"
#include "formats/fp8/fp8_convert.cuh"
#include "formats/mor/mor_stat.cuh"
#include "formats/nvfp4/nvfp4.h"
#include "formats/nvfp4/nvfp4_math.h"
#include "formats/scalar_codecs.h"

namespace nb::mor {
namespace {

constexpr int kThreads = 256;
using device::Sums;

// 16 elements per thread and iteration, two 8-element loads in flight (32 bytes of BF16, 16 of codes); n a multiple of
// 8 and the pointers aligned. Latency, not bandwidth or issue, bounded a one-load loop at half occupancy.
__global__ void __launch_bounds__(kThreads, 6)
    fp8_stat_vec8_kernel(const uint4* __restrict__ x, const uint2* __restrict__ codes,
                         const float* __restrict__ scale_inv, int64_t n8, bool e5m2, StatCell* cell) {
  const float s = *scale_inv;
  Sums t;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n8; i += 2 * stride) {
    const bool second = i + stride < n8;
    const uint4 v0 = x[i], v1 = second ? x[i + stride] : make_uint4(0, 0, 0, 0);
    const uint2 c0 = codes[i], c1 = second ? codes[i + stride] : make_uint2(0, 0);
    NB_UNROLL
    for (int h = 0; h < 2; ++h) {
      const uint4 v = h ? v1 : v0;
      const uint2 c = h ? c1 : c0;
      const uint32_t vw[4] = {v.x, v.y, v.z, v.w};
      NB_UNROLL
      for (int j = 0; j < 8; ++j) {
        const float f = __uint_as_float((vw[j / 2] >> (16 * (j & 1))) << 16);  // zero padding adds nothing
        t.add(f, ((j < 4 ? c.x : c.y) >> (8 * (j & 3))) & 0xFFu, s, e5m2);
      }
    }
  }
  device::add_block<kThreads>(t, cell);
}

// Any n and alignment: one element per thread and iteration.
__global__ void fp8_stat_kernel(const bf16* __restrict__ x, const uint8_t* __restrict__ codes,
                                const float* __restrict__ scale_inv, int64_t n, bool e5m2, StatCell* cell) {
  const float s = *scale_inv;
  Sums t;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    t.add(bf16_to_f32(x[i]), codes[i], s, e5m2);
  device::add_block<kThreads>(t, cell);
}

// One NVFP4 block (16 elements: 32 bytes of BF16, 8 bytes of codes, one scale byte) per thread and iteration; the
// value is nvfp4::dequant_value's, as the host computes it (products only: nothing to contract into an FMA). kE4m3:
// also add_fp8_stat_from_amax_host's E4M3 statistic from the same amax, while x is in registers.
template <bool kE4m3>
__global__ void __launch_bounds__(kThreads, 6)
    nvfp4_stat_kernel(const uint4* __restrict__ x, const uint2* __restrict__ data, const uint8_t* __restrict__ scales,
                      const float* __restrict__ amax, int64_t blocks, StatCell* cell, StatCell* e4m3_cell) {
  const float a = *amax;
  const float scale = fp8::scale_from_amax(a, fp8::format_max(fp8::Format::e4m3), false), scale_inv = 1.0f / scale;
  Sums t, t8;
  for (int64_t b = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; b < blocks; b += int64_t(gridDim.x) * blockDim.x) {
    const uint4 v0 = x[2 * b], v1 = x[2 * b + 1];
    const uint2 d = data[b];
    const uint32_t s = scales[b];
    const uint32_t vw[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
    NB_UNROLL
    for (int j = 0; j < 16; ++j) {
      const float v = __uint_as_float((vw[j / 2] >> (16 * (j & 1))) << 16);
      if (kE4m3 && (j & 1) == 0) {  // two elements per hardware conversion
        const float w = __uint_as_float(vw[j / 2] & 0xFFFF0000u);
        const uint32_t q = fp8::cvt_fp8x2<fp8::Format::e4m3>(__fmul_rn(v, scale), __fmul_rn(w, scale));
        t8.add(v, q & 0xFFu, scale_inv, false);
        t8.add(w, (q >> 8) & 0xFFu, scale_inv, false);
      }
      if (!isfinite(v)) {
        ++t.nonfinite;
        continue;
      }
      if (v == 0.0f) continue;
      const uint32_t code = ((j < 8 ? d.x : d.y) >> (4 * (j & 7))) & 0xFu;
      t.err += device::element_term(v, nvfp4::dequant_value(code, s, a));
      ++t.nonzero;
    }
  }
  device::add_block<kThreads>(t, cell);
  if (!kE4m3) return;
  __syncthreads();  // add_block's shared sums are read by warp 0 before the second call writes them
  device::add_block<kThreads>(t8, e4m3_cell);
}

// ---- The per-row ("per-channel") statistic (add_fp8_rowwise_stat_cuda) ----
// One unit: 8 elements (one 16-byte load) when kVec, else one element.
template <bool kVec>
__device__ __forceinline__ float unit_amax(const bf16* __restrict__ row, int64_t u) {
  if (!kVec) return fabsf(bf16_to_f32(row[u]));
  const uint4 v = reinterpret_cast<const uint4*>(row)[u];
  float m = 0.0f;
  NB_UNROLL
  for (uint32_t w : {v.x, v.y, v.z, v.w}) {
    m = fmaxf(m, fabsf(__uint_as_float(w << 16)));  // fmaxf skips a NaN, as fp8::amax_ref's std::fmax
    m = fmaxf(m, fabsf(__uint_as_float(w & 0xFFFF0000u)));
  }
  return m;
}

// The unit's terms: each element encoded as the FP8 quantizer encodes x * scale (satfinite RNE, two per conversion).
template <bool kVec, fp8::Format F>
__device__ __forceinline__ void add_unit(const bf16* __restrict__ row, int64_t u, float scale, float scale_inv,
                                         Sums* t) {
  constexpr bool kE5m2 = F == fp8::Format::e5m2;
  if (!kVec) {
    const float v = bf16_to_f32(row[u]);
    t->add(v, fp8::cvt_fp8x2<F>(__fmul_rn(v, scale), 0.0f) & 0xFFu, scale_inv, kE5m2);
    return;
  }
  const uint4 v = reinterpret_cast<const uint4*>(row)[u];
  NB_UNROLL
  for (uint32_t w : {v.x, v.y, v.z, v.w}) {
    const float lo = __uint_as_float(w << 16), hi = __uint_as_float(w & 0xFFFF0000u);
    const uint32_t q = fp8::cvt_fp8x2<F>(__fmul_rn(lo, scale), __fmul_rn(hi, scale));
    t->add(lo, q & 0xFFu, scale_inv, kE5m2);
    t->add(hi, (q >> 8) & 0xFFu, scale_inv, kE5m2);
  }
}

// The max over a row's kRowThreads threads (one warp, or every warp of the block). Every thread of the block calls it.
template <int kRowThreads>
__device__ __forceinline__ float row_max(float m, float* s_amax) {
  for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
  if (kRowThreads == 32) return m;
  constexpr int kWarpsPerRow = kRowThreads / 32;
  __syncthreads();  // the previous row's reads of s_amax are done
  if (threadIdx.x % 32 == 0) s_amax[threadIdx.x / 32] = m;
  __syncthreads();
  const int first = threadIdx.x / kRowThreads * kWarpsPerRow;
  m = s_amax[first];
  for (int w = 1; w < kWarpsPerRow; ++w) m = fmaxf(m, s_amax[first + w]);
  return m;
}

// kRowThreads threads per row (a warp for short rows, the block for long ones), kThreads / kRowThreads rows per block
// and iteration: the row's amax, its scale as the quantizer derives it, then its terms (the row read a second time,
// mostly from L1). kVec: cols % 8 == 0 and x 16-byte aligned, so every row starts on a 16-byte boundary.
template <int kRowThreads, bool kVec, fp8::Format F>
__global__ void __launch_bounds__(kThreads, 6)
    rowwise_stat_kernel(const bf16* __restrict__ x, int64_t rows, int64_t cols, StatCell* cell) {
  constexpr int kRowsPerBlock = kThreads / kRowThreads;
  __shared__ float s_amax[kThreads / 32];
  const int group = threadIdx.x / kRowThreads, lane = threadIdx.x % kRowThreads;
  const int64_t units = kVec ? cols / 8 : cols;
  Sums t;
  // `first` is the same for every thread of the block, so all of them reach row_max's barriers alike.
  for (int64_t first = int64_t(blockIdx.x) * kRowsPerBlock; first < rows; first += int64_t(gridDim.x) * kRowsPerBlock) {
    const int64_t r = first + group;
    const bool live = r < rows;
    const bf16* row = x + (live ? r : 0) * cols;
    float m = 0.0f;
    if (live)
      for (int64_t u = lane; u < units; u += kRowThreads) m = fmaxf(m, unit_amax<kVec>(row, u));
    m = row_max<kRowThreads>(m, s_amax);
    if (!live) continue;
    const float scale = fp8::scale_from_amax(m, fp8::format_max(F), false), scale_inv = 1.0f / scale;
    for (int64_t u = lane; u < units; u += kRowThreads) add_unit<kVec, F>(row, u, scale, scale_inv, &t);
  }
  device::add_block<kThreads>(t, cell);
}

int max_blocks() {
  static const int blocks = [] {
    int device = 0, sms = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
      return 528;
    return 6 * sms;  // every SM full (6 blocks of 256 under the launch bound), few atomics
  }();
  return blocks;
}

}  // namespace

Status add_fp8_stat_cuda(const bf16* x, const uint8_t* codes, const float* scale_inv, int64_t n, fp8::Format fmt,
                         StatCell* cell, Stream stream) {
  if (n <= 0) return Status::ok();
  const auto st = static_cast<cudaStream_t>(stream);
  const bool e5m2 = fmt == fp8::Format::e5m2;
  const bool vec =
      n % 8 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 && reinterpret_cast<uintptr_t>(codes) % 8 == 0;
  const int64_t work = vec ? n / 8 : n;
  const auto blocks = unsigned(std::min<int64_t>((work + kThreads - 1) / kThreads, max_blocks()));
  if (vec)
    fp8_stat_vec8_kernel<<<blocks, kThreads, 0, st>>>(
        reinterpret_cast<const uint4*>(x), reinterpret_cast<const uint2*>(codes), scale_inv, work, e5m2, cell);
  else
    fp8_stat_kernel<<<blocks, kThreads, 0, st>>>(x, codes, scale_inv, n, e5m2, cell);
  CUDA_CHECK_LAUNCH();
  return Status::ok();
}

namespace {
template <int kRowThreads, bool kVec>
void launch_rowwise(const bf16* x, int64_t rows, int64_t cols, fp8::Format fmt, StatCell* cell, cudaStream_t st) {
  constexpr int kRowsPerBlock = kThreads / kRowThreads;
  const auto grid = unsigned(std::min<int64_t>((rows + kRowsPerBlock - 1) / kRowsPerBlock, max_blocks()));
  if (fmt == fp8::Format::e5m2)
    rowwise_stat_kernel<kRowThreads, kVec, fp8::Format::e5m2><<<grid, kThreads, 0, st>>>(x, rows, cols, cell);
  else
    rowwise_stat_kernel<kRowThreads, kVec, fp8::Format::e4m3><<<grid, kThreads, 0, st>>>(x, rows, cols, cell);
}
}  // namespace

Status add_fp8_rowwise_stat_cuda(const bf16* x, int64_t rows, int64_t cols, fp8::Format fmt, StatCell* cell,
                                 Stream stream) {
  if (rows <= 0 || cols <= 0) return Status::ok();
  const auto st = static_cast<cudaStream_t>(stream);
  const bool vec = cols % 8 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0;
  const int64_t units = vec ? cols / 8 : cols;
  const bool warp_per_row = units <= 256;  // at most 8 loads per lane: a block per row would idle most of its threads
  if (warp_per_row)
    vec ? launch_rowwise<32, true>(x, rows, cols, fmt, cell, st)
        : launch_rowwise<32, false>(x, rows, cols, fmt, cell, st);
  else
    vec ? launch_rowwise<kThreads, true>(x, rows, cols, fmt, cell, st)
        : launch_rowwise<kThreads, false>(x, rows, cols, fmt, cell, st);
  CUDA_CHECK_LAUNCH();
  return Status::ok();
}

Status add_nvfp4_stat_cuda(const bf16* x, int64_t rows, int64_t cols, const uint8_t* data, const uint8_t* scales,
                           const float* amax, StatCell* cell, StatCell* e4m3_cell, Stream stream) {
  const int64_t n = rows * cols;
  if (n <= 0) return Status::ok();
  if (cols % nvfp4::kBlock != 0 || reinterpret_cast<uintptr_t>(x) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(data) % 8 != 0)
    return errorf("add_nvfp4_stat_cuda: [%lld, %lld] needs columns in whole 16-element blocks and aligned pointers",
                  (long long)rows, (long long)cols);
  const int64_t blocks = n / nvfp4::kBlock;
  const auto grid = unsigned(std::min<int64_t>((blocks + kThreads - 1) / kThreads, max_blocks()));
  const auto st = static_cast<cudaStream_t>(stream);
  const auto* xv = reinterpret_cast<const uint4*>(x);
  const auto* dv = reinterpret_cast<const uint2*>(data);
  if (e4m3_cell)
    nvfp4_stat_kernel<true><<<grid, kThreads, 0, st>>>(xv, dv, scales, amax, blocks, cell, e4m3_cell);
  else
    nvfp4_stat_kernel<false><<<grid, kThreads, 0, st>>>(xv, dv, scales, amax, blocks, cell, nullptr);
  CUDA_CHECK_LAUNCH();
  return Status::ok();
}

}  // namespace nb::mor
