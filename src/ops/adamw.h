// AdamW on FP32 master weights (PyTorch torch.optim.AdamW semantics, decoupled weight decay):
//   g = grad * grad_scale;  p *= 1 - lr * weight_decay
//   m = beta1 m + (1 - beta1) g;  v = beta2 v + (1 - beta2) g^2
//   p -= (lr / (1 - beta1^step)) * m / (sqrt(v) / sqrt(1 - beta2^step) + eps)
// step counts from 1. Bias corrections are computed once on the host in FP64.
// Shapes: master, grad, m, v FP32, all the same element count; compute_copy the same count, BF16
// (typical on CUDA) or FP32, written from the new master (RNE); pass a tensor with data == nullptr to
// skip it. The update is elementwise FP32 with the same operation order on CPU and CUDA.
#pragma once
#include <cstdint>
#include "core/stream.h"
#include "core/tensor.h"

namespace nb::ops {

struct AdamWParams {
  float lr = 0, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0;
  int64_t step = 1;
  float grad_scale = 1;  // e.g. gradient-clipping factor times 1/loss-scale
};

void adamw_update(const Tensor& master_f32, const Tensor& grad_f32, const Tensor& m, const Tensor& v,
                  const Tensor& compute_copy, const AdamWParams& params, Stream stream);

namespace detail {
// Per-step scalars shared by both backends so they compute the same FP32 operations.
struct AdamWScalars {
  float lr, beta1, beta2, one_minus_beta1, one_minus_beta2, eps, decay_factor, step_size, inv_sqrt_bc2, grad_scale;
};
AdamWScalars adamw_scalars(const AdamWParams& p);
void adamw_update_cuda(const Tensor& master_f32, const Tensor& grad_f32, const Tensor& m, const Tensor& v,
                       const Tensor& compute_copy, const AdamWScalars& k, Stream stream);
}  // namespace detail

}  // namespace nb::ops
