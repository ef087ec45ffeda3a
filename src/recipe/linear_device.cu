// CUDA side of linear_device.h: a one-thread fold kernel and stream-ordered memset/copies.
#include <cuda_runtime.h>
#include <cmath>
#include "core/cuda_check.h"
#include "recipe/linear_device.h"

namespace nb::recipe::detail {

// Same rule on both sides: NB_HD would need macros.h; the body is three lines, kept identical by hand.
__global__ void fold_role_state_kernel(float* floats, int* ints) {
  const bool bad = ints[kFlag] != 0;
  ints[kNonfiniteCount] += bad ? 1 : 0;
  float a = fmaxf(floats[kRowAmax], floats[kColAmax]);
  if (bad || a != a)
    floats[kStepAmax] = NAN;
  else if (floats[kStepAmax] == floats[kStepAmax])
    floats[kStepAmax] = fmaxf(floats[kStepAmax], a);
}

void fold_role_state_host(float* floats, int* ints) {
  const bool bad = ints[kFlag] != 0;
  ints[kNonfiniteCount] += bad ? 1 : 0;
  float a = std::fmax(floats[kRowAmax], floats[kColAmax]);
  if (bad || a != a)
    floats[kStepAmax] = NAN;
  else if (floats[kStepAmax] == floats[kStepAmax])
    floats[kStepAmax] = std::fmax(floats[kStepAmax], a);
}

Status fold_role_state_cuda(float* floats, int* ints, Stream stream) {
  fold_role_state_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(floats, ints);
  CUDA_CHECK_LAUNCH();
  return Status::ok();
}

Status memset_cuda(void* p, int value, size_t bytes, Stream stream) {
  CUDA_CHECK(cudaMemsetAsync(p, value, bytes, static_cast<cudaStream_t>(stream)));
  return Status::ok();
}

Status copy_to_host_cuda(void* dst, const void* src, size_t bytes, Stream stream) {
  auto s = static_cast<cudaStream_t>(stream);
  CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s));
  CUDA_CHECK(cudaStreamSynchronize(s));
  return Status::ok();
}

Status copy_to_device_cuda(void* dst, const void* src, size_t bytes, Stream stream) {
  auto s = static_cast<cudaStream_t>(stream);
  CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, s));
  CUDA_CHECK(cudaStreamSynchronize(s));
  return Status::ok();
}

}  // namespace nb::recipe::detail
