// FP8 with one FP32 scale per tensor (E4M3 or E5M2): current scaling and delayed scaling.
// Input: BF16 [rows, cols], row-major; any rows, cols >= 1.
//
// Layout (the CUDA kernel writes both copies in one pass over the input):
//   data       [rows, cols]  FP8 codes
//   data_t     [cols, rows]  FP8 codes of the transposed tensor (same values): Hopper's FP8 GEMMs take
//                            TN operands only, so the Dgrad/Wgrad operands need the transposed copy
//   scale_inv  1 FP32 (= 1/scale, what a GEMM multiplies back), amax 1 FP32 (of this input)
//
// Numerics (TransformerEngine, common/recipe/recipe_common.cuh compute_scale_from_amax), FP32:
//   amax      = max |x|  (fmax: NaN does not propagate; NaN/Inf are reported in `nonfinite`)
//   scale     = fp8_max / amax, IEEE division; amax 0, Inf or NaN -> 1; an infinite quotient ->
//               FLT_MAX; with pow2_scales the mantissa bits are cleared (rounded down to 2^k)
//   scale_inv = 1 / scale
//   q         = satfinite_rne(x * scale)   -- finite inputs never become Inf/NaN
//   x_hat     = value(q) * scale_inv
// Delayed scaling (TE DelayedScaling, pytorch/fp8.py): each step records its amax in history[0];
// after the step amax = max(history), scale = (fp8_max / amax) / 2^margin, kept unchanged when amax
// is 0 or non-finite, then the history rolls by one (torch.roll(h, -1)) and history[0] is zeroed.
#pragma once
#include <cfloat>
#include <cstdint>
#include <vector>
#include "core/bf16.h"
#include "core/macros.h"
#include "core/status.h"
#include "core/stream.h"
#include "formats/scalar_codecs.h"

namespace nb::mor {
struct StatCell;  // formats/mor/mor_stat.h
}

namespace nb::fp8 {

enum class Format : uint8_t { e4m3, e5m2 };
inline const char* format_name(Format f) { return f == Format::e4m3 ? "e4m3" : "e5m2"; }

NB_HD float format_max(Format f) { return f == Format::e4m3 ? kE4M3Max : kE5M2Max; }
NB_HD uint32_t encode(float x, Format f) {
  return f == Format::e4m3 ? f32_to_e4m3_satfinite(x) : f32_to_e5m2_satfinite(x);
}
NB_HD float decode(uint32_t code, Format f) { return f == Format::e4m3 ? e4m3_to_f32(code) : e5m2_to_f32(code); }

// TE's compute_scale_from_amax with epsilon 0 and value_for_inf FLT_MAX.
NB_HD float scale_from_amax(float amax, float max_fp8, bool pow2_scales) {
  if (amax != amax || amax == INFINITY || amax == 0.0f) return 1.0f;
  float scale = max_fp8 / amax;
  if (scale == INFINITY) scale = FLT_MAX;
  if (pow2_scales) scale = bits_f32(f32_bits(scale) & 0xFF800000u);
  return scale;
}

// Caller-owned buffers: host memory for *_ref, device memory for *_cuda. data_t may be null.
struct TensorView {
  int64_t rows = 0, cols = 0;
  uint8_t* data = nullptr;       // [rows, cols]
  uint8_t* data_t = nullptr;     // [cols, rows] or null
  float* scale_inv = nullptr;    // 1 value
  float* amax = nullptr;         // 1 value: amax of the input (written by every quantize_* call)
  int32_t* nonfinite = nullptr;  // optional: 1 if any input is NaN or Inf
  // Optional (Mixture of Representations): the quantization's error statistic (mor_stat.h) is added into this
  // cell, in the same memory as the other outputs; needs `data` (and on CUDA `scale_inv`). The CUDA quantizer computes
  // it while it encodes (rows and cols multiples of 8), else in a pass of its own over x and data.
  mor::StatCell* mor_stat = nullptr;
};

Status check_shape(int64_t rows, int64_t cols);

// Current scaling: amax of x -> scale -> codes. CPU reference.
Status quantize_current_ref(const bf16* x, Format fmt, bool pow2_scales, const TensorView& out);
// With a given scale (delayed scaling); still records amax and the non-finite flag.
Status quantize_with_scale_ref(const bf16* x, Format fmt, float scale, const TensorView& out);

// CUDA: an amax pass, a one-thread scale kernel and one quantize pass writing data and data_t.
Status quantize_current_cuda(const bf16* x, Format fmt, bool pow2_scales, const TensorView& out,
                             Stream stream = nullptr);
// `scale` is a device pointer (so a delayed-scaling state kept on the GPU needs no host sync).
Status quantize_with_scale_cuda(const bf16* x, Format fmt, const float* scale, const TensorView& out,
                                Stream stream = nullptr);

// Sharded weights (Megatron-FSDP's training-format gathers): a row chunk of a tensor quantized with the whole
// tensor's amax (max-reduced over the ranks) gets the codes and scale_inv that quantizing the whole tensor
// at once gives its rows. `amax` is the tensor's; out.amax is not written (may be null).
Status quantize_with_amax_ref(const bf16* x, Format fmt, bool pow2_scales, float amax, const TensorView& out);
// CUDA: *out.amax holds the tensor's amax (device), read and left as it is.
Status quantize_with_amax_cuda(const bf16* x, Format fmt, bool pow2_scales, const TensorView& out, Stream stream);
// The amax pass alone: *amax = max |x| over n elements, *nonfinite = 1 (when not null) on a NaN or Inf.
Status amax_cuda(const bf16* x, int64_t n, float* amax, int32_t* nonfinite, Stream stream);
float amax_ref(const bf16* x, int64_t n, int32_t* nonfinite);

// x_hat [rows, cols] from data (or [cols, rows] from data_t: same formula).
void dequantize_ref(const uint8_t* codes, int64_t n, Format fmt, float scale_inv, float* out);

// Delayed scaling state of one tensor (host side; one small window per tensor).
struct DelayedScaling {
  Format format = Format::e4m3;
  int margin = 0;
  std::vector<float> history;  // history[0] = the current step's amax
  float scale = 1.0f;

  explicit DelayedScaling(Format f = Format::e4m3, int history_len = 1024, int margin_ = 0)
      : format(f), margin(margin_), history(size_t(history_len > 0 ? history_len : 1), 0.0f) {}
  float scale_inv() const { return 1.0f / scale; }
  // Records this step's amax (max with what the step already recorded, for tensors used twice).
  void record(float amax);
  // After the step: new scale from max(history), then roll the window.
  void update();
};

}  // namespace nb::fp8
