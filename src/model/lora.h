// LoRA inside the model: the adapters as trainable parameters (a ParamStore of A and B per adapted
// fused linear), their two small GEMMs beside each frozen base GEMM, and the bridge to PEFT's files.
//
// For an adapted linear y = x W^T (W frozen, [out, in]) with A [r, in], B [out, r], s = alpha / r:
//   forward   h = d(x) A^T [T, r];  y += s h B^T
//   backward  gB += s dy^T h;  dh = s dy B;  gA += dh^T d(x);  dx += d'(dh A)
// where d is LoRA dropout on the adapter's input (identity at p = 0) and d' its backward with the same
// mask. h is recomputed in the backward (a [T, in] x [in, r] GEMM, r/out of the base GEMM's cost) rather
// than kept, so full recompute and plain runs share one path and no [T, r] tensor lives across layers.
// The dropout mask is a pure function of its Philox key (step, micro-batch, linear), so the backward
// recomputes it instead of storing it. Adapter GEMMs run in BF16 on CUDA (FP32 on the CPU reference),
// gradients accumulate in FP32 like every other weight gradient.
// Tensor parallelism (model/tensor_parallel.h) runs these per rank on its parts unchanged: a column-parallel
// adapter (whole A, B's output rows) computes h whole, its rows of y exactly and a partial dh, so gA and dx are
// partial sums (dx summed with the base's input gradient; gA by the trainer); a row-parallel adapter (A's input
// columns, whole B) gives a partial h, added into the base's partial output before its sum, so gB is partial
// and gA, dx this rank's columns exactly.
//
// Initialization (Megatron-Bridge's and PEFT's rule): B = 0, so the adapted model starts as the base;
// A ~ N(0, 1/(3 in)), the variance of PEFT's kaiming_uniform_(a = sqrt(5)), drawn from the store's
// Philox streams (normal rather than uniform: nibble's one initializer).
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>
#include "core/philox.h"
#include "core/stream.h"
#include "core/tensor.h"
#include "io/peft_adapter.h"
#include "model/params.h"

namespace nb {

// model.layers.{l}.self_attn.linear_qkv.lora_A.weight, ... (Megatron-Bridge's target names).
std::string lora_param_name(int64_t layer, LoraTarget t, bool a);
// Per layer, per target of s.targets: A then B. A and B are weight-decayed 2-D parameters.
std::vector<ParamInfo> lora_param_list(const LlamaConfig& c, const LoraSpec& s);
// Trainable parameters of the spec (what the optimizer and checkpoints hold).
int64_t lora_param_count(const LlamaConfig& c, const LoraSpec& s);

// One adapted linear's views into the adapter store, and its constants.
struct LoraModule {
  Tensor a, b;    // compute copies [r, in], [out, r]
  Tensor ga, gb;  // FP32 gradients
  float scale = 1.f, dropout = 0.f;
  uint32_t id = 0;  // the dropout key's stream: unique per adapted linear
  // Tensor parallelism, a row-parallel adapter: x holds the input columns [in_first, in_first + in) of in_whole,
  // and dropout draws each element's mask bit at its place in the whole input (in_whole 0: x is whole).
  int64_t in_whole = 0, in_first = 0;
};
// Scratch of one micro-batch (activation arena): h and dh [T, r]; with dropout, the dropped input and
// the adapter's input gradient before dropout's backward, [T, largest in].
struct LoraScratch {
  Tensor h, dh, xd, dxd;
};
// The dropout key of module m at optimizer step `step`, micro-batch `micro`.
RngKey lora_dropout_key(uint64_t seed, uint32_t step, uint32_t micro, const LoraModule& m);

Status lora_forward(const LoraModule& m, const Tensor& x, const LoraScratch& s, const Tensor& y, RngKey key,
                    Stream stream);
// after_dx (optional) runs once dx's last GEMM is queued, before the adapter's weight gradients: tensor
// parallelism launches dx's sum there, beside them (--tp-comm-overlap).
Status lora_backward(const LoraModule& m, const Tensor& dy, const Tensor& x, const LoraScratch& s, const Tensor& dx,
                     RngKey key, Stream stream, const std::function<Status()>& after_dx = {});

// The store's FP32 masters as a LoraAdapter (for write_peft_adapter), and a LoraAdapter into the store
// (masters and compute copies; AdamW state untouched). The adapter's spec must match the store's.
Status lora_adapter_from_store(const ParamStore& P, const LlamaConfig& c, const LoraSpec& s, LoraAdapter* out);
// The same from host FP32 values laid out as `params` says (a tensor-parallel store's gathered whole arrays).
void lora_adapter_from_values(const float* values, const std::vector<ParamInfo>& params, const LlamaConfig& c,
                              const LoraSpec& s, LoraAdapter* out);
Status lora_store_from_adapter(const LoraAdapter& ad, const LlamaConfig& c, ParamStore& P);

}  // namespace nb
