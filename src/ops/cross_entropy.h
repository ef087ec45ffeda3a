// Softmax cross-entropy, forward and backward in one call on a chunk of LM-head logits.
// Shapes: logits [T, V] (CPU FP32; CUDA BF16 or FP32), targets [T] i32, losses [T] FP32.
// Writes losses[t] = logsumexp(logits[t]) - logits[t, target[t]] and overwrites logits in place with
// dlogits = (softmax(logits[t]) - onehot(target[t])) * grad_scale, so the LM head never keeps a full
// FP32 copy (the caller runs the LM-head GEMM chunk by chunk). Targets < 0 are ignored (loss 0, grad 0);
// targets >= V are a bug (NB_CHECK on CPU; on CUDA the row is treated as ignored).
// CPU: FP64 math. CUDA: one block per row, two passes (online max/sum, then the gradient), FP32 math.
#pragma once
#include "core/stream.h"
#include "core/tensor.h"

namespace nb::ops {

void cross_entropy_fwd_bwd(const Tensor& logits, const Tensor& targets, float grad_scale, const Tensor& losses,
                           Stream stream);

namespace detail {
void cross_entropy_fwd_bwd_cuda(const Tensor& logits, const Tensor& targets, float grad_scale, const Tensor& losses,
                                Stream stream);
}  // namespace detail

}  // namespace nb::ops
