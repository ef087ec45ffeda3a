// CPU-only build: the device side of amax_gather.h answers with an error (a cuda tensor cannot exist here).
#if !defined(NIBBLE_HAVE_CUDA)
#include "recipe/amax_gather.h"

namespace nb::recipe::detail {

static Status no_cuda() {
  return errorf("amax gather on cuda: this nibble was built without the CUDA backend; rebuild with a CUDA toolkit");
}
Status gather_amaxes_cuda(const std::vector<float*>&, float*, Stream) { return no_cuda(); }
Status scatter_amaxes_cuda(const float*, const std::vector<float*>&, Stream) { return no_cuda(); }

}  // namespace nb::recipe::detail
#endif
