// HostUpload on CUDA: page-locked mapped staging, one copy kernel per upload (see host_upload.h).
#include <cstring>
#include "core/cuda_check.h"
#include "core/host_upload.h"

namespace nb {
namespace {
__global__ void copy_words(uint32_t* dst, const uint32_t* src, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    dst[i] = src[i];
}
}  // namespace

HostUpload::~HostUpload() {
  if (read_) cudaEventDestroy(cudaEvent_t(read_));
  if (host_) cudaFreeHost(host_);
}

Status HostUpload::upload(void* dst, Device dev, const void* src, size_t bytes, Stream s) {
  if (dev == Device::cpu) {
    std::memcpy(dst, src, bytes);
    return Status::ok();
  }
  NB_CHECK(bytes % 4 == 0, "HostUpload of %zu bytes: a multiple of 4 is needed", bytes);
  if (bytes == 0) return Status::ok();
  if (read_) CUDA_CHECK(cudaEventSynchronize(cudaEvent_t(read_)));  // the staging buffer is free again
  if (bytes > cap_) {
    if (host_) CUDA_CHECK(cudaFreeHost(host_));
    host_ = mapped_ = nullptr;
    cap_ = 0;
    if (cudaHostAlloc(&host_, bytes, cudaHostAllocMapped) != cudaSuccess) {
      cudaGetLastError();
      return errorf("could not page-lock %zu bytes of host memory for the step's inputs", bytes);
    }
    CUDA_CHECK(cudaHostGetDevicePointer(&mapped_, host_, 0));
    cap_ = bytes;
  }
  if (!read_) {
    cudaEvent_t e = nullptr;
    CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    read_ = e;
  }
  std::memcpy(host_, src, bytes);
  const size_t words = bytes / 4;
  const int blocks = int(std::min<size_t>((words + 255) / 256, 1024));
  copy_words<<<blocks, 256, 0, cudaStream_t(s)>>>(static_cast<uint32_t*>(dst), static_cast<const uint32_t*>(mapped_),
                                                  words);
  CUDA_CHECK(cudaGetLastError());
  CUDA_CHECK(cudaEventRecord(cudaEvent_t(read_), cudaStream_t(s)));
  return Status::ok();
}

}  // namespace nb
