// Device memory primitives for builds without the CUDA backend: every call explains itself.
#include "core/tensor.h"
#include <cstdlib>
#include <cstring>

#if !defined(NIBBLE_HAVE_CUDA)
namespace nb {

static const char* kNoCuda =
    "this nibble was built without the CUDA backend (no nvcc at configure time); "
    "rebuild with the CUDA toolkit installed to use a GPU";

Status device_malloc(void** p, size_t) {
  *p = nullptr;
  return Status::error(kNoCuda);
}
void device_free(void*) {}
Status pinned_host_malloc(void** p, size_t bytes) {
  *p = std::malloc(bytes);
  return *p || bytes == 0 ? Status::ok()
                          : errorf("cannot allocate %.2f GiB of host memory", double(bytes) / 1073741824.0);
}
void pinned_host_free(void* p) { std::free(p); }
Status copy_bytes(void* dst, Device dd, const void* src, Device sd, size_t bytes) {
  if (dd != Device::cpu || sd != Device::cpu) return Status::error(kNoCuda);
  std::memcpy(dst, src, bytes);
  return Status::ok();
}
Status copy_bytes_async(void* dst, Device dd, const void* src, Device sd, size_t bytes, void*) {
  return copy_bytes(dst, dd, src, sd, bytes);
}
Status copy_2d_async(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width, size_t height,
                     Device dev, void*) {
  if (dev != Device::cpu) return Status::error(kNoCuda);
  for (size_t r = 0; r < height; ++r)
    std::memcpy(static_cast<char*>(dst) + r * dst_pitch, static_cast<const char*>(src) + r * src_pitch, width);
  return Status::ok();
}
Status pin_host_range(void*, size_t) { return Status::ok(); }
void unpin_host_range(void*) {}
void stream_synchronize(void*) {}
bool cuda_device_available(std::string* why) {
  if (why) *why = kNoCuda;
  return false;
}
void device_memory_info(size_t* f, size_t* t) {
  *f = 0;
  *t = 0;
}
void device_synchronize() {}

}  // namespace nb
#endif
