// Build and device facts for builds without the CUDA backend.
#include "core/device_info.h"
#include "core/tensor.h"

#if !defined(NIBBLE_HAVE_CUDA)
namespace nb {
BuildInfo build_info() { return {}; }
std::vector<GpuInfo> query_gpus(std::string* why) {
  cuda_device_available(why);
  return {};
}
}  // namespace nb
#endif
