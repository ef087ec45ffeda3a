// The CUDA decode path: its kernels against the CPU reference (cache writes and argmax exactly, the cache
// attention within BF16 output rounding), and the CUDA generator against the CUDA full forward of the same
// BF16 weights (LlamaModel::forward_logits, bf16_mixed): every prefill position and teacher-forced decode
// steps, one sequence and a batch of different prompt lengths; with an unmerged LoRA adapter, against the
// CUDA training forward of a LoRA LlamaModel over the same base and adapter.
// Bound (scripts/hf_parity.py's BF16 bound, derived there): both sides round about n = 10 L + 2 activation
// tensors to BF16 on the way to the logits, so ||dlogits|| / ||logits|| <= 3 * 2^-8 / sqrt(3) * sqrt(n) and
// max |dlogit| <= 5 * that * rms(logits). The two paths differ only in attention (cuDNN vs the cache
// kernel) and the logits' last rounding (BF16 in training, FP32 here), so they sit far inside it.
#include <gtest/gtest.h>
#include <unistd.h>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>
#include "../infer_test_util.h"
#include "common/gpu.h"
#include "core/bf16.h"
#include "infer/decode_ops.h"
#include "infer/generator.h"
#include "ops/elementwise.h"

using namespace nb;
using namespace nb::testing;

namespace {

struct DeviceBuf {
  Buffer b;
  DeviceBuf(DType dt, std::initializer_list<int64_t> dims) {
    EXPECT_TRUE(Buffer::allocate(&b, dt, Device::cuda, dims));
  }
};

std::vector<bf16> random_bf16(size_t n, uint32_t seed, std::vector<float>* widened) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<bf16> h(n);
  widened->resize(n);
  for (size_t i = 0; i < n; ++i) {
    h[i] = f32_to_bf16(nd(rng));
    (*widened)[i] = bf16_to_f32(h[i]);
  }
  return h;
}

// Logits [S, V] of the CUDA generator decoding `seq` one token at a time (prefill of its first token).
std::vector<float> decode_logits(infer::Generator& gen, const std::vector<int32_t>& seq, int64_t V) {
  std::vector<float> all, step;
  EXPECT_TRUE(gen.prefill({{seq[0]}}, &all));
  for (size_t s = 1; s < seq.size(); ++s) {
    EXPECT_TRUE(gen.step(&seq[s], &step));
    all.insert(all.end(), step.begin(), step.end());
  }
  EXPECT_EQ(all.size(), seq.size() * size_t(V));
  return all;
}

void expect_bf16_close(const std::vector<float>& got, const std::vector<float>& ref, int64_t layers,
                       const std::string& what) {
  ASSERT_EQ(got.size(), ref.size());
  double d2 = 0, r2 = 0, dmax = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double d = double(got[i]) - double(ref[i]);
    d2 += d * d;
    r2 += double(ref[i]) * double(ref[i]);
    dmax = std::max(dmax, std::fabs(d));
  }
  const double n = 10.0 * double(layers) + 2, rel_bound = 3 * std::ldexp(1.0, -8) / std::sqrt(3.0) * std::sqrt(n);
  const double rms = std::sqrt(r2 / double(ref.size())), rel = std::sqrt(d2 / r2);
  EXPECT_LE(rel, rel_bound) << what;
  EXPECT_LE(dmax, 5 * rel_bound * rms) << what;
  std::printf("%s: rel rms %.3g (bound %.3g), max abs %.3g (bound %.3g)\n", what.c_str(), rel, rel_bound, dmax,
              5 * rel_bound * rms);
}

}  // namespace

TEST(DecodeKernelsCuda, CacheAttentionMatchesTheReference) {
  NB_REQUIRE_GPU();
  for (int64_t D : {32, 64, 128}) {
    const int64_t B = 3, L = 37, Hq = 8, Hkv = 2;
    std::vector<float> qf, kf, vf;
    const auto qh = random_bf16(size_t(B * Hq * D), 1, &qf), kh = random_bf16(size_t(B * L * Hkv * D), 2, &kf),
               vh = random_bf16(size_t(B * L * Hkv * D), 3, &vf);
    const std::vector<int32_t> pos = {0, 17, 36};
    DeviceBuf q(DType::bf16, {B, Hq, D}), k(DType::bf16, {B, L, Hkv, D}), v(DType::bf16, {B, L, Hkv, D}),
        o(DType::bf16, {B, Hq, D}), p(DType::i32, {B});
    ASSERT_TRUE(copy_bytes(q.b.data(), Device::cuda, qh.data(), Device::cpu, qh.size() * 2));
    ASSERT_TRUE(copy_bytes(k.b.data(), Device::cuda, kh.data(), Device::cpu, kh.size() * 2));
    ASSERT_TRUE(copy_bytes(v.b.data(), Device::cuda, vh.data(), Device::cpu, vh.size() * 2));
    ASSERT_TRUE(copy_bytes(p.b.data(), Device::cuda, pos.data(), Device::cpu, pos.size() * 4));
    const float scale = 1.f / std::sqrt(float(D));
    ASSERT_TRUE(
        infer::cache_attention(q.b.tensor(), k.b.tensor(), v.b.tensor(), p.b.tensor(), o.b.tensor(), scale, nullptr));
    std::vector<bf16> oh(qh.size());
    ASSERT_TRUE(copy_bytes(oh.data(), Device::cpu, o.b.data(), Device::cuda, oh.size() * 2));
    std::vector<float> of(qf.size());
    std::vector<int32_t> pos_h = pos;
    auto host = [](std::vector<float>& x, std::initializer_list<int64_t> d) {
      return Tensor::make(x.data(), DType::f32, Device::cpu, d);
    };
    ASSERT_TRUE(infer::cache_attention(host(qf, {B, Hq, D}), host(kf, {B, L, Hkv, D}), host(vf, {B, L, Hkv, D}),
                                       Tensor::make(pos_h.data(), DType::i32, Device::cpu, {B}), host(of, {B, Hq, D}),
                                       scale, nullptr));
    for (size_t i = 0; i < of.size(); ++i)  // BF16 output rounding (2^-9 relative) plus FP32 noise
      ASSERT_NEAR(bf16_to_f32(oh[i]), of[i], 4e-3 * std::max(1.f, std::fabs(of[i]))) << "D " << D << " element " << i;
  }
}

TEST(DecodeKernelsCuda, CacheWriteAndArgmaxAreExact) {
  NB_REQUIRE_GPU();
  const int64_t B = 2, L = 5, Hkv = 2, D = 8, T = 2;
  std::vector<float> kf, vf;
  const auto kh = random_bf16(size_t(T * Hkv * D), 4, &kf), vh = random_bf16(size_t(T * Hkv * D), 5, &vf);
  const std::vector<int32_t> pos = {3, 1};
  DeviceBuf k(DType::bf16, {T, Hkv, D}), v(DType::bf16, {T, Hkv, D}), ck(DType::bf16, {B, L, Hkv, D}),
      cv(DType::bf16, {B, L, Hkv, D}), p(DType::i32, {T});
  ASSERT_TRUE(copy_bytes(k.b.data(), Device::cuda, kh.data(), Device::cpu, kh.size() * 2));
  ASSERT_TRUE(copy_bytes(v.b.data(), Device::cuda, vh.data(), Device::cpu, vh.size() * 2));
  ASSERT_TRUE(copy_bytes(p.b.data(), Device::cuda, pos.data(), Device::cpu, pos.size() * 4));
  ops::fill(ck.b.tensor(), 0.f, nullptr);
  ops::fill(cv.b.tensor(), 0.f, nullptr);
  infer::kv_cache_write(k.b.tensor(), v.b.tensor(), ck.b.tensor(), cv.b.tensor(), p.b.tensor(), 1, nullptr);
  std::vector<bf16> got(size_t(B * L * Hkv * D));
  ASSERT_TRUE(copy_bytes(got.data(), Device::cpu, ck.b.data(), Device::cuda, got.size() * 2));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < Hkv * D; ++e)
      ASSERT_EQ(got[size_t((t * L + pos[size_t(t)]) * Hkv * D + e)].bits, kh[size_t(t * Hkv * D + e)].bits);
  // argmax: ties go to the first index, as on the CPU.
  const int64_t V = 1000;
  std::vector<float> logits(size_t(2 * V));
  for (int64_t i = 0; i < 2 * V; ++i) logits[size_t(i)] = float((i * 37) % 101);
  logits[size_t(V + 500)] = 1000.f;
  DeviceBuf lg(DType::f32, {2, V}), ids(DType::i32, {2});
  ASSERT_TRUE(copy_bytes(lg.b.data(), Device::cuda, logits.data(), Device::cpu, logits.size() * 4));
  infer::argmax_rows(lg.b.tensor(), ids.b.tensor(), nullptr);
  std::vector<int32_t> gpu(2), cpu(2);
  ASSERT_TRUE(copy_bytes(gpu.data(), Device::cpu, ids.b.data(), Device::cuda, 8));
  infer::argmax_rows(Tensor::make(logits.data(), DType::f32, Device::cpu, {2, V}),
                     Tensor::make(cpu.data(), DType::i32, Device::cpu, {2}), nullptr);
  EXPECT_EQ(gpu, cpu);
  EXPECT_EQ(gpu[1], 500);
}

TEST(GeneratorCuda, DecodeMatchesTheCudaFullForward) {
  NB_REQUIRE_GPU();
  LlamaConfig cfg;
  ASSERT_TRUE(llama_preset("tiny", &cfg));
  const int64_t S = 48, V = cfg.vocab;
  LlamaModel model;
  ASSERT_TRUE(model.init(cfg, Device::cuda, {1, S}, Recompute::none, 5));
  scale_weights(model, 21);
  infer::ModelWeights w;
  ASSERT_TRUE(infer::weights_from_store(model.params(), cfg, &w));
  const std::vector<int32_t> seq = random_tokens(S, V, 11);
  const std::vector<float> ref = full_logits(model, seq);
  infer::Generator gen;
  ASSERT_TRUE(gen.init(cfg, w, Device::cuda, 3, S));
  expect_bf16_close(decode_logits(gen, seq, V), ref, cfg.layers, "decode, one sequence");
  std::vector<float> last, all;
  ASSERT_TRUE(gen.prefill({seq}, &last, &all));
  expect_bf16_close(all, ref, cfg.layers, "prefill, every position");
  // A batch of three prompt lengths, continued with the sequence's own tokens (row b starts at lens[b]).
  const std::vector<int64_t> lens = {5, 31, 17};
  std::vector<std::vector<int32_t>> prompts;
  for (int64_t n : lens) prompts.emplace_back(seq.begin(), seq.begin() + n);
  ASSERT_TRUE(gen.prefill(prompts, &last));
  std::vector<float> got, want;
  for (size_t b = 0; b < lens.size(); ++b) {
    got.insert(got.end(), last.begin() + int64_t(b) * V, last.begin() + int64_t(b + 1) * V);
    want.insert(want.end(), ref.begin() + (lens[b] - 1) * V, ref.begin() + lens[b] * V);
  }
  for (int64_t i = 0; i < S - 31; ++i) {
    std::vector<int32_t> ids;
    for (int64_t n : lens) ids.push_back(seq[size_t(n + i)]);
    ASSERT_TRUE(gen.step(ids.data(), &last));
    got.insert(got.end(), last.begin(), last.end());
    for (int64_t n : lens) want.insert(want.end(), ref.begin() + (n + i) * V, ref.begin() + (n + i + 1) * V);
  }
  expect_bf16_close(got, want, cfg.layers, "batch of three lengths");
}

// LoRA on all four linears (rank 8, scale 2, generate_parity.py's sizes), unmerged: the decode and the training
// forward run the same BF16 adapter GEMMs (lora_forward) after the same base GEMMs, so they differ as the
// plain model's paths do (attention, the logits' last rounding). The PEFT upload rounds A and B to the very
// BF16 values of the training store's compute copies.
TEST(GeneratorCuda, AdapterDecodeMatchesTheCudaTrainingForward) {
  NB_REQUIRE_GPU();
  LlamaConfig cfg;
  ASSERT_TRUE(llama_preset("tiny", &cfg));
  const int64_t S = 48, V = cfg.vocab;
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("nibble_lora_cuda_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  ASSERT_NO_FATAL_FAILURE(write_scaled_hf(cfg, 21, (dir / "hf").string()));
  HfCheckpointReader reader;
  ASSERT_TRUE(reader.open((dir / "hf").string()));
  LoraSpec spec;
  spec.rank = 8;
  spec.alpha = 16;
  const LoraAdapter ad = random_adapter(cfg, spec, 31);
  LlamaModel model;
  model.set_lora(spec, &reader);
  ASSERT_TRUE(model.init(cfg, Device::cuda, {1, S}, Recompute::none, 5));
  ASSERT_TRUE(lora_store_from_adapter(ad, cfg, model.params()));
  infer::ModelWeights views, peft;
  Buffer upload;
  ASSERT_TRUE(infer::weights_from_store(model.base(), cfg, &views));
  ASSERT_TRUE(infer::lora_weights_from_store(model.params(), cfg, spec, &views));
  ASSERT_TRUE(infer::weights_from_store(model.base(), cfg, &peft));
  ASSERT_TRUE(infer::load_inference_adapter(ad, cfg, Device::cuda, &upload, &peft));
  for (int64_t l = 0; l < cfg.layers; ++l)
    for (int i = 0; i < 4; ++i) {
      const LoraModule &x = views.layers[size_t(l)].lora[i], &y = peft.layers[size_t(l)].lora[i];
      for (const auto& [a, b] : {std::pair{x.a, y.a}, std::pair{x.b, y.b}}) {
        ASSERT_EQ(a.numel(), b.numel());
        std::vector<uint16_t> ha(size_t(a.numel())), hb(ha.size());
        ASSERT_TRUE(copy_bytes(ha.data(), Device::cpu, a.data, Device::cuda, ha.size() * 2));
        ASSERT_TRUE(copy_bytes(hb.data(), Device::cpu, b.data, Device::cuda, hb.size() * 2));
        ASSERT_EQ(ha, hb) << "layer " << l << " linear " << i;
      }
      EXPECT_EQ(x.scale, y.scale);
    }
  const std::vector<int32_t> seq = random_tokens(S, V, 11);
  const std::vector<float> ref = full_logits(model, seq);
  infer::Generator gen;
  ASSERT_TRUE(gen.init(cfg, peft, Device::cuda, 1, S));
  expect_bf16_close(decode_logits(gen, seq, V), ref, cfg.layers, "LoRA decode, one sequence");
  std::vector<float> last, all;
  ASSERT_TRUE(gen.prefill({seq}, &last, &all));
  expect_bf16_close(all, ref, cfg.layers, "LoRA prefill, every position");
  // The adapter matters: the base alone is far outside the bound.
  infer::ModelWeights base;
  ASSERT_TRUE(infer::weights_from_store(model.base(), cfg, &base));
  infer::Generator plain;
  ASSERT_TRUE(plain.init(cfg, base, Device::cuda, 1, S));
  ASSERT_TRUE(plain.prefill({seq}, &last, &all));
  double scale = 0;
  EXPECT_GT(max_abs_diff(all.data(), ref.data(), all.size(), &scale), 0.1 * scale);
  std::filesystem::remove_all(dir);
}

TEST(GeneratorCuda, SameSeedSameTokens) {
  NB_REQUIRE_GPU();
  LlamaConfig cfg;
  ASSERT_TRUE(llama_preset("tiny", &cfg));
  LlamaModel model;
  ASSERT_TRUE(model.init(cfg, Device::cuda, {1, 8}, Recompute::none, 5));
  scale_weights(model, 4);
  infer::ModelWeights w;
  ASSERT_TRUE(infer::weights_from_store(model.params(), cfg, &w));
  infer::Generator gen;
  ASSERT_TRUE(gen.init(cfg, w, Device::cuda, 2, 64));
  infer::GenerateOptions o;
  o.max_new_tokens = 40;
  o.sampling = {0.8f, 50, 0.9f, 99};
  const std::vector<std::vector<int32_t>> prompts = {random_tokens(7, cfg.vocab, 1), random_tokens(3, cfg.vocab, 2)};
  infer::GenerateResult a, b;
  ASSERT_TRUE(gen.generate(prompts, o, &a));
  ASSERT_TRUE(gen.generate(prompts, o, &b));
  EXPECT_EQ(a.tokens, b.tokens);
  o.sampling = {};
  ASSERT_TRUE(gen.generate(prompts, o, &a));  // greedy on the device
  EXPECT_EQ(a.tokens[0].size(), 40u);
}
