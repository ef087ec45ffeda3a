// Tensor parallelism's split of a Llama's parameters over T ranks (Megatron-Core's): q, k, v and the fused
// gate/up are column-parallel (each rank the rows of its heads, its query groups, its FFN columns: gate rows
// r and up rows r, so the local gate_up keeps SwiGLU's [gate; up] layout), o and down are row-parallel
// (their input columns), the embedding and the LM head are vocabulary-parallel (rows of a vocabulary padded to
// a multiple of 128 x T, as --make-vocab-size-divisible-by), and the norms are whole on every rank.
// A rank's model is then a Llama of its own shape (local_config): heads, KV heads, FFN and the padded
// vocabulary divided by T, the same hidden size and parameter names, in the same store order. Checkpoints
// stay whole tensors: slice() takes a rank's part of a whole parameter, place() puts it back.
// LoRA's adapters follow their base (Megatron's LoRA): a column-parallel base's A [r, in] is whole and its B
// [out, r] holds the base's output rows ([q; k; v] or [gate; up] parts, each cut like the base); a row-parallel
// base's A [r, in] holds the base's input columns and its B [out, r] is whole.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>
#include "model/llama_config.h"

namespace nb {

struct ParamInfo;

namespace tp {

struct Shard {
  int rank = 0, size = 1;
  bool on() const { return size > 1; }
};

// The vocabulary the embedding and head hold over `size` ranks: padded to a multiple of 128 x size, as Megatron's
// --make-vocab-size-divisible-by 128 does under tensor parallelism (Llama 3's 128,256 at T8: 129,024).
int64_t padded_vocab(const LlamaConfig& whole, int size);
// The model one rank holds (above). size 1: `whole` itself.
LlamaConfig local_config(const LlamaConfig& whole, int size);
// The first vocabulary id of rank s's embedding and head rows.
int64_t vocab_begin(const LlamaConfig& whole, Shard s);

// qkv_rows: a fused [q; k; v] tensor (LoRA's linear_qkv B), each part's rows cut as q_proj's, k_proj's, v_proj's.
enum class Split { whole, rows, cols, gate_up_rows, qkv_rows, vocab_rows };
Split split_of(const std::string& name);

// The output columns of rank s's fused column-parallel projection (0: qkv, 2: gate_up) in the whole layer's
// output [q | k | v] or [gate | up]: {local column, whole column} where each part starts (NVFP4's SR of the
// output gradient draws at the whole's columns, recipe::Linear::set_grad_columns). *whole_cols: the layer's.
std::vector<std::pair<int64_t, int64_t>> fused_output_columns(const LlamaConfig& whole, Shard s, int linear,
                                                              int64_t* whole_cols);

// Rank s's part of whole parameter `whole` (src: whole.numel values in its shape) into dst (local.numel values,
// the local parameter's shape). Vocabulary rows past the whole vocabulary (padding) are zero. whole_cfg (the
// whole model) is needed only by a qkv_rows tensor, whose q rows its shape alone does not tell.
void slice(const ParamInfo& whole, const ParamInfo& local, Shard s, const float* src, float* dst,
           const LlamaConfig* whole_cfg = nullptr);
// The inverse: rank s's part src (local shape) into its place in the whole parameter dst (padding dropped).
void place(const ParamInfo& whole, const ParamInfo& local, Shard s, const float* src, float* dst,
           const LlamaConfig* whole_cfg = nullptr);

// The bytes of the [tokens, hidden] tensors each rank hands the group's collectives for one micro-batch
// (activations of elem_bytes each; an all-reduce counts its tensor, a reduce-scatter its input, an all-gather its
// output), plus the vocabulary-parallel loss's statistics (three FP32 per token). Without sequence parallelism,
// all-reduces: the forward's embedding and two per layer (the o and down outputs); with `backward` the LM head's
// and two per layer (the qkv and gate_up input gradients); full recompute runs each layer's o again. Sequence
// parallelism replaces each all-reduce by a reduce-scatter and adds an all-gather before each column-parallel
// GEMM (n1, n2, the final norm) and row-parallel backward (the residual gradients, the embedding's): twice the
// tensors, the same traffic (a ring all-reduce is a reduce-scatter plus an all-gather), and selective recompute
// gathers n1 and n2 again. A ring moves (T-1)/T of each reduce-scatter's or all-gather's tensor over each rank's
// links. (The quantized Linears' amax reductions are a few floats each, not counted.)
// Quantized gathers (sequence parallelism, recipe::Linear::set_input_gather, set_grad_gather): in
// `quantized_layers` layers the n1 and n2 gathers and the backward's two residual-gradient gathers move their
// Linears' quantized copies, `bytes_per_32` bytes per 32 elements (both copies: FP8 64, MXFP8 66, NVFP4 36, the
// presets' inputs and gradients alike; each piece of a rank's chunk rounded up to 256 bytes, nothing at real
// shapes), and selective recompute does not gather n1 and n2 again (the Linears keep their Wgrad copies).
struct Passes {
  bool backward = true, full_recompute = false, selective_recompute = false, sequence_parallel = false;
  int64_t quantized_layers = 0, bytes_per_32 = 0;
};
int64_t collective_bytes(const LlamaConfig& whole, int64_t tokens, int64_t elem_bytes, Passes p);

}  // namespace tp
}  // namespace nb
