// FP8 per-tensor CPU reference (current and delayed scaling): the specification for the CUDA kernels.
#include <algorithm>
#include <cmath>
#include "formats/fp8/fp8.h"
#include "formats/fp8/fp8_bench.h"
#include "formats/mor/mor_stat.h"

namespace nb::fp8 {

Status check_shape(int64_t rows, int64_t cols) {
  if (rows <= 0 || cols <= 0)
    return errorf("FP8 needs a non-empty 2-D tensor; got %lldx%lld", (long long)rows, (long long)cols);
  return Status::ok();
}

float amax_ref(const bf16* x, int64_t n, int32_t* nonfinite) {
  float amax = 0.0f;
  int32_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    float v = bf16_to_f32(x[i]);
    amax = std::fmax(amax, std::fabs(v));
    bad |= !std::isfinite(v);
  }
  if (nonfinite) *nonfinite = bad;
  return amax;
}

Status quantize_with_scale_ref(const bf16* x, Format fmt, float scale, const TensorView& out) {
  NB_TRY(check_shape(out.rows, out.cols));
  const int64_t rows = out.rows, cols = out.cols;
  float amax = amax_ref(x, rows * cols, out.nonfinite);
  if (out.amax) *out.amax = amax;
  if (out.scale_inv) *out.scale_inv = 1.0f / scale;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      uint8_t q = uint8_t(encode(bf16_to_f32(x[r * cols + c]) * scale, fmt));
      if (out.data) out.data[r * cols + c] = q;
      if (out.data_t) out.data_t[c * rows + r] = q;
    }
  if (out.mor_stat) {
    if (!out.data) return errorf("FP8 quantize: the MoR statistic reads the row-wise codes; `data` is required");
    mor::add_fp8_stat_host(x, out.data, 1.0f / scale, rows * cols, fmt, out.mor_stat);
  }
  return Status::ok();
}

Status quantize_current_ref(const bf16* x, Format fmt, bool pow2_scales, const TensorView& out) {
  NB_TRY(check_shape(out.rows, out.cols));
  float scale = scale_from_amax(amax_ref(x, out.rows * out.cols, nullptr), format_max(fmt), pow2_scales);
  return quantize_with_scale_ref(x, fmt, scale, out);
}

Status quantize_with_amax_ref(const bf16* x, Format fmt, bool pow2_scales, float amax, const TensorView& out) {
  TensorView v = out;
  v.amax = nullptr;  // the chunk's own amax is not the tensor's
  return quantize_with_scale_ref(x, fmt, scale_from_amax(amax, format_max(fmt), pow2_scales), v);
}

void dequantize_ref(const uint8_t* codes, int64_t n, Format fmt, float scale_inv, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = decode(codes[i], fmt) * scale_inv;
}

// A NaN amax is kept (fmax would drop it) so that update() sees the broken step, as TE's history does.
void DelayedScaling::record(float amax) {
  history[0] = (std::isnan(amax) || std::isnan(history[0])) ? NAN : std::fmax(history[0], amax);
}

void DelayedScaling::update() {
  float amax = 0.0f;
  bool finite = true;
  for (float a : history) {
    if (!std::isfinite(a)) finite = false;
    amax = std::fmax(amax, a);
  }
  // TE: sf = (fp8_max / amax) / 2^margin; keep the previous scale when amax is 0 or not finite.
  if (finite && amax > 0.0f) {
    float s = format_max(format) / amax / std::ldexp(1.0f, margin);
    scale = std::isinf(s) ? FLT_MAX : s;  // nibble: never an infinite scale (TE would keep inf)
  }
  std::rotate(history.begin(), history.begin() + 1, history.end());  // torch.roll(h, -1)
  history[0] = 0.0f;
}

#if !defined(NIBBLE_HAVE_CUDA)
Status quantize_current_cuda(const bf16*, Format, bool, const TensorView&, Stream) {
  return errorf("FP8 quantize_current_cuda: this nibble was built without CUDA; use the CPU path (--device cpu)");
}
Status quantize_with_scale_cuda(const bf16*, Format, const float*, const TensorView&, Stream) {
  return errorf("FP8 quantize_with_scale_cuda: this nibble was built without CUDA; use the CPU path (--device cpu)");
}
Status quantize_with_amax_cuda(const bf16*, Format, bool, const TensorView&, Stream) {
  return errorf("FP8 quantize_with_amax_cuda: this nibble was built without CUDA; use the CPU path (--device cpu)");
}
Status amax_cuda(const bf16*, int64_t, float*, int32_t*, Stream) {
  return errorf("FP8 amax_cuda: this nibble was built without CUDA; use the CPU path (--device cpu)");
}
Status bench_formats_cuda(int64_t, int64_t, int, FormatsBenchResult*) {
  return errorf("FP8 bench_formats_cuda: this nibble was built without CUDA; benchmarks need a GPU build");
}
#endif

}  // namespace nb::fp8
