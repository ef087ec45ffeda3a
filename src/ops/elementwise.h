// Elementwise helpers and reductions the model and trainer need: dtype casts, residual adds, fills,
// scaling, the finite check, and the sum of squares behind the global gradient norm.
// All tensors are contiguous and any shape (treated as flat). CPU: FP32 (cast also takes BF16 host
// tensors). CUDA: BF16 or FP32, FP32 math; conversions to BF16 round to nearest even, bit-identical
// to nb::f32_to_bf16 on the host.
#pragma once
#include "core/stream.h"
#include "core/tensor.h"

namespace nb::ops {

// dst = src converted (f32<->bf16 with RNE, or same-dtype copy); same element count, same device.
void cast(const Tensor& src, const Tensor& dst, Stream stream);
// y += x elementwise (residual adds). y and x may differ in dtype on CUDA (e.g. f32 += bf16).
void add_inplace(const Tensor& y, const Tensor& x, Stream stream);
void fill(const Tensor& t, float value, Stream stream);
void scale_inplace(const Tensor& t, float s, Stream stream);
// True if no element is NaN or Inf. Synchronizes the stream on CUDA.
bool all_finite(const Tensor& t, Stream stream);
// *out += sum(x^2). On CUDA `out` is a device pointer to one float and the kernel is deterministic
// (fixed two-level reduction order); on CPU `out` is a host pointer and the sum runs in FP64.
void sum_squares_accumulate(const Tensor& x, float* out, Stream stream);

namespace detail {
void cast_cuda(const Tensor& src, const Tensor& dst, Stream stream);
void add_inplace_cuda(const Tensor& y, const Tensor& x, Stream stream);
void fill_cuda(const Tensor& t, float value, Stream stream);
void scale_inplace_cuda(const Tensor& t, float s, Stream stream);
bool all_finite_cuda(const Tensor& t, Stream stream);
void sum_squares_accumulate_cuda(const Tensor& x, float* out, Stream stream);
}  // namespace detail

}  // namespace nb::ops
