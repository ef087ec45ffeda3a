// Shared by the inference tests: a small GQA Llama with Llama 3.1 RoPE scaling whose weights are scaled
// for O(1) activations and peaked attention (the default 0.02 init would leave logits near uniform and
// hide position or cache mistakes), and the full-sequence forward's logits as the oracle. For LoRA: such a
// model as an FP32 HF folder (the frozen base a LoRA LlamaModel reads) and a random adapter.
#pragma once
#include <gtest/gtest.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>
#include "io/hf_llama.h"
#include "io/peft_adapter.h"
#include "model/llama_model.h"

namespace nb::testing {

// hidden 32, 2 layers, 4 heads / 2 KV heads of dim 8, ffn 64, llama3 RoPE with original 64.
inline LlamaConfig infer_config(bool tied = false, int64_t vocab = 128) {
  LlamaConfig c;
  c.name = "infer-small";
  c.hidden = 32;
  c.ffn = 64;
  c.layers = 2;
  c.heads = 4;
  c.kv_heads = 2;
  c.head_dim = 8;
  c.vocab = vocab;
  c.rope_theta = 10000.0;
  c.rope_factor = 8.0;
  c.rope_original_max_pos = 64;
  c.max_seq = 128;
  c.tied_embeddings = tied;
  return c;
}

// Rewrites the model's weights: embeddings N(0, 1), 2-D weights N(0, 1/in), norms 1 + 0.2 N(0, 1), and on
// CUDA every value rounded to BF16 first so both paths start from the same numbers.
inline void scale_weights(LlamaModel& m, uint32_t seed) {
  ParamStore& P = m.params();
  std::vector<float> host(size_t(P.total()), 0.f);
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (const ParamInfo& p : P.params()) {
    const bool embed = p.name.find("embed_tokens") != std::string::npos;
    const float sd = p.shape.size() == 2 ? (embed ? 1.f : 1.f / std::sqrt(float(p.shape[1]))) : 0.2f;
    for (int64_t i = 0; i < p.numel; ++i) host[size_t(p.offset + i)] = (p.shape.size() == 2 ? 0.f : 1.f) + sd * nd(rng);
  }
  ASSERT_TRUE(P.set_master(host.data()));
}

// The weights of a fresh model of c after scale_weights(seed), written as an FP32 HF folder `dir`.
inline void write_scaled_hf(const LlamaConfig& c, uint32_t seed, const std::string& dir) {
  LlamaModel m;
  ASSERT_TRUE(m.init(c, Device::cpu, {1, 8}, Recompute::none, 3));
  scale_weights(m, seed);
  std::vector<float> host(static_cast<size_t>(m.params().total()));
  ASSERT_TRUE(m.params().get_flat(m.params().flat_master(), host.data()));
  HfExportOptions ex;
  ex.dtype = "fp32";
  ASSERT_TRUE(write_hf_folder(dir, c, hf_tensors(m.params()), host.data(), ex));
}

// A random adapter of spec s for c: A ~ N(0, 1/in), B ~ N(0, 0.2^2) (generate_parity.py's), which moves the
// logits by O(1), far beyond any rounding.
inline LoraAdapter random_adapter(const LlamaConfig& c, const LoraSpec& s, uint32_t seed) {
  LoraAdapter ad;
  ad.spec = s;
  lora_allocate(c, s, &ad);
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (LoraLinear& L : ad.linears) {
    for (float& x : L.a) x = nd(rng) / std::sqrt(float(L.in));
    for (float& x : L.b) x = 0.2f * nd(rng);
  }
  return ad;
}

// Logits [S, V] of one sequence (positions 0..S-1) from LlamaModel's full forward.
inline std::vector<float> full_logits(LlamaModel& m, const std::vector<int32_t>& seq) {
  std::vector<int32_t> labels(seq.size(), 0);
  std::vector<float> logits(seq.size() * size_t(m.config().vocab));
  double loss = 0;
  EXPECT_TRUE(m.forward_logits(seq.data(), labels.data(), logits.data(), &loss));
  return logits;
}

// The reference greedy continuation: n tokens, each the argmax of the whole sequence (zero-padded to S)
// re-run through the training-path forward; KV-cache decoding must reproduce it.
inline std::vector<int32_t> greedy_by_rerun(LlamaModel& m, std::vector<int32_t> seq, int64_t n, int64_t S, int64_t V) {
  std::vector<int32_t> out;
  for (int64_t i = 0; i < n; ++i) {
    std::vector<int32_t> padded = seq;
    padded.resize(size_t(S), 0);  // causal: later (pad) tokens do not change earlier logits
    const std::vector<float> ref = full_logits(m, padded);
    const float* row = ref.data() + (int64_t(seq.size()) - 1) * V;
    seq.push_back(int32_t(std::max_element(row, row + V) - row));
    out.push_back(seq.back());
  }
  return out;
}

inline std::vector<int32_t> random_tokens(int64_t n, int64_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = int32_t(rng() % uint32_t(vocab));
  return t;
}

// max |a - b| over n values starting at a and b, and max |b| (the scale).
inline double max_abs_diff(const float* a, const float* b, size_t n, double* scale = nullptr) {
  double d = 0, s = 0;
  for (size_t i = 0; i < n; ++i) {
    d = std::max(d, std::fabs(double(a[i]) - double(b[i])));
    s = std::max(s, std::fabs(double(b[i])));
  }
  if (scale) *scale = s;
  return d;
}

// got and want bit for bit; on a mismatch, where and by how much.
inline void expect_identical(const float* got, const float* want, int64_t n, const std::string& what) {
  if (std::memcmp(got, want, size_t(n) * 4) == 0) return;
  int64_t differ = 0, first = -1;
  for (int64_t i = 0; i < n; ++i)  // bits, not values: -0 and +0 (or two NaNs) differ too
    if (std::memcmp(got + i, want + i, 4) != 0 && differ++ == 0) first = i;
  ADD_FAILURE() << what << ": " << differ << " of " << n << " logits differ, first at " << first << " (" << got[first]
                << " vs " << want[first] << "), max |diff| " << max_abs_diff(got, want, size_t(n));
}

}  // namespace nb::testing
