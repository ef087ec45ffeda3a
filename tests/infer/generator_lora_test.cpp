// The KV-cache path with unmerged LoRA adapters against the training path on the CPU backend (FP32): a
// LoRA LlamaModel (frozen base read from an HF folder, the adapter in its store) is the oracle. Decode and
// prefill logits at every position, and greedy generation against argmax over re-running the whole sequence.
// Exact, not within a tolerance: every op of a decode step is the training forward's op on the same rows
// (row-independent FP32 GEMMs summing k in order, the same RMSNorm, RoPE and SwiGLU, lora_forward itself,
// and a cache attention with the reference attention's FP64 operations), so the logits agree bit for bit.
// Both adapter sources are checked: a PEFT adapter uploaded as `nibble generate --adapter` does, and views
// of the training store.
#include <gtest/gtest.h>
#include <unistd.h>
#include <filesystem>
#include "infer/generator.h"
#include "infer_test_util.h"

using namespace nb;
using namespace nb::testing;
namespace fs = std::filesystem;

namespace {

LoraSpec test_spec() {
  LoraSpec s;
  s.rank = 4;
  s.alpha = 8;  // scale 2, as generate_parity.py's r 8, alpha 16
  return s;
}

class LoraFixture {
 public:
  LlamaConfig cfg;
  LlamaModel model;  // the oracle: LoRA over the frozen base
  LoraAdapter adapter;
  infer::ModelWeights peft, views;  // the adapter uploaded from `adapter`, and views of the model's store
  Buffer upload;

  void build(bool tied, int64_t seq) {
    cfg = infer_config(tied);
    dir_ = fs::temp_directory_path() / ("nibble_lora_infer_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    ASSERT_NO_FATAL_FAILURE(write_scaled_hf(cfg, 17, (dir_ / "hf").string()));
    ASSERT_TRUE(reader_.open((dir_ / "hf").string()));
    adapter = random_adapter(cfg, test_spec(), 23);
    model.set_lora(adapter.spec, &reader_);
    ASSERT_TRUE(model.init(cfg, Device::cpu, {1, seq}, Recompute::none, 5));
    ASSERT_TRUE(lora_store_from_adapter(adapter, cfg, model.params()));
    ASSERT_TRUE(infer::weights_from_store(model.base(), cfg, &peft));
    ASSERT_TRUE(infer::load_inference_adapter(adapter, cfg, Device::cpu, &upload, &peft));
    ASSERT_TRUE(infer::weights_from_store(model.base(), cfg, &views));
    ASSERT_TRUE(infer::lora_weights_from_store(model.params(), cfg, adapter.spec, &views));
  }
  ~LoraFixture() { fs::remove_all(dir_); }
  std::string hf_dir() const { return (dir_ / "hf").string(); }

 private:
  fs::path dir_;
  HfCheckpointReader reader_;
};

}  // namespace

class LoraKvCache : public ::testing::TestWithParam<bool> {};

TEST_P(LoraKvCache, DecodeEqualsTheTrainingForwardAtEveryPosition) {
  const int64_t S = 24;
  LoraFixture f;
  ASSERT_NO_FATAL_FAILURE(f.build(GetParam(), S));
  const int64_t V = f.cfg.vocab;
  const std::vector<int32_t> seq = random_tokens(S, V, 3);
  const std::vector<float> ref = full_logits(f.model, seq);
  // The adapter matters: without it the logits move by far more than any rounding.
  infer::ModelWeights base;
  ASSERT_TRUE(infer::weights_from_store(f.model.base(), f.cfg, &base));
  infer::Generator plain;
  ASSERT_TRUE(plain.init(f.cfg, base, Device::cpu, 1, S));
  std::vector<float> last, all;
  ASSERT_TRUE(plain.prefill({seq}, &last, &all));
  double scale = 0;
  EXPECT_GT(max_abs_diff(all.data(), ref.data(), all.size(), &scale), 0.1 * scale);
  for (const infer::ModelWeights* w : {&f.peft, &f.views}) {
    const std::string src = w == &f.peft ? "PEFT upload: " : "store views: ";
    infer::Generator gen;
    ASSERT_TRUE(gen.init(f.cfg, *w, Device::cpu, 1, S));
    ASSERT_TRUE(gen.prefill({{seq[0]}}, &last));
    expect_identical(last.data(), ref.data(), V, src + "prefill position 0");
    for (int64_t s = 1; s < S; ++s) {
      ASSERT_TRUE(gen.step(&seq[size_t(s)], &last));
      expect_identical(last.data(), ref.data() + s * V, V, src + "decode position " + std::to_string(s));
    }
    ASSERT_TRUE(gen.prefill({seq}, &last, &all));
    expect_identical(all.data(), ref.data(), S * V, src + "prefill of all positions");
  }
}

INSTANTIATE_TEST_SUITE_P(Heads, LoraKvCache, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? std::string("tied") : std::string("untied"); });

// Greedy generation of a right-padded batch of two prompts equals argmax over the training forward of each
// growing sequence alone, and differs from the base model's greedy tokens (the adapter is applied).
TEST(LoraGenerate, GreedyEqualsRerunningTheWholeSequence) {
  const int64_t S = 32, new_tokens = 12;
  LoraFixture f;
  ASSERT_NO_FATAL_FAILURE(f.build(false, S));
  const int64_t V = f.cfg.vocab;
  const std::vector<std::vector<int32_t>> prompts = {random_tokens(9, V, 7), random_tokens(4, V, 8)};
  infer::GenerateOptions o;
  o.max_new_tokens = new_tokens;
  infer::GenerateResult r, base_r;
  infer::Generator gen;
  ASSERT_TRUE(gen.init(f.cfg, f.peft, Device::cpu, 2, S));
  ASSERT_TRUE(gen.generate(prompts, o, &r));
  infer::ModelWeights base;
  ASSERT_TRUE(infer::weights_from_store(f.model.base(), f.cfg, &base));
  infer::Generator plain;
  ASSERT_TRUE(plain.init(f.cfg, base, Device::cpu, 2, S));
  ASSERT_TRUE(plain.generate(prompts, o, &base_r));
  EXPECT_NE(r.tokens, base_r.tokens);
  for (size_t b = 0; b < prompts.size(); ++b) {
    ASSERT_EQ(int64_t(r.tokens[b].size()), new_tokens);
    EXPECT_EQ(r.tokens[b], greedy_by_rerun(f.model, prompts[b], new_tokens, S, V)) << "row " << b;
  }
}

// --merge-adapter's weights (W + scale B A, summed in FP64 and rounded once) give the same model up to
// rounding: within a few FP32 roundings of the logits' scale (1e-4 * max(1, max|logit|)), but not bit for
// bit (the count is printed: most logits differ in their last bits), which is why unmerged is the default.
TEST(LoraMerged, MergedWeightsAgreeToRounding) {
  const int64_t S = 24;
  LoraFixture f;
  ASSERT_NO_FATAL_FAILURE(f.build(false, S));
  const int64_t V = f.cfg.vocab;
  const std::vector<int32_t> seq = random_tokens(S, V, 3);
  const std::vector<float> ref = full_logits(f.model, seq);
  HfCheckpointReader reader;
  ASSERT_TRUE(reader.open(f.hf_dir()));
  const HfTensorSource base = [&reader](const HfTensor& t, float* dst) { return reader.read_f32(t.name, dst); };
  ParamStore store;
  ASSERT_TRUE(infer::load_inference_store(lora_merged_source(f.adapter, f.cfg, base), f.cfg, Device::cpu, &store));
  infer::ModelWeights w;
  ASSERT_TRUE(infer::weights_from_store(store, f.cfg, &w));
  infer::Generator gen;
  ASSERT_TRUE(gen.init(f.cfg, w, Device::cpu, 1, S));
  std::vector<float> last, all;
  ASSERT_TRUE(gen.prefill({seq}, &last, &all));
  double scale = 0;
  const double d = max_abs_diff(all.data(), ref.data(), all.size(), &scale);
  int64_t differ = 0;
  for (size_t i = 0; i < all.size(); ++i) differ += all[i] != ref[i];
  EXPECT_LE(d, 1e-4 * std::max(1.0, scale));
  std::printf("merged: %lld of %zu logits differ from the unmerged training forward, max |diff| %.3g at scale %.3g\n",
              (long long)differ, all.size(), d, scale);
}
