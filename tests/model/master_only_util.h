// Shared by the CPU and CUDA master-only tests: one optimizer step as the trainer runs it, and a check that
// a model quantizing from the FP32 master (no compute copies for quantized layers) trains exactly like
// one keeping every compute copy.
#pragma once
#include <gtest/gtest.h>
#include <random>
#include <vector>
#include "model/llama_model.h"
#include "ops/adamw.h"
#include "ops/elementwise.h"
#include "recipe/recipe.h"

namespace nb::testing {

// begin_step, one micro-batch, AdamW over the store's pieces (as the trainer does); returns the loss.
inline double train_step(LlamaModel& m, uint32_t step, const std::vector<int32_t>& tok,
                         const std::vector<int32_t>& lab) {
  ParamStore& P = m.params();
  m.begin_step(step);
  ops::fill(P.flat_grad(), 0.f, nullptr);
  double sum = 0;
  EXPECT_TRUE(m.forward_backward(tok.data(), lab.data(), 1.0f / float(tok.size()), &sum).is_ok());
  ops::AdamWParams ap{1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, int64_t(step) + 1, 1.f};
  for (const ParamStore::Piece& pc : P.compute_pieces(0, P.total()))
    ops::adamw_update(P.range(P.flat_master(), pc.begin, pc.end), P.range(P.flat_grad(), pc.begin, pc.end),
                      P.range(P.flat_m(), pc.begin, pc.end), P.range(P.flat_v(), pc.begin, pc.end), pc.compute, ap,
                      nullptr);
  return sum;
}

// Same seed, same batches: the same losses for three steps and bit-identical master weights after them.
inline void expect_master_only_trains_like_full(const std::string& recipe_name, Device dev) {
  LlamaConfig c;
  ASSERT_TRUE(llama_preset("tiny", &c).is_ok());
  recipe::Recipe r;
  ASSERT_TRUE(recipe::recipe_preset(recipe_name, &r).is_ok());
  recipe::RecipeKnobs k;
  k.layers_at_start_bf16 = 0;
  k.layers_at_end_bf16 = recipe_name == "bf16_with_nvfp4_mixed" ? 1 : 0;  // one case with a BF16 layer left
  ASSERT_TRUE(recipe::apply_knobs(k, &r).is_ok());
  MicroBatchShape s{2, 32};
  LlamaModel lean, full;
  full.master_only_quantized_weights = false;
  ASSERT_TRUE(lean.init(c, dev, s, Recompute::none, 5, r).is_ok());
  ASSERT_TRUE(full.init(c, dev, s, Recompute::none, 5, r).is_ok());
  EXPECT_GT(lean.params().master_only_elements(), 0);
  EXPECT_EQ(full.params().master_only_elements(), 0);
  std::mt19937 rng(9);
  for (uint32_t step = 0; step < 3; ++step) {
    std::vector<int32_t> tok(size_t(s.tokens())), lab(tok.size());
    for (auto& t : tok) t = int32_t(rng() % uint32_t(c.vocab));
    for (auto& t : lab) t = int32_t(rng() % uint32_t(c.vocab));
    EXPECT_EQ(train_step(lean, step, tok, lab), train_step(full, step, tok, lab)) << "step " << step;
  }
  const Tensor a = lean.params().flat_master(), b = full.params().flat_master();
  std::vector<float> ha(size_t(a.numel())), hb(ha.size());
  ASSERT_TRUE(copy_bytes(ha.data(), Device::cpu, a.data, dev, ha.size() * 4).is_ok());
  ASSERT_TRUE(copy_bytes(hb.data(), Device::cpu, b.data, dev, hb.size() * 4).is_ok());
  EXPECT_TRUE(ha == hb) << "master weights differ after three steps";
}

}  // namespace nb::testing
