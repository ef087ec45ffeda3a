// Golden parity with transformers: tests/io/data/hf_tiny/ (made by `python3 scripts/hf_parity.py fixture`
// on a machine with torch + transformers) holds a tiny random LlamaForCausalLM saved in BF16 (GQA, llama3
// RoPE scaling with all three frequency bands in use, untied head, weights scaled so activations are O(1)
// and attention is far from uniform), tokens.safetensors and the FP32 logits and mean loss transformers
// computed on the CPU. nibble's CPU backend (FP32 throughout) must reproduce them.
//
// Bound. Both sides compute in FP32 from the same BF16 weights (exact in FP32), so they differ only by
// rounding order: a dot product of length K summed in FP32 is off by at most K * u * sum|a_i b_i|
// (Higham's gamma_K, u = 2^-24), and with O(1)-normalized activations sum|a_i b_i| is of the order of
// the largest output. Counting the chained stages (per layer: norm, qkv, scores, softmax, PV, o, norm,
// gate/up, SwiGLU, down: 10; 2 layers, final norm and head: 22) with K <= 64, each side is within
// 22 * 64 * 2^-24 = 8.4e-5 of exact, relative to the logits' scale, so the two within 1.7e-4. The RoPE
// tables add little: transformers computes the angle position * inv_freq in FP32 (error <= 15 * 3u =
// 2.7e-6 rad at position 15), nibble in FP64, which moves cos/sin by < 3e-6. Hence
// |logit difference| <= 2e-4 * max(1, max|logit|), and the mean loss, per token a function of the
// logits with max-norm Lipschitz constant 2 (the target logit and the log-sum-exp), differs by at most
// 4e-4 * max(1, max|logit|) plus its own FP32 summation error (32 terms: 32 * u * loss).
#include <gtest/gtest.h>
#include <cmath>
#include <cstring>
#include <filesystem>
#include "io/hf_llama.h"
#include "model/llama_model.h"

using namespace nb;

namespace {
std::vector<float> f32_of(const SafeTensor& t) {
  std::vector<float> v(t.bytes.size() / 4);
  std::memcpy(v.data(), t.bytes.data(), t.bytes.size());
  return v;
}
}  // namespace

TEST(HfGolden, TinyLlamaMatchesTransformers) {
  // Beside this file (NIBBLE_TEST_DATA names the shared tests/data folder, which is the data tests' area).
  const std::string dir = (std::filesystem::path(__FILE__).parent_path() / "data" / "hf_tiny").string();
  if (!std::filesystem::exists(dir + "/config.json"))
    GTEST_SKIP() << "fixture " << dir << " is absent: make it on a machine with torch and transformers with "
                 << "`python3 scripts/hf_parity.py fixture tests/io/data/hf_tiny` and commit it";
  LlamaConfig cfg;
  Status st = read_hf_config(dir, &cfg);
  ASSERT_TRUE(st) << st.message();
  SafeTensorsFile tok, expected;
  ASSERT_TRUE(read_safetensors(dir + "/tokens.safetensors", &tok));
  ASSERT_TRUE(read_safetensors(dir + "/expected.safetensors", &expected));
  const SafeTensor& t = tok.tensors.at("tokens");
  ASSERT_EQ(t.dtype, "I32");
  const int64_t B = t.shape[0], S = t.shape[1] - 1;
  std::vector<int32_t> all(t.bytes.size() / 4), in, labels;
  std::memcpy(all.data(), t.bytes.data(), t.bytes.size());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s) {
      in.push_back(all[size_t(b * (S + 1) + s)]);
      labels.push_back(all[size_t(b * (S + 1) + s + 1)]);
    }
  LlamaModel model;
  ASSERT_TRUE(model.init(cfg, Device::cpu, {B, S}, Recompute::none, 0));
  st = load_hf_weights(dir, cfg, model.params());
  ASSERT_TRUE(st) << st.message();
  std::vector<float> logits(size_t(B * S * cfg.vocab));
  double loss_sum = 0;
  ASSERT_TRUE(model.forward_logits(in.data(), labels.data(), logits.data(), &loss_sum));

  const std::vector<float> ref = f32_of(expected.tensors.at("logits"));
  const float ref_loss = f32_of(expected.tensors.at("loss"))[0];
  ASSERT_EQ(ref.size(), logits.size());
  double max_ref = 0, max_diff = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    max_ref = std::max(max_ref, double(std::fabs(ref[i])));
    max_diff = std::max(max_diff, double(std::fabs(ref[i] - logits[i])));
  }
  const double scale = std::max(1.0, max_ref);
  const double loss = loss_sum / double(B * S);
  const double loss_bound = 4e-4 * scale + 32 * 0x1p-24 * loss;
  std::printf("hf_tiny: max |logit| %.4f, max |diff| %.3g (bound %.3g); loss %.7f vs %.7f, diff %.3g (bound %.3g)\n",
              max_ref, max_diff, 2e-4 * scale, loss, double(ref_loss), std::fabs(loss - ref_loss), loss_bound);
  EXPECT_LE(max_diff, 2e-4 * scale);
  EXPECT_LE(std::fabs(loss - double(ref_loss)), loss_bound);
}
