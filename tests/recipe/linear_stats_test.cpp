// CPU tests of a Linear's quantization statistics (recipe/linear_stats.h): flushed / saturated / SQNR of
// hand-quantized tensors (FP8 E4M3 per tensor, NVFP4), the Wgrad error against an FP64 dY^T X, the
// RHT-toggled alternative against a Linear that runs the toggled recipe, and numerics left untouched.
#include <gtest/gtest.h>
#include <algorithm>
#include <cmath>
#include <random>
#include <vector>
#include "core/bf16.h"
#include "core/tensor.h"
#include "formats/nvfp4/nvfp4.h"
#include "recipe/linear.h"
#include "recipe/recipe.h"

namespace nb::recipe {
namespace {

Buffer host_tensor(const std::vector<float>& v, int64_t rows, int64_t cols) {
  Buffer b;
  EXPECT_TRUE(Buffer::allocate(&b, DType::f32, Device::cpu, {rows, cols}).is_ok());
  std::copy(v.begin(), v.end(), b.ptr<float>());
  return b;
}

std::vector<float> gaussian(int64_t n, double sigma, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> d(0.0, sigma);
  std::vector<float> v(size_t(n), 0.f);
  for (float& x : v) x = float(d(rng));
  return v;
}

double bf16r(float v) { return double(bf16_to_f32(f32_to_bf16(v))); }

// One forward of x [m, k] through a fresh Linear with statistics on; returns its health.
LinearHealth forward_stats(const Recipe& r, const std::vector<float>& x, int64_t m, int64_t k, int64_t n) {
  Linear lin;
  EXPECT_TRUE(lin.init(r, false, "l", 1, m, k, n, Device::cpu).is_ok());
  lin.set_collect_stats(true);
  Buffer bx = host_tensor(x, m, k), bw = host_tensor(gaussian(n * k, 0.05, 2), n, k), by;
  EXPECT_TRUE(Buffer::allocate(&by, DType::f32, Device::cpu, {m, n}).is_ok());
  Status st = lin.forward(bx.tensor(), bw.tensor(), by.tensor(), 0.f, nullptr);
  EXPECT_TRUE(st.is_ok()) << st.message();
  LinearHealth h;
  EXPECT_TRUE(lin.take_health(&h).is_ok());
  return h;
}

TEST(LinearStats, HandQuantizedFp8E4m3PerTensor) {
  Recipe r;
  ASSERT_TRUE(recipe_preset("bf16_with_fp8_current_scaling_mixed", &r).is_ok());
  // x [16, 16], current scaling: amax 448 gives scale = 448 / 448 = 1, so each value is its own E4M3 code:
  //   448    -> 0x7E, the largest E4M3 magnitude: exact, saturated
  //   2^-11  -> 0: below half the smallest subnormal 2^-9: flushed, error 2^-11
  //   3      -> 3: exact
  //   17     -> 16: in [16, 32) the step is 2; the tie goes to the even mantissa (1.000b): error 1
  //   -20    -> -20 (1.010b x 2^4): exact
  // and 251 zeros (not counted as flushed; stored as code 0, not saturated).
  std::vector<float> x(size_t(16 * 16), 0.f);
  x[0] = 448.f;
  x[17] = std::ldexp(1.f, -11);
  x[40] = 3.f;
  x[100] = 17.f;
  x[255] = -20.f;
  LinearHealth h = forward_stats(r, x, 16, 16, 16);
  ASSERT_TRUE(h.has_stats);
  const RoleQuantStats& in = h.roles[0];
  ASSERT_TRUE(in.seen);
  EXPECT_EQ(in.fmt, Fmt::fp8_e4m3);
  EXPECT_DOUBLE_EQ(in.flushed, 1.0 / 5.0);      // 1 of the 5 non-zero values
  EXPECT_DOUBLE_EQ(in.saturated, 1.0 / 256.0);  // 448 of 256 elements
  const double e = std::ldexp(1.0, -11);
  const double sig = 448.0 * 448.0 + e * e + 9.0 + 289.0 + 400.0, err = e * e + 1.0;
  EXPECT_NEAR(in.sqnr_db, 10.0 * std::log10(sig / err), 1e-9);
  EXPECT_TRUE(h.roles[1].seen);   // the weight was quantized by the same forward
  EXPECT_FALSE(h.roles[2].seen);  // no backward yet
  EXPECT_FALSE(h.wgrad.measured);
  EXPECT_LE(h.sqnr_db, in.sqnr_db);  // the summary is the worst role
  EXPECT_GE(h.flushed, in.flushed);
}

TEST(LinearStats, HandQuantizedNvfp4) {
  Recipe r;
  ASSERT_TRUE(recipe_preset("bf16_with_nvfp4_mixed", &r).is_ok());
  // x [32, 32] (NVFP4 Linears take multiples of 32), all zero but row 0's two 16-element blocks.
  // Tensor amax 2688 = 6 * 448: S_enc = 6*448 / amax = 1, global decode scale amax / (6*448) = 1.
  // Block 0 {2688, 100, 1000}: block scale E4M3(2688 / 6) = 448; x / 448 rounds to E2M1 {0,.5,1,1.5,2,3,4,6}:
  //   2688 -> 6 (code 7, saturated), exact;  100 -> 0.223 -> 0: flushed, error 100;
  //   1000 -> 2.232 -> 2 -> 896: error 104
  // Block 1 {12, 5.5}: block scale E4M3(12 / 6) = 2:
  //   12 -> 6 (saturated), exact;  5.5 -> 2.75 -> 3 -> 6: error 0.5
  std::vector<float> x(size_t(32 * 32), 0.f);
  x[0] = 2688.f;
  x[1] = 100.f;
  x[2] = 1000.f;
  x[16] = 12.f;
  x[17] = 5.5f;
  LinearHealth h = forward_stats(r, x, 32, 32, 32);
  const RoleQuantStats& in = h.roles[0];
  ASSERT_TRUE(in.seen);
  EXPECT_EQ(in.fmt, Fmt::nvfp4);
  EXPECT_DOUBLE_EQ(in.flushed, 1.0 / 5.0);
  EXPECT_DOUBLE_EQ(in.saturated, 2.0 / 1024.0);
  const double sig = 2688.0 * 2688.0 + 100.0 * 100.0 + 1000.0 * 1000.0 + 144.0 + 30.25;
  const double err = 100.0 * 100.0 + 104.0 * 104.0 + 0.25;
  EXPECT_NEAR(in.sqnr_db, 10.0 * std::log10(sig / err), 1e-9);
}

// The block crest factor of the input role, by hand. x [32, 32] is zero but for two column-wise blocks
// (16 consecutive tokens of one feature; all-zero blocks are skipped):
//   feature 0, tokens 0-15: one spike 4 and 15 zeros -> max 4, rms sqrt(16/16) = 1: crest 4. Its RHT is
//     (1/4) * 4 * s_0 * (row 0 of H16) = 16 values +-1: crest 1 (the spike spread over the block).
//   feature 1, tokens 0-15: all 1 -> crest 1. Its RHT is (1/4) * s H16, computed here from the sign mask
//     and H16[i][j] = (-1)^popcount(i & j) (any ordering of H's columns gives the same crest factor).
TEST(LinearStats, Nvfp4BlockCrestFactorsByHand) {
  Recipe r;
  ASSERT_TRUE(recipe_preset("bf16_with_nvfp4_mixed", &r).is_ok());
  std::vector<float> x(size_t(32 * 32), 0.f);
  x[0] = 4.f;
  for (int t = 0; t < 16; ++t) x[size_t(t * 32 + 1)] = 1.f;
  double peak = 0, sq = 0;
  for (int j = 0; j < 16; ++j) {
    double y = 0;
    for (int i = 0; i < 16; ++i) {
      const double sign = (nvfp4::kRhtSignMask >> i) & 1u ? -1.0 : 1.0;
      y += sign * ((__builtin_popcount(unsigned(i & j)) & 1) ? -1.0 : 1.0) / 4.0;
    }
    peak = std::max(peak, std::fabs(y));
    sq += y * y;
  }
  const double constant_block_rht = peak / std::sqrt(sq / 16.0);  // 2.0 for the mask 0xD7E8
  LinearHealth h = forward_stats(r, x, 32, 32, 32);
  const RoleQuantStats& in = h.roles[0];
  ASSERT_TRUE(in.has_crest);
  EXPECT_DOUBLE_EQ(in.crest, (4.0 + 1.0) / 2.0);
  EXPECT_DOUBLE_EQ(in.crest_rht, (1.0 + constant_block_rht) / 2.0);
  EXPECT_DOUBLE_EQ(constant_block_rht, 2.0);
  EXPECT_FALSE(h.roles[1].has_crest);  // weights are not Wgrad operands: no crest factor
}

// A Linear of `r` run forward + backward once on fixed data, statistics on or off; dw starts at dw0.
struct WgradRun {
  static constexpr int64_t kM = 64, kK = 64, kN = 32;
  std::vector<float> x = gaussian(kM * kK, 1.0, 11), w = gaussian(kN * kK, 0.05, 12);
  std::vector<float> dy = gaussian(kM * kN, 1e-3, 13);
  std::vector<float> y, dx, dw0 = std::vector<float>(size_t(kN * kK), 0.25f), dw;
  LinearHealth health;

  Status run(const Recipe& r, bool stats, int micro_batches = 1) {
    Linear lin;
    NB_TRY(lin.init(r, false, "l", 7, kM, kK, kN, Device::cpu));
    lin.new_step(3);
    lin.set_collect_stats(stats);
    Buffer bx = host_tensor(x, kM, kK), bw = host_tensor(w, kN, kK), bdy = host_tensor(dy, kM, kN);
    Buffer bdw = host_tensor(dw0, kN, kK), by, bdx;
    NB_TRY(Buffer::allocate(&by, DType::f32, Device::cpu, {kM, kN}));
    NB_TRY(Buffer::allocate(&bdx, DType::f32, Device::cpu, {kM, kK}));
    for (int i = 0; i < micro_batches; ++i) {
      NB_TRY(lin.forward(bx.tensor(), bw.tensor(), by.tensor(), 0.f, nullptr));
      NB_TRY(lin.backward(bdy.tensor(), bx.tensor(), bw.tensor(), bdx.tensor(), 0.f, bdw.tensor(), nullptr));
    }
    y.assign(by.ptr<float>(), by.ptr<float>() + kM * kN);
    dx.assign(bdx.ptr<float>(), bdx.ptr<float>() + kM * kK);
    dw.assign(bdw.ptr<float>(), bdw.ptr<float>() + kN * kK);
    return lin.take_health(&health);
  }
  // dY^T X in FP64 over the BF16-rounded sources.
  std::vector<double> reference() const {
    std::vector<double> ref(size_t(kN * kK), 0.0);
    for (int64_t o = 0; o < kN; ++o)
      for (int64_t i = 0; i < kK; ++i)
        for (int64_t t = 0; t < kM; ++t)
          ref[size_t(o * kK + i)] += bf16r(dy[size_t(t * kN + o)]) * bf16r(x[size_t(t * kK + i)]);
    return ref;
  }
};

TEST(LinearStats, WgradErrorMatchesFp64) {
  Recipe r;
  ASSERT_TRUE(recipe_preset("bf16_with_nvfp4_mixed", &r).is_ok());
  WgradRun run;
  Status st = run.run(r, true);
  ASSERT_TRUE(st.is_ok()) << st.message();
  const std::vector<double> ref = run.reference();
  double g2 = 0, n2 = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double dwq = double(run.dw[i]) - double(run.dw0[i]);  // dw started at 0.25: dW_q is the increment
    g2 += ref[i] * ref[i];
    n2 += (dwq - ref[i]) * (dwq - ref[i]);
  }
  const WgradQuantStats& w = run.health.wgrad;
  ASSERT_TRUE(w.measured);
  EXPECT_NEAR(w.grad_norm, std::sqrt(g2), 1e-5 * std::sqrt(g2));
  // dW_q is recovered as dw_after - dw_before in FP32 (at most ulp(0.25) = 3e-8 per element, 1.4e-6 over the
  // 2048 elements) and the reference is FP32: well within 1e-4 of the noise (about 0.06 here).
  EXPECT_NEAR(w.noise_norm, std::sqrt(n2), 1e-4 * std::sqrt(n2));
  EXPECT_GT(w.noise_norm, 0.0);
  EXPECT_LT(w.noise_norm, w.grad_norm);  // NVFP4 on Gaussian data: rel_err well below 1
  ASSERT_TRUE(w.has_alt);
  EXPECT_FALSE(w.alt_rht);  // the preset uses RHT on both Wgrad operands: the alternative has none
  EXPECT_GT(w.alt_noise_norm, 0.0);
}

TEST(LinearStats, WgradAltIsTheRhtToggledRecipe) {
  Recipe with, without;
  ASSERT_TRUE(recipe_preset("bf16_with_nvfp4_mixed", &with).is_ok());
  without = with;
  without.input.rht = without.grad.rht = false;
  WgradRun a, b;
  a.dw0.assign(a.dw0.size(), 0.f);  // exact dW_q: the comparison below is then to rounding only
  b.dw0 = a.dw0;
  ASSERT_TRUE(a.run(with, true).is_ok());
  ASSERT_TRUE(b.run(without, true).is_ok());
  // Same SR keys (tensor id, step, micro-batch): the alternative of one is the other's own Wgrad.
  ASSERT_TRUE(a.health.wgrad.has_alt && b.health.wgrad.has_alt);
  EXPECT_FALSE(a.health.wgrad.alt_rht);
  EXPECT_TRUE(b.health.wgrad.alt_rht);
  EXPECT_NEAR(a.health.wgrad.alt_noise_norm, b.health.wgrad.noise_norm, 1e-5 * b.health.wgrad.noise_norm);
  EXPECT_NEAR(b.health.wgrad.alt_noise_norm, a.health.wgrad.noise_norm, 1e-5 * a.health.wgrad.noise_norm);
  EXPECT_DOUBLE_EQ(a.health.wgrad.grad_norm, b.health.wgrad.grad_norm);
}

TEST(LinearStats, StatisticsLeaveTheNumericsBitIdentical) {
  for (const char* preset : {"bf16_with_nvfp4_mixed", "bf16_with_fp8_current_scaling_mixed"}) {
    Recipe r;
    ASSERT_TRUE(recipe_preset(preset, &r).is_ok());
    WgradRun on, off;
    ASSERT_TRUE(on.run(r, true, 2).is_ok());
    ASSERT_TRUE(off.run(r, false, 2).is_ok());
    EXPECT_EQ(on.y, off.y) << preset;
    EXPECT_EQ(on.dx, off.dx) << preset;
    EXPECT_EQ(on.dw, off.dw) << preset;
    EXPECT_TRUE(on.health.wgrad.measured) << preset;
    EXPECT_EQ(on.health.wgrad.has_alt, r.input.fmt == Fmt::nvfp4) << preset;  // the alternative is NVFP4's
    EXPECT_FALSE(off.health.has_stats) << preset;
  }
}

TEST(LinearStats, OnlyTheFirstMicroBatchOfAStepIsMeasured) {
  Recipe r;
  ASSERT_TRUE(recipe_preset("bf16_with_fp8_current_scaling_mixed", &r).is_ok());
  WgradRun one, two;
  ASSERT_TRUE(one.run(r, true, 1).is_ok());
  ASSERT_TRUE(two.run(r, true, 2).is_ok());  // the second micro-batch (same data) is not measured again
  EXPECT_DOUBLE_EQ(one.health.wgrad.grad_norm, two.health.wgrad.grad_norm);
  EXPECT_DOUBLE_EQ(one.health.wgrad.noise_norm, two.health.wgrad.noise_norm);
  EXPECT_GT(two.health.stats_ms, 0.0);
}

TEST(LinearStats, Bf16LayerHasNoStatistics) {
  Recipe r;
  ASSERT_TRUE(recipe_preset("bf16_mixed", &r).is_ok());
  WgradRun run;
  ASSERT_TRUE(run.run(r, true).is_ok());
  EXPECT_FALSE(run.health.has_stats);
  EXPECT_FALSE(run.health.wgrad.measured);
}

// A copy over 65,536 elements is read in whole groups of 16 rows, every stride-th group (linear_stats.cpp):
// x [4096, 256] has 256 groups and 65,536 / (16 * 256) = 16 are wanted, so groups 0, 16, 32, ... (rows
// 0-15, 256-271, ...). The statistics must be exactly those of these rows of the full tensor's quantization.
TEST(LinearStats, LargeCopiesAreSampledInWholeRowGroups) {
  Recipe r;
  ASSERT_TRUE(recipe_preset("bf16_with_nvfp4_mixed", &r).is_ok());
  const int64_t m = 4096, k = 256;
  std::vector<float> x = gaussian(m * k, 1.0, 7);
  for (size_t i = 0; i < x.size(); i += 97) x[i] *= 1e-4f;  // some values small enough to flush
  LinearHealth h = forward_stats(r, x, m, k, 32);
  std::vector<bf16> xb(x.size());
  for (size_t i = 0; i < x.size(); ++i) xb[i] = f32_to_bf16(x[i]);
  std::vector<uint8_t> data(size_t(m * k / 2)), scales(size_t(m * k / 16));
  float amax = 0;
  nvfp4::Options o;
  o.colwise = false;
  ASSERT_TRUE(nvfp4::quantize_ref(xb.data(), o, {m, k, data.data(), scales.data(), nullptr, nullptr, &amax}).is_ok());
  std::vector<float> xq(x.size());
  nvfp4::dequantize_ref(data.data(), scales.data(), amax, m, k, xq.data());
  double sig = 0, err = 0;
  int64_t nonzero = 0, flushed = 0, n = 0;
  for (int64_t row = 0; row < m; ++row) {
    if ((row / 16) % 16 != 0) continue;
    for (int64_t c = 0; c < k; ++c, ++n) {
      const double v = bf16_to_f32(xb[size_t(row * k + c)]), q = xq[size_t(row * k + c)];
      sig += v * v;
      err += (v - q) * (v - q);
      nonzero += v != 0;
      flushed += v != 0 && q == 0;
    }
  }
  ASSERT_EQ(n, 65536);
  const RoleQuantStats& in = h.roles[0];
  ASSERT_TRUE(in.seen);
  EXPECT_GT(flushed, 0);
  EXPECT_DOUBLE_EQ(in.flushed, double(flushed) / double(nonzero));
  EXPECT_NEAR(in.sqnr_db, 10.0 * std::log10(sig / err), 1e-6);
}

}  // namespace
}  // namespace nb::recipe
