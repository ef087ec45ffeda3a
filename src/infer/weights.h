// The weights inference reads, as views: per layer the two norms and the four linears (q, k and v fused
// into one [qd + 2 kvd, H] view, gate and up into [2F, H], as the training pass sees them), the embedding,
// the final norm and the LM head (the embedding again when tied).
// Two sources: a compute-only ParamStore filled from Hugging Face tensors (nibble generate: BF16 on CUDA,
// FP32 on the CPU backend, 2 or 4 bytes per parameter and nothing else), or a training model's store, whose
// quantized layers may keep only FP32 masters of their linear weights (compute view empty, master set):
// the decode step then casts such a weight to the compute dtype when it needs it (samples while training).
//
// LoRA adapters stay apart from the base (unmerged): each adapted linear keeps its A [r, in] and B [out, r]
// in the compute dtype, and the forward adds scale * (x A^T) B^T after the base GEMM with the training
// path's own lora_forward (model/lora.h), as PEFT computes an adapter at inference. Two sources again: a
// PEFT folder read into a LoraAdapter (nibble generate --adapter), or a LoRA training model's adapter store.
#pragma once
#include <vector>
#include "core/tensor.h"
#include "io/hf_llama.h"
#include "io/peft_adapter.h"
#include "model/llama_config.h"
#include "model/lora.h"
#include "model/params.h"

namespace nb::infer {

struct LayerWeights {
  Tensor w_in, w_post;          // RMSNorm weights [H]
  Tensor wqkv, wo, wgu, wdown;  // compute copies; data == nullptr when only the master exists
  Tensor mqkv, mo, mgu, mdown;  // FP32 masters of those (training stores only)
  // The adapters of qkv, o, gate_up and down, in that order (compute copies of A and B, the scale; dropout
  // 0); a.data == nullptr where the linear has none.
  LoraModule lora[4];
};

struct ModelWeights {
  Tensor embed, norm, lm_head;  // [V, H], [H], [V, H]
  std::vector<LayerWeights> layers;
  int64_t lora_rank = 0;  // the largest adapter rank (the decode scratch's width); 0 without adapters
};

// Views of `P` (a frozen store or a training model's; with LoRA pass its base, which has no adapters).
Status weights_from_store(const ParamStore& P, const LlamaConfig& c, ModelWeights* out);

// A compute-only store on `dev` filled from `source` (HF names; e.g. an HfCheckpointReader, or with
// lora_merged_source an adapter merged in), one tensor at a time through an FP32 staging buffer.
Status load_inference_store(const HfTensorSource& source, const LlamaConfig& c, Device dev, ParamStore* out);

// The adapters of a LoRA training model (its params() store with spec s: compute copies of A and B), as
// views added to out's layers.
Status lora_weights_from_store(const ParamStore& adapters, const LlamaConfig& c, const LoraSpec& s, ModelWeights* out);

// A PEFT adapter's A and B on `dev` in the compute dtype (FP32 on the CPU; on CUDA BF16 rounded to nearest
// even from FP32, as a training store's compute copies are), held in `storage` and added to out's layers.
// storage must outlive every use of out.
Status load_inference_adapter(const LoraAdapter& ad, const LlamaConfig& c, Device dev, Buffer* storage,
                              ModelWeights* out);

}  // namespace nb::infer
