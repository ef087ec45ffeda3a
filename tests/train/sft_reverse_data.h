// Shared by the SFT training tests (CPU and GPU): a Megatron SFT dataset of "reverse the prompt" samples.
// Each of 400 samples is a prompt of min_prompt .. min_prompt + prompt_spread - 1 tokens from [10, 60), the
// separator 5, then the answer: the prompt's tokens + 100 in reverse order, and the end token 6. Only the
// answer and the end token are masked in. Returns the dataset prefix (dir/reverse).
#pragma once
#include <gtest/gtest.h>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>
#include "data/indexed_dataset.h"
#include "train/train_config.h"

namespace nb::test {

inline std::string write_reverse_sft_data(const std::string& dir, uint32_t seed, int min_prompt, int prompt_spread) {
  const std::string prefix = dir + "/reverse";
  std::unique_ptr<IndexedDatasetWriter> t, m;
  EXPECT_TRUE(IndexedDatasetWriter::create(prefix + "_tokens_document", IndexedDtype::u16, &t).is_ok());
  EXPECT_TRUE(IndexedDatasetWriter::create(prefix + "_mask_document", IndexedDtype::u8, &m).is_ok());
  std::mt19937 rng(seed);
  for (int s = 0; s < 400; ++s) {
    std::vector<int32_t> prompt(size_t(min_prompt) + rng() % uint32_t(prompt_spread)), tok, mask;
    for (auto& x : prompt) x = int32_t(10 + rng() % 50);
    tok = prompt;
    tok.push_back(5);
    mask.assign(tok.size(), 0);
    for (auto it = prompt.rbegin(); it != prompt.rend(); ++it) tok.push_back(*it + 100), mask.push_back(1);
    tok.push_back(6);
    mask.push_back(1);
    EXPECT_TRUE(t->add_document(tok.data(), int64_t(tok.size())).is_ok());
    EXPECT_TRUE(m->add_document(mask.data(), int64_t(mask.size())).is_ok());
  }
  EXPECT_TRUE(t->finalize().is_ok());
  EXPECT_TRUE(m->finalize().is_ok());
  return prefix;
}

// A training job on that dataset: packed SFT rows of 64 tokens, two per micro-batch, global batch 4, the samples
// split 90/10 into training and validation.
inline void use_reverse_sft(TrainConfig* c, const std::string& prefix) {
  c->sft = true;
  c->mock_data = false;
  c->data_path = prefix;
  c->split = "90,10,0";
  c->seq_length = 64;
  c->micro_batch_size = 2;
  c->global_batch_size = 4;
}

}  // namespace nb::test
