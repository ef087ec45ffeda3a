// CPU-only build: the host fold, and clear errors for the device helpers of linear_device.h.
#if !defined(NIBBLE_HAVE_CUDA)
#include <cmath>
#include "recipe/linear_device.h"

namespace nb::recipe::detail {

void fold_role_state_host(float* floats, int* ints) {
  const bool bad = ints[kFlag] != 0;
  ints[kNonfiniteCount] += bad ? 1 : 0;
  float a = std::fmax(floats[kRowAmax], floats[kColAmax]);
  if (bad || a != a)
    floats[kStepAmax] = NAN;
  else if (floats[kStepAmax] == floats[kStepAmax])
    floats[kStepAmax] = std::fmax(floats[kStepAmax], a);
}

static Status no_cuda() {
  return errorf("recipe::Linear on cuda: this nibble was built without the CUDA backend; rebuild with a CUDA toolkit");
}
Status fold_role_state_cuda(float*, int*, Stream) { return no_cuda(); }
Status memset_cuda(void*, int, size_t, Stream) { return no_cuda(); }
Status copy_to_host_cuda(void*, const void*, size_t, Stream) { return no_cuda(); }
Status copy_to_device_cuda(void*, const void*, size_t, Stream) { return no_cuda(); }
Status copy_device_to_device_cuda(void*, const void*, size_t, Stream) { return no_cuda(); }
Status transpose_bytes_cuda(const uint8_t*, int64_t, int64_t, uint8_t*, Stream) { return no_cuda(); }

}  // namespace nb::recipe::detail
#endif
