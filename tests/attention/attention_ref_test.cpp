// CPU reference of causal GQA attention: backward against central finite differences of the forward,
// GQA against explicitly repeated K/V heads, causality, and the single-token identity.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "attention/attention_test_util.h"
#include "ops/attention.h"

namespace nb::ops {
namespace {

// Everything one forward + backward needs, with random q/k/v and upstream gradient w.
struct Problem : AttentionTensors {
  explicit Problem(AttentionShape s, uint32_t seed) : AttentionTensors(s) { randomize(seed); }
  void forward() { ASSERT_TRUE(attention_forward(sh, q.t, k.t, v.t, out.t, lse.t, nullptr).is_ok()); }
  void backward() {
    ASSERT_TRUE(attention_backward(sh, q.t, k.t, v.t, out.t, w.t, lse.t, dq.t, dk.t, dv.t, nullptr).is_ok());
  }
  // Scalar loss L = sum(out * w), so dL/dout = w; summed in double.
  double loss() {
    forward();
    double l = 0.0;
    for (size_t i = 0; i < out.data.size(); ++i) l += double(out.data[i]) * double(w.data[i]);
    return l;
  }
};

// Central differences of L with step eps=1e-2. Truncation error is eps^2/6 * L''' ~ 2e-5 for O(1)
// derivatives; the FP32 rounding of ~100 outputs of size ~1 perturbs L by ~1e-6, i.e. ~5e-5 after
// dividing by 2*eps. A tolerance of 1e-3 absolute + 1e-3 relative is well above both and far below
// the size of a wrong gradient (entries are O(0.1..1)).
void expect_matches_finite_differences(Problem& p, Host& x, const Host& grad, const char* name) {
  const double eps = 1e-2;
  double grad_norm = 0.0;
  for (size_t i = 0; i < x.data.size(); ++i) {
    const float saved = x.data[i];
    x.data[i] = float(saved + eps);
    const double up = p.loss();
    x.data[i] = float(saved - eps);
    const double down = p.loss();
    x.data[i] = saved;
    const double fd = (up - down) / (2 * eps);
    EXPECT_NEAR(grad.data[i], fd, 1e-3 + 1e-3 * std::fabs(fd)) << name << "[" << i << "]";
    grad_norm += fd * fd;
  }
  EXPECT_GT(std::sqrt(grad_norm), 1e-2) << name << ": the finite-difference gradient is ~0, the test is vacuous";
}

TEST(AttentionRef, BackwardMatchesFiniteDifferencesGqa) {
  Problem p(make_shape(2, 5, 4, 2, 3), 7);
  p.forward();
  p.backward();
  expect_matches_finite_differences(p, p.q, p.dq, "dq");
  expect_matches_finite_differences(p, p.k, p.dk, "dk");
  expect_matches_finite_differences(p, p.v, p.dv, "dv");
}

TEST(AttentionRef, BackwardMatchesFiniteDifferencesMha) {
  Problem p(make_shape(1, 6, 2, 2, 4), 11);
  p.forward();
  p.backward();
  expect_matches_finite_differences(p, p.q, p.dq, "dq");
  expect_matches_finite_differences(p, p.k, p.dk, "dk");
  expect_matches_finite_differences(p, p.v, p.dv, "dv");
}

// Repeats each K/V head `group` times: [B,S,Hkv,D] -> [B,S,Hq,D] with query head h reading K/V head h/group.
void repeat_heads(const Host& src, Host& dst, const AttentionShape& gqa) {
  const int64_t group = gqa.heads / gqa.kv_heads, D = gqa.head_dim;
  for (int64_t bs = 0; bs < gqa.batch * gqa.seq; ++bs)
    for (int64_t h = 0; h < gqa.heads; ++h)
      for (int64_t d = 0; d < D; ++d)
        dst.data[(bs * gqa.heads + h) * D + d] = src.data[(bs * gqa.kv_heads + h / group) * D + d];
}

TEST(AttentionRef, GqaEqualsRepeatedKvHeads) {
  const AttentionShape gqa = make_shape(2, 9, 6, 2, 5);
  AttentionShape mha = gqa;
  mha.kv_heads = gqa.heads;
  Problem a(gqa, 3);
  Problem b(mha, 99);
  b.q.data = a.q.data;
  b.w.data = a.w.data;
  repeat_heads(a.k, b.k, gqa);
  repeat_heads(a.v, b.v, gqa);
  a.forward();
  a.backward();
  b.forward();
  b.backward();
  // Same arithmetic in the same order per query head: forward and dq agree bit for bit.
  EXPECT_EQ(a.out.data, b.out.data);
  EXPECT_EQ(a.lse.data, b.lse.data);
  EXPECT_EQ(a.dq.data, b.dq.data);
  // dk/dv of a shared head = sum of the repeated heads' gradients; the repeated path rounds each head to
  // FP32 before summing (3 roundings of 2^-24 relative), hence 1e-6 relative.
  const int64_t group = gqa.heads / gqa.kv_heads, D = gqa.head_dim;
  for (int64_t bs = 0; bs < gqa.batch * gqa.seq; ++bs)
    for (int64_t g = 0; g < gqa.kv_heads; ++g)
      for (int64_t d = 0; d < D; ++d) {
        double sk = 0.0, sv = 0.0;
        for (int64_t r = 0; r < group; ++r) {
          sk += b.dk.data[(bs * gqa.heads + g * group + r) * D + d];
          sv += b.dv.data[(bs * gqa.heads + g * group + r) * D + d];
        }
        const float gk = a.dk.data[(bs * gqa.kv_heads + g) * D + d];
        const float gv = a.dv.data[(bs * gqa.kv_heads + g) * D + d];
        EXPECT_NEAR(gk, sk, 1e-6 * (1.0 + std::fabs(sk)));
        EXPECT_NEAR(gv, sv, 1e-6 * (1.0 + std::fabs(sv)));
      }
}

TEST(AttentionRef, IsCausal) {
  Problem p(make_shape(1, 8, 2, 1, 4), 5);
  p.forward();
  const std::vector<float> before = p.out.data;
  const std::vector<float> lse_before = p.lse.data;
  // Change keys and values at positions 5..7: rows 0..4 must not move, rows 5..7 must.
  for (int64_t j = 5; j < 8; ++j)
    for (int64_t d = 0; d < 4; ++d) {
      p.k.data[j * 4 + d] += 0.5f;
      p.v.data[j * 4 + d] -= 0.75f;
    }
  p.forward();
  for (int64_t i = 0; i < 8; ++i)
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t d = 0; d < 4; ++d) {
        const int64_t at = (i * 2 + h) * 4 + d;
        if (i < 5)
          EXPECT_EQ(p.out.data[at], before[at]) << "row " << i << " saw a future key";
        else
          EXPECT_NE(p.out.data[at], before[at]) << "row " << i << " ignored a visible key";
      }
  for (int64_t h = 0; h < 2; ++h)
    for (int64_t i = 0; i < 5; ++i) EXPECT_EQ(p.lse.data[h * 8 + i], lse_before[h * 8 + i]);
}

TEST(AttentionRef, FirstTokenCopiesItsValueAndLseIsItsScore) {
  Problem p(make_shape(1, 3, 2, 2, 4), 8);
  p.forward();
  const float scale = p.sh.scale;
  for (int64_t h = 0; h < 2; ++h) {
    double s = 0.0;
    for (int64_t d = 0; d < 4; ++d) {
      EXPECT_EQ(p.out.data[h * 4 + d], p.v.data[h * 4 + d]);
      s += double(p.q.data[h * 4 + d]) * double(p.k.data[h * 4 + d]);
    }
    EXPECT_NEAR(p.lse.data[h * 3 + 0], scale * s, 1e-6);
  }
}

TEST(AttentionRef, RejectsBadShapes) {
  Problem p(make_shape(1, 4, 4, 2, 8), 1);
  AttentionShape bad = p.sh;
  bad.kv_heads = 3;  // 4 query heads cannot share 3 K/V heads
  Status s = attention_forward(bad, p.q.t, p.k.t, p.v.t, p.out.t, p.lse.t, nullptr);
  EXPECT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("multiple"), std::string::npos) << s.message();
  bad = p.sh;
  bad.seq = 5;  // tensors hold 4 positions
  s = attention_forward(bad, p.q.t, p.k.t, p.v.t, p.out.t, p.lse.t, nullptr);
  EXPECT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("'q'"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace nb::ops
