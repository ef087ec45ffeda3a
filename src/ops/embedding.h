// Token embedding lookup and its gradient.
// Shapes: table [V, H] (CPU FP32; CUDA BF16 or FP32), ids [T] i32, out [T, H] (table's dtype);
// backward: dout [T, H], dtable_f32 [V, H] FP32 accumulated (+=).
// Id -1 is another tensor-parallel rank's row (model/llama_tp.cpp): the forward writes a zero row and the
// backward skips the token. Other ids outside [0, V) are a bug: NB_CHECK on CPU; on CUDA they are treated as
// -1 (a kernel cannot report an error cheaply).
// The CUDA backward is deterministic: the ids are stably radix-sorted (token order kept within one
// id), then one block per distinct id sums its dout rows in token order and adds once into dtable.
// No float atomics, so the result does not depend on timing; it equals the CPU sum order.
#pragma once
#include "core/stream.h"
#include "core/tensor.h"

namespace nb::ops {

void embedding_forward(const Tensor& table, const Tensor& ids, const Tensor& out, Stream stream);
void embedding_backward(const Tensor& ids, const Tensor& dout, const Tensor& dtable_f32, Stream stream);

namespace detail {
void embedding_forward_cuda(const Tensor& table, const Tensor& ids, const Tensor& out, Stream stream);
void embedding_backward_cuda(const Tensor& ids, const Tensor& dout, const Tensor& dtable_f32, Stream stream);
}  // namespace detail

}  // namespace nb::ops
