// Tensor parallelism's split of a Llama's parameters over T ranks (Megatron-Core's): q, k, v and the fused
// gate/up are column-parallel (each rank the rows of its heads, its query groups, its FFN columns: gate rows
// r and up rows r, so the local gate_up keeps SwiGLU's [gate; up] layout), o and down are row-parallel
// (their input columns), the embedding and the LM head are vocabulary-parallel (rows of a vocabulary padded to
// a multiple of 128 x T, as --make-vocab-size-divisible-by), and the norms are whole on every rank.
// A rank's model is then a Llama of its own shape (local_config): heads, KV heads, FFN and the padded
// vocabulary divided by T, the same hidden size and parameter names, in the same store order. Checkpoints
// stay whole tensors: slice() takes a rank's part of a whole parameter, place() puts it back.
#pragma once
#include <cstdint>
#include <string>
#include "model/llama_config.h"

namespace nb {

struct ParamInfo;

namespace tp {

struct Shard {
  int rank = 0, size = 1;
  bool on() const { return size > 1; }
};

// The vocabulary the embedding and head hold over `size` ranks: padded to a multiple of 128 x size.
int64_t padded_vocab(const LlamaConfig& whole, int size);
// The model one rank holds (above). size 1: `whole` itself.
LlamaConfig local_config(const LlamaConfig& whole, int size);
// The first vocabulary id of rank s's embedding and head rows.
int64_t vocab_begin(const LlamaConfig& whole, Shard s);

enum class Split { whole, rows, cols, gate_up_rows, vocab_rows };
Split split_of(const std::string& name);

// Rank s's part of whole parameter `whole` (src: whole.numel values in its shape) into dst (local.numel values,
// the local parameter's shape). Vocabulary rows past the whole vocabulary (padding) are zero.
void slice(const ParamInfo& whole, const ParamInfo& local, Shard s, const float* src, float* dst);
// The inverse: rank s's part src (local shape) into its place in the whole parameter dst (padding dropped).
void place(const ParamInfo& whole, const ParamInfo& local, Shard s, const float* src, float* dst);

// The bytes each rank puts into the group's all-reduces for one micro-batch of `tokens` tokens (activations of
// elem_bytes each): the forward's embedding and two per layer (the o and down outputs), the vocabulary-parallel
// loss's statistics (three FP32 per token), and with `backward` the LM head's and two per layer (the qkv and
// gate_up input gradients); full recompute runs each layer's o again. A ring all-reduce moves 2 (T-1)/T of
// them over each rank's links. (The quantized Linears' amax reductions are a few floats each, not counted.)
int64_t all_reduce_bytes(const LlamaConfig& whole, int64_t tokens, int64_t elem_bytes, bool backward,
                         bool full_recompute);

}  // namespace tp
}  // namespace nb
