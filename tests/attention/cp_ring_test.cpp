// Context parallelism's per-rank ring (ops/cp_ring.h) on the CPU: C ranks as threads passing K/V through an
// in-process mailbox, each on its own load-balanced tokens (chunks r and 2C-1-r of every row), against the
// whole-sequence causal reference gathered at the same tokens: out and lse within FP32 rounding of the FP32
// merge, dq/dk/dv likewise; the bytes each rank passes equal cp::ring_traffic's formula. C = 1, 2, 4, GQA, two
// rows. Packed rows at C = 2, 4 (segments of several lengths, each cut into 2C chunks) against whole-row
// segmented attention, and a wrong segment table seen. Also the shapes the non-causal blocks accept, and the
// segment halves the packed blocks take.
#include <gtest/gtest.h>

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

#include "attention/attention_test_util.h"
#include "attention/cp_test_util.h"
#include "ops/cp_attention.h"
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
  // The CPU forward merges its blocks in FP64 and rounds once, as the reference does: out and lse are the whole
  // sequence's bit for bit (an FP32 merge flipped their last bits, and with them, now and then, a quantized code of the
  // next Linear's input: NVFP4 at C2 then differed from one rank for one mock sample).
  EXPECT_EQ(mine.out.data, cp_rows(ref.out.data, B, S, qw, r, C)) << "out, rank " << r;
  EXPECT_EQ(mine.lse.data, cp_lse(ref.lse.data, B, sh.heads, S, r, C)) << "lse, rank " << r;
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

// Packed rows: two rows of 48 tokens holding segments of different lengths, each a multiple of 2C.
std::vector<int32_t> packed_ring_starts(int C) {
  const int32_t unit = 2 * C, units = 48 / unit;  // C2: 12 units of 4 tokens per row, C4: 6 of 8
  std::vector<int32_t> starts{0};
  for (int32_t len : {1, units / 2, units - 1 - units / 2, units - 1, 1}) starts.push_back(starts.back() + len * unit);
  return starts;  // row 0: 1, U/2 and the rest; row 1: U-1 and 1
}

// How a packed rank runs its ring: with its own segment table (table = the whole table, cut), with another
// one (a wrong table), or as whole rows (no table).
struct PackedRun {
  std::vector<int32_t> table;
  bool rows = false;
};

// One rank of the packed ring: its tokens (chunks r and 2C-1-r of every segment) against the whole-row
// segmented reference at the same tokens; out, lse (token-major), dq, dk, dv.
void run_packed_rank(const AttentionTensors& ref, const std::vector<int32_t>& starts, const PackedRun& run, int r,
                     int C, RingMailbox* box, double* worst) {
  const AttentionShape& sh = ref.sh;
  const int64_t qw = sh.heads * sh.head_dim, kw = sh.kv_heads * sh.head_dim;
  const AttentionSegments whole{int64_t(starts.size()) - 1, starts.data(), nullptr, 0};
  std::vector<int64_t> tokens;
  ASSERT_TRUE(cp::shard_tokens(sh, &whole, C, r, &tokens).is_ok());
  AttentionShape local = sh;
  local.seq = sh.seq / C;
  AttentionTensors mine(local);
  auto load = [](Host& h, const std::vector<float>& v) { std::copy(v.begin(), v.end(), h.data.begin()); };
  load(mine.q, cp_tokens(ref.q.data, tokens, qw));
  load(mine.k, cp_tokens(ref.k.data, tokens, kw));
  load(mine.v, cp_tokens(ref.v.data, tokens, kw));
  load(mine.w, cp_tokens(ref.w.data, tokens, qw));
  const std::vector<int32_t> table = cp_local_starts(run.table, C);
  const AttentionSegments seg{int64_t(table.size()) - 1, table.data(), nullptr, 0};
  const AttentionSegments* segs = run.rows ? nullptr : &seg;
  ThreadRingLink link(r, C, box);
  cp::Ring ring;
  ASSERT_TRUE(ring.init(local, Device::cpu, DType::f32, &link).is_ok());
  ASSERT_TRUE(ring.forward(mine.q.t, mine.k.t, mine.v.t, mine.out.t, mine.lse.t, nullptr, segs).is_ok());
  const cp::RingTraffic want = cp::ring_traffic(local, DType::f32, C);  // the same K|V blocks as whole rows
  EXPECT_EQ(link.sent, want.forward) << "forward, rank " << r;
  ASSERT_TRUE(ring.backward(mine.q.t, mine.k.t, mine.v.t, mine.out.t, mine.w.t, mine.lse.t, mine.dq.t, mine.dk.t,
                            mine.dv.t, nullptr, segs)
                  .is_ok());
  const std::vector<float> lse_want = cp_tokens(ref.lse.data, tokens, sh.heads);
  // As whole rows the ring writes lse [B, Hq, S/C]; read it token-major for the comparison.
  std::vector<float> lse_got = mine.lse.data;
  if (run.rows)
    for (int64_t t = 0; t < local.batch * local.seq; ++t)
      for (int64_t h = 0; h < sh.heads; ++h)
        lse_got[size_t(t * sh.heads + h)] =
            mine.lse.data[size_t(((t / local.seq) * sh.heads + h) * local.seq + t % local.seq)];
  const double errs[] = {max_rel_err(mine.out.data, cp_tokens(ref.out.data, tokens, qw)),
                         max_rel_err(lse_got, lse_want), max_rel_err(mine.dq.data, cp_tokens(ref.dq.data, tokens, qw)),
                         max_rel_err(mine.dk.data, cp_tokens(ref.dk.data, tokens, kw)),
                         max_rel_err(mine.dv.data, cp_tokens(ref.dv.data, tokens, kw))};
  for (double e : errs) *worst = std::max(*worst, e);
}

// The worst error of each rank of a packed ring at C ranks, run as `run` says.
std::vector<double> packed_ring_errors(int C, const PackedRun& run) {
  const std::vector<int32_t> starts = packed_ring_starts(C);
  const AttentionSegments seg{int64_t(starts.size()) - 1, starts.data(), nullptr, 0};
  AttentionTensors ref(make_shape(2, 48, 4, 2, 8));
  ref.randomize(29);
  EXPECT_TRUE(attention_forward_ref(ref.sh, ref.q.t, ref.k.t, ref.v.t, ref.out.t, ref.lse.t, &seg).is_ok());
  EXPECT_TRUE(attention_backward_ref(ref.sh, ref.q.t, ref.k.t, ref.v.t, ref.out.t, ref.w.t, ref.lse.t, ref.dq.t,
                                     ref.dk.t, ref.dv.t, &seg)
                  .is_ok());
  RingMailbox box(C);
  std::vector<double> worst(size_t(C), 0.0);
  std::vector<std::thread> ranks;
  for (int r = 0; r < C; ++r)
    ranks.emplace_back([&, r] { run_packed_rank(ref, starts, run, r, C, &box, &worst[size_t(r)]); });
  for (auto& t : ranks) t.join();
  return worst;
}

class RingPackedPerRank : public ::testing::TestWithParam<int> {};

TEST_P(RingPackedPerRank, EachRankEqualsWholeRowSegmentedAttentionAtItsTokens) {
  const int C = GetParam();
  const std::vector<double> worst = packed_ring_errors(C, {packed_ring_starts(C), false});
  for (int r = 0; r < C; ++r) EXPECT_LT(worst[size_t(r)], 5e-6) << "rank " << r << " of " << C;
}

// The comparison sees the segment table: a ring given a table with one boundary moved by 2C tokens, or none at
// all (whole rows), is far off on some rank.
TEST_P(RingPackedPerRank, AWrongSegmentTableIsSeen) {
  const int C = GetParam();
  std::vector<int32_t> moved = packed_ring_starts(C);
  moved[2] += 2 * C;  // row 0's second segment starts one unit later
  for (const PackedRun& run : {PackedRun{moved, false}, PackedRun{{}, true}}) {
    const std::vector<double> worst = packed_ring_errors(C, run);
    EXPECT_GT(*std::max_element(worst.begin(), worst.end()), 1e-2) << (run.rows ? "whole rows" : "moved boundary");
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, RingPackedPerRank, ::testing::Values(2, 4));

// The ring blocks' segment halves on the CPU reference (the spec the cuDNN graphs follow): each segment's query
// part against its key part is the non-causal block of those tokens alone, and tokens outside keep their values.
TEST(RingBlocks, SegmentHalvesAreEachSegmentsNonCausalBlock) {
  AttentionShape sh = make_shape(1, 24, 2, 1, 4);
  sh.causal = false;
  const std::vector<int32_t> starts{0, 8, 12, 24};
  using P = SegmentPart;
  for (const auto& [qp, kp] : {std::pair<P, P>{P::whole, P::first_half}, {P::second_half, P::whole}}) {
    AttentionTensors t(sh);
    t.randomize(5);
    for (Host* h : {&t.out, &t.lse, &t.dq, &t.dk, &t.dv}) std::fill(h->data.begin(), h->data.end(), 7.0f);
    AttentionSegments seg{3, starts.data(), nullptr, 0};
    seg.q_part = qp;
    seg.kv_part = kp;
    ASSERT_TRUE(attention_forward_ref(sh, t.q.t, t.k.t, t.v.t, t.out.t, t.lse.t, &seg).is_ok());
    ASSERT_TRUE(
        attention_backward_ref(sh, t.q.t, t.k.t, t.v.t, t.out.t, t.w.t, t.lse.t, t.dq.t, t.dk.t, t.dv.t, &seg).is_ok());
    std::vector<char> is_q(24, 0), is_kv(24, 0);
    for (int i = 0; i < 3; ++i) {
      const int32_t s0 = starts[size_t(i)], len = starts[size_t(i) + 1] - s0;
      auto part = [&](P p, std::vector<char>* mark) {
        std::vector<int64_t> toks;
        for (int32_t j = p == P::second_half ? len / 2 : 0; j < (p == P::first_half ? len / 2 : len); ++j) {
          toks.push_back(s0 + j);
          (*mark)[size_t(s0 + j)] = 1;
        }
        return toks;
      };
      const std::vector<int64_t> qt = part(qp, &is_q), kt = part(kp, &is_kv);
      AttentionShape b = make_shape(1, int64_t(qt.size()), 2, 1, 4);
      b.kv_seq = int64_t(kt.size());
      b.causal = false;
      Host q({1, b.seq, 2, 4}), k({1, b.kv_seq, 1, 4}), v({1, b.kv_seq, 1, 4}), w({1, b.seq, 2, 4});
      Host out({1, b.seq, 2, 4}), lse({1, 2, b.seq}), dq({1, b.seq, 2, 4}), dk({1, b.kv_seq, 1, 4}),
          dv({1, b.kv_seq, 1, 4});
      q.data = cp_tokens(t.q.data, qt, 8);
      w.data = cp_tokens(t.w.data, qt, 8);
      k.data = cp_tokens(t.k.data, kt, 4);
      v.data = cp_tokens(t.v.data, kt, 4);
      for (Host* h : {&q, &w, &k, &v}) h->t.data = h->data.data();
      ASSERT_TRUE(attention_forward_ref(b, q.t, k.t, v.t, out.t, lse.t).is_ok());
      ASSERT_TRUE(attention_backward_ref(b, q.t, k.t, v.t, out.t, w.t, lse.t, dq.t, dk.t, dv.t).is_ok());
      EXPECT_LT(max_rel_err(cp_tokens(t.out.data, qt, 8), out.data), 1e-6) << "segment " << i;
      EXPECT_LT(max_rel_err(cp_tokens(t.dq.data, qt, 8), dq.data), 1e-6) << "segment " << i;
      EXPECT_LT(max_rel_err(cp_tokens(t.dk.data, kt, 4), dk.data), 1e-6) << "segment " << i;
      EXPECT_LT(max_rel_err(cp_tokens(t.dv.data, kt, 4), dv.data), 1e-6) << "segment " << i;
      for (size_t j = 0; j < qt.size(); ++j)  // lse: token-major here, [1, Hq, n] in the block
        for (int h = 0; h < 2; ++h)
          EXPECT_NEAR(t.lse.data[size_t(qt[j] * 2 + h)], lse.data[size_t(h) * qt.size() + j], 1e-6);
    }
    for (int64_t x = 0; x < 24; ++x) {
      const bool q_kept =
          t.out.data[size_t(x * 8)] == 7.0f && t.lse.data[size_t(x * 2)] == 7.0f && t.dq.data[size_t(x * 8)] == 7.0f;
      EXPECT_TRUE(is_q[size_t(x)] || q_kept) << "query " << x << " was written";
      EXPECT_TRUE(is_kv[size_t(x)] || (t.dk.data[size_t(x * 4)] == 7.0f && t.dv.data[size_t(x * 4)] == 7.0f))
          << "key " << x << " was written";
    }
  }
  // A causal call takes whole segments only; an odd segment has no halves.
  sh.causal = true;
  AttentionTensors t(sh);
  AttentionSegments seg{3, starts.data(), nullptr, 0};
  seg.kv_part = SegmentPart::first_half;
  EXPECT_FALSE(attention_forward_ref(sh, t.q.t, t.k.t, t.v.t, t.out.t, t.lse.t, &seg).is_ok());
  sh.causal = false;
  const std::vector<int32_t> odd{0, 7, 24};
  seg = AttentionSegments{2, odd.data(), nullptr, 0};
  seg.q_part = SegmentPart::second_half;
  const Status st = attention_forward_ref(sh, t.q.t, t.k.t, t.v.t, t.out.t, t.lse.t, &seg);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("do not split into the halves"), std::string::npos) << st.message();
}

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
