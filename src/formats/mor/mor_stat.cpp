// Host side of mor_stat.h (and the CPU-only build's answer for the GPU entry point).
#include "formats/mor/mor_stat.h"
#include <cmath>
#include "formats/nvfp4/nvfp4.h"
#include "formats/nvfp4/nvfp4_math.h"

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

void add_fp8_stat_from_amax_host(const bf16* x, int64_t n, float amax, fp8::Format fmt, StatCell* cell) {
  const float scale = fp8::scale_from_amax(amax, fp8::format_max(fmt), false), scale_inv = 1.0f / scale;
  for (int64_t i = 0; i < n; ++i) {
    const float v = bf16_to_f32(x[i]);
    if (!std::isfinite(v)) {
      ++cell->nonfinite;
      continue;
    }
    if (v == 0.0f) continue;
    cell->err_fixed += element_error_fixed(v, fp8::decode(fp8::encode(v * scale, fmt), fmt) * scale_inv);
    ++cell->nonzero;
  }
}

void add_nvfp4_stat_host(const bf16* x, int64_t rows, int64_t cols, const uint8_t* data, const uint8_t* scales,
                         float amax, StatCell* cell) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const float v = bf16_to_f32(x[r * cols + c]);
      if (!std::isfinite(v)) {
        ++cell->nonfinite;
        continue;
      }
      if (v == 0.0f) continue;
      const uint32_t code = (data[(r * cols + c) / 2] >> (4 * (c & 1))) & 0xFu;
      const float x_hat = nvfp4::dequant_value(code, scales[r * (cols / nvfp4::kBlock) + c / nvfp4::kBlock], amax);
      cell->err_fixed += element_error_fixed(v, x_hat);
      ++cell->nonzero;
    }
}

#if !defined(NIBBLE_HAVE_CUDA)
Status add_fp8_stat_from_amax_cuda(const bf16*, int64_t, const float*, fp8::Format, StatCell*, Stream) {
  return errorf("the MoR statistic on the GPU needs the CUDA backend; rebuild nibble with the CUDA toolkit");
}
Status add_nvfp4_stat_cuda(const bf16*, int64_t, int64_t, const uint8_t*, const uint8_t*, const float*, StatCell*,
                           Stream) {
  return errorf("the MoR statistic on the GPU needs the CUDA backend; rebuild nibble with the CUDA toolkit");
}
Status add_fp8_stat_cuda(const bf16*, const uint8_t*, const float*, int64_t, fp8::Format, StatCell*, Stream) {
  return errorf("the MoR statistic on the GPU needs the CUDA backend; rebuild nibble with the CUDA toolkit");
}
#endif

}  // namespace nb::mor
