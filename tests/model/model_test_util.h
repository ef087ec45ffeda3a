// Shared by the CPU model tests: the tiny preset and one fixed random batch (tokens and next-token labels).
#pragma once
#include <gtest/gtest.h>
#include <random>
#include <vector>
#include "model/llama_config.h"
#include "model/llama_model.h"

namespace nb::testing {

inline LlamaConfig tiny_config() {
  LlamaConfig c;
  EXPECT_TRUE(llama_preset("tiny", &c).is_ok());
  return c;
}

// s.tokens() random tokens below the vocabulary and the same sequence shifted by one as labels.
inline void fixed_batch(const LlamaConfig& c, MicroBatchShape s, uint32_t seed, std::vector<int32_t>* tok,
                        std::vector<int32_t>* lab) {
  std::mt19937 rng(seed);
  std::vector<int32_t> seq(size_t(s.tokens() + 1));
  for (auto& t : seq) t = int32_t(rng() % uint32_t(c.vocab));
  tok->assign(seq.begin(), seq.end() - 1);
  lab->assign(seq.begin() + 1, seq.end());
}

}  // namespace nb::testing
