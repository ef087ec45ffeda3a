// The step amaxes of FP8 delayed scaling as one contiguous f32 tensor, and back.
// Each role of a delayed-scaling Linear folds the amaxes of the step's quantizations into one float of
// its own small state block (linear_device.h); new_step() records that value in the role's history and
// derives the next scale. With data parallelism the ranks must record the same value, the MAX over ranks
// (TransformerEngine reduces its amax buffer so before updating scales). The state blocks are separate
// allocations, so gather_amaxes copies every role's step amax into one buffer (one kernel on CUDA), the
// caller all-reduces that buffer once, and scatter_amaxes writes the result back: one collective per step
// instead of one per role (a 32-layer model has 384).
//
// A NaN step amax (the step quantized a non-finite value) travels as +Inf: a MAX reduction keeps +Inf on
// every backend, while NCCL's and Gloo's max need not keep a NaN. A step amax is never +Inf otherwise
// (a non-finite source makes it NaN), so scatter_amaxes turns +Inf back into NaN losslessly.
#pragma once
#include <vector>
#include "core/status.h"
#include "core/stream.h"
#include "core/tensor.h"

namespace nb::recipe {

// amaxes: one-element f32 tensors on one device (Linear::step_amax_views); dst/src: a contiguous f32
// tensor of amaxes.size() elements on that device. Queued on `stream` (CUDA); the CPU runs them at once.
Status gather_amaxes(const std::vector<Tensor>& amaxes, const Tensor& dst, Stream stream);
Status scatter_amaxes(const Tensor& src, const std::vector<Tensor>& amaxes, Stream stream);

namespace detail {
// CUDA side (amax_gather.cu; the CPU-only build answers with an error). `ptrs` are device pointers.
Status gather_amaxes_cuda(const std::vector<float*>& ptrs, float* dst, Stream stream);
Status scatter_amaxes_cuda(const float* src, const std::vector<float*>& ptrs, Stream stream);
}  // namespace detail

}  // namespace nb::recipe
