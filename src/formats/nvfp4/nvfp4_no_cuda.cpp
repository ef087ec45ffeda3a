// CPU-only build: the CUDA entry points of nvfp4.h and nvfp4_bench.h answer with a clear Status.
#if !defined(NIBBLE_HAVE_CUDA)
#include "formats/nvfp4/nvfp4.h"
#include "formats/nvfp4/nvfp4_bench.h"

namespace nb::nvfp4 {

static Status no_cuda(const char* what) {
  return errorf(
      "%s needs the CUDA backend, but nibble was built without CUDA; rebuild with the CUDA toolkit "
      "installed or use the CPU reference",
      what);
}

Status compute_amax_cuda(const bf16*, int64_t, int64_t, bool, float*, float*, Stream) {
  return no_cuda("NVFP4 amax on the GPU");
}
Status quantize_cuda_with_amax(const bf16*, const Options&, const QuantizedView&, Stream) {
  return no_cuda("NVFP4 quantization on the GPU");
}
Status quantize_4over6_cuda_with_amax(const bf16*, const Options&, const QuantizedView&, Stream) {
  return no_cuda("NVFP4 4/6 quantization on the GPU");
}
Status quantize_cuda(const bf16*, const Options&, const QuantizedView&, Stream) {
  return no_cuda("NVFP4 quantization on the GPU");
}
Status dequantize_cuda(const uint8_t*, const uint8_t*, const float*, int64_t, int64_t, float*, Stream, bool) {
  return no_cuda("NVFP4 dequantization on the GPU");
}
Status swizzle_scales_cuda(const uint8_t*, int64_t, int64_t, uint8_t*, Stream) {
  return no_cuda("NVFP4 scale swizzling on the GPU");
}
Status unswizzle_scales_cuda(const uint8_t*, int64_t, int64_t, uint8_t*, Stream) {
  return no_cuda("NVFP4 scale unswizzling on the GPU");
}
Status bench_nvfp4_cuda(int64_t, int64_t, const Options&, int, BenchResult*) {
  return no_cuda("The NVFP4 quantizer benchmark");
}

}  // namespace nb::nvfp4
#endif
