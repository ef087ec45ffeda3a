// CUDA side of linear_device.h: a one-thread fold kernel, stream-ordered memset/copies and a byte transpose.
#include <cuda_runtime.h>
#include <cmath>
#include <cstdint>
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

Status copy_device_to_device_cuda(void* dst, const void* src, size_t bytes, Stream stream) {
  CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(stream)));
  return Status::ok();
}

// One 64x64 byte tile per 256-thread block, staged in shared memory: tile[r][c] = src[r0 + r][c0 + c],
// row pitch 68 bytes (a warp's column reads then touch at most 2 words per bank). Thread (hi, lo) of
// 16 x 16 loads word lo (bytes 4 lo .. 4 lo + 3) of tile rows hi + 16 i, then stores the 4 bytes of tile
// rows 4 lo .. 4 lo + 3 in tile column c = hi + 16 i as one word of dst row c0 + c: a warp's loads and
// stores are two 64-byte row segments each. rows, cols multiples of 4: a word is all in or all out.
constexpr int kTT = 64, kTPitch = kTT + 4;

__global__ void __launch_bounds__(256)
    transpose_bytes_kernel(const uint8_t* __restrict__ src, int64_t rows, int64_t cols, uint8_t* __restrict__ dst) {
  __shared__ __align__(4) uint8_t tile[kTT * kTPitch];
  const int64_t r0 = int64_t(blockIdx.y) * kTT, c0 = int64_t(blockIdx.x) * kTT;
  const int lo = int(threadIdx.x % 16), hi = int(threadIdx.x / 16);
  const bool word_in = c0 + 4 * lo < cols;
  for (int i = 0; i < 4; ++i) {
    const int r = hi + 16 * i;
    if (word_in && r0 + r < rows)
      *reinterpret_cast<uint32_t*>(&tile[r * kTPitch + 4 * lo]) =
          *reinterpret_cast<const uint32_t*>(src + (r0 + r) * cols + c0 + 4 * lo);
  }
  __syncthreads();
  if (r0 + 4 * lo >= rows) return;
  for (int i = 0; i < 4; ++i) {
    const int c = hi + 16 * i;
    if (c0 + c >= cols) continue;
    const uint8_t* t = &tile[4 * lo * kTPitch + c];
    const uint32_t w =
        uint32_t(t[0]) | uint32_t(t[kTPitch]) << 8 | uint32_t(t[2 * kTPitch]) << 16 | uint32_t(t[3 * kTPitch]) << 24;
    *reinterpret_cast<uint32_t*>(dst + (c0 + c) * rows + r0 + 4 * lo) = w;
  }
}

Status transpose_bytes_cuda(const uint8_t* src, int64_t rows, int64_t cols, uint8_t* dst, Stream stream) {
  auto misaligned = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 3u) != 0; };
  if (rows <= 0 || cols <= 0 || rows % 4 != 0 || cols % 4 != 0 || misaligned(src) || misaligned(dst))
    return errorf(
        "internal: transpose_bytes_cuda of %lld x %lld needs positive multiples of 4 and 4-byte aligned pointers",
        (long long)rows, (long long)cols);
  const int64_t grid_y = (rows + kTT - 1) / kTT, grid_x = (cols + kTT - 1) / kTT;
  if (grid_y > 65535)
    return errorf("transpose_bytes_cuda: %lld rows is too many for one launch (at most %d)", (long long)rows,
                  65535 * kTT);
  transpose_bytes_kernel<<<dim3(unsigned(grid_x), unsigned(grid_y)), 256, 0, static_cast<cudaStream_t>(stream)>>>(
      src, rows, cols, dst);
  CUDA_CHECK_LAUNCH();
  return Status::ok();
}

}  // namespace nb::recipe::detail
