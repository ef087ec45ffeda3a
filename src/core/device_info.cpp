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
Status set_current_gpu(int index) {
  return errorf("GPU %d was asked for, but this nibble was built without CUDA", index);
}
}  // namespace nb
#endif
