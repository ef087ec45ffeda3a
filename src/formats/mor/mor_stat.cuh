// Device pieces of MoR's statistic (mor_stat.h), shared by its own pass (mor_stat.cu) and the FP8 per-tensor
// quantizer that computes it while it encodes (formats/fp8/fp8.cu): the per-element fixed-point term, the FP8
// decode, a thread's running sums and the block's reduction into a cell. Integer sums, so any order of blocks and
// threads gives add_fp8_stat_host's result bit for bit.
#pragma once
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cstdint>
#include "formats/mor/mor_stat.h"

namespace nb::mor::device {

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
  // v: the source value; code: its FP8 byte; scale_inv: the value the GEMM multiplies the decoded code by.
  // kMayBeNonfinite false: the caller knows v is finite (the quantizer checks a chunk's exponent bits at once).
  template <bool kMayBeNonfinite = true>
  __device__ __forceinline__ void add(float v, uint32_t code, float scale_inv, bool e5m2) {
    if (kMayBeNonfinite && !isfinite(v)) {
      ++nonfinite;
      return;
    }
    if (v == 0.0f) return;
    err += element_term(v, __fmul_rn(decode_fp8(code, e5m2), scale_inv));  // _rn: never contracted into an FMA
    ++nonzero;
  }
};

// The block's sums (warp shuffles, then one warp over the warps' sums) added into the cell: one atomic per field
// per block, so a few hundred blocks never queue on the cell. Every thread of the block must call it.
template <int kThreads>
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

}  // namespace nb::mor::device
