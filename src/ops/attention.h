// Causal scaled-dot-product attention with grouped-query heads (GQA), forward and backward (and, for
// context parallelism's ring, the non-causal block of a query chunk against another chunk's keys).
//
// Shapes (row-major, PyTorch order, contiguous):
//   q, out, dq, dout : [B, S, Hq, D]
//   k, v, dk, dv     : [B, S, Hkv, D]      Hq % Hkv == 0; query head h reads K/V head h / (Hq / Hkv)
//   lse              : [B, Hq, S] f32      softmax statistics saved by the forward for the backward
// lse[b,h,i] = log(sum_{j<=i} exp(scale * q_i . k_j)) in natural log, i.e. max + log(sum exp(x - max)).
// This is exactly cuDNN's "Stats" tensor ([B,H,S,1], stride {H*S, S, 1, 1}), so both backends share it.
//
// Packed segments (several samples per row, SFT packing): with an AttentionSegments, token t of the
// segment [s0, s1) attends to tokens s0..t only, never across a segment boundary. lse then holds the
// same B*Hq*S floats token-major, [T, Hq] with T = B*S (lse[t*Hq + h]): cuDNN's ragged Stats layout. Its
// tensor may be shaped [B, S, Hq] or, as the same floats, [B, Hq, S]; only the backward reads it.
//
// Backends (picked by the tensors' device):
//   cpu  : f32 tensors; the readable reference, FP64 accumulation (the spec).
//   cuda : bf16 q/k/v/out/dout/dq/dk/dv, f32 lse; cuDNN 9 fused flash attention (never materializes the
//          S x S score matrix) built through cuDNN's C backend graph API. Execution plans are cached per
//          shape; the workspace is owned by the wrapper, grown on demand and freed at process exit
//          (one workspace per process: do not overlap attention calls on different streams).
//          Measured on H100 SXM, B=2 S=4096 Hq=32 Hkv=8 D=128: 592 TFLOP/s forward, 446 TFLOP/s
//          backward (B=1 S=8192: 621 / 493); workspace 257 MiB (128 MiB of it the FP32 dQ accumulator).
//          Segmented calls use cuDNN's packed (THD) layout and need cuDNN >= 9.6 and D % 16 == 0
//          (attention_graphs.h has the graph design); they are asynchronous like the others.
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
  // Context parallelism's ring steps (ops/cp_ring.h): K/V rows of their own length (kv_seq; 0 = seq),
  // seen whole by every query (causal = false). k, v, dk, dv are then [B, kv_seq, Hkv, D]. A causal call has
  // kv_seq == seq; so has a segmented one (whose ring blocks pick halves through AttentionSegments instead).
  int64_t kv_seq = 0;
  bool causal = true;
  int64_t kv_len() const { return kv_seq > 0 ? kv_seq : seq; }
};

// Which tokens of each segment a call takes as its queries, or as its keys: all of them, or the first or the
// second half of an even-length segment (context parallelism's ring blocks over packed rows, ops/cp_ring.h).
enum class SegmentPart : uint8_t { whole, first_half, second_half };

// The segments of a packed micro-batch: `count` segments tile the T = batch * seq tokens in order.
// starts holds count + 1 token indices: starts[0] = 0, strictly increasing, starts[count] = T; segment i
// is [starts[i], starts[i+1]) and must lie inside one row of `seq` tokens. attention_check_args checks
// all of this whenever the host array is given (O(count)); the CUDA path trusts starts_device to hold
// the same values.
struct AttentionSegments {
  int64_t count = 0;
  const int32_t* starts = nullptr;         // host array; required on the cpu, optional (checked) on cuda
  const int32_t* starts_device = nullptr;  // device copy, required on cuda (read on the call's stream)
  int64_t max_len = 0;  // the longest segment or an upper bound of it; 0: computed from the host starts
  // A ring block (causal = false) over packed rows: segment i's queries are q_part of its tokens and they see
  // every key of kv_part of the same segment (K/V share the queries' token layout: kv_seq = seq). Halves need
  // even segments. Tokens outside the parts are neither read nor written: their out, lse and dq (queries), dk
  // and dv (keys) keep whatever they held.
  SegmentPart q_part = SegmentPart::whole, kv_part = SegmentPart::whole;
};

// Checks `segments` against the AttentionSegments rules for a call on `dev` (attention_check_args runs it).
Status attention_check_segments(const AttentionShape& shape, const AttentionSegments& segments, Device dev);

// The longest segment as the CUDA graphs need it: max_len when set, else the longest one in the host
// starts (0 when neither is given).
int64_t attention_segments_max_len(const AttentionSegments& segments);

// Causal attention forward: writes out and lse. segments: nullptr = each row is one sequence.
Status attention_forward(const AttentionShape& shape, const Tensor& q, const Tensor& k, const Tensor& v,
                         const Tensor& out, const Tensor& lse, Stream stream,
                         const AttentionSegments* segments = nullptr);

// Causal attention backward from the forward's out and lse: writes dq, dk, dv (overwritten, not accumulated).
// Pass the segments the forward was given.
Status attention_backward(const AttentionShape& shape, const Tensor& q, const Tensor& k, const Tensor& v,
                          const Tensor& out, const Tensor& dout, const Tensor& lse, const Tensor& dq, const Tensor& dk,
                          const Tensor& dv, Stream stream, const AttentionSegments* segments = nullptr);

// Bytes of device workspace the CUDA path holds right now (cuDNN workspace plus the backward's FP32
// dQ accumulator and softmax-sum scratch); 0 before the first CUDA call.
int64_t attention_workspace_bytes();

// Checks shapes, dtypes, devices and contiguity of the tensors against `shape` for the given dtype of
// q/k/v/out (f32 on cpu, bf16 on cuda). Pass nullptr for tensors the caller does not use. With segments
// it also checks them (see AttentionSegments) and accepts the token-major lse shape.
Status attention_check_args(const AttentionShape& shape, const Tensor& q, const Tensor& k, const Tensor& v,
                            const Tensor& out, const Tensor& lse, const Tensor* dout, const Tensor* dq,
                            const Tensor* dk, const Tensor* dv, const AttentionSegments* segments = nullptr);

// The two backends behind the dispatchers above (tests call them directly).
Status attention_forward_ref(const AttentionShape& shape, const Tensor& q, const Tensor& k, const Tensor& v,
                             const Tensor& out, const Tensor& lse, const AttentionSegments* segments = nullptr);
// The same, with the FP64 values it rounds to out and lse also written to out64 and lse64 (their layouts): context
// parallelism's ring on the CPU merges its blocks from these, so its output is rounded once, as one rank's.
Status attention_forward_ref(const AttentionShape& shape, const Tensor& q, const Tensor& k, const Tensor& v,
                             const Tensor& out, const Tensor& lse, const AttentionSegments* segments, double* out64,
                             double* lse64);
Status attention_backward_ref(const AttentionShape& shape, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& out, const Tensor& dout, const Tensor& lse, const Tensor& dq,
                              const Tensor& dk, const Tensor& dv, const AttentionSegments* segments = nullptr);
Status attention_forward_cudnn(const AttentionShape& shape, const Tensor& q, const Tensor& k, const Tensor& v,
                               const Tensor& out, const Tensor& lse, Stream stream,
                               const AttentionSegments* segments = nullptr);
Status attention_backward_cudnn(const AttentionShape& shape, const Tensor& q, const Tensor& k, const Tensor& v,
                                const Tensor& out, const Tensor& dout, const Tensor& lse, const Tensor& dq,
                                const Tensor& dk, const Tensor& dv, Stream stream,
                                const AttentionSegments* segments = nullptr);

}  // namespace nb::ops
