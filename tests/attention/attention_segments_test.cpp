// CPU reference of packed-segment attention (several samples per row): each segment gets exactly (bit for
// bit) what it gets as a sequence of its own, one segment per row is the unsegmented path, and malformed
// segment tables are refused with a sentence that names the problem.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "attention/attention_test_util.h"
#include "ops/attention.h"

namespace nb::ops {
namespace {

// One forward + backward problem; lse is [B, Hq, S] (its floats are [T, Hq] in segmented calls).
struct SegmentProblem : AttentionTensors {
  explicit SegmentProblem(AttentionShape s) : AttentionTensors(s) {}
  Status run(const AttentionSegments* seg) {
    NB_TRY(attention_forward(sh, q.t, k.t, v.t, out.t, lse.t, nullptr, seg));
    return attention_backward(sh, q.t, k.t, v.t, out.t, w.t, lse.t, dq.t, dk.t, dv.t, nullptr, seg);
  }
};

// Copies tokens [t0, t0 + n) of a [T, heads, D] tensor into (or, with back, out of) a [n, heads, D] one.
void copy_tokens(std::vector<float>& whole, std::vector<float>& part, int64_t t0, int64_t n, int64_t width, bool back) {
  for (int64_t i = 0; i < n * width; ++i) {
    float& a = whole[size_t(t0 * width + i)];
    float& b = part[size_t(i)];
    if (back)
      a = b;
    else
      b = a;
  }
}

AttentionSegments segments_of(const std::vector<int32_t>& starts) {
  AttentionSegments seg;
  seg.count = int64_t(starts.size()) - 1;
  seg.starts = starts.data();
  return seg;
}

// Runs `starts` as packed segments of one problem, then each segment alone as a B=1 problem of its own,
// and requires identical bits for out, lse, dq, dk and dv.
void expect_segments_equal_separate_runs(const AttentionShape& sh, const std::vector<int32_t>& starts, uint32_t seed) {
  SegmentProblem packed(sh);
  packed.randomize(seed);
  const AttentionSegments seg = segments_of(starts);
  Status st = packed.run(&seg);
  ASSERT_TRUE(st.is_ok()) << st.message();
  const int64_t Hq = sh.heads, Hkv = sh.kv_heads, D = sh.head_dim;
  for (size_t i = 0; i + 1 < starts.size(); ++i) {
    const int64_t t0 = starts[i], n = starts[i + 1] - starts[i];
    SCOPED_TRACE(testing::Message() << "segment " << i << " tokens " << t0 << ".." << t0 + n - 1);
    SegmentProblem alone(make_shape(1, n, Hq, Hkv, D));
    copy_tokens(packed.q.data, alone.q.data, t0, n, Hq * D, false);
    copy_tokens(packed.k.data, alone.k.data, t0, n, Hkv * D, false);
    copy_tokens(packed.v.data, alone.v.data, t0, n, Hkv * D, false);
    copy_tokens(packed.w.data, alone.w.data, t0, n, Hq * D, false);
    st = alone.run(nullptr);
    ASSERT_TRUE(st.is_ok()) << st.message();
    std::vector<float> want_out(size_t(n * Hq * D)), want_dq(want_out.size()), want_dk(size_t(n * Hkv * D)),
        want_dv(want_dk.size());
    copy_tokens(packed.out.data, want_out, t0, n, Hq * D, false);
    copy_tokens(packed.dq.data, want_dq, t0, n, Hq * D, false);
    copy_tokens(packed.dk.data, want_dk, t0, n, Hkv * D, false);
    copy_tokens(packed.dv.data, want_dv, t0, n, Hkv * D, false);
    EXPECT_EQ(want_out, alone.out.data);
    EXPECT_EQ(want_dq, alone.dq.data);
    EXPECT_EQ(want_dk, alone.dk.data);
    EXPECT_EQ(want_dv, alone.dv.data);
    // Segmented lse is token-major [T, Hq]; the segment alone has [1, Hq, n].
    for (int64_t j = 0; j < n; ++j)
      for (int64_t h = 0; h < Hq; ++h)
        ASSERT_EQ(packed.lse.data[size_t((t0 + j) * Hq + h)], alone.lse.data[size_t(h * n + j)])
            << "lse of position " << j << " head " << h;
  }
}

// Two rows of 12: short, single-token and long segments, a segment ending exactly at the row end, one
// starting exactly at the next row's start.
const std::vector<int32_t> kMixed = {0, 3, 4, 12, 13, 20, 24};

TEST(AttentionSegments, EachSegmentEqualsItsOwnRunGqa) {
  expect_segments_equal_separate_runs(make_shape(2, 12, 4, 2, 5), kMixed, 1);
}

TEST(AttentionSegments, EachSegmentEqualsItsOwnRunMhaAndMqa) {
  expect_segments_equal_separate_runs(make_shape(2, 12, 3, 3, 4), kMixed, 2);
  expect_segments_equal_separate_runs(make_shape(2, 12, 4, 1, 6), kMixed, 3);
}

TEST(AttentionSegments, AllSingleTokenSegmentsCopyTheirValues) {
  const AttentionShape sh = make_shape(1, 6, 2, 1, 3);
  const std::vector<int32_t> starts = {0, 1, 2, 3, 4, 5, 6};
  expect_segments_equal_separate_runs(sh, starts, 4);
  SegmentProblem p(sh);
  p.randomize(4);
  const AttentionSegments seg = segments_of(starts);
  ASSERT_TRUE(p.run(&seg).is_ok());
  // A token alone attends only to itself: out = its value, dq = dk = 0, dv = the summed upstream gradient.
  for (int64_t t = 0; t < 6; ++t)
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t d = 0; d < 3; ++d) {
        EXPECT_EQ(p.out.data[size_t((t * 2 + h) * 3 + d)], p.v.data[size_t(t * 3 + d)]);
        EXPECT_EQ(p.dq.data[size_t((t * 2 + h) * 3 + d)], 0.0f);
      }
}

// One segment per row is the unsegmented path: the same bits, with lse transposed to token-major.
TEST(AttentionSegments, OneSegmentPerRowEqualsUnsegmented) {
  const AttentionShape sh = make_shape(3, 7, 4, 2, 5);
  SegmentProblem rows(sh), segs(sh);
  rows.randomize(5);
  segs.randomize(5);
  const std::vector<int32_t> starts = {0, 7, 14, 21};
  const AttentionSegments seg = segments_of(starts);
  ASSERT_TRUE(rows.run(nullptr).is_ok());
  ASSERT_TRUE(segs.run(&seg).is_ok());
  EXPECT_EQ(rows.out.data, segs.out.data);
  EXPECT_EQ(rows.dq.data, segs.dq.data);
  EXPECT_EQ(rows.dk.data, segs.dk.data);
  EXPECT_EQ(rows.dv.data, segs.dv.data);
  for (int64_t b = 0; b < 3; ++b)
    for (int64_t h = 0; h < 4; ++h)
      for (int64_t i = 0; i < 7; ++i)
        EXPECT_EQ(rows.lse.data[size_t((b * 4 + h) * 7 + i)], segs.lse.data[size_t((b * 7 + i) * 4 + h)]);
}

// Changing one segment's inputs leaves every other segment's outputs alone (the mask really cuts).
TEST(AttentionSegments, SegmentsDoNotSeeEachOther) {
  const AttentionShape sh = make_shape(2, 12, 4, 2, 5);
  SegmentProblem p(sh);
  p.randomize(6);
  const AttentionSegments seg = segments_of(kMixed);
  ASSERT_TRUE(p.run(&seg).is_ok());
  const std::vector<float> out = p.out.data, dk = p.dk.data;
  for (int64_t t = 4; t < 12; ++t)  // segment [4, 12)
    for (int64_t i = 0; i < 2 * 5; ++i) {
      p.k.data[size_t(t * 10 + i)] += 0.25f;
      p.v.data[size_t(t * 10 + i)] -= 0.5f;
    }
  ASSERT_TRUE(p.run(&seg).is_ok());
  for (int64_t t = 0; t < 24; ++t) {
    const bool inside = t >= 4 && t < 12;
    for (int64_t i = 0; i < 4 * 5; ++i) {
      if (inside) {
        EXPECT_NE(p.out.data[size_t(t * 20 + i)], out[size_t(t * 20 + i)]) << "token " << t << " ignored its keys";
      } else {
        EXPECT_EQ(p.out.data[size_t(t * 20 + i)], out[size_t(t * 20 + i)]) << "token " << t << " saw another segment";
      }
    }
    if (!inside) {
      for (int64_t i = 0; i < 2 * 5; ++i) EXPECT_EQ(p.dk.data[size_t(t * 10 + i)], dk[size_t(t * 10 + i)]);
    }
  }
}

// lse may be given in its honest token-major shape [B, S, Hq]: the same floats as the [B, Hq, S] view.
TEST(AttentionSegments, LseMayBeShapedTokenMajor) {
  const AttentionShape sh = make_shape(2, 12, 4, 2, 5);
  SegmentProblem p(sh);
  p.randomize(7);
  const AttentionSegments seg = segments_of(kMixed);
  ASSERT_TRUE(p.run(&seg).is_ok());
  std::vector<float> lse(p.lse.data.size()), out(p.out.data.size());
  const Tensor lse_bsh = Tensor::make(lse.data(), DType::f32, Device::cpu, {2, 12, 4});
  const Tensor out_t = Tensor::make(out.data(), DType::f32, Device::cpu, {2, 12, 4, 5});
  Status st = attention_forward(sh, p.q.t, p.k.t, p.v.t, out_t, lse_bsh, nullptr, &seg);
  ASSERT_TRUE(st.is_ok()) << st.message();
  EXPECT_EQ(lse, p.lse.data);
  // Without segments the lse must keep the [B, Hq, S] shape.
  st = attention_forward(sh, p.q.t, p.k.t, p.v.t, out_t, lse_bsh, nullptr);
  EXPECT_FALSE(st.is_ok());
}

TEST(AttentionSegments, MaxLenIsGivenOrComputed) {
  AttentionSegments seg = segments_of(kMixed);
  EXPECT_EQ(attention_segments_max_len(seg), 8);
  seg.max_len = 11;
  EXPECT_EQ(attention_segments_max_len(seg), 11);
}

// Runs the forward with `starts` (and overrides) and expects a refusal whose message contains `want`.
void expect_refused(const std::vector<int32_t>& starts, const char* want, int64_t max_len = 0,
                    const int32_t* host = nullptr, int64_t count = -1) {
  SegmentProblem p(make_shape(2, 12, 4, 2, 5));
  AttentionSegments seg = segments_of(starts);
  seg.max_len = max_len;
  if (host != nullptr || count >= 0) seg.starts = host;
  if (count >= 0) seg.count = count;
  const Status st = attention_forward(p.sh, p.q.t, p.k.t, p.v.t, p.out.t, p.lse.t, nullptr, &seg);
  ASSERT_FALSE(st.is_ok()) << "accepted segments that should fail with '" << want << "'";
  EXPECT_NE(st.message().find(want), std::string::npos) << st.message();
}

TEST(AttentionSegments, RefusesBadSegments) {
  expect_refused({1, 12, 24}, "must tile the B*S = 24 tokens");     // does not start at 0
  expect_refused({0, 12, 23}, "must tile the B*S = 24 tokens");     // does not reach T
  expect_refused({0, 5, 5, 24}, "segment 1 is empty or reversed");  // empty segment
  expect_refused({0, 9, 7, 24}, "segment 1 is empty or reversed");  // not increasing
  expect_refused({0, 10, 14, 24}, "crosses the end of row 0");      // [10, 14) spans both rows
  expect_refused({0, 24}, "crosses the end of row 0");              // one segment over both rows
  expect_refused({0, 12, 24}, "shorter than the longest segment", 5);
  expect_refused({0, 12, 24}, "must lie in [1, S=12]", 13);
  expect_refused({0, 12, 24}, "need the host array 'starts'", 0, nullptr, 2);
  expect_refused({0}, "1 to B*S segments");  // no segment at all
}

}  // namespace
}  // namespace nb::ops
