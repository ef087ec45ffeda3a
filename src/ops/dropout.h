// Dropout with a recomputable mask (LoRA dropout): out = keep ? x / (1 - p) : 0 elementwise.
// The mask is a pure function of (key, element index), so the backward recomputes it from the same
// key instead of storing it, and the CPU reference and the CUDA kernels draw identical masks:
//   bits_i = philox_block(key, i / 4).v[i % 4]      (Philox4x32-10, counter = i / 4, 32-bit lane i % 4)
//   u_i    = (bits_i + 0.5) / 2^32                  (in (0, 1), compared exactly, see dropout_threshold)
//   keep_i = u_i >= p
//   out_i  = keep_i ? x_i * scale : +0,  scale = 1.f / (1.f - p) in FP32
// The product is one FP32 multiply, rounded once to the output dtype (BF16 with round-to-nearest-even,
// as nb::f32_to_bf16), so CUDA and CPU results are bit-identical. Dropped elements are written as +0
// whatever x is (a NaN there does not propagate). p == 0 is an exact copy (nothing when out is x).
// Tensors: contiguous, any shape (treated as flat), x and out the same dtype, device and element count;
// out may be x itself but must not partially overlap it. CPU: FP32. CUDA: BF16 or FP32.
// p must be in [0, 1): a p outside it is a bug in the caller (NB_CHECK).
// Column windows (DropoutColumns): a 2-D x [rows, cols] that is the columns [first, first + cols) of a
// [rows, whole] tensor (a row-parallel LoRA input under tensor parallelism holds its rank's columns) draws each
// element's bits at its index in that whole tensor, so the mask is the whole tensor's, restricted to the window.
#pragma once
#include <cmath>
#include <cstdint>
#include "core/macros.h"
#include "core/philox.h"
#include "core/stream.h"
#include "core/tensor.h"

namespace nb::ops {

struct DropoutColumns {
  int64_t whole = 0, first = 0;  // whole == 0: the tensor is whole
};
void dropout_forward(const Tensor& x, const Tensor& out, float p, RngKey key, Stream stream, DropoutColumns cols = {});
// dx = dy * keep / (1 - p) with the forward's mask (same key, same p, same window); dx may be dy itself.
void dropout_backward(const Tensor& dy, const Tensor& dx, float p, RngKey key, Stream stream, DropoutColumns cols = {});

// The smallest 32-bit draw that is kept: keep_i = bits_i >= threshold, which is exactly
// (bits_i + 0.5) / 2^32 >= p (both sides exact in FP64: p * 2^32 needs 24 significant bits).
// p in [0, 1) gives a threshold in [0, 2^32 - 256]; p == 0 keeps everything.
inline uint32_t dropout_threshold(float p) {
  double t = std::ceil(double(p) * 4294967296.0 - 0.5);
  return t <= 0 ? 0u : uint32_t(t);
}
inline float dropout_scale(float p) { return 1.f / (1.f - p); }

// One element given its 32-bit draw; the same source on host and device.
NB_HD float dropout_apply(float x, uint32_t bits, uint32_t threshold, float scale) {
  return bits >= threshold ? x * scale : 0.f;
}
// The 32-bit draw of element i.
NB_HD uint32_t dropout_bits(const RngKey& key, uint64_t i) { return philox_block(key, i >> 2).v[i & 3]; }
// Element i of a window of `cols` columns: its index in the whole tensor.
NB_HD uint64_t dropout_whole_index(int64_t i, int64_t cols, DropoutColumns w) {
  return uint64_t(i / cols * w.whole + w.first + i % cols);
}

namespace detail {
void dropout_cuda(const Tensor& x, const Tensor& out, uint32_t threshold, float scale, RngKey key, Stream stream);
// A window (w.whole > 0) of `cols` columns, element by element.
void dropout_window_cuda(const Tensor& x, const Tensor& out, uint32_t threshold, float scale, RngKey key, int64_t cols,
                         DropoutColumns w, Stream stream);
}  // namespace detail

}  // namespace nb::ops
