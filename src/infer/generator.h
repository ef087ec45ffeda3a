// Autoregressive generation with a KV cache over a Llama's weights (infer/weights.h), on the CPU backend
// (FP32) or CUDA (BF16 weights, activations and cache; FP32 accumulation, norm statistics, softmax and
// logits): the same numerics as the training forward (model/llama_pass.cpp), one token per sequence per
// decode step. LoRA adapters in the weights (ModelWeights' lora) are applied unmerged after each base GEMM,
// with the training path's lora_forward: on the CPU, decode logits equal LlamaModel::forward_logits of the
// same base and adapters bit for bit.
//
// Batches: B prompts of different lengths are right-padded to the longest (pad id 0) with per-row lengths.
// Prefill runs all B x S_max positions in one pass with the causal attention of the training forward
// (cuDNN on CUDA), so a real token never sees a pad; every position's key and value go into the cache, and
// the pads' entries are overwritten by the row's own decode steps before any query can reach them. Row b's
// first new token comes from the logits at position len[b] - 1; decode step i then feeds each row's latest
// token at position len[b] + i, attending over cache positions 0..len[b] + i.
//
// Tensor parallelism (samples while training under --tensor-model-parallel-size T): every rank of the group
// runs one Generator over its own shard (cfg: the rank's tp::local_config, its heads, KV heads, FFN and
// vocabulary rows), in step with the others: the embedding is vocabulary-parallel (ids of other ranks' rows
// give zero rows, then the group's sum), the o and down outputs are summed over the group before the residual
// add (the training forward's order, model/llama_pass_tp.cpp), and the LM head's logits are all-gathered into
// the whole vocabulary's [B, V] (V = whole_vocab) on every rank, so every rank picks the same tokens and stops
// with the others. Decode steps then run eagerly (no CUDA graphs around the collectives).
//
// Cache: per layer K and V [B, L, Hkv, hd], L = the longest prompt plus the new tokens, capped at the
// model's context (max_seq): 2 * layers * B * L * kv_dim elements. Positions live on the device and
// advance there, so a decode step uploads nothing under greedy decoding (the argmax runs on the device too).
#pragma once
#include <cstdint>
#include <string>
#include <vector>
#include "core/tensor.h"
#include "infer/sampler.h"
#include "infer/weights.h"
#include "model/llama_config.h"
#include "ops/vocab_parallel_ce.h"

namespace nb::infer {

struct GenerateOptions {
  int64_t max_new_tokens = 64;
  SamplingParams sampling;
  std::vector<int32_t> stop_ids;  // a row ends at the first of these it generates (kept in its tokens)
  bool prefill_logits = false;    // keep the logits of every prompt position (parity checks)
};

struct GenerateResult {
  std::vector<std::vector<int32_t>> tokens;  // per prompt: the new tokens
  std::vector<std::string> finish;           // per prompt: "stop" (an end token), "length" or "context"
  int64_t prompt_tokens = 0, decode_steps = 0;
  double prefill_s = 0, decode_s = 0;  // wall time: prefill up to the first tokens on the host; the rest
  std::vector<float> prefill_logits;   // [B, S_max, V] FP32 when asked for (pads' rows included)
};

struct TensorParallelGroup {
  ops::tp::ReduceGroup* group = nullptr;  // nullptr: one rank holds the whole model
  int64_t vocab_begin = 0;                // the first vocabulary id of this rank's rows
  int64_t whole_vocab = 0;                // the logits' width: the whole model's vocabulary
};

class Generator {
 public:
  Generator();
  ~Generator();
  // A context of `max_len` positions for up to `max_batch` sequences (<= cfg.max_seq).
  Status init(const LlamaConfig& cfg, const ModelWeights& w, Device dev, int64_t max_batch, int64_t max_len,
              const TensorParallelGroup& tp = {});
  // The bytes init and a generate() of prompts of up to `prompt_tokens` positions in all allocate (each buffer a
  // 256-byte multiple, as the allocator holds it), without allocating: the memory estimate's figure for the
  // training samples. cast_weights: some linear weights have no compute copy (cast on use through a stage).
  // Under tensor parallelism pass the whole model's config and tp_size: a rank's buffers.
  static int64_t planned_bytes(const LlamaConfig& cfg, Device dev, int64_t max_batch, int64_t max_len,
                               int64_t prompt_tokens, bool cast_weights, int64_t lora_rank = 0, int tp_size = 1);
  Status generate(const std::vector<std::vector<int32_t>>& prompts, const GenerateOptions& o, GenerateResult* r);

  // The two passes generate() is made of (tests drive them directly).
  // Prefill: fills the cache with the prompts' positions; last_logits [B, V] gets each row's logits at its
  // last prompt position, all_logits (optional) [B, S_max, V] every position's.
  Status prefill(const std::vector<std::vector<int32_t>>& prompts, std::vector<float>* last_logits,
                 std::vector<float>* all_logits = nullptr);
  // One decode step: feeds ids (host, one per row; nullptr = the device argmax of the previous step) at
  // each row's next position and writes the logits [B, V] to the host (nullptr = greedy only: next_ids
  // gets the argmax, and the logits stay on the device).
  Status step(const int32_t* ids, std::vector<float>* logits, std::vector<int32_t>* next_ids = nullptr);
  int64_t batch() const { return B_; }
  int64_t max_len() const { return L_; }
  int64_t max_batch() const;
  const LlamaConfig& config() const;
  int64_t vocab() const;  // the logits' width: config().vocab, or the whole vocabulary under tensor parallelism

 private:
  Status first_argmax(std::vector<int32_t>* next);   // the prefill logits' argmax, into the next step's ids
  Status copy_ids(const std::vector<int32_t>& ids);  // the next step's ids, from the host
  void freeze_row(int64_t b);                        // row b stopped: its position stays where it is
  struct Impl;
  Impl* impl_ = nullptr;
  int64_t B_ = 0, L_ = 0;
};

// The shortest checks of a batch against a context: every prompt non-empty and shorter than the context.
Status check_prompts(const std::vector<std::vector<int32_t>>& prompts, const LlamaConfig& cfg, int64_t context);

}  // namespace nb::infer
