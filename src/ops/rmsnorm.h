// RMSNorm as in Llama: y = x * rstd * w with rstd = 1/sqrt(mean(x^2) + eps) per row.
// Shapes: x, y, dy, dx [T, H] (any leading dims, last dim H); w [H]; rstd [T] FP32 (saved by the
// forward for the backward); dw_f32 [H] FP32, accumulated (+=) so micro-batches sum into it.
// dx is written (not accumulated) and must not alias dy.
// CPU: FP32 tensors, FP64 row sums. CUDA: x/y/dy/dx and w BF16 or FP32, FP32 math, one block per row;
// dw is reduced over rows in a fixed order (chunk partials, then an ordered sum): deterministic.
#pragma once
#include "core/stream.h"
#include "core/tensor.h"

namespace nb::ops {

void rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, const Tensor& y, const Tensor& rstd, Stream stream);
void rmsnorm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy, const Tensor& dx,
                      const Tensor& dw_f32, Stream stream);

namespace detail {
void rmsnorm_forward_cuda(const Tensor& x, const Tensor& w, float eps, const Tensor& y, const Tensor& rstd,
                          Stream stream);
void rmsnorm_backward_cuda(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy, const Tensor& dx,
                           const Tensor& dw_f32, Stream stream);
}  // namespace detail

}  // namespace nb::ops
