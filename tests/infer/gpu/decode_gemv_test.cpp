// The decode step's CUDA fast paths: decode_gemv against an FP64 reference of the same BF16 inputs, and
// the CUDA-graph replay of greedy steps against the step logits they come from.
// decode_gemv bound (rigorous for FP32 sums of K products in any order, Higham's gamma_K): with
// S = sum_k |w_k x_k| (+ |y| when accumulating), |fp32 result - exact| <= gamma_K S, gamma_K = K u / (1 - K u),
// u = 2^-24 (fused multiply-adds only make this smaller); a BF16 output adds its rounding, <= 2^-9 |exact|
// (round to nearest). The test allows gamma_K S + 2^-8 |exact| + 2^-9 gamma_K S for a BF16 output.
#include <gtest/gtest.h>
#include <cmath>
#include <random>
#include <vector>
#include "../infer_test_util.h"
#include "common/gpu.h"
#include "core/bf16.h"
#include "infer/decode_ops.h"
#include "infer/generator.h"

using namespace nb;
using namespace nb::testing;

namespace {

std::vector<bf16> random_bf16(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<bf16> h(n);
  for (bf16& v : h) v = f32_to_bf16(nd(rng));
  return h;
}

Buffer upload(const void* src, DType dt, std::initializer_list<int64_t> dims) {
  Buffer b;
  EXPECT_TRUE(Buffer::allocate(&b, dt, Device::cuda, dims));
  EXPECT_TRUE(copy_bytes(b.data(), Device::cuda, src, Device::cpu, size_t(b.tensor().bytes())));
  return b;
}

// One case: M rows, N outputs, K inputs; output dtype `out`; accumulate onto a random y or not.
void check_gemv(int64_t M, int64_t N, int64_t K, DType out, bool accumulate) {
  const auto xh = random_bf16(size_t(M * K), 1), wh = random_bf16(size_t(N * K), 2), yb = random_bf16(size_t(M * N), 3);
  std::vector<float> y0(size_t(M * N));
  for (size_t i = 0; i < y0.size(); ++i) y0[i] = bf16_to_f32(yb[i]);  // exactly representable in both dtypes
  Buffer x = upload(xh.data(), DType::bf16, {M, K}), w = upload(wh.data(), DType::bf16, {N, K});
  Buffer y = out == DType::bf16 ? upload(yb.data(), out, {M, N}) : upload(y0.data(), out, {M, N});
  ASSERT_TRUE(infer::gemv_fits(x.tensor(), w.tensor(), y.tensor()));
  infer::decode_gemv(x.tensor(), w.tensor(), y.tensor(), accumulate, nullptr);
  std::vector<float> got(size_t(M * N));
  if (out == DType::bf16) {
    std::vector<bf16> gb(got.size());
    ASSERT_TRUE(copy_bytes(gb.data(), Device::cpu, y.data(), Device::cuda, gb.size() * 2));
    for (size_t i = 0; i < got.size(); ++i) got[i] = bf16_to_f32(gb[i]);
  } else {
    ASSERT_TRUE(copy_bytes(got.data(), Device::cpu, y.data(), Device::cuda, got.size() * 4));
  }
  const double u = std::ldexp(1.0, -24), gamma = double(K) * u / (1 - double(K) * u);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double exact = accumulate ? double(y0[size_t(m * N + n)]) : 0.0, mag = std::fabs(exact);
      for (int64_t k = 0; k < K; ++k) {
        const double p = double(bf16_to_f32(xh[size_t(m * K + k)])) * double(bf16_to_f32(wh[size_t(n * K + k)]));
        exact += p;
        mag += std::fabs(p);
      }
      const double tol =
          out == DType::bf16 ? gamma * mag * (1 + std::ldexp(1.0, -9)) + std::ldexp(std::fabs(exact), -8) : gamma * mag;
      ASSERT_LE(std::fabs(double(got[size_t(m * N + n)]) - exact), tol)
          << "M " << M << " N " << N << " K " << K << " acc " << accumulate << " at (" << m << ", " << n << ")";
    }
}

}  // namespace

TEST(DecodeGemvCuda, MatchesTheFp64ReferenceWithinTheFp32Bound) {
  NB_REQUIRE_GPU();
  // K: one partial chunk, not a multiple of a lane sweep (256), several unrolled sweeps; N not a multiple of
  // the block's 8 columns; M across the 1, 2, 4 and 8-row instantiations.
  for (int64_t M : {1, 2, 3, 5, 8})
    for (int64_t K : {8, 264, 2048})
      for (DType out : {DType::bf16, DType::f32})
        for (bool acc : {false, true}) ASSERT_NO_FATAL_FAILURE(check_gemv(M, 37, K, out, acc));
  ASSERT_NO_FATAL_FAILURE(check_gemv(1, 1024, 8192, DType::bf16, true));  // a down projection's K
}

TEST(DecodeGemvCuda, RefusesWhatItCannotTake) {
  NB_REQUIRE_GPU();
  Buffer x, w, y, x9;
  ASSERT_TRUE(Buffer::allocate(&x, DType::bf16, Device::cuda, {9, 16}));
  ASSERT_TRUE(Buffer::allocate(&w, DType::bf16, Device::cuda, {4, 16}));
  ASSERT_TRUE(Buffer::allocate(&y, DType::bf16, Device::cuda, {9, 4}));
  EXPECT_FALSE(infer::gemv_fits(x.tensor(), w.tensor(), y.tensor()));  // more rows than kGemvMaxRows
  const Tensor x1 = Tensor::make(x.data(), DType::bf16, Device::cuda, {1, 12});
  const Tensor w1 = Tensor::make(w.data(), DType::bf16, Device::cuda, {4, 12});
  const Tensor y1 = Tensor::make(y.data(), DType::bf16, Device::cuda, {1, 4});
  EXPECT_FALSE(infer::gemv_fits(x1, w1, y1));  // K not a multiple of 8
  std::vector<float> h(16);
  EXPECT_FALSE(infer::gemv_fits(Tensor::make(h.data(), DType::f32, Device::cpu, {1, 16}),
                                Tensor::make(h.data(), DType::f32, Device::cpu, {1, 16}),
                                Tensor::make(h.data(), DType::f32, Device::cpu, {1, 1})));  // the CPU backend
}

// Greedy generation replays one graph per batch size (argmax on the device); teacher-forcing its own tokens
// through step() with host logits (another graph, no argmax) must give logits whose argmax is each next
// token: the two graphs run the same kernels on the same inputs, so the logits agree exactly.
TEST(GeneratorCuda, GraphReplayedGreedyStepsFollowTheirLogits) {
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
  const std::vector<std::vector<int32_t>> prompts = {random_tokens(7, cfg.vocab, 1), random_tokens(3, cfg.vocab, 2)};
  infer::GenerateOptions o;
  o.max_new_tokens = 24;
  infer::GenerateResult r, again;
  ASSERT_TRUE(gen.generate(prompts, o, &r));
  ASSERT_TRUE(gen.generate(prompts, o, &again));  // every step now a replay
  EXPECT_EQ(r.tokens, again.tokens);
  std::vector<float> logits;
  ASSERT_TRUE(gen.prefill(prompts, nullptr));
  const int64_t V = cfg.vocab;
  for (size_t i = 0; i + 1 < r.tokens[0].size(); ++i) {
    const std::vector<int32_t> ids = {r.tokens[0][i], r.tokens[1][i]};
    ASSERT_TRUE(gen.step(ids.data(), &logits));
    for (size_t b = 0; b < 2; ++b) {
      const float* row = logits.data() + int64_t(b) * V;
      const int64_t best = std::max_element(row, row + V) - row;
      ASSERT_EQ(best, r.tokens[b][i + 1]) << "row " << b << " step " << i;
    }
  }
}
