// Context parallelism's ring (ops/cp_ring.h) on CUDA: C = 2 and 4 ranks as threads on one GPU (K/V passed
// through host memory), each on its load-balanced tokens, against the FP64 CPU reference of whole-sequence
// causal attention at the same tokens; one non-causal key block (fewer keys than queries, and more) against
// the reference; packed rows (segments of several lengths, each cut into 2C chunks) at C = 2 and 4 against the
// whole-row segmented reference, and the packed blocks' segment halves alone. Tolerances are the cuDNN test's
// (attention_cudnn_test.cpp): relative L2 <= 1e-2 for bf16 outputs and max |lse diff| <= 1e-3; the ring's FP32
// merge adds only FP32 rounding to cuDNN's.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <barrier>
#include <cmath>
#include <random>
#include <thread>
#include <vector>

#include "attention/cp_test_util.h"
#include "attention/gpu/attention_gpu_util.h"
#include "common/gpu.h"
#include "core/bf16.h"
#include "ops/attention.h"
#include "ops/cp_attention.h"
#include "ops/cp_ring.h"

namespace nb::ops {
namespace {

double ring_max_diff(const std::vector<float>& got, const std::vector<float>& want) {
  double m = 0;
  for (size_t i = 0; i < got.size(); ++i) m = std::max(m, std::fabs(double(got[i]) - double(want[i])));
  return m;
}

// A device tensor holding `v` (bf16, or f32 when f32 is set), freed with the object.
struct Dev {
  Buffer buf;
  Dev(const std::vector<float>& v, std::initializer_list<int64_t> dims, bool f32 = false) {
    EXPECT_TRUE(Buffer::allocate(&buf, f32 ? DType::f32 : DType::bf16, Device::cuda, dims).is_ok());
    if (f32) {
      EXPECT_EQ(cudaMemcpy(buf.data(), v.data(), v.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
    } else {
      std::vector<bf16> h(v.size());
      for (size_t i = 0; i < v.size(); ++i) h[i] = f32_to_bf16(v[i]);
      EXPECT_EQ(cudaMemcpy(buf.data(), h.data(), h.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
    }
  }
  const Tensor& t() const { return buf.tensor(); }
  std::vector<float> host() const {
    const size_t n = size_t(buf.tensor().numel());
    std::vector<float> out(n);
    if (buf.tensor().dtype == DType::f32) {
      EXPECT_EQ(cudaMemcpy(out.data(), buf.data(), n * 4, cudaMemcpyDeviceToHost), cudaSuccess);
      return out;
    }
    std::vector<bf16> h(n);
    EXPECT_EQ(cudaMemcpy(h.data(), buf.data(), n * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    for (size_t i = 0; i < n; ++i) out[i] = bf16_to_f32(h[i]);
    return out;
  }
};

struct Problem {
  AttentionShape sh;
  std::vector<float> q, k, v, dout, out, lse, dq, dk, dv;
};

Problem reference_problem(AttentionShape sh, uint32_t seed) {
  Problem p{sh, {}, {}, {}, {}, {}, {}, {}, {}, {}};
  const int64_t B = sh.batch, S = sh.seq, Skv = sh.kv_len(), Hq = sh.heads, Hkv = sh.kv_heads, D = sh.head_dim;
  std::mt19937 rng(seed);
  p.q = random_bf16_values(size_t(B * S * Hq * D), rng);
  p.k = random_bf16_values(size_t(B * Skv * Hkv * D), rng);
  p.v = random_bf16_values(p.k.size(), rng);
  p.dout = random_bf16_values(p.q.size(), rng);
  p.out.resize(p.q.size());
  p.dq.resize(p.q.size());
  p.lse.resize(size_t(B * Hq * S));
  p.dk.resize(p.k.size());
  p.dv.resize(p.k.size());
  auto h = [](std::vector<float>& x, std::initializer_list<int64_t> d) {
    return Tensor::make(x.data(), DType::f32, Device::cpu, d);
  };
  EXPECT_TRUE(attention_forward_ref(sh, h(p.q, {B, S, Hq, D}), h(p.k, {B, Skv, Hkv, D}), h(p.v, {B, Skv, Hkv, D}),
                                    h(p.out, {B, S, Hq, D}), h(p.lse, {B, Hq, S}))
                  .is_ok());
  EXPECT_TRUE(attention_backward_ref(sh, h(p.q, {B, S, Hq, D}), h(p.k, {B, Skv, Hkv, D}), h(p.v, {B, Skv, Hkv, D}),
                                     h(p.out, {B, S, Hq, D}), h(p.dout, {B, S, Hq, D}), h(p.lse, {B, Hq, S}),
                                     h(p.dq, {B, S, Hq, D}), h(p.dk, {B, Skv, Hkv, D}), h(p.dv, {B, Skv, Hkv, D}))
                  .is_ok());
  return p;
}

void ring_rank(const Problem& p, int r, int C, RingMailbox* box, std::vector<double>* errs) {
  const AttentionShape& sh = p.sh;
  const int64_t B = sh.batch, S = sh.seq, Sl = S / C, Hq = sh.heads, Hkv = sh.kv_heads, D = sh.head_dim;
  AttentionShape local = sh;
  local.seq = Sl;
  const Dev q(cp_rows(p.q, B, S, Hq * D, r, C), {B, Sl, Hq, D}), k(cp_rows(p.k, B, S, Hkv * D, r, C), {B, Sl, Hkv, D});
  const Dev v(cp_rows(p.v, B, S, Hkv * D, r, C), {B, Sl, Hkv, D});
  const Dev dout(cp_rows(p.dout, B, S, Hq * D, r, C), {B, Sl, Hq, D});
  const std::vector<float> zq(size_t(B * Sl * Hq * D)), zkv(size_t(B * Sl * Hkv * D)), zs(size_t(B * Hq * Sl));
  const Dev out(zq, {B, Sl, Hq, D}), dq(zq, {B, Sl, Hq, D}), dk(zkv, {B, Sl, Hkv, D}), dv(zkv, {B, Sl, Hkv, D});
  const Dev lse(zs, {B, Hq, Sl}, true);
  ThreadRingLink link(r, C, box);
  cp::Ring ring;
  ASSERT_TRUE(ring.init(local, Device::cuda, DType::bf16, &link).is_ok());
  ASSERT_TRUE(ring.forward(q.t(), k.t(), v.t(), out.t(), lse.t(), nullptr).is_ok());
  ASSERT_TRUE(ring.backward(q.t(), k.t(), v.t(), out.t(), dout.t(), lse.t(), dq.t(), dk.t(), dv.t(), nullptr).is_ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  *errs = {rel_l2(out.host(), cp_rows(p.out, B, S, Hq * D, r, C)), rel_l2(dq.host(), cp_rows(p.dq, B, S, Hq * D, r, C)),
           rel_l2(dk.host(), cp_rows(p.dk, B, S, Hkv * D, r, C)), rel_l2(dv.host(), cp_rows(p.dv, B, S, Hkv * D, r, C)),
           ring_max_diff(lse.host(), cp_lse(p.lse, B, Hq, S, r, C))};
}

class RingGpu : public ::testing::TestWithParam<int> {};

TEST_P(RingGpu, EachRankMatchesTheReferenceAtItsTokens) {
  NB_REQUIRE_GPU();
  const int C = GetParam();
  const Problem p = reference_problem({2, 512, 8, 2, 64, 0.125f}, 7);
  RingMailbox box(C);
  std::vector<std::vector<double>> errs(static_cast<size_t>(C));
  std::vector<std::thread> ranks;
  for (int r = 0; r < C; ++r) ranks.emplace_back([&, r] { ring_rank(p, r, C, &box, &errs[size_t(r)]); });
  for (auto& t : ranks) t.join();
  for (int r = 0; r < C; ++r) {
    ASSERT_EQ(errs[size_t(r)].size(), 5u) << "rank " << r;
    for (int i = 0; i < 4; ++i) EXPECT_LE(errs[size_t(r)][size_t(i)], 1e-2) << "rank " << r << " output " << i;
    EXPECT_LE(errs[size_t(r)][4], 1e-3) << "rank " << r << " lse";
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, RingGpu, ::testing::Values(2, 4));

// One non-causal block on cuDNN against the reference: 128 queries over 64 keys, and 64 over 256.
TEST(RingGpuBlocks, NonCausalBlocksMatchTheReference) {
  NB_REQUIRE_GPU();
  for (auto [sq, skv] : {std::pair<int64_t, int64_t>{128, 64}, {64, 256}}) {
    AttentionShape sh{2, sq, 8, 2, 64, 0.125f};
    sh.kv_seq = skv;
    sh.causal = false;
    const Problem p = reference_problem(sh, 3);
    const int64_t B = 2, Hq = 8, Hkv = 2, D = 64;
    const Dev q(p.q, {B, sq, Hq, D}), k(p.k, {B, skv, Hkv, D}), v(p.v, {B, skv, Hkv, D}), dout(p.dout, {B, sq, Hq, D});
    const Dev out(p.out, {B, sq, Hq, D}), dq(p.out, {B, sq, Hq, D}), dk(p.k, {B, skv, Hkv, D}),
        dv(p.k, {B, skv, Hkv, D});
    const Dev lse(p.lse, {B, Hq, sq}, true);
    Status st = attention_forward(sh, q.t(), k.t(), v.t(), out.t(), lse.t(), nullptr);
    ASSERT_TRUE(st.is_ok()) << st.message();
    st = attention_backward(sh, q.t(), k.t(), v.t(), out.t(), dout.t(), lse.t(), dq.t(), dk.t(), dv.t(), nullptr);
    ASSERT_TRUE(st.is_ok()) << st.message();
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    SCOPED_TRACE(testing::Message() << sq << " queries over " << skv << " keys");
    EXPECT_LE(rel_l2(out.host(), p.out), 1e-2);
    EXPECT_LE(ring_max_diff(lse.host(), p.lse), 1e-3);
    EXPECT_LE(rel_l2(dq.host(), p.dq), 1e-2);
    EXPECT_LE(rel_l2(dk.host(), p.dk), 1e-2);
    EXPECT_LE(rel_l2(dv.host(), p.dv), 1e-2);
  }
}

// ---- Packed rows: segments of several lengths, each a multiple of 2C, cut into 2C chunks like a row ----

// Two rows of 512 tokens: row 0 holds segments of 64, 200 and 248 tokens, row 1 of 8, 120 and 384.
const std::vector<int32_t> kPackedStarts{0, 64, 264, 512, 520, 640, 1024};

// The whole-row segmented reference (FP64 inside; lse token-major [T, Hq]) of bf16-exact inputs.
Problem packed_problem(AttentionShape sh, const std::vector<int32_t>& starts, uint32_t seed) {
  Problem p{sh, {}, {}, {}, {}, {}, {}, {}, {}, {}};
  const int64_t B = sh.batch, S = sh.seq, Hq = sh.heads, Hkv = sh.kv_heads, D = sh.head_dim;
  std::mt19937 rng(seed);
  p.q = random_bf16_values(size_t(B * S * Hq * D), rng);
  p.k = random_bf16_values(size_t(B * S * Hkv * D), rng);
  p.v = random_bf16_values(p.k.size(), rng);
  p.dout = random_bf16_values(p.q.size(), rng);
  p.out.resize(p.q.size());
  p.dq.resize(p.q.size());
  p.lse.resize(size_t(B * Hq * S));
  p.dk.resize(p.k.size());
  p.dv.resize(p.k.size());
  auto h = [](std::vector<float>& x, std::initializer_list<int64_t> d) {
    return Tensor::make(x.data(), DType::f32, Device::cpu, d);
  };
  const AttentionSegments seg{int64_t(starts.size()) - 1, starts.data(), nullptr, 0};
  EXPECT_TRUE(attention_forward_ref(sh, h(p.q, {B, S, Hq, D}), h(p.k, {B, S, Hkv, D}), h(p.v, {B, S, Hkv, D}),
                                    h(p.out, {B, S, Hq, D}), h(p.lse, {B, S, Hq}), &seg)
                  .is_ok());
  EXPECT_TRUE(attention_backward_ref(sh, h(p.q, {B, S, Hq, D}), h(p.k, {B, S, Hkv, D}), h(p.v, {B, S, Hkv, D}),
                                     h(p.out, {B, S, Hq, D}), h(p.dout, {B, S, Hq, D}), h(p.lse, {B, S, Hq}),
                                     h(p.dq, {B, S, Hq, D}), h(p.dk, {B, S, Hkv, D}), h(p.dv, {B, S, Hkv, D}), &seg)
                  .is_ok());
  return p;
}

// A device copy of int32 segment starts.
struct DevStarts {
  Buffer buf;
  explicit DevStarts(const std::vector<int32_t>& s) {
    EXPECT_TRUE(Buffer::allocate(&buf, DType::i32, Device::cuda, {int64_t(s.size())}).is_ok());
    EXPECT_EQ(cudaMemcpy(buf.data(), s.data(), s.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  }
};

void packed_ring_rank(const Problem& p, int r, int C, RingMailbox* box, std::vector<double>* errs) {
  const AttentionShape& sh = p.sh;
  const int64_t B = sh.batch, Sl = sh.seq / C, Hq = sh.heads, Hkv = sh.kv_heads, D = sh.head_dim;
  const AttentionSegments whole{int64_t(kPackedStarts.size()) - 1, kPackedStarts.data(), nullptr, 0};
  std::vector<int64_t> tokens;
  ASSERT_TRUE(cp::shard_tokens(sh, &whole, C, r, &tokens).is_ok());
  const std::vector<int32_t> table = cp_local_starts(kPackedStarts, C);
  const DevStarts table_dev(table);
  const AttentionSegments seg{int64_t(table.size()) - 1, table.data(), table_dev.buf.tensor().ptr<int32_t>(), 0};
  AttentionShape local = sh;
  local.seq = Sl;
  const Dev q(cp_tokens(p.q, tokens, Hq * D), {B, Sl, Hq, D}), k(cp_tokens(p.k, tokens, Hkv * D), {B, Sl, Hkv, D});
  const Dev v(cp_tokens(p.v, tokens, Hkv * D), {B, Sl, Hkv, D});
  const Dev dout(cp_tokens(p.dout, tokens, Hq * D), {B, Sl, Hq, D});
  const std::vector<float> zq(size_t(B * Sl * Hq * D)), zkv(size_t(B * Sl * Hkv * D)), zs(size_t(B * Hq * Sl));
  const Dev out(zq, {B, Sl, Hq, D}), dq(zq, {B, Sl, Hq, D}), dk(zkv, {B, Sl, Hkv, D}), dv(zkv, {B, Sl, Hkv, D});
  const Dev lse(zs, {B, Sl, Hq}, true);  // token-major
  ThreadRingLink link(r, C, box);
  cp::Ring ring;
  ASSERT_TRUE(ring.init(local, Device::cuda, DType::bf16, &link).is_ok());
  Status st = ring.forward(q.t(), k.t(), v.t(), out.t(), lse.t(), nullptr, &seg);
  ASSERT_TRUE(st.is_ok()) << st.message();
  st = ring.backward(q.t(), k.t(), v.t(), out.t(), dout.t(), lse.t(), dq.t(), dk.t(), dv.t(), nullptr, &seg);
  ASSERT_TRUE(st.is_ok()) << st.message();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  *errs = {rel_l2(out.host(), cp_tokens(p.out, tokens, Hq * D)), rel_l2(dq.host(), cp_tokens(p.dq, tokens, Hq * D)),
           rel_l2(dk.host(), cp_tokens(p.dk, tokens, Hkv * D)), rel_l2(dv.host(), cp_tokens(p.dv, tokens, Hkv * D)),
           ring_max_diff(lse.host(), cp_tokens(p.lse, tokens, Hq))};
}

class RingGpuPacked : public ::testing::TestWithParam<int> {};

TEST_P(RingGpuPacked, EachRankMatchesTheSegmentedReferenceAtItsTokens) {
  NB_REQUIRE_GPU();
  const int C = GetParam();
  const Problem p = packed_problem({2, 512, 8, 2, 64, 0.125f}, kPackedStarts, 17);
  RingMailbox box(C);
  std::vector<std::vector<double>> errs(static_cast<size_t>(C));
  std::vector<std::thread> ranks;
  for (int r = 0; r < C; ++r) ranks.emplace_back([&, r] { packed_ring_rank(p, r, C, &box, &errs[size_t(r)]); });
  for (auto& t : ranks) t.join();
  for (int r = 0; r < C; ++r) {
    ASSERT_EQ(errs[size_t(r)].size(), 5u) << "rank " << r;
    std::printf("C%d rank %d: rel L2 out %.2e dq %.2e dk %.2e dv %.2e, max |lse diff| %.2e\n", C, r, errs[size_t(r)][0],
                errs[size_t(r)][1], errs[size_t(r)][2], errs[size_t(r)][3], errs[size_t(r)][4]);
    for (int i = 0; i < 4; ++i) EXPECT_LE(errs[size_t(r)][size_t(i)], 1e-2) << "rank " << r << " output " << i;
    EXPECT_LE(errs[size_t(r)][4], 1e-3) << "rank " << r << " lse";
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, RingGpuPacked, ::testing::Values(2, 4));

// The packed blocks alone on cuDNN: every segment's query part against its key part (no causal mask; query and
// key lengths and offsets differ per slot) against the reference, and tokens outside the parts left as they were.
TEST(RingGpuBlocks, SegmentHalvesMatchTheReference) {
  NB_REQUIRE_GPU();
  AttentionShape sh{2, 512, 8, 2, 64, 0.125f};
  sh.causal = false;
  const int64_t B = 2, S = 512, Hq = 8, Hkv = 2, D = 64;
  const DevStarts starts_dev(kPackedStarts);
  using P = SegmentPart;
  for (const auto& [qp, kp] : {std::pair<P, P>{P::whole, P::first_half}, {P::second_half, P::whole}}) {
    AttentionSegments seg{int64_t(kPackedStarts.size()) - 1, kPackedStarts.data(),
                          starts_dev.buf.tensor().ptr<int32_t>(), 0};
    seg.q_part = qp;
    seg.kv_part = kp;
    Problem p = reference_problem({B, S, Hq, Hkv, D, 0.125f}, 9);  // inputs only; the reference is below
    constexpr float kMark = 3.0f;                                  // exact in bf16: "not written"
    for (auto* x : {&p.out, &p.dq}) std::fill(x->begin(), x->end(), kMark);
    for (auto* x : {&p.dk, &p.dv}) std::fill(x->begin(), x->end(), kMark);
    std::fill(p.lse.begin(), p.lse.end(), kMark);
    const Dev q(p.q, {B, S, Hq, D}), k(p.k, {B, S, Hkv, D}), v(p.v, {B, S, Hkv, D}), dout(p.dout, {B, S, Hq, D});
    const Dev out(p.out, {B, S, Hq, D}), dq(p.dq, {B, S, Hq, D}), dk(p.dk, {B, S, Hkv, D}), dv(p.dv, {B, S, Hkv, D});
    const Dev lse(p.lse, {B, S, Hq}, true);
    Status st = attention_forward(sh, q.t(), k.t(), v.t(), out.t(), lse.t(), nullptr, &seg);
    ASSERT_TRUE(st.is_ok()) << st.message();
    st = attention_backward(sh, q.t(), k.t(), v.t(), out.t(), dout.t(), lse.t(), dq.t(), dk.t(), dv.t(), nullptr, &seg);
    ASSERT_TRUE(st.is_ok()) << st.message();
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    auto h = [](std::vector<float>& x, std::initializer_list<int64_t> d) {
      return Tensor::make(x.data(), DType::f32, Device::cpu, d);
    };
    ASSERT_TRUE(attention_forward_ref(sh, h(p.q, {B, S, Hq, D}), h(p.k, {B, S, Hkv, D}), h(p.v, {B, S, Hkv, D}),
                                      h(p.out, {B, S, Hq, D}), h(p.lse, {B, S, Hq}), &seg)
                    .is_ok());
    ASSERT_TRUE(attention_backward_ref(sh, h(p.q, {B, S, Hq, D}), h(p.k, {B, S, Hkv, D}), h(p.v, {B, S, Hkv, D}),
                                       h(p.out, {B, S, Hq, D}), h(p.dout, {B, S, Hq, D}), h(p.lse, {B, S, Hq}),
                                       h(p.dq, {B, S, Hq, D}), h(p.dk, {B, S, Hkv, D}), h(p.dv, {B, S, Hkv, D}), &seg)
                    .is_ok());
    SCOPED_TRACE(testing::Message() << "query part " << int(qp) << ", key part " << int(kp));
    // The reference leaves the marks where the GPU must have left them too, so whole tensors compare.
    EXPECT_LE(rel_l2(out.host(), p.out), 1e-2);
    EXPECT_LE(ring_max_diff(lse.host(), p.lse), 1e-3);
    EXPECT_LE(rel_l2(dq.host(), p.dq), 1e-2);
    EXPECT_LE(rel_l2(dk.host(), p.dk), 1e-2);
    EXPECT_LE(rel_l2(dv.host(), p.dv), 1e-2);
    const std::vector<float> out_h = out.host(), dk_h = dk.host();
    int64_t moved = 0;  // marks the GPU overwrote
    for (size_t i = 0; i < out_h.size(); ++i) moved += (p.out[i] == kMark) != (out_h[i] == kMark);
    for (size_t i = 0; i < dk_h.size(); ++i) moved += (p.dk[i] == kMark) != (dk_h[i] == kMark);
    EXPECT_EQ(moved, 0);
  }
}

}  // namespace
}  // namespace nb::ops
