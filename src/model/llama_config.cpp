// Presets and derived counts for LlamaConfig.
#include "model/llama_config.h"

namespace nb {

int64_t LlamaConfig::linear_params_per_layer() const {
  return hidden * (q_dim() + 2 * kv_dim()) + q_dim() * hidden + 3 * hidden * ffn;
}

int64_t LlamaConfig::matmul_params() const { return layers * linear_params_per_layer() + hidden * vocab; }

int64_t LlamaConfig::total_params() const {
  int64_t norms = layers * 2 * hidden + hidden;
  int64_t embed = vocab * hidden;
  return matmul_params() + norms + (tied_embeddings ? 0 : embed);
}

double LlamaConfig::flops_per_token(int64_t seq_len) const {
  return 6.0 * double(matmul_params()) + 6.0 * double(layers) * double(q_dim()) * double(seq_len);
}

namespace {
LlamaConfig base_8b(const std::string& name, int64_t layers) {
  LlamaConfig c;
  c.name = name;
  c.hidden = 4096;
  c.ffn = 14336;
  c.layers = layers;
  c.heads = 32;
  c.kv_heads = 8;
  c.head_dim = 128;
  c.vocab = 128256;
  c.rope_theta = 500000.0;
  c.norm_eps = 1e-5f;
  c.max_seq = 131072;
  return c;
}
}  // namespace

std::vector<std::string> preset_names() {
  return {"llama3.1-8b", "llama3.1-70b", "llama3.2-1b",     "llama3.2-3b",
          "llama-125m",  "tiny",         "llama3-8b-proxy", "llama3-8b-proxy-deep"};
}

Status llama_preset(const std::string& name, LlamaConfig* out) {
  LlamaConfig c;
  if (name == "llama3.1-8b") {
    c = base_8b(name, 32);
  } else if (name == "llama3-8b-proxy") {
    c = base_8b(name, 4);  // the benchmark protocol's 4-layer proxy of Llama 3.1 8B
  } else if (name == "llama3-8b-proxy-deep") {
    c = base_8b(name, 8);
  } else if (name == "llama3.1-70b") {
    c = base_8b(name, 80);
    c.hidden = 8192;
    c.ffn = 28672;
    c.heads = 64;
  } else if (name == "llama3.2-1b" || name == "llama3.2-3b") {
    // Llama 3.2 small models: tied embeddings, RoPE scaling factor 32.
    c = base_8b(name, name == "llama3.2-1b" ? 16 : 28);
    c.hidden = name == "llama3.2-1b" ? 2048 : 3072;
    c.ffn = 8192;
    c.heads = name == "llama3.2-1b" ? 32 : 24;
    c.head_dim = name == "llama3.2-1b" ? 64 : 128;
    c.tied_embeddings = true;
    c.rope_factor = 32.0;
  } else if (name == "llama-125m") {
    // A small Llama for convergence studies: GPT-2-sized vocabulary padded to a multiple of 128.
    c.name = name;
    c.hidden = 768;
    c.ffn = 2048;
    c.layers = 12;
    c.heads = 12;
    c.kv_heads = 4;
    c.head_dim = 64;
    c.vocab = 50304;
    c.rope_theta = 10000.0;
    c.rope_factor = 1.0;
    c.tied_embeddings = true;
    c.max_seq = 2048;
  } else if (name == "tiny") {
    // For tests: every GEMM dimension a multiple of 128 so that every recipe's block shapes apply
    // (FP8 sub-channel needs 128x128 weight tiles).
    c.name = name;
    c.hidden = 256;
    c.ffn = 512;
    c.layers = 2;
    c.heads = 8;
    c.kv_heads = 4;
    c.head_dim = 32;
    c.vocab = 256;
    c.rope_theta = 10000.0;
    c.rope_factor = 1.0;
    c.max_seq = 512;  // MoR's block rule at C2 needs 128-token chunks: sequences of 512
  } else {
    std::string list;
    for (const auto& n : preset_names()) list += (list.empty() ? "" : ", ") + n;
    return errorf("unknown model preset '%s'; choose one of: %s", name.c_str(), list.c_str());
  }
  *out = c;
  return Status::ok();
}

Status validate(const LlamaConfig& c) {
  if (c.hidden <= 0 || c.ffn <= 0 || c.layers <= 0 || c.heads <= 0 || c.kv_heads <= 0 || c.head_dim <= 0 ||
      c.vocab <= 0)
    return errorf("model '%s': hidden, ffn, layers, heads, kv-heads, head-dim and vocab must all be positive",
                  c.name.c_str());
  if (c.hidden % c.heads != 0)
    return errorf("model '%s': heads (%lld) must divide hidden (%lld)", c.name.c_str(), (long long)c.heads,
                  (long long)c.hidden);
  if (c.heads % c.kv_heads != 0)
    return errorf("model '%s': kv-heads (%lld) must divide heads (%lld) for grouped-query attention", c.name.c_str(),
                  (long long)c.kv_heads, (long long)c.heads);
  if (c.head_dim % 2 != 0)
    return errorf("model '%s': head-dim (%lld) must be even for RoPE", c.name.c_str(), (long long)c.head_dim);
  if (c.norm_eps <= 0) return errorf("model '%s': norm-eps must be positive", c.name.c_str());
  return Status::ok();
}

ops::RopeConfig rope_config(const LlamaConfig& c) {
  ops::RopeConfig r;
  r.theta = c.rope_theta;
  r.llama31_scaling = c.rope_factor != 1.0;
  r.factor = c.rope_factor;
  r.low_freq_factor = c.rope_low_freq_factor;
  r.high_freq_factor = c.rope_high_freq_factor;
  r.original_max_pos = c.rope_original_max_pos;
  return r;
}

}  // namespace nb
