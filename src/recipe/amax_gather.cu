// CUDA side of amax_gather.h: one launch per 256 amaxes, the pointers passed by value (2 KiB, within the
// 4 KiB a kernel's parameters may take), so no pointer table has to live in device memory.
#include <cuda_runtime.h>
#include <algorithm>
#include <cmath>
#include "core/cuda_check.h"
#include "recipe/amax_gather.h"

namespace nb::recipe::detail {

namespace {

constexpr int kChunk = 256;

struct Pointers {
  float* p[kChunk];
  int n;
};

Pointers chunk(const std::vector<float*>& ptrs, size_t begin) {
  Pointers c{};
  c.n = int(std::min(ptrs.size() - begin, size_t(kChunk)));
  std::copy(ptrs.begin() + std::ptrdiff_t(begin), ptrs.begin() + std::ptrdiff_t(begin) + c.n, c.p);
  return c;
}

__global__ void gather_kernel(Pointers c, float* dst) {
  const int i = int(threadIdx.x);
  if (i >= c.n) return;
  const float v = *c.p[i];
  dst[i] = v != v ? INFINITY : v;  // NaN travels as +Inf (amax_gather.h)
}

__global__ void scatter_kernel(const float* src, Pointers c) {
  const int i = int(threadIdx.x);
  if (i >= c.n) return;
  const float v = src[i];
  *c.p[i] = v == INFINITY ? NAN : v;
}

}  // namespace

Status gather_amaxes_cuda(const std::vector<float*>& ptrs, float* dst, Stream stream) {
  for (size_t b = 0; b < ptrs.size(); b += kChunk) {
    gather_kernel<<<1, kChunk, 0, static_cast<cudaStream_t>(stream)>>>(chunk(ptrs, b), dst + b);
    CUDA_CHECK_LAUNCH();
  }
  return Status::ok();
}

Status scatter_amaxes_cuda(const float* src, const std::vector<float*>& ptrs, Stream stream) {
  for (size_t b = 0; b < ptrs.size(); b += kChunk) {
    scatter_kernel<<<1, kChunk, 0, static_cast<cudaStream_t>(stream)>>>(src + b, chunk(ptrs, b));
    CUDA_CHECK_LAUNCH();
  }
  return Status::ok();
}

}  // namespace nb::recipe::detail
