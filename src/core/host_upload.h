// Host-to-device copies of a step's small inputs (token ids, labels, segment starts, positions) that
// must not wait behind bulk copies. Copies in one direction run in issue order, and a streamed optimizer
// update (--optimizer-cpu-offload) queues up to seconds of host-to-device copies that the next forward
// would otherwise wait for before its first kernel. So an upload goes through page-locked host memory
// mapped into the device and a copy kernel on the given stream, which reads it over PCIe beside the
// copy engines. On the CPU device it is a memcpy.
#pragma once
#include <cstddef>
#include "core/status.h"
#include "core/stream.h"
#include "core/tensor.h"

namespace nb {

class HostUpload {
 public:
  HostUpload() = default;
  ~HostUpload();
  HostUpload(const HostUpload&) = delete;
  HostUpload& operator=(const HostUpload&) = delete;
  // Copies bytes (a multiple of 4) from host src to dst on device dev, queued on stream s. The staging
  // buffer is reused: the call waits until the previous upload's kernel has read it.
  Status upload(void* dst, Device dev, const void* src, size_t bytes, Stream s);

 private:
  void* host_ = nullptr;    // page-locked, mapped
  void* mapped_ = nullptr;  // its device address
  void* read_ = nullptr;    // event: the last copy kernel has run
  size_t cap_ = 0;
};

}  // namespace nb
