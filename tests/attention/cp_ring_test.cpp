// Context parallelism's per-rank ring (ops/cp_ring.h) on the CPU: C ranks as threads passing K/V through an
// in-process mailbox, each on its own load-balanced tokens (chunks r and 2C-1-r of every row), against the
// whole-sequence causal reference gathered at the same tokens: out and lse within FP32 rounding of the FP32
// merge, dq/dk/dv likewise; the bytes each rank passes equal cp::ring_traffic's formula. C = 1, 2, 4, GQA, two
// rows. Also the shapes the non-causal blocks accept.
#include <gtest/gtest.h>

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

#include "attention/attention_test_util.h"
#include "attention/cp_test_util.h"
#include "ops/cp_ring.h"

namespace nb::ops {
namespace {

// One rank's run: its tokens in, its out/lse/dq/dk/dv compared with the reference's at the same tokens.
void run_rank(const AttentionTensors& ref, int r, int C, RingMailbox* box, double* worst) {
  const AttentionShape& sh = ref.sh;
  const int64_t B = sh.batch, S = sh.seq, qw = sh.heads * sh.head_dim, kw = sh.kv_heads * sh.head_dim;
  AttentionShape local = sh;
  local.seq = S / C;
  AttentionTensors mine(local);
  // Copied into the tensors' own storage (assigning the vectors would leave the tensors pointing at freed memory).
  auto load = [](Host& h, const std::vector<float>& v) { std::copy(v.begin(), v.end(), h.data.begin()); };
  load(mine.q, cp_rows(ref.q.data, B, S, qw, r, C));
  load(mine.k, cp_rows(ref.k.data, B, S, kw, r, C));
  load(mine.v, cp_rows(ref.v.data, B, S, kw, r, C));
  load(mine.w, cp_rows(ref.w.data, B, S, qw, r, C));
  ThreadRingLink link(r, C, box);
  cp::Ring ring;
  ASSERT_TRUE(ring.init(local, Device::cpu, DType::f32, &link).is_ok());
  ASSERT_TRUE(ring.forward(mine.q.t, mine.k.t, mine.v.t, mine.out.t, mine.lse.t, nullptr).is_ok());
  // The bytes passed, counted at the link, are the formula's (docs/DISTRIBUTED.md's traffic per layer).
  const cp::RingTraffic want = cp::ring_traffic(local, DType::f32, C);
  EXPECT_EQ(link.sent, want.forward) << "forward, rank " << r;
  link.sent = 0;
  ASSERT_TRUE(ring.backward(mine.q.t, mine.k.t, mine.v.t, mine.out.t, mine.w.t, mine.lse.t, mine.dq.t, mine.dk.t,
                            mine.dv.t, nullptr)
                  .is_ok());
  EXPECT_EQ(link.sent, want.backward) << "backward, rank " << r;
  const double errs[] = {max_rel_err(mine.out.data, cp_rows(ref.out.data, B, S, qw, r, C)),
                         max_rel_err(mine.lse.data, cp_lse(ref.lse.data, B, sh.heads, S, r, C)),
                         max_rel_err(mine.dq.data, cp_rows(ref.dq.data, B, S, qw, r, C)),
                         max_rel_err(mine.dk.data, cp_rows(ref.dk.data, B, S, kw, r, C)),
                         max_rel_err(mine.dv.data, cp_rows(ref.dv.data, B, S, kw, r, C))};
  for (double e : errs) *worst = std::max(*worst, e);
}

class RingPerRank : public ::testing::TestWithParam<int> {};

TEST_P(RingPerRank, EachRankEqualsWholeSequenceAttentionAtItsTokens) {
  const int C = GetParam();
  AttentionTensors ref(make_shape(2, 32, 4, 2, 8));
  ref.randomize(23);
  ASSERT_TRUE(attention_forward_ref(ref.sh, ref.q.t, ref.k.t, ref.v.t, ref.out.t, ref.lse.t).is_ok());
  ASSERT_TRUE(attention_backward_ref(ref.sh, ref.q.t, ref.k.t, ref.v.t, ref.out.t, ref.w.t, ref.lse.t, ref.dq.t,
                                     ref.dk.t, ref.dv.t)
                  .is_ok());
  RingMailbox box(C);
  std::vector<double> worst(size_t(C), 0.0);
  std::vector<std::thread> ranks;
  for (int r = 0; r < C; ++r) ranks.emplace_back([&, r] { run_rank(ref, r, C, &box, &worst[size_t(r)]); });
  for (auto& t : ranks) t.join();
  // FP32 rounding of the merge and of the FP32 gradient sums over C blocks; a wrong block is O(1e-1).
  for (int r = 0; r < C; ++r) EXPECT_LT(worst[size_t(r)], 5e-6) << "rank " << r << " of " << C;
}

INSTANTIATE_TEST_SUITE_P(Ranks, RingPerRank, ::testing::Values(1, 2, 4));

TEST(RingBlocks, NonCausalKeyBlocksAreWholeRowsOnly) {
  AttentionShape sh = make_shape(1, 8, 2, 1, 4);
  AttentionTensors t(sh);
  sh.kv_seq = 4;  // causal with fewer keys than queries: refused
  Host k({1, 4, 1, 4}), v({1, 4, 1, 4});
  Status st = attention_forward_ref(sh, t.q.t, k.t, v.t, t.out.t, t.lse.t);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("causal"), std::string::npos) << st.message();
  sh.causal = false;
  EXPECT_TRUE(attention_forward_ref(sh, t.q.t, k.t, v.t, t.out.t, t.lse.t).is_ok());
  // A non-causal query sees every key: with one key, out is that key's value row exactly.
  AttentionShape one = make_shape(1, 3, 1, 1, 2);
  one.kv_seq = 1;
  one.causal = false;
  Host q({1, 3, 1, 2}), k1({1, 1, 1, 2}), v1({1, 1, 1, 2}), out({1, 3, 1, 2}), lse({1, 1, 3});
  v1.data[0] = 0.25f;
  v1.data[1] = -2.0f;
  ASSERT_TRUE(attention_forward_ref(one, q.t, k1.t, v1.t, out.t, lse.t).is_ok());
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(out.data[size_t(2 * i)], 0.25f);
    EXPECT_EQ(out.data[size_t(2 * i + 1)], -2.0f);
  }
}

}  // namespace
}  // namespace nb::ops
