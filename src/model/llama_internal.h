// Internals shared by the LlamaModel files (not part of the model's interface): one layer's weight views,
// one micro-batch's activations and their plan (llama_plan.cpp), and small tensor views. The pass over a
// micro-batch (llama_pass.cpp) reads them; llama_model.cpp sizes the arena and the parameter store with them.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <vector>
#include "core/tensor.h"
#include "model/llama_model.h"

namespace nb {

// The weights of one layer as views into the ParamStore.
// q, k and v are adjacent in the ParamStore, so wqkv / gqkv view them as one [qd + 2 kvd, H] weight.
// A quantized layer's linear weights have no compute copy (data == nullptr): m* are their FP32 masters.
struct LlamaModel::Layer {
  Tensor w_in, wqkv, wo, w_post, wgu, wdown;  // compute copies
  Tensor g_in, gqkv, go, g_post, ggu, gdown;  // FP32 gradients
  Tensor mqkv, mo, mgu, mdown;                // FP32 masters of the linear weights
};

// One micro-batch's activations. Per-layer tensors that recompute does not keep point into shared scratch.
struct LlamaModel::Acts {
  struct PerLayer {
    Tensor n1, rstd1, q, k, v, o, lse, mid, n2, rstd2, gu, a;
  };
  std::vector<Tensor> resid;    // L+1 residual-stream tensors [T,H]
  std::vector<PerLayer> layer;  // L
  Tensor nf, rstdf, logits, losses, dnf;
  Tensor dx, dx2, dmid, dn, da, dgu, dout, dq, dk, dv;
  Tensor qkv, dqkv;  // the fused projection's output and gradient; only when they cannot borrow gu / dgu
  // Sequence parallelism: a [T, H] buffer for the row-parallel partial sums and the gathered residual
  // gradients, and a [T/tp, H] one for this rank's block of a column-parallel input gradient.
  Tensor sp_full, sp_local;
  LoraScratch lora;  // LoRA: the adapters' scratch (model/lora.h)
};

namespace llama {

// Allocates from the arena, or only counts bytes when planning (arena == nullptr).
struct Planner {
  Arena* arena = nullptr;
  Device dev = Device::cpu;
  int64_t bytes = 0;
  Status st;
  Tensor operator()(DType dt, std::initializer_list<int64_t> dims) {
    Tensor t = Tensor::make(nullptr, dt, dev, dims);
    bytes += (t.bytes() + 255) / 256 * 256;
    if (arena && st) t.data = arena->alloc(size_t(t.bytes()), &st);
    return t;
  }
};

// Layers whose linears keep quantized copies of their inputs need no BF16 n1, n2 and SwiGLU output:
// those then live in shared scratch (written by the forward, read by no backward).
std::vector<bool> quantized_layers(const LlamaConfig& c, const recipe::Recipe& r);
// Layers whose BF16 linear inputs live in shared scratch: none with LoRA, whose adapters read them.
std::vector<bool> scratch_input_layers(const LlamaConfig& c, const recipe::Recipe& r, const LoraSpec* lora);
// One micro-batch's activations for `rc`, the LM head `chunk` tokens at a time.
// Sequence parallelism over sp ranks: the residual stream, the norms' statistics and the residual gradients
// hold T/sp tokens; the norms' outputs (the column-parallel inputs) are gathered whole.
// head = false: no final norm, LM head or loss buffers (a pipeline stage without them); c.layers layers, `quantized`
// one flag per layer of them.
// scratch (optional): where the tensors that no backward reads from its forward go (the recompute's shared layer
// set, the LM head's chunk, the backward's temporaries, LoRA's scratch); P keeps the rest. Pipeline slots share
// one scratch (each pass rewrites it before reading it); without one, everything comes from P.
void plan_acts(LlamaModel::Acts* a, Planner& P, const LlamaConfig& c, MicroBatchShape s, Recompute rc, DType dt,
               int64_t chunk, const std::vector<bool>& quantized, const LoraSpec* lora, int sp = 1, bool head = true,
               Planner* scratch = nullptr);
// LM-head chunk: at most 2^29 logits at a time (1 GiB of BF16), i.e. 4096 tokens for V = 128256.
int64_t lm_chunk_tokens(const LlamaConfig& cfg, MicroBatchShape shape);

// Rows [begin, end) of `t`.
inline Tensor rows(const Tensor& t, int64_t begin, int64_t end) {
  Tensor r = t;
  r.data = static_cast<uint8_t*>(t.data) + dtype_bytes(t.dtype, begin * t.stride[0]);
  r.shape[0] = end - begin;
  return r;
}
inline Tensor reshape4(const Tensor& t, int64_t b, int64_t s, int64_t h, int64_t d) {
  return Tensor::make(t.data, t.dtype, t.device, {b, s, h, d});
}
// A [rows, cols] view of the start of `t` (which must hold at least that many elements).
inline Tensor borrow(const Tensor& t, int64_t n_rows, int64_t cols) {
  NB_CHECK(t.numel() >= n_rows * cols, "internal: borrowing [%lld, %lld] from %s", (long long)n_rows, (long long)cols,
           t.shape_str().c_str());
  return Tensor::make(t.data, t.dtype, t.device, {n_rows, cols});
}

}  // namespace llama
}  // namespace nb
