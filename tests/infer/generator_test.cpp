// The KV-cache path against the full-sequence forward on the CPU backend (FP32): prefill logits at every
// position, teacher-forced decode steps, batches of different prompt lengths (right-padded), greedy
// generation against re-running the whole sequence, tied and untied heads; and the prompt checks.
// Exact: every op of a step is the training forward's op on the same rows (the CPU GEMM sums k in order per
// row; the cache attention does the reference attention's FP64 operations), so logits agree bit for bit.
#include <gtest/gtest.h>
#include "infer/generator.h"
#include "infer_test_util.h"

using namespace nb;
using namespace nb::testing;

namespace {

struct Fixture {
  LlamaConfig cfg;
  LlamaModel model;  // the oracle, whose store the generator reads
  infer::ModelWeights w;
  Fixture(bool tied, int64_t seq) : cfg(infer_config(tied)) {
    EXPECT_TRUE(model.init(cfg, Device::cpu, {1, seq}, Recompute::none, 5));
    scale_weights(model, 17);
    EXPECT_TRUE(infer::weights_from_store(model.params(), cfg, &w));
  }
};

}  // namespace

class KvCache : public ::testing::TestWithParam<bool> {};

TEST_P(KvCache, DecodeEqualsFullForwardAtEveryPosition) {
  const int64_t S = 24;
  Fixture f(GetParam(), S);
  const std::vector<int32_t> seq = random_tokens(S, f.cfg.vocab, 3);
  const std::vector<float> ref = full_logits(f.model, seq);
  const int64_t V = f.cfg.vocab;
  infer::Generator gen;
  ASSERT_TRUE(gen.init(f.cfg, f.w, Device::cpu, 1, S));
  std::vector<float> last, all;
  ASSERT_TRUE(gen.prefill({{seq[0]}}, &last));
  expect_identical(last.data(), ref.data(), V, "prefill position 0");
  for (int64_t s = 1; s < S; ++s) {
    ASSERT_TRUE(gen.step(&seq[size_t(s)], &last));
    expect_identical(last.data(), ref.data() + s * V, V, "decode position " + std::to_string(s));
  }
  ASSERT_TRUE(gen.prefill({seq}, &last, &all));  // a whole-sequence prefill: every position
  expect_identical(all.data(), ref.data(), S * V, "prefill of all positions");
  expect_identical(last.data(), ref.data() + (S - 1) * V, V, "prefill's last position");
}

INSTANTIATE_TEST_SUITE_P(Heads, KvCache, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? std::string("tied") : std::string("untied"); });

// Three rows of different lengths (right-padded to the longest) continue with teacher-forced tokens: each
// row's logits equal the full forward of that row alone.
TEST(KvCacheBatch, RowsOfDifferentLengthsMatchTheirOwnForward) {
  const int64_t S = 20, V = 128;
  Fixture f(false, S);
  const std::vector<int64_t> lens = {7, 3, 11};
  std::vector<std::vector<int32_t>> seqs, prompts, refs;
  std::vector<std::vector<float>> ref;
  for (size_t b = 0; b < lens.size(); ++b) {
    seqs.push_back(random_tokens(S, V, uint32_t(40 + b)));
    prompts.emplace_back(seqs[b].begin(), seqs[b].begin() + lens[b]);
    ref.push_back(full_logits(f.model, seqs[b]));
  }
  infer::Generator gen;
  ASSERT_TRUE(gen.init(f.cfg, f.w, Device::cpu, 3, S));
  std::vector<float> last;
  ASSERT_TRUE(gen.prefill(prompts, &last));
  for (size_t b = 0; b < lens.size(); ++b)
    expect_identical(last.data() + b * V, ref[b].data() + (lens[b] - 1) * V, V, "prefill row " + std::to_string(b));
  for (int64_t i = 0; i < S - 11; ++i) {
    std::vector<int32_t> ids;
    for (size_t b = 0; b < lens.size(); ++b) ids.push_back(seqs[b][size_t(lens[b] + i)]);
    ASSERT_TRUE(gen.step(ids.data(), &last));
    for (size_t b = 0; b < lens.size(); ++b)
      expect_identical(last.data() + b * V, ref[b].data() + (lens[b] + i) * V, V,
                       "row " + std::to_string(b) + " step " + std::to_string(i));
  }
}

// Greedy generation equals argmax over the full forward of the growing sequence, for both rows of a batch.
TEST(Generate, GreedyEqualsRerunningTheWholeSequence) {
  const int64_t S = 32, V = 128, new_tokens = 12;
  Fixture f(false, S);
  const std::vector<std::vector<int32_t>> prompts = {random_tokens(9, V, 7), random_tokens(4, V, 8)};
  infer::Generator gen;
  ASSERT_TRUE(gen.init(f.cfg, f.w, Device::cpu, 2, S));
  infer::GenerateOptions o;
  o.max_new_tokens = new_tokens;
  infer::GenerateResult r;
  ASSERT_TRUE(gen.generate(prompts, o, &r));
  for (size_t b = 0; b < prompts.size(); ++b) {
    ASSERT_EQ(int64_t(r.tokens[b].size()), new_tokens);
    EXPECT_EQ(r.finish[b], "length");
    EXPECT_EQ(r.tokens[b], greedy_by_rerun(f.model, prompts[b], new_tokens, S, V)) << "row " << b;
  }
}

TEST(Generate, StopsAtAnEndTokenAndKeepsIt) {
  Fixture f(false, 32);
  infer::Generator gen;
  ASSERT_TRUE(gen.init(f.cfg, f.w, Device::cpu, 1, 32));
  infer::GenerateOptions o;
  o.max_new_tokens = 10;
  infer::GenerateResult r;
  const std::vector<std::vector<int32_t>> prompt = {random_tokens(5, f.cfg.vocab, 9)};
  ASSERT_TRUE(gen.generate(prompt, o, &r));
  o.stop_ids = {r.tokens[0][3]};
  infer::GenerateResult stopped;
  ASSERT_TRUE(gen.generate(prompt, o, &stopped));
  const auto first = std::find(r.tokens[0].begin(), r.tokens[0].end(), r.tokens[0][3]) - r.tokens[0].begin();
  ASSERT_EQ(stopped.tokens[0].size(), size_t(first + 1));
  EXPECT_EQ(stopped.finish[0], "stop");
  EXPECT_TRUE(std::equal(stopped.tokens[0].begin(), stopped.tokens[0].end(), r.tokens[0].begin()));
}

TEST(Generate, ContextEndsARowAndPromptsAreChecked) {
  Fixture f(false, 16);
  infer::Generator gen;
  ASSERT_TRUE(gen.init(f.cfg, f.w, Device::cpu, 1, 16));
  infer::GenerateOptions o;
  o.max_new_tokens = 100;
  infer::GenerateResult r;
  ASSERT_TRUE(gen.generate({random_tokens(10, f.cfg.vocab, 1)}, o, &r));
  EXPECT_EQ(r.tokens[0].size(), 6u);  // prompt + new tokens fill the 16 positions
  EXPECT_EQ(r.finish[0], "context");
  const Status too_long = gen.generate({random_tokens(16, f.cfg.vocab, 1)}, o, &r);
  ASSERT_FALSE(too_long);
  EXPECT_NE(too_long.message().find("context of 16 tokens"), std::string::npos) << too_long.message();
  const Status empty = infer::check_prompts({{}}, f.cfg, 16);
  EXPECT_NE(empty.message().find("no tokens"), std::string::npos) << empty.message();
  const Status bad_id = infer::check_prompts({{1, 128}}, f.cfg, 16);
  EXPECT_NE(bad_id.message().find("outside the model's vocabulary"), std::string::npos) << bad_id.message();
}
