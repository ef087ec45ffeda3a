// CPU-only build: the GPU ceiling measurements answer with a Status saying why they cannot run.
#include "gemm/gemm_bench.h"

namespace nb::gemm {

#if !defined(NIBBLE_HAVE_CUDA)
Status measure_gemm_tflops(int64_t, int64_t, int64_t, int, double*) {
  return errorf("GEMM ceiling: this nibble was built without the CUDA backend; rebuild with a CUDA toolkit");
}
Status measure_matmul_tflops(int64_t, int64_t, int64_t, const GemmArgs&, DType, int, double*) {
  return errorf("GEMM timing: this nibble was built without the CUDA backend; rebuild with a CUDA toolkit");
}
Status measure_in_loop_gemms(int64_t, int64_t, int64_t, int, InLoopTflops*) {
  return errorf("in-loop GEMM timing: this nibble was built without the CUDA backend; rebuild with a CUDA toolkit");
}
Status measure_gemm_call_tflops(const GemmCall&, int, double*) {
  return errorf("GEMM timing: this nibble was built without the CUDA backend; rebuild with a CUDA toolkit");
}
Status measure_copy_bandwidth(size_t, int, double*) {
  return errorf("copy bandwidth: this nibble was built without the CUDA backend; rebuild with a CUDA toolkit");
}
#endif

}  // namespace nb::gemm
