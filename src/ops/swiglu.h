// SwiGLU on the fused gate/up projection: gate_up [T, 2F] holds gate in columns [0, F) and up in
// [F, 2F) (Megatron's linear_fc1 layout); out [T, F] = silu(gate) * up with silu(g) = g / (1 + e^-g).
// Backward writes dgate_up [T, 2F] (not accumulated); dgate_up may be the same memory as gate_up
// (each element is read before it is overwritten by the same thread).
// CPU: FP32. CUDA: BF16 or FP32, FP32 math, one rounding per output.
#pragma once
#include "core/stream.h"
#include "core/tensor.h"

namespace nb::ops {

void swiglu_forward(const Tensor& gate_up, const Tensor& out, Stream stream);
void swiglu_backward(const Tensor& gate_up, const Tensor& dout, const Tensor& dgate_up, Stream stream);

namespace detail {
void swiglu_forward_cuda(const Tensor& gate_up, const Tensor& out, Stream stream);
void swiglu_backward_cuda(const Tensor& gate_up, const Tensor& dout, const Tensor& dgate_up, Stream stream);
}  // namespace detail

}  // namespace nb::ops
