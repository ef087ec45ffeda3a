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

namespace {
// Adds x[0, n)'s terms into *cell, element i against x_hat(i, value): non-finite elements counted, zeros left out.
template <typename XHat>
void add_terms(const bf16* x, int64_t n, StatCell* cell, XHat x_hat) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = bf16_to_f32(x[i]);
    if (!std::isfinite(v)) {
      ++cell->nonfinite;
      continue;
    }
    if (v == 0.0f) continue;
    cell->err_fixed += element_error_fixed(v, x_hat(i, v));
    ++cell->nonzero;
  }
}
}  // namespace

void add_fp8_stat_host(const bf16* x, const uint8_t* codes, float scale_inv, int64_t n, fp8::Format fmt,
                       StatCell* cell) {
  add_terms(x, n, cell, [&](int64_t i, float) { return fp8::decode(codes[i], fmt) * scale_inv; });
}

void add_fp8_stat_from_amax_host(const bf16* x, int64_t n, float amax, fp8::Format fmt, StatCell* cell) {
  const float scale = fp8::scale_from_amax(amax, fp8::format_max(fmt), false), scale_inv = 1.0f / scale;
  add_terms(x, n, cell, [&](int64_t, float v) { return fp8::decode(fp8::encode(v * scale, fmt), fmt) * scale_inv; });
}

void add_fp8_rowwise_stat_host(const bf16* x, int64_t rows, int64_t cols, fp8::Format fmt, StatCell* cell) {
  for (int64_t r = 0; r < rows; ++r) {  // each row its own per-tensor quantization
    const bf16* row = x + r * cols;
    add_fp8_stat_from_amax_host(row, cols, fp8::amax_ref(row, cols, nullptr), fmt, cell);
  }
}

void add_nvfp4_stat_host(const bf16* x, int64_t rows, int64_t cols, const uint8_t* data, const uint8_t* scales,
                         float amax, StatCell* cell) {
  add_terms(x, rows * cols, cell, [&](int64_t i, float) {
    const uint32_t code = (data[i / 2] >> (4 * (i & 1))) & 0xFu;         // cols is even: element i's nibble
    return nvfp4::dequant_value(code, scales[i / nvfp4::kBlock], amax);  // cols is a multiple of 16
  });
}

#if !defined(NIBBLE_HAVE_CUDA)
Status add_nvfp4_stat_cuda(const bf16*, int64_t, int64_t, const uint8_t*, const uint8_t*, const float*, StatCell*,
                           StatCell*, Stream) {
  return errorf("the MoR statistic on the GPU needs the CUDA backend; rebuild nibble with the CUDA toolkit");
}
Status add_fp8_stat_cuda(const bf16*, const uint8_t*, const float*, int64_t, fp8::Format, StatCell*, Stream) {
  return errorf("the MoR statistic on the GPU needs the CUDA backend; rebuild nibble with the CUDA toolkit");
}
Status add_fp8_rowwise_stat_cuda(const bf16*, int64_t, int64_t, fp8::Format, StatCell*, Stream) {
  return errorf("the MoR statistic on the GPU needs the CUDA backend; rebuild nibble with the CUDA toolkit");
}
#endif

}  // namespace nb::mor
