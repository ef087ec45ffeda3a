// HostUpload without the CUDA backend: a memcpy.
#include "core/host_upload.h"
#include <cstring>

#if !defined(NIBBLE_HAVE_CUDA)
namespace nb {

HostUpload::~HostUpload() = default;

Status HostUpload::upload(void* dst, Device, const void* src, size_t bytes, Stream) {
  std::memcpy(dst, src, bytes);
  return Status::ok();
}

}  // namespace nb
#endif
