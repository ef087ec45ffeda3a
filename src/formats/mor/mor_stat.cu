// GPU side of mor_stat.h: one grid-stride pass over x and its FP8 codes; each warp sums its threads' integers and
// adds them into the cell with one atomic per field. Integer sums do not depend on the order, so the result equals
// add_fp8_stat_host's bit for bit (the per-element float expression is element_error_fixed's, IEEE division).
#include <cuda_runtime.h>
#include <algorithm>
#include "core/cuda_check.h"
#include "formats/mor/mor_stat.h"
#include "formats/scalar_codecs.h"

namespace nb::mor {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ unsigned long long element_term(float x, float x_hat) {
  float e = fabsf(x - x_hat) / fabsf(x);
  if (!(e < 1.0f)) e = 1.0f;
  return (unsigned long long)(e * 4294967296.0f);
}

__global__ void fp8_stat_kernel(const bf16* __restrict__ x, const uint8_t* __restrict__ codes,
                                const float* __restrict__ scale_inv, int64_t n, bool e5m2, StatCell* cell) {
  const float s = *scale_inv;
  unsigned long long err = 0, nonzero = 0;
  unsigned int nonfinite = 0;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float v = bf16_to_f32(x[i]);
    if (!isfinite(v)) {
      ++nonfinite;
      continue;
    }
    if (v == 0.0f) continue;
    const float decoded = e5m2 ? e5m2_to_f32(codes[i]) : e4m3_to_f32(codes[i]);
    err += element_term(v, __fmul_rn(decoded, s));  // _rn: never contracted into the subtraction (an FMA)
    ++nonzero;
  }
  for (int off = 16; off > 0; off >>= 1) {
    err += __shfl_down_sync(0xffffffffu, err, off);
    nonzero += __shfl_down_sync(0xffffffffu, nonzero, off);
    nonfinite += __shfl_down_sync(0xffffffffu, nonfinite, off);
  }
  if ((threadIdx.x & 31) == 0) {
    if (err) atomicAdd(reinterpret_cast<unsigned long long*>(&cell->err_fixed), err);
    if (nonzero) atomicAdd(reinterpret_cast<unsigned long long*>(&cell->nonzero), nonzero);
    if (nonfinite) atomicAdd(&cell->nonfinite, nonfinite);
  }
}

}  // namespace

Status add_fp8_stat_cuda(const bf16* x, const uint8_t* codes, const float* scale_inv, int64_t n, fp8::Format fmt,
                         StatCell* cell, Stream stream) {
  if (n <= 0) return Status::ok();
  const int64_t blocks = std::min<int64_t>((n + kThreads - 1) / kThreads, 2048);
  fp8_stat_kernel<<<unsigned(blocks), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(x, codes, scale_inv, n,
                                                                                        fmt == fp8::Format::e5m2, cell);
  CUDA_CHECK_LAUNCH();
  return Status::ok();
}

}  // namespace nb::mor
