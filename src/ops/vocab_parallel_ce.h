// Tensor parallelism's cross-entropy over a vocabulary split across T ranks (Megatron's
// vocab_parallel_cross_entropy): rank r holds the LM head's logits for vocabulary ids [vocab_begin,
// vocab_begin + V/T) of every token, and the loss is computed without gathering the logits:
//   m_t = MAX over ranks of the local row max        (one all-reduce of T values)
//   s_t = SUM over ranks of sum_j exp(x_tj - m_t), and the target's logit (held by one rank, 0 elsewhere),
//         in one all-reduce of 2T values
//   loss_t = log(s_t) + m_t - x_t,target;   dlogits_tj = (exp(x_tj - m_t) / s_t - [j == target]) * grad_scale
// Columns whose global id is >= vocab (the padding of a vocabulary padded to a multiple of 128 x T) take no
// part: they are left out of the max and the sum, and their gradient is 0, so the loss equals the unpadded
// model's. Every rank writes the same losses.
// Shapes as ops/cross_entropy.h: logits [T, V/T] (CPU FP32; CUDA BF16 or FP32; overwritten with dlogits),
// targets [T] i32 (global ids; < 0 ignored: loss 0, grad 0), losses [T] FP32, scratch [3, T] FP32 (the row
// max, then the sum of exponentials and the target's logit, which the group reduces in place).
// CPU: FP64 math within a rank (the reduced statistics are FP32). CUDA: FP32 math, as ops/cross_entropy.
#pragma once
#include "core/status.h"
#include "core/stream.h"
#include "core/tensor.h"

namespace nb::ops::tp {

// The tensor-parallel group: in-place all-reduces over every rank of the group, on the tensor's device (on
// `stream` for CUDA tensors). sum takes FP32 or the compute dtype (BF16 activations); max takes FP32.
class ReduceGroup {
 public:
  virtual ~ReduceGroup() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual Status max(const Tensor& values, Stream stream) = 0;
  virtual Status sum(const Tensor& values, Stream stream) = 0;
  // Sequence parallelism (compute dtype): `in` holds size() blocks of n elements, `out` n: block rank() of their
  // sum over the group. all_gather: every rank's n elements of `in` to block r of `out`; `in` may be its block.
  virtual Status reduce_scatter(const Tensor& in, const Tensor& out, Stream stream) = 0;
  virtual Status all_gather(const Tensor& in, const Tensor& out, Stream stream) = 0;
};

Status vocab_parallel_cross_entropy(const Tensor& logits, const Tensor& targets, int64_t vocab_begin, int64_t vocab,
                                    float grad_scale, const Tensor& losses, const Tensor& scratch, ReduceGroup* group,
                                    Stream stream);

namespace detail {
// The three passes on CUDA (vocab_parallel_ce.cu); scratch rows as above.
void vp_ce_row_max_cuda(const Tensor& logits, int64_t vocab_begin, int64_t vocab, const Tensor& row_max, Stream stream);
void vp_ce_sums_cuda(const Tensor& logits, const Tensor& targets, int64_t vocab_begin, int64_t vocab,
                     const Tensor& row_max, const Tensor& sums_and_target, Stream stream);
void vp_ce_finish_cuda(const Tensor& logits, const Tensor& targets, int64_t vocab_begin, int64_t vocab,
                       float grad_scale, const Tensor& row_max, const Tensor& sums_and_target, const Tensor& losses,
                       Stream stream);
}  // namespace detail

}  // namespace nb::ops::tp
