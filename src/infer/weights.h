// The weights inference reads, as views: per layer the two norms and the four linears (q, k and v fused
// into one [qd + 2 kvd, H] view, gate and up into [2F, H], as the training pass sees them), the embedding,
// the final norm and the LM head (the embedding again when tied).
// Two sources: a compute-only ParamStore filled from Hugging Face tensors (nibble generate: BF16 on CUDA,
// FP32 on the CPU backend, 2 or 4 bytes per parameter and nothing else), or a training model's store, whose
// quantized layers may keep only FP32 masters of their linear weights (compute view empty, master set):
// the decode step then casts such a weight to the compute dtype when it needs it (samples while training).
#pragma once
#include <vector>
#include "core/tensor.h"
#include "io/hf_llama.h"
#include "model/llama_config.h"
#include "model/params.h"

namespace nb::infer {

struct LayerWeights {
  Tensor w_in, w_post;          // RMSNorm weights [H]
  Tensor wqkv, wo, wgu, wdown;  // compute copies; data == nullptr when only the master exists
  Tensor mqkv, mo, mgu, mdown;  // FP32 masters of those (training stores only)
};

struct ModelWeights {
  Tensor embed, norm, lm_head;  // [V, H], [H], [V, H]
  std::vector<LayerWeights> layers;
};

// Views of `P` (a frozen store or a training model's; with LoRA pass its base, which has no adapters).
Status weights_from_store(const ParamStore& P, const LlamaConfig& c, ModelWeights* out);

// A compute-only store on `dev` filled from `source` (HF names; e.g. an HfCheckpointReader, or with
// lora_merged_source an adapter merged in), one tensor at a time through an FP32 staging buffer.
Status load_inference_store(const HfTensorSource& source, const LlamaConfig& c, Device dev, ParamStore* out);

}  // namespace nb::infer
