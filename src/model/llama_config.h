// Llama-family model configuration, named presets, validation, and the counts derived from it:
// parameter count and the model FLOPs per token of the benchmark protocol (Megatron's formula,
// causal attention). Hyperparameters of the presets follow the published Llama 3 / 3.1 / 3.2 configs.
#pragma once
#include <cstdint>
#include <string>
#include <vector>
#include "core/status.h"
#include "ops/rope.h"

namespace nb {

struct LlamaConfig {
  std::string name = "custom";
  int64_t hidden = 0, ffn = 0, layers = 0, heads = 0, kv_heads = 0, head_dim = 0, vocab = 0;
  double rope_theta = 500000.0;
  // Llama 3.1 RoPE frequency scaling (factor 1 disables it).
  double rope_factor = 8.0, rope_low_freq_factor = 1.0, rope_high_freq_factor = 4.0;
  int64_t rope_original_max_pos = 8192;
  float norm_eps = 1e-5f;
  bool tied_embeddings = false;
  int64_t max_seq = 8192;

  int64_t q_dim() const { return heads * head_dim; }
  int64_t kv_dim() const { return kv_heads * head_dim; }
  // Parameters in the GEMMs (LM head counted, embedding not), as the FLOP formula wants them.
  int64_t linear_params_per_layer() const;  // q, k, v, o, gate, up, down weights of one layer
  int64_t matmul_params() const;
  int64_t total_params() const;
  // 6 * matmul_params + 6 * L * d_q * s: forward and backward, causal attention.
  double flops_per_token(int64_t seq_len) const;
};

// The names `preset_names()` lists: llama3.1-8b, llama3.1-70b, llama3.2-1b, llama3.2-3b, llama-125m,
// tiny, llama3-8b-proxy, llama3-8b-proxy-deep.
Status llama_preset(const std::string& name, LlamaConfig* out);
std::vector<std::string> preset_names();
// Structural checks with one clear sentence each (heads dividing hidden, KV heads dividing heads, ...).
Status validate(const LlamaConfig& c);

// The model's RoPE settings as the table builder takes them (training's forward and generation share them).
ops::RopeConfig rope_config(const LlamaConfig& c);

}  // namespace nb
