// GPU side of mor_stat.h: one grid-stride pass over x and its FP8 codes (8 elements per thread and iteration where
// the sizes and pointers allow, 4 blocks per SM); each block sums its threads' integers and adds them into the cell
// with one atomic per field. Integer sums do not depend on the order, so the result equals
// add_fp8_stat_host's bit for bit (the per-element float expression is element_error_fixed's, IEEE division).
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <algorithm>
#include "core/cuda_check.h"
#include "formats/mor/mor_stat.h"
#include "formats/scalar_codecs.h"

namespace nb::mor {
namespace {

constexpr int kThreads = 256;

// element_error_fixed's term. e < 1 scales to below 2^32 exactly (a power of two), so the truncation is a 32-bit
// conversion (a 64-bit one runs at a fraction of the rate); a clamped e is 2^32.
__device__ __forceinline__ unsigned long long element_term(float x, float x_hat) {
  const float e = __fdiv_rn(fabsf(x - x_hat), fabsf(x));
  return e < 1.0f ? (unsigned long long)__float2uint_rz(e * 4294967296.0f) : 4294967296ull;
}

// An FP8 code's value by the hardware conversion to FP16 (sm_89+; every E4M3 and E5M2 value is an FP16 value),
// where the software decoder of scalar_codecs.h would take several times as long.
__device__ __forceinline__ float decode_fp8(uint32_t code, bool e5m2) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t(code), e5m2 ? __NV_E5M2 : __NV_E4M3);
  return __half2float(__half(h));
}

// One thread's running sums.
struct Sums {
  unsigned long long err = 0;
  unsigned int nonzero = 0, nonfinite = 0;  // a thread sees far fewer than 2^32 elements
  __device__ __forceinline__ void add(float v, uint32_t code, float s, bool e5m2) {
    if (!isfinite(v)) {
      ++nonfinite;
      return;
    }
    if (v == 0.0f) return;
    const float decoded = decode_fp8(code, e5m2);
    err += element_term(v, __fmul_rn(decoded, s));  // _rn: never contracted into the subtraction (an FMA)
    ++nonzero;
  }
};

// The block's sums (warp shuffles, then one warp over the warps' sums) added into the cell: one atomic per field
// per block, so a few hundred blocks never queue on the cell.
__device__ __forceinline__ void add_block(Sums t, StatCell* cell) {
  __shared__ unsigned long long s_err[kThreads / 32], s_nz[kThreads / 32];
  __shared__ unsigned int s_nf[kThreads / 32];
  unsigned long long nonzero = t.nonzero;
  for (int off = 16; off > 0; off >>= 1) {
    t.err += __shfl_down_sync(0xffffffffu, t.err, off);
    nonzero += __shfl_down_sync(0xffffffffu, nonzero, off);
    t.nonfinite += __shfl_down_sync(0xffffffffu, t.nonfinite, off);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    s_err[warp] = t.err;
    s_nz[warp] = nonzero;
    s_nf[warp] = t.nonfinite;
  }
  __syncthreads();
  if (warp != 0) return;
  unsigned long long b_err = 0, b_nz = 0;
  unsigned int b_nf = 0;
  if (lane < kThreads / 32) {
    b_err = s_err[lane];
    b_nz = s_nz[lane];
    b_nf = s_nf[lane];
  }
  for (int off = 16; off > 0; off >>= 1) {
    b_err += __shfl_down_sync(0xffffffffu, b_err, off);
    b_nz += __shfl_down_sync(0xffffffffu, b_nz, off);
    b_nf += __shfl_down_sync(0xffffffffu, b_nf, off);
  }
  if (lane == 0) {
    if (b_err) atomicAdd(reinterpret_cast<unsigned long long*>(&cell->err_fixed), b_err);
    if (b_nz) atomicAdd(reinterpret_cast<unsigned long long*>(&cell->nonzero), b_nz);
    if (b_nf) atomicAdd(&cell->nonfinite, b_nf);
  }
}

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
  add_block(t, cell);
}

// Any n and alignment: one element per thread and iteration.
__global__ void fp8_stat_kernel(const bf16* __restrict__ x, const uint8_t* __restrict__ codes,
                                const float* __restrict__ scale_inv, int64_t n, bool e5m2, StatCell* cell) {
  const float s = *scale_inv;
  Sums t;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    t.add(bf16_to_f32(x[i]), codes[i], s, e5m2);
  add_block(t, cell);
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

}  // namespace nb::mor
