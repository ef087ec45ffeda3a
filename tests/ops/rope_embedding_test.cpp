// RoPE and embedding CPU references: the Llama 3.1 frequency rule at hand-checked indices, the
// rotation against its formula, backward = transpose of forward, explicit positions (packed sequences),
// and the embedding gather/scatter.
#include <gtest/gtest.h>
#include "ops/embedding.h"
#include "ops/rope.h"
#include "ops_test_util.h"

using namespace nb;
using namespace nb::ops;
using namespace nb::ops::testing;

// theta 500000, hd 128: base f_i = 500000^(-i/64), wavelength 2*pi/f_i. Thresholds: 8192/4 = 2048 and
// 8192/1 = 8192. Hand values:
//   i = 0:  f = 1, wavelength 6.28 < 2048 -> kept.
//   i = 28: f = 500000^-0.4375 = 3.2114460e-3, wavelength 1956.5 < 2048 -> kept.
//   i = 32: f = 1/sqrt(500000) = 1.41421356e-3, wavelength 4442.88, s = (8192/4442.88 - 1)/3 = 0.281284,
//           f' = f * ((1 - s)/8 + s) = 5.2484616e-4.
//   i = 35: f = 7.6449699e-4, wavelength 8218.7 > 8192 -> f/8 = 9.5562124e-5.
//   i = 63: f = 2.4551408e-6 -> f/8 = 3.0689260e-7.
TEST(RoPE, Llama31FrequencyRule) {
  RopeConfig cfg;  // Llama 3.1 defaults
  std::vector<double> f(64);
  rope_inv_freq(cfg, 128, f.data());
  EXPECT_DOUBLE_EQ(f[0], 1.0);
  EXPECT_NEAR(f[28], 3.2114460e-3, 1e-9);
  EXPECT_NEAR(f[32], 5.2484616e-4, 1e-10);
  EXPECT_NEAR(f[35], 9.5562124e-5, 1e-11);
  EXPECT_NEAR(f[63], 3.0689260e-7, 1e-13);
  // Without scaling (Llama 3): plain theta^(-2i/hd).
  cfg.llama31_scaling = false;
  rope_inv_freq(cfg, 128, f.data());
  EXPECT_NEAR(f[32], 1.41421356e-3, 1e-11);
  EXPECT_NEAR(f[35], 7.6449699e-4, 1e-11);
}

TEST(RoPE, TableIsCosSinOfPositionTimesFrequency) {
  RopeConfig cfg;
  const int64_t S = 9000, hd = 128, half = 64;
  std::vector<float> c(S * half), s(S * half);
  rope_table(cfg, S, hd, c.data(), s.data());
  std::vector<double> f(half);
  rope_inv_freq(cfg, hd, f.data());
  for (int64_t pos : {0L, 1L, 77L, 8999L})
    for (int64_t i : {0L, 31L, 32L, 63L}) {
      EXPECT_EQ(c[pos * half + i], float(std::cos(double(pos) * f[i])));
      EXPECT_EQ(s[pos * half + i], float(std::sin(double(pos) * f[i])));
    }
  EXPECT_EQ(c[0], 1.f);
  EXPECT_EQ(s[0], 0.f);
}

TEST(RoPE, ForwardRotatesHalvesAndBackwardIsTranspose) {
  const int64_t B = 2, S = 5, nh = 3, hd = 8, half = 4;
  RopeConfig cfg;
  cfg.theta = 10000;
  cfg.llama31_scaling = false;  // compare against the plain formula below
  std::vector<float> c(S * half), s(S * half);
  rope_table(cfg, S, hd, c.data(), s.data());
  auto x = random_vec(B * S * nh * hd, 11), y = random_vec(B * S * nh * hd, 12);
  auto rx = x;
  rope_forward(host_f32(rx, {B, S, nh, hd}), host_f32(c, {S, half}), host_f32(s, {S, half}), nullptr);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t p = 0; p < S; ++p)
      for (int64_t h = 0; h < nh; ++h)
        for (int64_t i = 0; i < half; ++i) {
          int64_t o = ((b * S + p) * nh + h) * hd;
          double a = double(p) * std::pow(10000.0, -2.0 * double(i) / hd);
          double x1 = x[o + i], x2 = x[o + half + i];
          EXPECT_NEAR(rx[o + i], x1 * std::cos(a) - x2 * std::sin(a), 1e-6);
          EXPECT_NEAR(rx[o + half + i], x2 * std::cos(a) + x1 * std::sin(a), 1e-6);
        }
  // <R x, y> == <x, R^T y>: the backward is the gradient of the forward.
  auto ry = y;
  rope_backward(host_f32(ry, {B, S, nh, hd}), host_f32(c, {S, half}), host_f32(s, {S, half}), nullptr);
  EXPECT_NEAR(dot(rx, y), dot(x, ry), 1e-5);
  // And it inverts the forward.
  rope_backward(host_f32(rx, {B, S, nh, hd}), host_f32(c, {S, half}), host_f32(s, {S, half}), nullptr);
  for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(rx[i], x[i], 1e-6);
}

// The fused-QKV split equals slicing the heads and rotating q and k in place (the same arithmetic, so
// bit for bit), and its backward equals rope_backward on dq, dk and dv copied, gathered per token.
TEST(RoPE, FusedQkvSplitAndMergeMatchSeparateOps) {
  const int64_t B = 2, S = 6, hq = 4, hkv = 2, hd = 8, half = 4, T = B * S, heads = hq + 2 * hkv;
  std::vector<float> c(S * half), s(S * half);
  rope_table(RopeConfig{}, S, hd, c.data(), s.data());
  const Tensor hc = host_f32(c, {S, half}), hs = host_f32(s, {S, half});
  auto qkv = random_vec(T * heads * hd, 21);
  // Expected: slice per token, then the existing in-place rotation.
  std::vector<float> eq(T * hq * hd), ek(T * hkv * hd), ev(T * hkv * hd);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t d = 0; d < hd; ++d) {
        float x = qkv[(t * heads + h) * hd + d];
        if (h < hq)
          eq[(t * hq + h) * hd + d] = x;
        else if (h < hq + hkv)
          ek[(t * hkv + h - hq) * hd + d] = x;
        else
          ev[(t * hkv + h - hq - hkv) * hd + d] = x;
      }
  rope_forward(host_f32(eq, {B, S, hq, hd}), hc, hs, nullptr);
  rope_forward(host_f32(ek, {B, S, hkv, hd}), hc, hs, nullptr);
  std::vector<float> q(eq.size()), k(ek.size()), v(ev.size());
  rope_split_qkv(host_f32(qkv, {B, S, heads, hd}), hc, hs, host_f32(q, {B, S, hq, hd}), host_f32(k, {B, S, hkv, hd}),
                 host_f32(v, {B, S, hkv, hd}), nullptr);
  EXPECT_EQ(q, eq);
  EXPECT_EQ(k, ek);
  EXPECT_EQ(v, ev);
  // Backward: gather of the inverse rotations.
  auto dq = random_vec(eq.size(), 22), dk = random_vec(ek.size(), 23), dv = random_vec(ev.size(), 24);
  std::vector<float> dqkv(qkv.size(), 7.f);
  rope_merge_qkv_grad(host_f32(dq, {B, S, hq, hd}), host_f32(dk, {B, S, hkv, hd}), host_f32(dv, {B, S, hkv, hd}), hc,
                      hs, host_f32(dqkv, {B, S, heads, hd}), nullptr);
  rope_backward(host_f32(dq, {B, S, hq, hd}), hc, hs, nullptr);
  rope_backward(host_f32(dk, {B, S, hkv, hd}), hc, hs, nullptr);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t d = 0; d < hd; ++d) {
        float want = h < hq         ? dq[(t * hq + h) * hd + d]
                     : h < hq + hkv ? dk[(t * hkv + h - hq) * hd + d]
                                    : dv[(t * hkv + h - hq - hkv) * hd + d];
        ASSERT_EQ(dqkv[(t * heads + h) * hd + d], want) << "token " << t << " head " << h << " dim " << d;
      }
}

// The fused split and merge of a [B, S, *] problem with optional positions; returns q|k|v then dqkv.
struct QkvRun {
  std::vector<float> q, k, v, dqkv;
};
QkvRun run_qkv(int64_t B, int64_t S, int64_t hq, int64_t hkv, int64_t hd, std::vector<float> qkv, std::vector<float> dq,
               std::vector<float> dk, std::vector<float> dv, std::vector<float>& c, std::vector<float>& s,
               std::vector<int32_t>* positions) {
  const int64_t half = hd / 2, rows = int64_t(c.size()) / half, heads = hq + 2 * hkv;
  const Tensor hc = host_f32(c, {rows, half}), hs = host_f32(s, {rows, half});
  const Tensor pos = positions ? host_i32(*positions, {B * S}) : Tensor{};
  QkvRun r{std::vector<float>(B * S * hq * hd), std::vector<float>(B * S * hkv * hd),
           std::vector<float>(B * S * hkv * hd), std::vector<float>(qkv.size())};
  rope_split_qkv(host_f32(qkv, {B, S, heads, hd}), hc, hs, host_f32(r.q, {B, S, hq, hd}),
                 host_f32(r.k, {B, S, hkv, hd}), host_f32(r.v, {B, S, hkv, hd}), nullptr, positions ? &pos : nullptr);
  rope_merge_qkv_grad(host_f32(dq, {B, S, hq, hd}), host_f32(dk, {B, S, hkv, hd}), host_f32(dv, {B, S, hkv, hd}), hc,
                      hs, host_f32(r.dqkv, {B, S, heads, hd}), nullptr, positions ? &pos : nullptr);
  return r;
}

// rope_forward then rope_backward (each in place on its own copy) with optional positions.
std::pair<std::vector<float>, std::vector<float>> run_rope(int64_t B, int64_t S, int64_t nh, int64_t hd,
                                                           std::vector<float> x, std::vector<float> dx,
                                                           std::vector<float>& c, std::vector<float>& s,
                                                           std::vector<int32_t>* positions) {
  const int64_t half = hd / 2, rows = int64_t(c.size()) / half;
  const Tensor hc = host_f32(c, {rows, half}), hs = host_f32(s, {rows, half});
  const Tensor pos = positions ? host_i32(*positions, {B * S}) : Tensor{};
  rope_forward(host_f32(x, {B, S, nh, hd}), hc, hs, nullptr, positions ? &pos : nullptr);
  rope_backward(host_f32(dx, {B, S, nh, hd}), hc, hs, nullptr, positions ? &pos : nullptr);
  return {x, dx};
}

// positions[t] = t % S selects the rows the ops use without positions: the same bits.
TEST(RoPE, PositionsOfRowIndexEqualNoPositions) {
  const int64_t B = 2, S = 5, hq = 4, hkv = 2, hd = 8, half = 4, heads = hq + 2 * hkv;
  std::vector<float> c(S * half), s(S * half);
  rope_table(RopeConfig{}, S, hd, c.data(), s.data());
  std::vector<int32_t> pos(B * S);
  for (int64_t t = 0; t < B * S; ++t) pos[size_t(t)] = int32_t(t % S);
  auto x = random_vec(B * S * hq * hd, 31), dx = random_vec(x.size(), 32);
  EXPECT_EQ(run_rope(B, S, hq, hd, x, dx, c, s, &pos), run_rope(B, S, hq, hd, x, dx, c, s, nullptr));
  auto qkv = random_vec(B * S * heads * hd, 33), dq = random_vec(B * S * hq * hd, 34);
  auto dk = random_vec(B * S * hkv * hd, 35), dv = random_vec(B * S * hkv * hd, 36);
  const QkvRun a = run_qkv(B, S, hq, hkv, hd, qkv, dq, dk, dv, c, s, &pos);
  const QkvRun b = run_qkv(B, S, hq, hkv, hd, qkv, dq, dk, dv, c, s, nullptr);
  EXPECT_EQ(a.q, b.q);
  EXPECT_EQ(a.k, b.k);
  EXPECT_EQ(a.v, b.v);
  EXPECT_EQ(a.dqkv, b.dqkv);
}

// Packed rows: positions restart at each segment start, so every segment is rotated (and its gradient
// rotated back) exactly as the same tokens alone in a [1, len] problem without positions.
TEST(RoPE, RestartedPositionsRotateEachSegmentAlone) {
  const int64_t B = 2, S = 6, hq = 4, hkv = 2, hd = 8, half = 4, heads = hq + 2 * hkv;
  const std::vector<int64_t> starts = {0, 2, 6, 7, 12};  // segments [0,2) [2,6) [6,7) [7,12)
  std::vector<int32_t> pos(B * S);
  for (size_t i = 0; i + 1 < starts.size(); ++i)
    for (int64_t t = starts[i]; t < starts[i + 1]; ++t) pos[size_t(t)] = int32_t(t - starts[i]);
  std::vector<float> c(S * half), s(S * half);
  rope_table(RopeConfig{}, S, hd, c.data(), s.data());
  auto x = random_vec(B * S * hq * hd, 41), dx = random_vec(x.size(), 42);
  auto qkv = random_vec(B * S * heads * hd, 43), dq = random_vec(B * S * hq * hd, 44);
  auto dk = random_vec(B * S * hkv * hd, 45), dv = random_vec(B * S * hkv * hd, 46);
  const auto packed = run_rope(B, S, hq, hd, x, dx, c, s, &pos);
  const QkvRun pq = run_qkv(B, S, hq, hkv, hd, qkv, dq, dk, dv, c, s, &pos);
  // Tokens [t0, t0 + n) of a [T, width] vector.
  auto slice = [](const std::vector<float>& v, int64_t t0, int64_t n, int64_t width) {
    return std::vector<float>(v.begin() + t0 * width, v.begin() + (t0 + n) * width);
  };
  for (size_t i = 0; i + 1 < starts.size(); ++i) {
    const int64_t t0 = starts[i], n = starts[i + 1] - starts[i];
    SCOPED_TRACE(::testing::Message() << "segment " << i);
    const auto alone = run_rope(1, n, hq, hd, slice(x, t0, n, hq * hd), slice(dx, t0, n, hq * hd), c, s, nullptr);
    EXPECT_EQ(slice(packed.first, t0, n, hq * hd), alone.first);
    EXPECT_EQ(slice(packed.second, t0, n, hq * hd), alone.second);
    const QkvRun aq = run_qkv(1, n, hq, hkv, hd, slice(qkv, t0, n, heads * hd), slice(dq, t0, n, hq * hd),
                              slice(dk, t0, n, hkv * hd), slice(dv, t0, n, hkv * hd), c, s, nullptr);
    EXPECT_EQ(slice(pq.q, t0, n, hq * hd), aq.q);
    EXPECT_EQ(slice(pq.k, t0, n, hkv * hd), aq.k);
    EXPECT_EQ(slice(pq.v, t0, n, hkv * hd), aq.v);
    EXPECT_EQ(slice(pq.dqkv, t0, n, heads * hd), aq.dqkv);
  }
  // And restarting really changes the rotation of the later tokens of a row.
  EXPECT_NE(packed, run_rope(B, S, hq, hd, x, dx, c, s, nullptr));
}

TEST(RoPEDeathTest, PositionOutsideTheTableIsABug) {
  const int64_t S = 4, hd = 8, half = 4;
  std::vector<float> c(S * half), s(S * half), x(S * hd);
  rope_table(RopeConfig{}, S, hd, c.data(), s.data());
  std::vector<int32_t> pos = {0, 1, 4, 2};  // the table has rows 0..3
  const Tensor tp = host_i32(pos, {S});
  EXPECT_DEATH(rope_forward(host_f32(x, {1, S, 1, hd}), host_f32(c, {S, half}), host_f32(s, {S, half}), nullptr, &tp),
               "outside the cos/sin table");
  pos[2] = -1;
  EXPECT_DEATH(rope_forward(host_f32(x, {1, S, 1, hd}), host_f32(c, {S, half}), host_f32(s, {S, half}), nullptr, &tp),
               "outside the cos/sin table");
}

TEST(Embedding, ForwardGathersRowsBackwardScattersInOrder) {
  const int64_t V = 6, H = 4, T = 7;
  auto table = random_vec(V * H, 13);
  std::vector<int32_t> ids = {3, 0, 3, 5, 3, 1, 0};
  std::vector<float> out(T * H);
  embedding_forward(host_f32(table, {V, H}), host_i32(ids, {T}), host_f32(out, {T, H}), nullptr);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < H; ++j) EXPECT_EQ(out[t * H + j], table[ids[t] * H + j]);
  // Backward of loss = sum(out * r) w.r.t. table: a linear op, so FD is exact up to rounding.
  auto r = random_vec(T * H, 14);
  auto n = numeric_grad(table, [&] {
    embedding_forward(host_f32(table, {V, H}), host_i32(ids, {T}), host_f32(out, {T, H}), nullptr);
    return dot(out, r);
  });
  std::vector<float> dtable(V * H, 1.f);
  embedding_backward(host_i32(ids, {T}), host_f32(r, {T, H}), host_f32(dtable, {V, H}), nullptr);
  for (float& d : dtable) d -= 1.f;
  EXPECT_GRAD_NEAR(dtable, n, 1e-5);
  for (int64_t j = 0; j < H; ++j) EXPECT_EQ(dtable[2 * H + j], 0.f);  // id 2 never appears
}

TEST(EmbeddingDeathTest, OutOfRangeIdIsABug) {
  std::vector<float> table(4 * 2), out(2);
  std::vector<int32_t> ids = {4};
  EXPECT_DEATH(embedding_forward(host_f32(table, {4, 2}), host_i32(ids, {1}), host_f32(out, {1, 2}), nullptr),
               "outside the vocabulary");
}
