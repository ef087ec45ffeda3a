// The hardware's FP8 conversion of two floats (sm_89+, round to nearest even, saturating to the largest
// finite value), shared by the CUDA quantizers of formats/fp8 and formats/mxfp8. For every finite or
// infinite input it gives the bytes of f32_to_e4m3_satfinite / f32_to_e5m2_satfinite (scalar_codecs.h);
// NaN bytes may differ, so callers route NaN inputs through the software codec.
#pragma once
#include <cuda_fp8.h>
#include <cstdint>
#include "formats/fp8/fp8.h"

namespace nb::fp8 {

// Two values to FP8 bytes, a in the low byte.
template <Format F>
__device__ __forceinline__ uint32_t cvt_fp8x2(float a, float b) {
  return __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, F == Format::e4m3 ? __NV_E4M3 : __NV_E5M2);
}

}  // namespace nb::fp8
