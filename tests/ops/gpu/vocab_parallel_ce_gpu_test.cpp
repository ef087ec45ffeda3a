// CUDA vocabulary-parallel cross-entropy (ops/vocab_parallel_ce.h) against the CPU path of the same function:
// 2 ranks as threads, one CUDA stream each, BF16 and FP32 logits, a padded vocabulary with garbage (large,
// infinite, NaN) in the padding, ignored rows and a target >= vocab (ignored on CUDA). The group synchronizes
// its stream, copies the device values to the host, reduces them in a mailbox and copies them back.
#include <gtest/gtest.h>
#include <cuda_runtime.h>
#include <barrier>
#include <cmath>
#include <limits>
#include <random>
#include <thread>
#include "../ops_test_util.h"
#include "common/gpu.h"
#include "gpu_util.h"
#include "ops/vocab_parallel_ce.h"

using namespace nb;
using namespace nb::ops;
using namespace nb::ops::testing;

namespace {

// Each rank posts its values, all wait, each reduces every rank's in rank order (the same bits on every rank),
// all wait again. Device values take a round trip through the host, ordered on the caller's stream.
class DeviceMailboxGroup : public tp::ReduceGroup {
 public:
  struct Shared {
    explicit Shared(int n) : posted(size_t(n)), sync(n) {}
    std::vector<std::vector<float>> posted;
    std::barrier<> sync;
  };
  DeviceMailboxGroup(int rank, Shared* s) : rank_(rank), s_(s) {}
  int rank() const override { return rank_; }
  int size() const override { return int(s_->posted.size()); }
  Status max(const Tensor& v, Stream stream) override {
    return reduce(v, stream, [](float a, float b) { return std::max(a, b); });
  }
  Status sum(const Tensor& v, Stream stream) override {
    return reduce(v, stream, [](float a, float b) { return a + b; });
  }
  // The loss calls only max and sum.
  Status reduce_scatter(const Tensor&, const Tensor&, Stream) override { return errorf("not used by the loss"); }
  Status all_gather(const Tensor&, const Tensor&, Stream) override { return errorf("not used by the loss"); }

 private:
  template <typename Op>
  Status reduce(const Tensor& v, Stream stream, Op op) {
    if (v.dtype != DType::f32) return errorf("mailbox group: f32 only");
    std::vector<float>& mine = s_->posted[size_t(rank_)];
    mine.resize(size_t(v.numel()));
    NB_TRY(copy_bytes_async(mine.data(), Device::cpu, v.data, v.device, size_t(v.bytes()), stream));
    if (v.device == Device::cuda) stream_synchronize(stream);  // the copy (after the pass before) has landed
    s_->sync.arrive_and_wait();
    std::vector<float> acc = s_->posted[0];
    for (size_t r = 1; r < s_->posted.size(); ++r)
      for (size_t i = 0; i < acc.size(); ++i) acc[i] = op(acc[i], s_->posted[r][i]);
    s_->sync.arrive_and_wait();
    NB_TRY(copy_bytes_async(v.data, v.device, acc.data(), Device::cpu, size_t(v.bytes()), stream));
    if (v.device == Device::cuda) stream_synchronize(stream);  // acc is freed on return
    return Status::ok();
  }
  int rank_;
  Shared* s_;
};

constexpr int kRanks = 2;
constexpr float kScale = 1.f / 3.f;

struct VpCeShape {
  int64_t rows, vocab, padded;
  DType dt;
};
class VocabParallelCeGpu : public ::testing::TestWithParam<VpCeShape> {};

// Per rank: its logits slice (overwritten with dlogits) and losses.
struct RankOutput {
  std::vector<float> dlogits, losses;
};

// Runs the op on kRanks threads, on the CPU (FP32 host tensors) or on CUDA (dt, one stream per rank).
std::vector<RankOutput> run_vp_ce(bool cuda, DType dt, const std::vector<float>& whole, int64_t rows, int64_t vocab,
                                  int64_t padded, const std::vector<int32_t>& targets) {
  const int64_t Vl = padded / kRanks;
  DeviceMailboxGroup::Shared shared(kRanks);
  std::vector<RankOutput> out(kRanks);
  std::vector<Status> results(kRanks, Status::ok());
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      RankOutput& o = out[size_t(r)];
      for (int64_t t = 0; t < rows; ++t)
        o.dlogits.insert(o.dlogits.end(), whole.begin() + t * padded + r * Vl,
                         whole.begin() + t * padded + (r + 1) * Vl);
      o.losses.assign(size_t(rows), -1.f);
      DeviceMailboxGroup group(r, &shared);
      if (!cuda) {
        std::vector<int32_t> tgt = targets;
        std::vector<float> scratch(static_cast<size_t>(3 * rows));
        results[size_t(r)] = tp::vocab_parallel_cross_entropy(host_f32(o.dlogits, {rows, Vl}), host_i32(tgt, {rows}),
                                                              r * Vl, vocab, kScale, host_f32(o.losses, {rows}),
                                                              host_f32(scratch, {3, rows}), &group, nullptr);
        return;
      }
      cudaStream_t stream = nullptr;
      NB_CHECK(cudaStreamCreate(&stream) == cudaSuccess);
      auto logits = upload(o.dlogits, dt, {rows, Vl});
      auto tgt = upload_i32(targets, {rows});
      auto losses = upload(o.losses, DType::f32, {rows});
      auto scratch = upload(std::vector<float>(size_t(3 * rows)), DType::f32, {3, rows});
      results[size_t(r)] = tp::vocab_parallel_cross_entropy(logits.t(), tgt.t(), r * Vl, vocab, kScale, losses.t(),
                                                            scratch.t(), &group, stream);
      NB_CHECK(cudaStreamSynchronize(stream) == cudaSuccess);
      NB_CHECK(cudaStreamDestroy(stream) == cudaSuccess);
      o.dlogits = download(logits.t());
      o.losses = download(losses.t());
    });
  }
  for (auto& th : threads) th.join();
  for (int r = 0; r < kRanks; ++r) EXPECT_TRUE(results[size_t(r)].is_ok()) << results[size_t(r)].message();
  return out;
}

TEST_P(VocabParallelCeGpu, MatchesTheCpuPath) {
  NB_REQUIRE_GPU();
  const auto [rows, vocab, padded, dt] = GetParam();
  const int64_t Vl = padded / kRanks;
  auto whole = rounded(random_vec(size_t(rows * padded), 91, -8.f, 8.f), dt);
  const float garbage[] = {1e4f, std::numeric_limits<float>::infinity(), -1e30f,
                           std::numeric_limits<float>::quiet_NaN()};
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t j = vocab; j < padded; ++j) whole[size_t(t * padded + j)] = garbage[(t + j) % 4];
  std::vector<int32_t> targets(static_cast<size_t>(rows));
  std::mt19937 rng(92);
  for (int64_t t = 0; t < rows; ++t) targets[size_t(t)] = (t % 7 == 3) ? -1 : int32_t(rng() % uint32_t(vocab));
  targets[1] = int32_t(vocab - 1);
  targets[2] = int32_t(Vl);  // the first id of rank 1
  // CUDA treats a target in the padding as an ignored row (the CPU path stops on it as a bug).
  targets[5] = int32_t(padded - 1);
  std::vector<int32_t> cpu_targets = targets;
  cpu_targets[5] = -1;
  const auto want = run_vp_ce(false, DType::f32, whole, rows, vocab, padded, cpu_targets);
  const auto got = run_vp_ce(true, dt, whole, rows, vocab, padded, targets);
  for (int r = 0; r < kRanks; ++r) {
    SCOPED_TRACE(::testing::Message() << "rank " << r);
    // Loss: an FP32 sum of exponentials (relative error ~1e-6) then a log, as ops/cross_entropy's test.
    EXPECT_EQ(count_bad(got[size_t(r)].losses, want[size_t(r)].losses, 1e-5, {1e-5}, "loss"), 0);
    // Gradient: FP32 softmax (a few ulps) rounded once; p - 1 at the target is off by ~1e-7 absolute.
    EXPECT_EQ(count_bad(got[size_t(r)].dlogits, want[size_t(r)].dlogits, dt == DType::bf16 ? kBf16Rel : 1e-5,
                        {0x1p-20 * kScale}, "dlogits"),
              0);
    for (int64_t t = 0; t < rows; ++t)
      for (int64_t j = std::max<int64_t>(vocab - r * Vl, 0); j < Vl; ++j)
        ASSERT_EQ(got[size_t(r)].dlogits[size_t(t * Vl + j)], 0.f) << "row " << t << ", padded column " << j;
  }
  EXPECT_TRUE(same_bits(got[0].losses, got[1].losses));  // every rank writes the same losses
  // Fixed-order block reductions, no atomics: a second run gives the same bits.
  const auto again = run_vp_ce(true, dt, whole, rows, vocab, padded, targets);
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_TRUE(same_bits(again[size_t(r)].losses, got[size_t(r)].losses));
    EXPECT_TRUE(same_bits(again[size_t(r)].dlogits, got[size_t(r)].dlogits));
  }
}

// 1001 ids in 1024 columns (512 a rank: 8-wide accesses, the last real one mid-vector) and 243 in 250 (125 a rank:
// scalar accesses).
INSTANTIATE_TEST_SUITE_P(Shapes, VocabParallelCeGpu,
                         ::testing::Values(VpCeShape{37, 1001, 1024, DType::bf16},
                                           VpCeShape{37, 1001, 1024, DType::f32}, VpCeShape{19, 243, 250, DType::bf16},
                                           VpCeShape{19, 243, 250, DType::f32}));

}  // namespace
