// Context parallelism's ring attention (ops/cp_attention.h) against whole-sequence attention, on the CPU:
// C = 1, 2, 4 ranks, GQA, whole rows and packed segments; forward (out, lse) and backward (dq, dk, dv) within
// FP32 rounding; the load-balanced shards; the FP32 merge rule; uneven sequences refused in one sentence.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "attention/attention_test_util.h"
#include "attention/cp_test_util.h"
#include "ops/cp_attention.h"

namespace nb::ops {
namespace {

struct CpCase {
  int ranks;
  bool packed;
};

class RingAttention : public ::testing::TestWithParam<CpCase> {};

TEST_P(RingAttention, EqualsWholeSequenceAttention) {
  const CpCase c = GetParam();
  const AttentionShape sh = make_shape(2, 32, 4, 2, 8);
  // Packed: segments whose lengths are multiples of 2 x 4 (every rank count here), inside their rows.
  const std::vector<int32_t> starts = {0, 8, 24, 32, 48, 56, 64};
  AttentionSegments seg{int64_t(starts.size()) - 1, starts.data(), nullptr, 0};
  const AttentionSegments* segs = c.packed ? &seg : nullptr;
  AttentionTensors ref(sh), ring(sh);
  ref.randomize(11);
  ring.q.data = ref.q.data;
  ring.k.data = ref.k.data;
  ring.v.data = ref.v.data;
  ring.w.data = ref.w.data;
  ASSERT_TRUE(attention_forward_ref(sh, ref.q.t, ref.k.t, ref.v.t, ref.out.t, ref.lse.t, segs).is_ok());
  ASSERT_TRUE(attention_backward_ref(sh, ref.q.t, ref.k.t, ref.v.t, ref.out.t, ref.w.t, ref.lse.t, ref.dq.t, ref.dk.t,
                                     ref.dv.t, segs)
                  .is_ok());
  ASSERT_TRUE(cp::ring_forward(sh, segs, c.ranks, ring.q.t, ring.k.t, ring.v.t, ring.out.t, ring.lse.t).is_ok());
  ASSERT_TRUE(cp::ring_backward(sh, segs, c.ranks, ring.q.t, ring.k.t, ring.v.t, ring.out.t, ring.w.t, ring.lse.t,
                                ring.dq.t, ring.dk.t, ring.dv.t)
                  .is_ok());
  EXPECT_LT(max_rel_err(ring.out.data, ref.out.data), 2e-6);
  EXPECT_LT(max_rel_err(ring.lse.data, ref.lse.data), 2e-6);
  EXPECT_LT(max_rel_err(ring.dq.data, ref.dq.data), 5e-6);
  EXPECT_LT(max_rel_err(ring.dk.data, ref.dk.data), 5e-6);
  EXPECT_LT(max_rel_err(ring.dv.data, ref.dv.data), 5e-6);
}

INSTANTIATE_TEST_SUITE_P(Ranks, RingAttention,
                         ::testing::Values(CpCase{1, false}, CpCase{2, false}, CpCase{4, false}, CpCase{2, true},
                                           CpCase{4, true}),
                         [](const auto& i) {
                           return "cp" + std::to_string(i.param.ranks) + (i.param.packed ? "_packed" : "_rows");
                         });

TEST(RingAttention, ShardsAreLoadBalancedChunks) {
  const AttentionShape sh = make_shape(1, 16, 1, 1, 4);
  std::vector<int64_t> r0, r1, all;
  ASSERT_TRUE(cp::shard_tokens(sh, nullptr, 2, 0, &r0).is_ok());
  ASSERT_TRUE(cp::shard_tokens(sh, nullptr, 2, 1, &r1).is_ok());
  EXPECT_EQ(r0, (std::vector<int64_t>{0, 1, 2, 3, 12, 13, 14, 15}));  // chunks 0 and 3 of 4
  EXPECT_EQ(r1, (std::vector<int64_t>{4, 5, 6, 7, 8, 9, 10, 11}));    // chunks 1 and 2
  // Equal causal work: the (query, key) pairs each rank's queries see over the whole ring.
  auto pairs = [](const std::vector<int64_t>& qs) {
    int64_t n = 0;
    for (int64_t i : qs) n += i + 1;
    return n;
  };
  EXPECT_EQ(pairs(r0), pairs(r1));
  const AttentionShape odd = make_shape(1, 12, 1, 1, 4);
  std::vector<int64_t> t;
  const Status st = cp::shard_tokens(odd, nullptr, 4, 0, &t);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("not a multiple of 8"), std::string::npos) << st.message();
}

TEST(RingAttention, MergeIsTheSoftmaxOfTheUnion) {
  // Two partials over disjoint key sets {x1} and {x2, x3} merge into the softmax over all three.
  const double s[3] = {0.3, -1.2, 2.0}, v[3] = {1.0, -2.0, 0.5};
  auto lse_of = [&](int a, int b) {
    double m = -1e30;
    for (int i = a; i < b; ++i) m = std::max(m, s[i]);
    double sum = 0;
    for (int i = a; i < b; ++i) sum += std::exp(s[i] - m);
    return m + std::log(sum);
  };
  auto out_of = [&](int a, int b) {
    const double l = lse_of(a, b);
    double o = 0;
    for (int i = a; i < b; ++i) o += std::exp(s[i] - l) * v[i];
    return o;
  };
  float out_a = float(out_of(0, 1)), lse_a = float(lse_of(0, 1));
  const float out_b = float(out_of(1, 3)), lse_b = float(lse_of(1, 3));
  cp::merge_partial(&out_a, &lse_a, &out_b, lse_b, 1);
  EXPECT_NEAR(out_a, out_of(0, 3), 1e-6);
  EXPECT_NEAR(lse_a, lse_of(0, 3), 1e-6);
  float none = 0, none_lse = -INFINITY;  // nothing seen yet: the partial is taken as it is
  cp::merge_partial(&none, &none_lse, &out_b, lse_b, 1);
  EXPECT_EQ(none, out_b);
  EXPECT_EQ(none_lse, lse_b);
}

}  // namespace
}  // namespace nb::ops
