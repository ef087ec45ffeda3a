// Device memory primitives of the CUDA backend. Out of memory is a Status (the caller can name the
// knob to turn); anything else is a bug and aborts with the CUDA error.
#include <cstring>
#include "core/cuda_check.h"
#include "core/memory_ledger.h"
#include "core/tensor.h"

namespace nb {

Status device_malloc(void** p, size_t bytes) {
  cudaError_t e = cudaMalloc(p, bytes);
  if (e == cudaErrorMemoryAllocation) {
    cudaGetLastError();  // clear the sticky-free error state
    size_t free_b = 0, total_b = 0;
    cudaMemGetInfo(&free_b, &total_b);
    const LedgerSnapshot held = ledger_snapshot(Device::cuda);
    return errorf(
        "out of GPU memory allocating %s: asked for %.2f GiB with %.2f GiB free of %.2f GiB (nibble holds %.2f GiB)",
        mem_part_name(current_mem_part()), bytes / 1073741824.0, free_b / 1073741824.0, total_b / 1073741824.0,
        held.total.current / 1073741824.0);
  }
  if (e != cudaSuccess) return errorf("cudaMalloc of %zu bytes failed: %s", bytes, cudaGetErrorString(e));
  ledger_add(Device::cuda, *p, bytes);
  return Status::ok();
}

void device_free(void* p) {
  ledger_remove(Device::cuda, p);
  CUDA_CHECK(cudaFree(p));
}
Status pinned_host_malloc(void** p, size_t bytes) {
  if (cudaMallocHost(p, bytes) != cudaSuccess) {
    cudaGetLastError();
    *p = nullptr;
    return errorf("cannot allocate %.2f GiB of page-locked host memory", double(bytes) / 1073741824.0);
  }
  return Status::ok();
}
void pinned_host_free(void* p) {
  if (p) CUDA_CHECK(cudaFreeHost(p));
}

Status copy_bytes(void* dst, Device dd, const void* src, Device sd, size_t bytes) {
  if (dd == Device::cpu && sd == Device::cpu) {
    std::memcpy(dst, src, bytes);
    return Status::ok();
  }
  CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault));
  return Status::ok();
}

Status copy_bytes_async(void* dst, Device dd, const void* src, Device sd, size_t bytes, void* stream) {
  if (dd == Device::cpu && sd == Device::cpu) return copy_bytes(dst, dd, src, sd, bytes);
  CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, cudaStream_t(stream)));
  return Status::ok();
}

Status copy_2d_async(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width, size_t height,
                     Device dev, void* stream) {
  if (width == 0 || height == 0) return Status::ok();
  if (dev == Device::cpu) {
    for (size_t r = 0; r < height; ++r)
      std::memcpy(static_cast<char*>(dst) + r * dst_pitch, static_cast<const char*>(src) + r * src_pitch, width);
    return Status::ok();
  }
  CUDA_CHECK(
      cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, height, cudaMemcpyDeviceToDevice, cudaStream_t(stream)));
  return Status::ok();
}

Status pin_host_range(void* p, size_t bytes) {
  if (cudaHostRegister(p, bytes, cudaHostRegisterDefault) != cudaSuccess) {
    const cudaError_t e = cudaGetLastError();
    return errorf("cannot page-lock %.2f GiB of host memory (%s)", double(bytes) / 1073741824.0, cudaGetErrorString(e));
  }
  return Status::ok();
}
void unpin_host_range(void* p) {
  if (p && cudaHostUnregister(p) != cudaSuccess) cudaGetLastError();  // never registered: nothing to undo
}
void stream_synchronize(void* stream) { CUDA_CHECK(cudaStreamSynchronize(cudaStream_t(stream))); }

void device_memory_info(size_t* f, size_t* t) {
  if (cudaMemGetInfo(f, t) != cudaSuccess) {
    cudaGetLastError();
    *f = 0;
    *t = 0;
  }  // no GPU: nothing to report
}
void device_synchronize() { CUDA_CHECK(cudaDeviceSynchronize()); }

bool cuda_device_available(std::string* why) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();
    if (why) *why = std::string("no usable CUDA device: ") + cudaGetErrorString(e);
    return false;
  }
  if (n == 0) {
    if (why) *why = "no CUDA device found";
    return false;
  }
  return true;
}

}  // namespace nb
