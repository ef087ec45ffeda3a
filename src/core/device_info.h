// Facts about the GPU (queried, never assumed) and the libraries nibble was built with.
#pragma once
#include <string>
#include <vector>
#include "core/status.h"

namespace nb {

struct GpuInfo {
  int index = 0;
  std::string name;
  int cc_major = 0, cc_minor = 0;
  int sm_count = 0;
  double memory_gib = 0;
  int l2_bytes = 0;
  int smem_per_block_optin = 0;
};

struct BuildInfo {
  bool cuda = false;
  std::string cuda_runtime, cublaslt, cudnn;  // versions, empty without CUDA
};

BuildInfo build_info();
// Empty with `why` set when no GPU is usable.
std::vector<GpuInfo> query_gpus(std::string* why);
// Makes GPU `index` (an index into query_gpus()) current for this thread and the streams it creates;
// each data-parallel rank on a host takes the GPU of its local rank.
Status set_current_gpu(int index);
// SM count of the current CUDA device, queried once per device and cached (for launch sizing on hot
// paths; CUDA builds only).
int current_device_sm_count();

}  // namespace nb
