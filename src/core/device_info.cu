// Build and device facts of the CUDA backend.
#include <atomic>
#include <cublasLt.h>
#include <cudnn.h>
#include "core/cuda_check.h"
#include "core/device_info.h"
#include "core/tensor.h"

namespace nb {

static std::string version3(int v, int major_div, int minor_div) {
  return std::to_string(v / major_div) + "." + std::to_string((v % major_div) / minor_div) + "." +
         std::to_string(v % minor_div);
}

BuildInfo build_info() {
  BuildInfo b;
  b.cuda = true;
  int rt = 0;
  cudaRuntimeGetVersion(&rt);
  b.cuda_runtime = std::to_string(rt / 1000) + "." + std::to_string((rt % 1000) / 10);
  b.cublaslt = version3(int(cublasLtGetVersion()), 10000, 100);
  b.cudnn = version3(int(cudnnGetVersion()), 10000, 100);
  return b;
}

std::vector<GpuInfo> query_gpus(std::string* why) {
  std::vector<GpuInfo> out;
  if (!cuda_device_available(why)) return out;
  int n = 0;
  CUDA_CHECK(cudaGetDeviceCount(&n));
  for (int i = 0; i < n; ++i) {
    cudaDeviceProp p{};
    CUDA_CHECK(cudaGetDeviceProperties(&p, i));
    GpuInfo g;
    g.index = i;
    g.name = p.name;
    g.cc_major = p.major;
    g.cc_minor = p.minor;
    g.sm_count = p.multiProcessorCount;
    g.memory_gib = double(p.totalGlobalMem) / 1073741824.0;
    g.l2_bytes = p.l2CacheSize;
    g.smem_per_block_optin = int(p.sharedMemPerBlockOptin);
    out.push_back(g);
  }
  return out;
}

Status set_current_gpu(int index) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
  if (index < 0 || index >= n)
    return errorf("GPU %d was asked for (the local rank), but this machine shows %d; start at most %d ranks per node",
                  index, n, n);
  cudaError_t e = cudaSetDevice(index);
  if (e != cudaSuccess) return errorf("cannot use GPU %d: %s", index, cudaGetErrorString(e));
  return Status::ok();
}

int current_device_sm_count() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cached[kMaxDevices] = {};
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < kMaxDevices && cached[dev].load(std::memory_order_relaxed) > 0)
    return cached[dev].load(std::memory_order_relaxed);
  int sms = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  if (dev < kMaxDevices) cached[dev].store(sms, std::memory_order_relaxed);
  return sms;
}

}  // namespace nb
