// The sampler: greedy picks the first largest logit, seeded draws repeat exactly, top-k and top-p keep
// only their candidates, frequencies follow the softmax, bad settings are refused; and seeded generation
// of a batch repeats token for token.
#include <gtest/gtest.h>
#include <map>
#include "infer/generator.h"
#include "infer/sampler.h"
#include "infer_test_util.h"

using namespace nb;
using namespace nb::infer;

TEST(Sampler, GreedyIsTheFirstLargestLogit) {
  const std::vector<float> x = {0.5f, 2.f, -1.f, 2.f, 1.f};
  SamplingParams p;
  EXPECT_EQ(sample_token(x.data(), 5, p, 0, 0), 1);
  p.temperature = 1.f;
  p.top_k = 1;
  EXPECT_EQ(sample_token(x.data(), 5, p, 7, 3), 1);
}

TEST(Sampler, SameSeedSameTokensAndTopKTopPKeepTheirCandidates) {
  std::vector<float> x(1000);
  for (size_t i = 0; i < x.size(); ++i) x[i] = float((i * 7919) % 1000) / 100.f;  // distinct, max 9.99 at one id
  SamplingParams p{1.f, 0, 1.f, 42};
  std::vector<int32_t> a, b, c;
  for (uint32_t s = 0; s < 50; ++s) {
    a.push_back(sample_token(x.data(), 1000, p, s, 0));
    b.push_back(sample_token(x.data(), 1000, p, s, 0));
  }
  EXPECT_EQ(a, b);
  p.seed = 43;
  for (uint32_t s = 0; s < 50; ++s) c.push_back(sample_token(x.data(), 1000, p, s, 0));
  EXPECT_NE(a, c);
  // top-k 3: only the three largest logits (9.99, 9.98, 9.97) may come out.
  p.top_k = 3;
  for (uint32_t s = 0; s < 200; ++s) EXPECT_GE(x[size_t(sample_token(x.data(), 1000, p, s, 1))], 9.97f - 1e-4f);
  // top-p tiny: only the most likely token.
  p.top_k = 0;
  p.top_p = 1e-6f;
  const int32_t best = int32_t(std::max_element(x.begin(), x.end()) - x.begin());
  for (uint32_t s = 0; s < 50; ++s) EXPECT_EQ(sample_token(x.data(), 1000, p, s, 2), best);
}

TEST(Sampler, FrequenciesFollowTheSoftmaxAndTopPRenormalizes) {
  // p = softmax(log [0.5, 0.3, 0.2]); top-p 0.75 keeps {0, 1} with 0.625 / 0.375.
  const std::vector<float> x = {std::log(0.5f), std::log(0.3f), std::log(0.2f)};
  SamplingParams p{1.f, 0, 1.f, 1};
  std::map<int32_t, int> n, m;
  const int draws = 20000;
  for (int s = 0; s < draws; ++s) ++n[sample_token(x.data(), 3, p, uint32_t(s), 0)];
  EXPECT_NEAR(n[0] / double(draws), 0.5, 0.015);
  EXPECT_NEAR(n[2] / double(draws), 0.2, 0.015);
  p.top_p = 0.75f;
  for (int s = 0; s < draws; ++s) ++m[sample_token(x.data(), 3, p, uint32_t(s), 0)];
  EXPECT_EQ(m[2], 0);
  EXPECT_NEAR(m[0] / double(draws), 0.625, 0.015);
}

TEST(Sampler, BadSettingsAreOneSentence) {
  EXPECT_NE(validate(SamplingParams{-1.f, 0, 1.f, 0}).message().find("--temperature"), std::string::npos);
  EXPECT_NE(validate(SamplingParams{1.f, -2, 1.f, 0}).message().find("--top-k"), std::string::npos);
  EXPECT_NE(validate(SamplingParams{1.f, 0, 0.f, 0}).message().find("--top-p"), std::string::npos);
  EXPECT_TRUE(validate(SamplingParams{0.7f, 40, 0.9f, 5}));
}

TEST(Sampler, SeededGenerationRepeatsAndSeedsDiffer) {
  LlamaConfig cfg = nb::testing::infer_config();
  LlamaModel model;
  ASSERT_TRUE(model.init(cfg, Device::cpu, {1, 8}, Recompute::none, 5));
  nb::testing::scale_weights(model, 3);
  ModelWeights w;
  ASSERT_TRUE(weights_from_store(model.params(), cfg, &w));
  Generator gen;
  ASSERT_TRUE(gen.init(cfg, w, Device::cpu, 2, 40));
  GenerateOptions o;
  o.max_new_tokens = 24;
  o.sampling = {1.f, 50, 0.95f, 1234};
  const std::vector<std::vector<int32_t>> prompts = {{1, 2, 3}, {4, 5, 6, 7, 8}};
  GenerateResult a, b, c;
  ASSERT_TRUE(gen.generate(prompts, o, &a));
  ASSERT_TRUE(gen.generate(prompts, o, &b));
  EXPECT_EQ(a.tokens, b.tokens);
  o.sampling.seed = 1235;
  ASSERT_TRUE(gen.generate(prompts, o, &c));
  EXPECT_NE(a.tokens, c.tokens);
}
