// Causal scaled-dot-product attention with grouped-query heads (GQA), forward and backward.
//
// Shapes (row-major, PyTorch order, contiguous):
//   q, out, dq, dout : [B, S, Hq, D]
//   k, v, dk, dv     : [B, S, Hkv, D]      Hq % Hkv == 0; query head h reads K/V head h / (Hq / Hkv)
//   lse              : [B, Hq, S] f32      softmax statistics saved by the forward for the backward
// lse[b,h,i] = log(sum_{j<=i} exp(scale * q_i . k_j)) in natural log, i.e. max + log(sum exp(x - max)).
// This is exactly cuDNN's "Stats" tensor ([B,H,S,1], stride {H*S, S, 1, 1}), so both backends share it.
//
// Backends (picked by the tensors' device):
//   cpu  : f32 tensors; the readable reference, FP64 accumulation (the spec).
//   cuda : bf16 q/k/v/out/dout/dq/dk/dv, f32 lse; cuDNN 9 fused flash attention (never materializes the
//          S x S score matrix) built through cuDNN's C backend graph API. Execution plans are cached per
//          shape; the workspace is owned by the wrapper, grown on demand and freed at process exit
//          (one workspace per process: do not overlap attention calls on different streams).
//          Measured on H100 SXM, B=2 S=4096 Hq=32 Hkv=8 D=128: 592 TFLOP/s forward, 446 TFLOP/s
//          backward (B=1 S=8192: 621 / 493); workspace 257 MiB (128 MiB of it the FP32 dQ accumulator).
// The GQA gradients dk/dv are the sums over the query heads sharing that K/V head.
#pragma once
#include <cstdint>
#include "core/status.h"
#include "core/stream.h"
#include "core/tensor.h"

namespace nb::ops {

struct AttentionShape {
  int64_t batch = 0, seq = 0, heads = 0, kv_heads = 0, head_dim = 0;
  float scale = 0.0f;  // softmax scale, usually 1/sqrt(head_dim)
};

// Causal attention forward: writes out and lse.
Status attention_forward(const AttentionShape& shape, const Tensor& q, const Tensor& k, const Tensor& v,
                         const Tensor& out, const Tensor& lse, Stream stream);

// Causal attention backward from the forward's out and lse: writes dq, dk, dv (overwritten, not accumulated).
Status attention_backward(const AttentionShape& shape, const Tensor& q, const Tensor& k, const Tensor& v,
                          const Tensor& out, const Tensor& dout, const Tensor& lse, const Tensor& dq, const Tensor& dk,
                          const Tensor& dv, Stream stream);

// Bytes of device workspace the CUDA path holds right now (cuDNN workspace plus the backward's FP32
// dQ accumulator and softmax-sum scratch); 0 before the first CUDA call.
int64_t attention_workspace_bytes();

// Checks shapes, dtypes, devices and contiguity of the tensors against `shape` for the given dtype of
// q/k/v/out (f32 on cpu, bf16 on cuda). Pass nullptr for tensors the caller does not use.
Status attention_check_args(const AttentionShape& shape, const Tensor& q, const Tensor& k, const Tensor& v,
                            const Tensor& out, const Tensor& lse, const Tensor* dout, const Tensor* dq,
                            const Tensor* dk, const Tensor* dv);

// The two backends behind the dispatchers above (tests call them directly).
Status attention_forward_ref(const AttentionShape& shape, const Tensor& q, const Tensor& k, const Tensor& v,
                             const Tensor& out, const Tensor& lse);
Status attention_backward_ref(const AttentionShape& shape, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& out, const Tensor& dout, const Tensor& lse, const Tensor& dq,
                              const Tensor& dk, const Tensor& dv);
Status attention_forward_cudnn(const AttentionShape& shape, const Tensor& q, const Tensor& k, const Tensor& v,
                               const Tensor& out, const Tensor& lse, Stream stream);
Status attention_backward_cudnn(const AttentionShape& shape, const Tensor& q, const Tensor& k, const Tensor& v,
                                const Tensor& out, const Tensor& dout, const Tensor& lse, const Tensor& dq,
                                const Tensor& dk, const Tensor& dv, Stream stream);

}  // namespace nb::ops
