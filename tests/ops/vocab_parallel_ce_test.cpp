// Tensor parallelism's vocabulary-parallel cross-entropy (ops/vocab_parallel_ce.h) against the whole-vocabulary
// reference (ops::cross_entropy_fwd_bwd, FP64 on the CPU): T = 1, 2, 4 ranks as threads, each holding V/T of
// every row's logits, the group's MAX and SUM done through a mailbox. Losses and every rank's slice of the
// gradient equal the whole computation's within FP32 rounding (the FP64 sums only change order); targets at the
// slices' edges and ignored rows (-1: loss and gradient 0) included.
#include <gtest/gtest.h>

#include <algorithm>
#include <barrier>
#include <cmath>
#include <random>
#include <thread>
#include <vector>

#include "ops/cross_entropy.h"
#include "ops/vocab_parallel_ce.h"

namespace nb::ops {
namespace {

// Each rank posts its values, all wait, each reduces every rank's in rank order, all wait again.
class ThreadVocabReducer : public tp::VocabReducer {
 public:
  struct Shared {
    explicit Shared(int n) : posted(size_t(n)), sync(n) {}
    std::vector<std::vector<double>> posted;
    std::barrier<> sync;
  };
  ThreadVocabReducer(int rank, Shared* s) : rank_(rank), s_(s) {}
  Status max(double* v, int64_t n) override {
    return reduce(v, n, [](double a, double b) { return std::max(a, b); });
  }
  Status sum(double* v, int64_t n) override {
    return reduce(v, n, [](double a, double b) { return a + b; });
  }

 private:
  template <typename Op>
  Status reduce(double* v, int64_t n, Op op) {
    s_->posted[size_t(rank_)].assign(v, v + n);
    s_->sync.arrive_and_wait();
    for (int64_t i = 0; i < n; ++i) {
      double acc = s_->posted[0][size_t(i)];
      for (size_t r = 1; r < s_->posted.size(); ++r) acc = op(acc, s_->posted[r][size_t(i)]);
      v[i] = acc;
    }
    s_->sync.arrive_and_wait();
    return Status::ok();
  }
  int rank_;
  Shared* s_;
};

class VocabParallelCe : public ::testing::TestWithParam<int> {};

TEST_P(VocabParallelCe, EqualsTheWholeVocabulary) {
  const int ranks = GetParam();
  const int64_t T = 6, V = 64, Vl = V / ranks;
  std::mt19937 rng(5);
  std::normal_distribution<float> dist(0.f, 3.f);
  std::vector<float> whole(size_t(T * V));
  for (float& x : whole) x = dist(rng);
  // Targets at both ends of the slices, inside them, and an ignored row.
  std::vector<int32_t> targets = {0, int32_t(Vl - 1), int32_t(std::min(Vl, V - 2)), 37, -1, int32_t(V - 1)};
  std::vector<float> ref_losses(static_cast<size_t>(T)), ref = whole;
  cross_entropy_fwd_bwd(Tensor::make(ref.data(), DType::f32, Device::cpu, {T, V}),
                        Tensor::make(targets.data(), DType::i32, Device::cpu, {T}), 0.25f,
                        Tensor::make(ref_losses.data(), DType::f32, Device::cpu, {T}), nullptr);
  ThreadVocabReducer::Shared shared(ranks);
  std::vector<std::vector<float>> slices(static_cast<size_t>(ranks)),
      losses(static_cast<size_t>(ranks), std::vector<float>(static_cast<size_t>(T)));
  std::vector<Status> results(static_cast<size_t>(ranks), Status::ok());
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    for (int64_t t = 0; t < T; ++t)
      slices[size_t(r)].insert(slices[size_t(r)].end(), whole.begin() + t * V + r * Vl,
                               whole.begin() + t * V + (r + 1) * Vl);
    threads.emplace_back([&, r] {
      ThreadVocabReducer group(r, &shared);
      results[size_t(r)] = tp::vocab_parallel_cross_entropy(
          Tensor::make(slices[size_t(r)].data(), DType::f32, Device::cpu, {T, Vl}),
          Tensor::make(targets.data(), DType::i32, Device::cpu, {T}), r * Vl, 0.25f,
          Tensor::make(losses[size_t(r)].data(), DType::f32, Device::cpu, {T}), &group);
    });
  }
  for (auto& th : threads) th.join();
  for (int r = 0; r < ranks; ++r) {
    ASSERT_TRUE(results[size_t(r)].is_ok()) << results[size_t(r)].message();
    for (int64_t t = 0; t < T; ++t) {
      EXPECT_NEAR(losses[size_t(r)][size_t(t)], ref_losses[size_t(t)], 2e-6 * std::fabs(ref_losses[size_t(t)]) + 1e-7)
          << "rank " << r << ", row " << t;
      for (int64_t j = 0; j < Vl; ++j)
        EXPECT_NEAR(slices[size_t(r)][size_t(t * Vl + j)], ref[size_t(t * V + r * Vl + j)], 1e-7)
            << "rank " << r << ", row " << t << ", id " << r * Vl + j;
    }
  }
  EXPECT_EQ(losses[0][4], 0.f);  // the ignored row
}

INSTANTIATE_TEST_SUITE_P(Ranks, VocabParallelCe, ::testing::Values(1, 2, 4));

}  // namespace
}  // namespace nb::ops
