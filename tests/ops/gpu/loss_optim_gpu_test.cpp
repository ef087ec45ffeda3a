// CUDA cross-entropy, AdamW and elementwise helpers against the CPU reference, plus a rough bandwidth
// report for the memory-bound kernels (printed, not asserted).
#include <gtest/gtest.h>
#include <cuda_runtime.h>
#include <chrono>
#include <cmath>
#include "../ops_test_util.h"
#include "common/gpu.h"
#include "gpu_util.h"
#include "ops/adamw.h"
#include "ops/cross_entropy.h"
#include "ops/elementwise.h"
#include "ops/embedding.h"
#include "ops/swiglu.h"
#include "ops/rmsnorm.h"

using namespace nb;
using namespace nb::ops;
using namespace nb::ops::testing;

struct CeShape {
  int64_t T, V;
  DType dt;
};
class CrossEntropyGpu : public ::testing::TestWithParam<CeShape> {};

TEST_P(CrossEntropyGpu, LossAndGradMatchCpu) {
  NB_REQUIRE_GPU();
  const auto [T, V, dt] = GetParam();
  auto logits = rounded(random_vec(T * V, 71, -8.f, 8.f), dt);
  std::vector<int32_t> tgt(T);
  std::mt19937 rng(72);
  for (int64_t t = 0; t < T; ++t) tgt[t] = (t % 7 == 3) ? -1 : int32_t(rng() % V);
  const float scale = 1.f / 3.f;
  auto ref = logits;
  std::vector<float> loss(T);
  cross_entropy_fwd_bwd(host_f32(ref, {T, V}), host_i32(tgt, {T}), scale, host_f32(loss, {T}), nullptr);
  auto gl = upload(logits, dt, {T, V});
  auto gt = upload_i32(tgt, {T});
  auto gloss = upload(std::vector<float>(T), DType::f32, {T});
  cross_entropy_fwd_bwd(gl.t(), gt.t(), scale, gloss.t(), nullptr);
  // Loss: FP32 sum of V exponentials (relative error ~1e-6) then a log: 1e-5 relative + 1e-5 absolute.
  EXPECT_EQ(count_bad(download(gloss.t()), loss, 1e-5, {1e-5}, "loss"), 0);
  // Gradient: softmax in FP32 (a few ulps) rounded once; p - 1 at the target has an absolute FP32 error
  // of ~1e-7, hence the 2^-20 * scale floor.
  EXPECT_EQ(count_bad(download(gl.t()), ref, dt == DType::bf16 ? kBf16Rel : 1e-5, {0x1p-20 * scale}, "dlogits"), 0);
}

INSTANTIATE_TEST_SUITE_P(Shapes, CrossEntropyGpu,
                         ::testing::Values(CeShape{33, 1001, DType::bf16}, CeShape{17, 250, DType::f32},
                                           CeShape{512, 128256, DType::bf16}, CeShape{64, 32000, DType::f32}));

TEST(AdamWGpu, MatchesCpuBitForBit) {
  NB_REQUIRE_GPU();
  const int64_t n = 1000003;  // not a multiple of 8: exercises the scalar tail
  auto p = random_vec(n, 81), g = random_vec(n, 82, -0.01f, 0.01f), m = random_vec(n, 83, -1e-3f, 1e-3f);
  auto v = random_vec(n, 84, 0.f, 1e-5f);
  AdamWParams prm{};
  prm.lr = 3e-4f;
  prm.beta1 = 0.9f;
  prm.beta2 = 0.95f;
  prm.eps = 1e-8f;
  prm.weight_decay = 0.033f;
  prm.step = 17;
  prm.grad_scale = 0.75f;
  auto gp = upload(p, DType::f32, {n}), gg = upload(g, DType::f32, {n}), gm = upload(m, DType::f32, {n});
  auto gv = upload(v, DType::f32, {n}), gc = upload(std::vector<float>(n), DType::bf16, {n});
  std::vector<float> copy(n);
  adamw_update(host_f32(p, {n}), host_f32(g, {n}), host_f32(m, {n}), host_f32(v, {n}), host_f32(copy, {n}), prm,
               nullptr);
  adamw_update(gp.t(), gg.t(), gm.t(), gv.t(), gc.t(), prm, nullptr);
  // Same FP32 operations in the same order, no FMA contraction, IEEE sqrt and division on both sides.
  EXPECT_TRUE(same_bits(download(gp.t()), p));
  EXPECT_TRUE(same_bits(download(gm.t()), m));
  EXPECT_TRUE(same_bits(download(gv.t()), v));
  EXPECT_TRUE(same_bits(download(gc.t()), rounded(copy, DType::bf16)));
}

TEST(ElementwiseGpu, CastAddScaleFillFiniteSumSquares) {
  NB_REQUIRE_GPU();
  const int64_t n = 1000005;
  auto a = random_vec(n, 91, -100.f, 100.f);
  a[10] = 1.0f + 0x1p-8f;  // a tie: rounds to even
  auto ga = upload(a, DType::f32, {n});
  auto gb = upload(std::vector<float>(n), DType::bf16, {n});
  cast(ga.t(), gb.t(), nullptr);
  EXPECT_TRUE(same_bits(download(gb.t()), rounded(a, DType::bf16))) << "cast must be RNE like f32_to_bf16";
  // bf16 += bf16: one FP32 add, one rounding, as on the host.
  auto x = rounded(random_vec(n, 92), DType::bf16);
  auto gx = upload(x, DType::bf16, {n});
  add_inplace(gb.t(), gx.t(), nullptr);
  std::vector<float> want(n);
  for (int64_t i = 0; i < n; ++i) want[i] = round_to_bf16(round_to_bf16(a[i]) + x[i]);
  EXPECT_TRUE(same_bits(download(gb.t()), want));
  scale_inplace(ga.t(), 0.5f, nullptr);
  for (int64_t i = 0; i < n; ++i) want[i] = a[i] * 0.5f;
  EXPECT_TRUE(same_bits(download(ga.t()), want));
  // f32 += bf16 (mixed dtypes).
  add_inplace(ga.t(), gx.t(), nullptr);
  for (int64_t i = 0; i < n; ++i) want[i] = a[i] * 0.5f + x[i];
  EXPECT_TRUE(same_bits(download(ga.t()), want));
  // Sum of squares: deterministic, and within FP32 tree-summation error of the FP64 sum.
  auto dsum = upload({2.0f}, DType::f32, {1});
  sum_squares_accumulate(ga.t(), static_cast<float*>(dsum.buf.data()), nullptr);
  double ref = 2.0;
  for (float w : want) ref += double(w) * w;
  float got = download(dsum.t())[0];
  EXPECT_NEAR(got, ref, 1e-5 * ref);
  auto dsum2 = upload({2.0f}, DType::f32, {1});
  sum_squares_accumulate(ga.t(), static_cast<float*>(dsum2.buf.data()), nullptr);
  EXPECT_EQ(download(dsum2.t())[0], got);
  EXPECT_TRUE(all_finite(ga.t(), nullptr));
  for (int64_t pos : {int64_t(0), n / 2, n - 1}) {  // head, vector body, scalar tail
    auto bad = want;
    bad[pos] = (pos % 2) ? INFINITY : NAN;
    auto gbad = upload(bad, DType::bf16, {n});
    EXPECT_FALSE(all_finite(gbad.t(), nullptr)) << "position " << pos;
  }
  fill(gb.t(), -3.25f, nullptr);
  auto filled = download(gb.t());
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(filled[i], -3.25f);
}

// Rough effective bandwidth of the memory-bound kernels at Llama-8B shapes, for the report.
TEST(OpsBandwidth, Report) {
  NB_REQUIRE_GPU();
  auto time_ms = [](auto&& fn) {
    fn();
    cudaDeviceSynchronize();
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 10; ++i) fn();
    cudaDeviceSynchronize();
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / 10;
  };
  const int64_t T = 8192, H = 4096;
  auto gx = upload(std::vector<float>(T * H, 0.5f), DType::bf16, {T, H});
  auto gy = upload(std::vector<float>(T * H), DType::bf16, {T, H});
  auto gw = upload(std::vector<float>(H, 1.f), DType::bf16, {H});
  auto gr = upload(std::vector<float>(T), DType::f32, {T});
  auto gdw = upload(std::vector<float>(H), DType::f32, {H});
  double ms = time_ms([&] { rmsnorm_forward(gx.t(), gw.t(), 1e-5f, gy.t(), gr.t(), nullptr); });
  printf("rmsnorm_forward  [%lld,%lld] bf16: %.3f ms, %.0f GB/s\n", (long long)T, (long long)H, ms,
         2.0 * T * H * 2 / ms / 1e6);
  auto gdx = upload(std::vector<float>(T * H), DType::bf16, {T, H});
  ms = time_ms([&] { rmsnorm_backward(gx.t(), gw.t(), gr.t(), gy.t(), gdx.t(), gdw.t(), nullptr); });
  printf("rmsnorm_backward [%lld,%lld] bf16: %.3f ms, %.0f GB/s (min traffic: x, dy, dx)\n", (long long)T, (long long)H,
         ms, 3.0 * T * H * 2 / ms / 1e6);
  {
    const int64_t F = 14336;
    auto gu = upload(std::vector<float>(T * 2 * F, 0.5f), DType::bf16, {T, 2 * F});
    auto ga = upload(std::vector<float>(T * F), DType::bf16, {T, F});
    ms = time_ms([&] { swiglu_forward(gu.t(), ga.t(), nullptr); });
    printf("swiglu_forward [%lld,%lld] bf16: %.3f ms, %.0f GB/s\n", (long long)T, (long long)F, ms,
           3.0 * T * F * 2 / ms / 1e6);
    std::vector<int32_t> ids(T);
    for (int64_t t = 0; t < T; ++t) ids[t] = int32_t((t * 7919) % 128256);
    auto gids = upload_i32(ids, {T});
    auto gtab = upload(std::vector<float>(size_t(128256) * H), DType::f32, {128256, H});
    ms = time_ms([&] { embedding_backward(gids.t(), gx.t(), gtab.t(), nullptr); });
    printf("embedding_backward T=%lld H=%lld (sort + owner sums): %.3f ms, %.0f GB/s\n", (long long)T, (long long)H, ms,
           double(T) * H * (2 + 8) / ms / 1e6);
  }
  const int64_t n = 1 << 28;
  auto p = upload(std::vector<float>(n, 0.1f), DType::f32, {n});
  auto g = upload(std::vector<float>(n, 0.1f), DType::f32, {n});
  auto m = upload(std::vector<float>(n, 0.f), DType::f32, {n});
  auto v = upload(std::vector<float>(n, 0.f), DType::f32, {n});
  auto c = upload(std::vector<float>(n), DType::bf16, {n});
  AdamWParams prm{};
  prm.lr = 1e-4f;
  ms = time_ms([&] { adamw_update(p.t(), g.t(), m.t(), v.t(), c.t(), prm, nullptr); });
  printf("adamw_update n=2^28: %.3f ms, %.0f GB/s\n", ms, double(n) * (4 * 4 + 3 * 4 + 2) / ms / 1e6);
  const int64_t Tc = 1024, Vc = 128256;
  auto lg = upload(std::vector<float>(Tc * Vc, 0.25f), DType::bf16, {Tc, Vc});
  std::vector<int32_t> tg(Tc, 5);
  auto gt = upload_i32(tg, {Tc});
  auto gl = upload(std::vector<float>(Tc), DType::f32, {Tc});
  ms = time_ms([&] { cross_entropy_fwd_bwd(lg.t(), gt.t(), 1.f, gl.t(), nullptr); });
  printf("cross_entropy [%lld,%lld] bf16: %.3f ms, %.0f GB/s (read + write)\n", (long long)Tc, (long long)Vc, ms,
         2.0 * Tc * Vc * 2 / ms / 1e6);
  EXPECT_TRUE(all_finite(gl.t(), nullptr));
}
