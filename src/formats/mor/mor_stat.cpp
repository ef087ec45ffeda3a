// Host side of mor_stat.h (and the CPU-only build's answer for the GPU entry point).
#include "formats/mor/mor_stat.h"
#include <cmath>

namespace nb::mor {

ErrorStat stat_of(const StatCell& c) {
  ErrorStat s;
  s.err_fixed = c.err_fixed;
  s.nonzero = int64_t(c.nonzero);
  s.nonfinite = c.nonfinite != 0;
  return s;
}

void add_fp8_stat_host(const bf16* x, const uint8_t* codes, float scale_inv, int64_t n, fp8::Format fmt,
                       StatCell* cell) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = bf16_to_f32(x[i]);
    if (!std::isfinite(v)) {
      ++cell->nonfinite;
      continue;
    }
    if (v == 0.0f) continue;
    cell->err_fixed += element_error_fixed(v, fp8::decode(codes[i], fmt) * scale_inv);
    ++cell->nonzero;
  }
}

#if !defined(NIBBLE_HAVE_CUDA)
Status add_fp8_stat_cuda(const bf16*, const uint8_t*, const float*, int64_t, fp8::Format, StatCell*, Stream) {
  return errorf("the MoR statistic on the GPU needs the CUDA backend; rebuild nibble with the CUDA toolkit");
}
#endif

}  // namespace nb::mor
