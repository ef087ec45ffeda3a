// LoRA on the CPU reference: with B = 0 the adapted model is the base exactly (logits, for a BF16 and an
// NVFP4 base); the adapter gradients against central finite differences; a frozen base keeps no
// gradient or optimizer state; an NVFP4 base holds the codes `nibble quant --2d` gives for its weight.
#include <gtest/gtest.h>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>
#include "common/nibble_binary.h"
#include "core/bf16.h"
#include "io/safetensors.h"
#include "model/llama_model.h"
#include "model_test_util.h"
#include "ops/elementwise.h"

using namespace nb;
using nb::testing::fixed_batch;
using nb::testing::tiny_config;

namespace {

recipe::Recipe preset(const std::string& name) {
  recipe::Recipe r;
  EXPECT_TRUE(recipe::recipe_preset(name, &r).is_ok());
  return r;
}

// Fills every B with N(0, 0.05) values (masters and compute copies), so the adapters change the model.
void randomize_b(LlamaModel& m, uint32_t seed) {
  ParamStore& P = m.params();
  std::vector<float> host(size_t(P.total()));
  ASSERT_TRUE(P.get_state(optim::StateArray::master, host.data()).is_ok());
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 0.05f);
  for (const ParamInfo& p : P.params())
    if (p.name.find("lora_B") != std::string::npos)
      for (int64_t i = 0; i < p.numel; ++i) host[size_t(p.offset + i)] = nd(rng);
  ASSERT_TRUE(P.set_master(host.data()).is_ok());
}

std::vector<float> logits_of(LlamaModel& m, const LlamaConfig& c, const std::vector<int32_t>& tok,
                             const std::vector<int32_t>& lab, double* loss) {
  std::vector<float> out(tok.size() * size_t(c.vocab));
  *loss = 0;
  EXPECT_TRUE(m.forward_logits(tok.data(), lab.data(), out.data(), loss).is_ok());
  return out;
}

}  // namespace

// B = 0: every adapter adds exactly zero, so the logits are the base model's bit for bit, for a base in
// BF16 (FP32 reference GEMMs) and in NVFP4 (frozen, quantized once from the same seeded weights). A
// backward then gives A no gradient (dh = s dy B = 0) while B's is not zero.
TEST(LoraCpu, ZeroBReproducesTheBaseModel) {
  LlamaConfig c = tiny_config();
  c.layers = 6;  // quantized layers in both recipes (NVFP4 keeps the last 4 in BF16, FP8 the first and last)
  const MicroBatchShape s{2, 32};
  std::vector<int32_t> tok, lab;
  fixed_batch(c, s, 3, &tok, &lab);
  for (const char* name : {"bf16_mixed", "bf16_with_nvfp4_mixed", "bf16_with_fp8_current_scaling_mixed"}) {
    SCOPED_TRACE(name);
    LlamaModel base, lora;
    ASSERT_TRUE(base.init(c, Device::cpu, s, Recompute::none, 7, preset(name)).is_ok());
    LoraSpec spec;
    spec.rank = 4;
    lora.set_lora(spec, nullptr);
    ASSERT_TRUE(lora.init(c, Device::cpu, s, Recompute::none, 7, preset(name)).is_ok());
    double lb = 0, ll = 0;
    const std::vector<float> want = logits_of(base, c, tok, lab, &lb), got = logits_of(lora, c, tok, lab, &ll);
    ASSERT_EQ(want.size(), got.size());
    EXPECT_EQ(0, std::memcmp(want.data(), got.data(), want.size() * 4));
    EXPECT_EQ(lb, ll);
    ParamStore& P = lora.params();
    double sum = 0;
    ASSERT_TRUE(lora.forward_backward(tok.data(), lab.data(), 1.f / float(tok.size()), &sum).is_ok());
    double ga = 0, gb = 0;
    for (const ParamInfo& p : P.params()) {
      const float* g = P.grad(p.name).ptr<float>();
      double& acc = p.name.find("lora_A") != std::string::npos ? ga : gb;
      for (int64_t i = 0; i < p.numel; ++i) acc += std::fabs(double(g[i]));
    }
    EXPECT_EQ(ga, 0.0);
    EXPECT_GT(gb, 0.0);
  }
}

// Directional derivatives of the loss along a random unit direction per adapter matrix, against central
// differences (FP32 reference; tolerance as the full model's gradient test: 2e-3 absolute + 2% relative),
// with every target adapted, B random, alpha != rank, for no recompute and full recompute.
TEST(LoraCpu, AdapterGradientsMatchFiniteDifferences) {
  const LlamaConfig c = tiny_config();
  const MicroBatchShape s{2, 16};
  std::vector<int32_t> tok, lab;
  fixed_batch(c, s, 5, &tok, &lab);
  for (Recompute rc : {Recompute::none, Recompute::full}) {
    LlamaModel m;
    LoraSpec spec;
    spec.rank = 4;
    spec.alpha = 8;
    m.set_lora(spec, nullptr);
    ASSERT_TRUE(m.init(c, Device::cpu, s, rc, 9).is_ok());
    randomize_b(m, 1);
    ParamStore& P = m.params();
    ops::fill(P.flat_grad(), 0.f, nullptr);
    double sum = 0;
    ASSERT_TRUE(m.forward_backward(tok.data(), lab.data(), 1.f / float(tok.size()), &sum).is_ok());
    auto loss = [&] {
      double l = 0;
      EXPECT_TRUE(m.forward_loss(tok.data(), lab.data(), &l).is_ok());
      return l / double(tok.size());
    };
    std::mt19937 rng(11);
    std::normal_distribution<float> nd;
    for (const ParamInfo& p : P.params()) {
      Tensor w = P.compute(p.name), g = P.grad(p.name);
      std::vector<float> r(size_t(p.numel));
      double nrm = 0, analytic = 0;
      for (auto& x : r) {
        x = nd(rng);
        nrm += double(x) * x;
      }
      for (int64_t i = 0; i < p.numel; ++i)
        analytic += double(g.ptr<float>()[i]) * (r[size_t(i)] /= float(std::sqrt(nrm)));
      const float h = 1e-2f;
      std::vector<float> w0(w.ptr<float>(), w.ptr<float>() + p.numel);
      for (int64_t i = 0; i < p.numel; ++i) w.ptr<float>()[i] = w0[size_t(i)] + h * r[size_t(i)];
      const double lp = loss();
      for (int64_t i = 0; i < p.numel; ++i) w.ptr<float>()[i] = w0[size_t(i)] - h * r[size_t(i)];
      const double lm = loss();
      std::copy(w0.begin(), w0.end(), w.ptr<float>());
      const double numeric = (lp - lm) / (2.0 * h);
      EXPECT_NEAR(analytic, numeric, 2e-3 + 0.02 * std::fabs(numeric)) << p.name;
    }
  }
}

// The trainable store holds only the adapters; the frozen base has compute copies only.
TEST(LoraCpu, TheBaseIsFrozen) {
  LlamaConfig c = tiny_config();
  c.layers = 6;  // NVFP4 keeps the last 4 in BF16: layers 0 and 1 quantized
  LlamaModel m;
  LoraSpec spec;
  spec.rank = 8;
  spec.targets = {LoraTarget::linear_qkv, LoraTarget::linear_fc2};
  m.set_lora(spec, nullptr);
  ASSERT_TRUE(m.init(c, Device::cpu, {1, 32}, Recompute::none, 1, preset("bf16_with_nvfp4_mixed")).is_ok());
  EXPECT_EQ(m.params().params().size(), size_t(c.layers * 2 * 2));
  const int64_t n = lora_param_count(c, spec), pieces = int64_t(m.params().params().size());
  EXPECT_GE(m.params().total(), n);
  EXPECT_LT(m.params().total(), n + 64 * pieces);  // only the 64-element alignment between parameters
  EXPECT_TRUE(m.base().frozen());
  EXPECT_FALSE(m.params().frozen());
  // Quantized layers' linear weights have no copy in the base store: only BF16 layers' do.
  int64_t stored = 0;
  for (const ParamInfo& p : m.base().params()) stored += m.base().has_compute(p.name) ? 1 : 0;
  EXPECT_LT(stored, int64_t(m.base().params().size()));
}

// The frozen NVFP4 base of layer 0's fused qkv holds exactly the codes, scales and amax that
// `nibble quant --format nvfp4 --2d` writes for the same BF16 weight (an independent path: the CLI reads
// the weight from a file).
TEST(LoraCpu, Nvfp4BaseMatchesNibbleQuant) {
  LlamaConfig c = tiny_config();
  c.layers = 6;  // NVFP4 keeps the last 4 in BF16: layer 0 quantized
  LlamaModel plain, lora;
  ASSERT_TRUE(plain.init(c, Device::cpu, {1, 32}, Recompute::none, 5).is_ok());
  LoraSpec spec;
  lora.set_lora(spec, nullptr);
  ASSERT_TRUE(lora.init(c, Device::cpu, {1, 32}, Recompute::none, 5, preset("bf16_with_nvfp4_mixed")).is_ok());
  // The same seed gives the same base: layer 0's [q; k; v] from the plain model's FP32 masters, as BF16.
  const ParamStore& P = plain.params();
  std::vector<uint16_t> w;
  for (const char* n : {"q_proj", "k_proj", "v_proj"}) {
    const Tensor t = P.master(std::string("model.layers.0.self_attn.") + n + ".weight");
    for (int64_t i = 0; i < t.numel(); ++i) w.push_back(f32_to_bf16(t.ptr<float>()[i]).bits);
  }
  const int64_t rows = c.q_dim() + 2 * c.kv_dim(), cols = c.hidden;
  SafeTensorsFile f;
  std::vector<uint8_t> bytes(w.size() * 2);
  std::memcpy(bytes.data(), w.data(), bytes.size());
  f.tensors["w"] = SafeTensor{"BF16", {rows, cols}, bytes};
  const std::string in = ::testing::TempDir() + "lora_qkv.safetensors", out = ::testing::TempDir() + "lora_qkv_q.st";
  ASSERT_TRUE(write_safetensors(in, f).is_ok());
  const auto r =
      nb::test::run_nibble("quant --input " + in + " --tensor w --format nvfp4 --2d --device cpu --out " + out);
  ASSERT_EQ(r.code, 0) << r.out;
  SafeTensorsFile q;
  ASSERT_TRUE(read_safetensors(out, &q).is_ok());
  recipe::QuantizedBytes got;
  ASSERT_TRUE(lora.linear(0, 0).debug_copies(1, &got).is_ok());
  EXPECT_EQ(got.row_data, q.tensors.at("row_data").bytes);
  EXPECT_EQ(got.row_scales, q.tensors.at("row_scales").bytes);
  float amax = 0;
  std::memcpy(&amax, q.tensors.at("row_amax").bytes.data(), 4);
  EXPECT_EQ(got.row_amax, amax);
}
