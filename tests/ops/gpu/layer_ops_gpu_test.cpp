// CUDA RMSNorm, RoPE (also with packed-sequence positions), SwiGLU and embedding against the CPU
// reference on the same (BF16-rounded) inputs, at odd shapes (scalar paths, tails) and Llama-8B shapes
// (vector paths).
#include <gtest/gtest.h>
#include <cmath>
#include "../ops_test_util.h"
#include "common/gpu.h"
#include "gpu_util.h"
#include "ops/embedding.h"
#include "ops/rmsnorm.h"
#include "ops/rope.h"
#include "ops/swiglu.h"

using namespace nb;
using namespace nb::ops;
using namespace nb::ops::testing;

struct Shape2 {
  int64_t rows, cols;
  DType dt;
};

class RMSNormGpu : public ::testing::TestWithParam<Shape2> {};

TEST_P(RMSNormGpu, ForwardBackwardMatchCpu) {
  NB_REQUIRE_GPU();
  const auto [T, H, dt] = GetParam();
  auto x = rounded(random_vec(T * H, 31, -2.f, 2.f), dt), w = rounded(random_vec(H, 32, 0.5f, 1.5f), dt);
  auto dy = rounded(random_vec(T * H, 33), dt);
  std::vector<float> y(T * H), rstd(T), dx(T * H), dw(H, 0.5f);
  rmsnorm_forward(host_f32(x, {T, H}), host_f32(w, {H}), 1e-5f, host_f32(y, {T, H}), host_f32(rstd, {T}), nullptr);
  rmsnorm_backward(host_f32(x, {T, H}), host_f32(w, {H}), host_f32(rstd, {T}), host_f32(dy, {T, H}),
                   host_f32(dx, {T, H}), host_f32(dw, {H}), nullptr);
  auto gx = upload(x, dt, {T, H}), gw = upload(w, dt, {H}), gdy = upload(dy, dt, {T, H});
  auto gy = upload(std::vector<float>(T * H), dt, {T, H}), gdx = upload(std::vector<float>(T * H), dt, {T, H});
  auto grstd = upload(std::vector<float>(T), DType::f32, {T});
  auto gdw = upload(std::vector<float>(H, 0.5f), DType::f32, {H});
  rmsnorm_forward(gx.t(), gw.t(), 1e-5f, gy.t(), grstd.t(), nullptr);
  // rstd: FP32 sum of squares in a different order, ~1e-6 relative.
  EXPECT_EQ(count_bad(download(grstd.t()), rstd, 1e-5, {0.0}, "rstd"), 0);
  double out_rel = dt == DType::bf16 ? kBf16Rel : 1e-5;
  EXPECT_EQ(count_bad(download(gy.t()), y, out_rel, {1e-30}, "y"), 0);
  // The backward uses the CPU's rstd so both sides start from the same numbers.
  auto grstd_cpu = upload(rstd, DType::f32, {T});
  rmsnorm_backward(gx.t(), gw.t(), grstd_cpu.t(), gdy.t(), gdx.t(), gdw.t(), nullptr);
  // dx = rstd*w*dy - coef*x can cancel; the FP32 error of coef (a row dot product) is ~1e-6 of the row's
  // largest term, so allow 2^-16 of the row max on top of the BF16 output rounding.
  std::vector<double> dx_abs(T * H);
  for (int64_t t = 0; t < T; ++t) {
    double mx = 0;
    for (int64_t j = 0; j < H; ++j) mx = std::fmax(mx, std::fabs(dx[t * H + j]));
    for (int64_t j = 0; j < H; ++j) dx_abs[t * H + j] = 0x1p-16 * mx;
  }
  EXPECT_EQ(count_bad(download(gdx.t()), dx, out_rel, dx_abs, "dx"), 0);
  // dw: FP32 sums of T terms (chunks of 256, then chunk partials) vs FP64 on the CPU: the error bound is
  // ~(depth) * 2^-24 * sum|terms| with depth < 64, so 1e-5 of sum|terms| (plus the 0.5 start value).
  std::vector<double> dw_abs(H);
  for (int64_t j = 0; j < H; ++j) {
    double s = 0;
    for (int64_t t = 0; t < T; ++t) s += std::fabs(double(dy[t * H + j]) * x[t * H + j] * rstd[t]);
    dw_abs[j] = 1e-5 * s + 1e-7;
  }
  EXPECT_EQ(count_bad(download(gdw.t()), dw, 0.0, dw_abs, "dw"), 0);
  // Deterministic: a second backward adds the bit-identical amount again.
  auto dw1 = download(gdw.t());
  auto gdw2 = upload(std::vector<float>(H, 0.5f), DType::f32, {H});
  rmsnorm_backward(gx.t(), gw.t(), grstd_cpu.t(), gdy.t(), gdx.t(), gdw2.t(), nullptr);
  EXPECT_TRUE(same_bits(download(gdw2.t()), dw1));
}

INSTANTIATE_TEST_SUITE_P(Shapes, RMSNormGpu,
                         ::testing::Values(Shape2{37, 1001, DType::bf16}, Shape2{5, 24, DType::f32},
                                           Shape2{300, 4096, DType::f32}, Shape2{4096, 4096, DType::bf16}));

struct RopeShape {
  int64_t B, S, nh, hd;
  DType dt;
};
class RoPEGpu : public ::testing::TestWithParam<RopeShape> {};

TEST_P(RoPEGpu, ForwardBackwardMatchCpu) {
  NB_REQUIRE_GPU();
  const auto [B, S, nh, hd, dt] = GetParam();
  const int64_t half = hd / 2, n = B * S * nh * hd;
  std::vector<float> c(S * half), s(S * half);
  rope_table(RopeConfig{}, S, hd, c.data(), s.data());
  auto x = rounded(random_vec(n, 41, -3.f, 3.f), dt);
  auto gc = upload(c, DType::f32, {S, half}), gs = upload(s, DType::f32, {S, half});
  for (bool inverse : {false, true}) {
    auto ref = x;
    auto gx = upload(x, dt, {B, S, nh, hd});
    Tensor hx = host_f32(ref, {B, S, nh, hd}), hc = host_f32(c, {S, half}), hs = host_f32(s, {S, half});
    if (inverse) {
      rope_backward(hx, hc, hs, nullptr);
      rope_backward(gx.t(), gc.t(), gs.t(), nullptr);
    } else {
      rope_forward(hx, hc, hs, nullptr);
      rope_forward(gx.t(), gc.t(), gs.t(), nullptr);
    }
    // Same FP32 operations on both sides; the output is rounded once (BF16) or not at all (FP32).
    std::vector<double> abs_tol(n);
    for (int64_t i = 0; i < n; ++i) abs_tol[i] = 1e-30;
    EXPECT_EQ(count_bad(download(gx.t()), ref, dt == DType::bf16 ? kBf16Rel : 1e-6, abs_tol,
                        inverse ? "rope_backward" : "rope_forward"),
              0);
  }
}

// The fused-QKV split and its backward on CUDA against the CPU reference: the same FP32 arithmetic per
// element, one rounding to the storage type.
TEST(RoPEGpu, FusedQkvSplitAndMergeMatchCpu) {
  NB_REQUIRE_GPU();
  for (DType dt : {DType::bf16, DType::f32}) {
    const int64_t B = 2, S = 64, hq = 8, hkv = 2, hd = 64, half = 32, heads = hq + 2 * hkv;
    const int64_t nq = B * S * hq * hd, nkv = B * S * hkv * hd, nf = B * S * heads * hd;
    std::vector<float> c(S * half), s(S * half);
    rope_table(RopeConfig{}, S, hd, c.data(), s.data());
    auto gc = upload(c, DType::f32, {S, half}), gs = upload(s, DType::f32, {S, half});
    const Tensor hc = host_f32(c, {S, half}), hs = host_f32(s, {S, half});
    auto qkv = rounded(random_vec(nf, 51, -3.f, 3.f), dt);
    std::vector<float> q(nq), k(nkv), v(nkv);
    rope_split_qkv(host_f32(qkv, {B, S, heads, hd}), hc, hs, host_f32(q, {B, S, hq, hd}), host_f32(k, {B, S, hkv, hd}),
                   host_f32(v, {B, S, hkv, hd}), nullptr);
    auto gqkv = upload(qkv, dt, {B, S, heads, hd});
    auto gq = upload(std::vector<float>(nq), dt, {B, S, hq, hd});
    auto gk = upload(std::vector<float>(nkv), dt, {B, S, hkv, hd}),
         gv = upload(std::vector<float>(nkv), dt, {B, S, hkv, hd});
    rope_split_qkv(gqkv.t(), gc.t(), gs.t(), gq.t(), gk.t(), gv.t(), nullptr);
    const double rel = dt == DType::bf16 ? kBf16Rel : 1e-6;
    EXPECT_EQ(count_bad(download(gq.t()), q, rel, std::vector<double>(nq, 1e-30), "split q"), 0);
    EXPECT_EQ(count_bad(download(gk.t()), k, rel, std::vector<double>(nkv, 1e-30), "split k"), 0);
    EXPECT_TRUE(same_bits(download(gv.t()), v)) << "v is a copy";
    auto dq = rounded(random_vec(nq, 52), dt), dk = rounded(random_vec(nkv, 53), dt),
         dv = rounded(random_vec(nkv, 54), dt);
    std::vector<float> dqkv(nf);
    rope_merge_qkv_grad(host_f32(dq, {B, S, hq, hd}), host_f32(dk, {B, S, hkv, hd}), host_f32(dv, {B, S, hkv, hd}), hc,
                        hs, host_f32(dqkv, {B, S, heads, hd}), nullptr);
    auto gdq = upload(dq, dt, {B, S, hq, hd}), gdk = upload(dk, dt, {B, S, hkv, hd}),
         gdv = upload(dv, dt, {B, S, hkv, hd});
    auto gdqkv = upload(std::vector<float>(nf), dt, {B, S, heads, hd});
    rope_merge_qkv_grad(gdq.t(), gdk.t(), gdv.t(), gc.t(), gs.t(), gdqkv.t(), nullptr);
    EXPECT_EQ(count_bad(download(gdqkv.t()), dqkv, rel, std::vector<double>(nf, 1e-30), "merge dqkv"), 0);
  }
}

// Packed-row positions (restarting at each segment start) for one RoPE problem, and t % S.
std::vector<int32_t> restarted_positions(int64_t T, int64_t S, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> pos(T);
  int64_t start = 0;
  for (int64_t t = 0; t < T; ++t) {
    if (t % S == 0 || rng() % 5 == 0) start = t;  // a new segment at every row start, else at random
    pos[t] = int32_t(t - start);
  }
  return pos;
}

// rope_forward/backward and the fused split/merge with positions on CUDA against the CPU (which the CPU
// tests tie to rotating each segment alone); positions t % S give the bits of no positions.
TEST_P(RoPEGpu, PositionsMatchCpu) {
  NB_REQUIRE_GPU();
  const auto [B, S, nh, hd, dt] = GetParam();
  const int64_t half = hd / 2, T = B * S, hkv = 1, hq = nh, heads = hq + 2 * hkv;
  std::vector<float> c(S * half), s(S * half);
  rope_table(RopeConfig{}, S, hd, c.data(), s.data());
  auto gc = upload(c, DType::f32, {S, half}), gs = upload(s, DType::f32, {S, half});
  const Tensor hc = host_f32(c, {S, half}), hs = host_f32(s, {S, half});
  std::vector<int32_t> pos = restarted_positions(T, S, 71), rows(T);
  for (int64_t t = 0; t < T; ++t) rows[t] = int32_t(t % S);
  auto gpos = upload_i32(pos, {T}), grows = upload_i32(rows, {T});
  const Tensor hpos = host_i32(pos, {T});
  const double rel = dt == DType::bf16 ? kBf16Rel : 1e-6;
  auto x = rounded(random_vec(T * nh * hd, 72, -3.f, 3.f), dt);
  for (bool inverse : {false, true}) {
    auto ref = x;
    auto gx = upload(x, dt, {B, S, nh, hd}), gx_rows = upload(x, dt, {B, S, nh, hd}),
         gx_none = upload(x, dt, {B, S, nh, hd});
    auto op = inverse ? rope_backward : rope_forward;
    op(host_f32(ref, {B, S, nh, hd}), hc, hs, nullptr, &hpos);
    op(gx.t(), gc.t(), gs.t(), nullptr, &gpos.t());
    op(gx_rows.t(), gc.t(), gs.t(), nullptr, &grows.t());
    op(gx_none.t(), gc.t(), gs.t(), nullptr, nullptr);
    EXPECT_EQ(count_bad(download(gx.t()), ref, rel, {1e-30}, inverse ? "rope_backward" : "rope_forward"), 0);
    EXPECT_TRUE(same_bits(download(gx_rows.t()), download(gx_none.t()))) << "positions t % S";
  }
  // Fused split and merge (hq = nh query heads, one K/V head).
  auto qkv = rounded(random_vec(T * heads * hd, 73, -3.f, 3.f), dt);
  std::vector<float> q(T * hq * hd), k(T * hkv * hd), v(T * hkv * hd), dqkv(qkv.size());
  rope_split_qkv(host_f32(qkv, {B, S, heads, hd}), hc, hs, host_f32(q, {B, S, hq, hd}), host_f32(k, {B, S, hkv, hd}),
                 host_f32(v, {B, S, hkv, hd}), nullptr, &hpos);
  auto gqkv = upload(qkv, dt, {B, S, heads, hd});
  auto gq = upload(std::vector<float>(q.size()), dt, {B, S, hq, hd});
  auto gk = upload(std::vector<float>(k.size()), dt, {B, S, hkv, hd}),
       gv = upload(std::vector<float>(v.size()), dt, {B, S, hkv, hd});
  rope_split_qkv(gqkv.t(), gc.t(), gs.t(), gq.t(), gk.t(), gv.t(), nullptr, &gpos.t());
  EXPECT_EQ(count_bad(download(gq.t()), q, rel, {1e-30}, "split q"), 0);
  EXPECT_EQ(count_bad(download(gk.t()), k, rel, {1e-30}, "split k"), 0);
  EXPECT_TRUE(same_bits(download(gv.t()), v)) << "v is a copy";
  auto dq = rounded(random_vec(q.size(), 74), dt), dk = rounded(random_vec(k.size(), 75), dt);
  auto dv = rounded(random_vec(v.size(), 76), dt);
  rope_merge_qkv_grad(host_f32(dq, {B, S, hq, hd}), host_f32(dk, {B, S, hkv, hd}), host_f32(dv, {B, S, hkv, hd}), hc,
                      hs, host_f32(dqkv, {B, S, heads, hd}), nullptr, &hpos);
  auto gdqkv = upload(std::vector<float>(qkv.size()), dt, {B, S, heads, hd});
  auto gdq = upload(dq, dt, {B, S, hq, hd}), gdk = upload(dk, dt, {B, S, hkv, hd}),
       gdv = upload(dv, dt, {B, S, hkv, hd});
  rope_merge_qkv_grad(gdq.t(), gdk.t(), gdv.t(), gc.t(), gs.t(), gdqkv.t(), nullptr, &gpos.t());
  EXPECT_EQ(count_bad(download(gdqkv.t()), dqkv, rel, {1e-30}, "merge dqkv"), 0);
}

INSTANTIATE_TEST_SUITE_P(Shapes, RoPEGpu,
                         ::testing::Values(RopeShape{3, 7, 5, 6, DType::bf16}, RopeShape{2, 9, 3, 16, DType::f32},
                                           RopeShape{1, 8192, 32, 128, DType::bf16}));

class SwiGLUGpu : public ::testing::TestWithParam<Shape2> {};

TEST_P(SwiGLUGpu, ForwardBackwardMatchCpu) {
  NB_REQUIRE_GPU();
  const auto [T, F, dt] = GetParam();
  auto gu = rounded(random_vec(T * 2 * F, 51, -6.f, 6.f), dt), dout = rounded(random_vec(T * F, 52), dt);
  std::vector<float> out(T * F), dgu(T * 2 * F);
  swiglu_forward(host_f32(gu, {T, 2 * F}), host_f32(out, {T, F}), nullptr);
  swiglu_backward(host_f32(gu, {T, 2 * F}), host_f32(dout, {T, F}), host_f32(dgu, {T, 2 * F}), nullptr);
  auto ggu = upload(gu, dt, {T, 2 * F}), gd = upload(dout, dt, {T, F});
  auto gout = upload(std::vector<float>(T * F), dt, {T, F});
  swiglu_forward(ggu.t(), gout.t(), nullptr);
  double rel = dt == DType::bf16 ? kBf16Rel : 1e-5;
  // expf differs from std::exp by a few FP32 ulps; near g = 0 or u = 0 the product is tiny, hence an
  // absolute floor of 2^-20 times the operand magnitudes.
  std::vector<double> abs_out(T * F), abs_dgu(T * 2 * F);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < F; ++j) {
      double g = std::fabs(gu[t * 2 * F + j]), u = std::fabs(gu[t * 2 * F + F + j]), d = std::fabs(dout[t * F + j]);
      abs_out[t * F + j] = 0x1p-20 * g * u + 1e-30;
      abs_dgu[t * 2 * F + j] = 0x1p-20 * d * u * (1 + g) + 1e-30;  // 1 + g(1 - sig) can cancel
      abs_dgu[t * 2 * F + F + j] = 0x1p-20 * d * g + 1e-30;
    }
  EXPECT_EQ(count_bad(download(gout.t()), out, rel, abs_out, "swiglu out"), 0);
  auto gdgu = upload(std::vector<float>(T * 2 * F), dt, {T, 2 * F});
  swiglu_backward(ggu.t(), gd.t(), gdgu.t(), nullptr);
  EXPECT_EQ(count_bad(download(gdgu.t()), dgu, rel, abs_dgu, "swiglu dgate_up"), 0);
  swiglu_backward(ggu.t(), gd.t(), ggu.t(), nullptr);  // in place gives the same bits
  EXPECT_TRUE(same_bits(download(ggu.t()), download(gdgu.t())));
}

INSTANTIATE_TEST_SUITE_P(Shapes, SwiGLUGpu,
                         ::testing::Values(Shape2{13, 77, DType::bf16}, Shape2{9, 40, DType::f32},
                                           Shape2{1024, 14336, DType::bf16}));

class EmbeddingGpu : public ::testing::TestWithParam<Shape2> {};

// rows = T tokens, cols = H; vocab 32000 (odd shapes: 97).
TEST_P(EmbeddingGpu, ForwardExactBackwardDeterministic) {
  NB_REQUIRE_GPU();
  const auto [T, H, dt] = GetParam();
  const int64_t V = H % 8 ? 97 : 32000;
  auto table = rounded(random_vec(V * H, 61), dt);
  std::vector<int32_t> ids(T);
  std::mt19937 rng(62);
  for (int64_t t = 0; t < T; ++t) ids[t] = (t % 5 == 0) ? 7 : int32_t(rng() % (V < 1000 ? V : 1000));  // heavy repeats
  std::vector<float> out(T * H);
  embedding_forward(host_f32(table, {V, H}), host_i32(ids, {T}), host_f32(out, {T, H}), nullptr);
  auto gt = upload(table, dt, {V, H});
  auto gids = upload_i32(ids, {T});
  auto gout = upload(std::vector<float>(T * H), dt, {T, H});
  embedding_forward(gt.t(), gids.t(), gout.t(), nullptr);
  EXPECT_TRUE(same_bits(download(gout.t()), out)) << "the gather copies values exactly";
  auto dout = rounded(random_vec(T * H, 63), dt);
  std::vector<float> dtable(V * H, 0.f);
  embedding_backward(host_i32(ids, {T}), host_f32(dout, {T, H}), host_f32(dtable, {V, H}), nullptr);
  auto gdout = upload(dout, dt, {T, H});
  auto gdt = upload(std::vector<float>(V * H, 0.f), DType::f32, {V, H});
  embedding_backward(gids.t(), gdout.t(), gdt.t(), nullptr);
  // Starting from zero, both sides add each id's rows in token order in FP32: identical bits.
  auto got = download(gdt.t());
  EXPECT_TRUE(same_bits(got, dtable)) << "embedding backward should equal the CPU token-order sum";
  embedding_backward(gids.t(), gdout.t(), gdt.t(), nullptr);  // accumulates: now twice the sum
  auto twice = download(gdt.t());
  int64_t bad = 0;
  for (size_t i = 0; i < got.size(); ++i) bad += twice[i] != got[i] + got[i];
  EXPECT_EQ(bad, 0);
}

INSTANTIATE_TEST_SUITE_P(Shapes, EmbeddingGpu,
                         ::testing::Values(Shape2{1001, 100, DType::f32}, Shape2{333, 36, DType::bf16},
                                           Shape2{8192, 4096, DType::bf16}));
