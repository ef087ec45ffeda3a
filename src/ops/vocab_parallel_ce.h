// Tensor parallelism's cross-entropy over a vocabulary split across T ranks (Megatron's
// vocab_parallel_cross_entropy): rank r holds the LM head's logits for vocabulary ids [vocab_begin,
// vocab_begin + V/T) of every token, and the loss is computed without gathering the logits:
//   m_t = MAX over ranks of the local row max        (one all-reduce of T values)
//   s_t = SUM over ranks of sum_j exp(x_tj - m_t), and the target's logit (held by one rank, 0 elsewhere),
//         in one all-reduce of 2T values
//   loss_t = log(s_t) + m_t - x_t,target;   dlogits_tj = (exp(x_tj - m_t) / s_t - [j == target]) * grad_scale
// Shapes as ops/cross_entropy.h: logits [T, V/T] (overwritten with dlogits), targets [T] i32 (global ids;
// < 0 ignored: loss 0, grad 0), losses [T] FP32. CPU reference (FP64 math); not used by training yet.
#pragma once
#include "core/status.h"
#include "core/stream.h"
#include "core/tensor.h"

namespace nb::ops::tp {

// The tensor-parallel group's reductions of host doubles in place, over every rank of the group.
class VocabReducer {
 public:
  virtual ~VocabReducer() = default;
  virtual Status max(double* values, int64_t n) = 0;
  virtual Status sum(double* values, int64_t n) = 0;
};

Status vocab_parallel_cross_entropy(const Tensor& logits, const Tensor& targets, int64_t vocab_begin, float grad_scale,
                                    const Tensor& losses, VocabReducer* group);

}  // namespace nb::ops::tp
