// The in-loop GEMM's format names, and its answer on a CPU-only build.
#include "gemm/wgmma_gemm.h"

namespace nb::gemm {

const char* in_loop_format_name(InLoopFormat f) {
  return f == InLoopFormat::bf16 ? "bf16" : f == InLoopFormat::mxfp8 ? "mxfp8" : "nvfp4";
}

#if !defined(NIBBLE_HAVE_CUDA)
Status in_loop_gemm_cuda(const InLoopOperand&, const bf16*, bf16*, int64_t, int64_t, int64_t, const float*, Stream) {
  return errorf("in-loop GEMM: this nibble was built without the CUDA backend; rebuild with a CUDA toolkit");
}
#endif

}  // namespace nb::gemm
