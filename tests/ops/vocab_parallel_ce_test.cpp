// Tensor parallelism's vocabulary-parallel cross-entropy (ops/vocab_parallel_ce.h) against the whole-vocabulary
// reference (ops::cross_entropy_fwd_bwd, FP64 on the CPU): T = 1, 2, 4 ranks as threads, each holding V/T of
// every row's logits, the group's MAX and SUM done through a mailbox on FP32 host tensors. Losses and every
// rank's slice of the gradient equal the whole computation's within the FP32 rounding of the reduced
// statistics; targets at the slices' edges and ignored rows (-1: loss and gradient 0) included. A padded
// vocabulary (60 ids in 64 columns, garbage in the padding) equals the unpadded 60-column computation.
#include <gtest/gtest.h>

#include <algorithm>
#include <barrier>
#include <cmath>
#include <limits>
#include <random>
#include <thread>
#include <vector>

#include "ops/cross_entropy.h"
#include "ops/vocab_parallel_ce.h"

namespace nb::ops {
namespace {

// Each rank posts its values, all wait, each reduces every rank's in rank order (so all get the same bits),
// all wait again.
class MailboxReduceGroup : public tp::ReduceGroup {
 public:
  struct Shared {
    explicit Shared(int n) : posted(size_t(n)), sync(n) {}
    std::vector<std::vector<float>> posted;
    std::barrier<> sync;
  };
  MailboxReduceGroup(int rank, Shared* s) : rank_(rank), s_(s) {}
  int rank() const override { return rank_; }
  int size() const override { return int(s_->posted.size()); }
  Status max(const Tensor& v, Stream) override {
    return reduce(v, [](float a, float b) { return std::max(a, b); });
  }
  Status sum(const Tensor& v, Stream) override {
    return reduce(v, [](float a, float b) { return a + b; });
  }
  // The loss calls only max and sum.
  Status reduce_scatter(const Tensor&, const Tensor&, Stream) override { return errorf("not used by the loss"); }
  Status all_gather(const Tensor&, const Tensor&, Stream) override { return errorf("not used by the loss"); }

 private:
  template <typename Op>
  Status reduce(const Tensor& v, Op op) {
    if (v.device != Device::cpu || v.dtype != DType::f32) return errorf("mailbox group: f32 host tensors only");
    float* p = v.ptr<float>();
    const int64_t n = v.numel();
    s_->posted[size_t(rank_)].assign(p, p + n);
    s_->sync.arrive_and_wait();
    for (int64_t i = 0; i < n; ++i) {
      float acc = s_->posted[0][size_t(i)];
      for (size_t r = 1; r < s_->posted.size(); ++r) acc = op(acc, s_->posted[r][size_t(i)]);
      p[i] = acc;
    }
    s_->sync.arrive_and_wait();
    return Status::ok();
  }
  int rank_;
  Shared* s_;
};

// Runs the op on `ranks` threads over rows of `padded` columns (ids >= vocab are padding) and checks losses
// and gradients against cross_entropy_fwd_bwd on the rows' first `vocab` columns.
void expect_equals_whole(int ranks, int64_t vocab, int64_t padded, const std::vector<float>& whole,
                         const std::vector<int32_t>& targets) {
  const int64_t T = int64_t(targets.size()), Vl = padded / ranks;
  const float scale = 0.25f;
  std::vector<float> ref(static_cast<size_t>(T * vocab)), ref_losses(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) std::copy_n(whole.begin() + t * padded, vocab, ref.begin() + t * vocab);
  std::vector<int32_t> tgt = targets;
  cross_entropy_fwd_bwd(Tensor::make(ref.data(), DType::f32, Device::cpu, {T, vocab}),
                        Tensor::make(tgt.data(), DType::i32, Device::cpu, {T}), scale,
                        Tensor::make(ref_losses.data(), DType::f32, Device::cpu, {T}), nullptr);
  MailboxReduceGroup::Shared shared(ranks);
  std::vector<std::vector<float>> slices(static_cast<size_t>(ranks)),
      losses(static_cast<size_t>(ranks), std::vector<float>(static_cast<size_t>(T), -1.f)),
      scratch(static_cast<size_t>(ranks), std::vector<float>(static_cast<size_t>(3 * T)));
  std::vector<Status> results(static_cast<size_t>(ranks), Status::ok());
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    for (int64_t t = 0; t < T; ++t)
      slices[size_t(r)].insert(slices[size_t(r)].end(), whole.begin() + t * padded + r * Vl,
                               whole.begin() + t * padded + (r + 1) * Vl);
    threads.emplace_back([&, r] {
      MailboxReduceGroup group(r, &shared);
      results[size_t(r)] = tp::vocab_parallel_cross_entropy(
          Tensor::make(slices[size_t(r)].data(), DType::f32, Device::cpu, {T, Vl}),
          Tensor::make(tgt.data(), DType::i32, Device::cpu, {T}), r * Vl, vocab, scale,
          Tensor::make(losses[size_t(r)].data(), DType::f32, Device::cpu, {T}),
          Tensor::make(scratch[size_t(r)].data(), DType::f32, Device::cpu, {3, T}), &group, nullptr);
    });
  }
  for (auto& th : threads) th.join();
  // Tolerances from the rounding of the statistics to FP32: each rank's sum of exponentials is rounded once
  // and the mailbox adds the ranks' sums in FP32, so s carries a relative error of at most ranks x 2^-24
  // (2.4e-7 at 4 ranks). That shifts log(s), so the loss, by as much in absolute terms (hence the 5e-7 floor
  // under the 1e-6 relative bound), and each probability p <= 1 by as much relative, so the gradient by at
  // most 2.4e-7 x scale plus its own FP32 rounding: 1e-6 x scale. A onehot on the local id, a padded column
  // in the max or the sum, or a missing rank's share moves them by 1e-2 and more.
  for (int r = 0; r < ranks; ++r) {
    ASSERT_TRUE(results[size_t(r)].is_ok()) << results[size_t(r)].message();
    for (int64_t t = 0; t < T; ++t) {
      EXPECT_NEAR(losses[size_t(r)][size_t(t)], ref_losses[size_t(t)], 1e-6 * std::fabs(ref_losses[size_t(t)]) + 5e-7)
          << "rank " << r << ", row " << t;
      for (int64_t j = 0; j < Vl; ++j) {
        const int64_t id = r * Vl + j;
        const float got = slices[size_t(r)][size_t(t * Vl + j)];
        if (id >= vocab)
          EXPECT_EQ(got, 0.f) << "rank " << r << ", row " << t << ", padded id " << id;
        else
          EXPECT_NEAR(got, ref[size_t(t * vocab + id)], 1e-6 * scale) << "rank " << r << ", row " << t << ", id " << id;
      }
    }
  }
  for (int64_t t = 0; t < T; ++t) {
    if (targets[size_t(t)] < 0) { EXPECT_EQ(losses[0][size_t(t)], 0.f) << "ignored row " << t; }
  }
}

std::vector<float> normal_logits(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.f, 3.f);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = dist(rng);
  return v;
}

class VocabParallelCe : public ::testing::TestWithParam<int> {};

TEST_P(VocabParallelCe, EqualsTheWholeVocabulary) {
  const int ranks = GetParam();
  const int64_t T = 6, V = 64, Vl = V / ranks;
  // Targets at both ends of the slices, inside them, and an ignored row.
  expect_equals_whole(ranks, V, V, normal_logits(T * V, 5),
                      {0, int32_t(Vl - 1), int32_t(std::min(Vl, V - 2)), 37, -1, int32_t(V - 1)});
}

// 60 ids padded to 64 columns: at 4 ranks the last slice holds ids 48..59 and 4 columns of padding whose
// garbage (large, infinite, NaN) would dominate the max or poison the sum if it took part.
TEST_P(VocabParallelCe, PaddedColumnsTakeNoPart) {
  const int ranks = GetParam();
  const int64_t T = 5, V = 60, padded = 64;
  std::vector<float> whole = normal_logits(T * padded, 9);
  const float garbage[] = {1e4f, std::numeric_limits<float>::infinity(), -1e30f,
                           std::numeric_limits<float>::quiet_NaN()};
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = V; j < padded; ++j) whole[size_t(t * padded + j)] = garbage[(j + t) % 4];
  expect_equals_whole(ranks, V, padded, whole, {59, 48, 0, -1, 47});
}

INSTANTIATE_TEST_SUITE_P(Ranks, VocabParallelCe, ::testing::Values(1, 2, 4));

TEST(VocabParallelCeArgs, BadArgumentsAreAStatus) {
  std::vector<float> logits(8), losses(2), scratch(6);
  std::vector<int32_t> targets = {0, 1};
  MailboxReduceGroup::Shared shared(1);
  MailboxReduceGroup group(0, &shared);
  auto call = [&](const Tensor& scr, int64_t vocab, tp::ReduceGroup* g) {
    return tp::vocab_parallel_cross_entropy(Tensor::make(logits.data(), DType::f32, Device::cpu, {2, 4}),
                                            Tensor::make(targets.data(), DType::i32, Device::cpu, {2}), 0, vocab, 1.f,
                                            Tensor::make(losses.data(), DType::f32, Device::cpu, {2}), scr, g, nullptr);
  };
  const Tensor good = Tensor::make(scratch.data(), DType::f32, Device::cpu, {3, 2});
  EXPECT_TRUE(call(good, 4, &group).is_ok());
  EXPECT_FALSE(call(Tensor::make(scratch.data(), DType::f32, Device::cpu, {2, 2}), 4, &group).is_ok());
  EXPECT_FALSE(call(Tensor::make(scratch.data(), DType::f32, Device::cpu, {2, 3}), 4, &group).is_ok());
  EXPECT_FALSE(call(good, 0, &group).is_ok());
  EXPECT_FALSE(call(good, 4, nullptr).is_ok());
}

}  // namespace
}  // namespace nb::ops
