// Gradient buckets, the two overlaps and BF16 reduction (train/grad_sync.h) on the CPU backend (Gloo),
// through the real CLI.
//
// On the CPU backend every collective has finished when it returns, so an overlapped run issues the
// same collectives on the same bytes as a non-overlapped one with the same buckets, only earlier: the
// results must be bit-identical. A bucket reduced before its last gradient arrived (the bug overlap
// invites) loses that gradient and shows at step 1. Cutting the flat space into buckets changes
// nothing per element with two ranks (a + b), but the gradient norm is summed slice by slice, so the
// clipping factor moves by a few ulp: bucketed runs match one bucket to the bounds of the distributed
// optimizer against DDP (ddp_test.cpp). BF16 reduction rounds each summed gradient element to 8
// significant bits (relative error <= 2^-9), so step 1's gradient norm moves by at most 2^-9 relative
// (about 2e-3, checked at 4e-3), and it must move (else the reduction did not run in BF16).
#include <gtest/gtest.h>
#include "distributed/ddp_util.h"

namespace nb {
namespace {

const std::string kBuckets = " --ddp-bucket-size 30000";  // the tiny model's 1.3M elements in 44 buckets

std::string run(const std::string& dir, const std::string& name, int ranks, const std::string& flags) {
  const std::string save = dir + "/" + name + "_" + std::to_string(ranks);
  const test::CliRun r = test::run_nibble(kJob + "--recipe bf16_mixed --train-iters 4 --save-interval 4 --save " +
                                          save + " --nproc-per-node " + std::to_string(ranks) + " " + flags);
  EXPECT_EQ(r.code, 0) << r.out;
  return save;
}

void expect_identical(const std::string& a, const std::string& b, const char* what) {
  const auto x = read_metrics(a), y = read_metrics(b);
  ASSERT_EQ(x.size(), 4u) << what;
  ASSERT_EQ(x.size(), y.size()) << what;
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_EQ(x[i].loss, y[i].loss) << what << ", step " << i + 1;
    EXPECT_EQ(x[i].grad_norm, y[i].grad_norm) << what << ", step " << i + 1;
  }
  EXPECT_EQ(max_weight_difference(a, b, 4), 0.0) << what;
}

TEST(DataParallelOverlapCpu, OverlappedBucketsEqualSequentialBuckets) {
  const std::string dir = test::temp_folder("ddp_overlap");
  for (int ranks : {2, 4}) {
    const std::string opt = " --use-distributed-optimizer";
    expect_identical(
        run(dir, "sharded_buckets", ranks, opt + kBuckets),
        run(dir, "sharded_overlap", ranks, opt + kBuckets + " --overlap-grad-reduce --overlap-param-gather"),
        "distributed optimizer");
    expect_identical(run(dir, "ddp_buckets", ranks, kBuckets),
                     run(dir, "ddp_overlap", ranks, kBuckets + " --overlap-grad-reduce"), "DDP");
  }
}

TEST(DataParallelOverlapCpu, BucketsMatchOneBucket) {
  const std::string dir = test::temp_folder("ddp_buckets");
  const std::string opt = " --use-distributed-optimizer";
  const std::string one = run(dir, "one", 2, opt), many = run(dir, "many", 2, opt + kBuckets);
  const auto a = read_metrics(one), b = read_metrics(many);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(b[i].loss, a[i].loss, 1e-6 * a[i].loss) << "step " << i + 1;
  EXPECT_LE(max_weight_difference(one, many, 4), 1e-4 * 4 * kLr);
}

TEST(DataParallelOverlapCpu, Bf16ReductionRoundsTheGradients) {
  const std::string dir = test::temp_folder("ddp_bf16");
  for (const std::string opt : {"", " --use-distributed-optimizer"}) {
    const auto f32 = read_metrics(run(dir, "f32", 2, opt + kBuckets));
    const auto b16 = read_metrics(run(dir, "bf16", 2, opt + kBuckets + " --grad-reduce-in-bf16 --overlap-grad-reduce"));
    ASSERT_EQ(f32.size(), b16.size());
    EXPECT_EQ(b16[0].loss, f32[0].loss) << "the loss of step 1 comes before any reduction";
    EXPECT_NEAR(b16[0].grad_norm, f32[0].grad_norm, 4e-3 * f32[0].grad_norm) << opt;
    EXPECT_NE(b16[0].grad_norm, f32[0].grad_norm) << "BF16 reduction left the gradients in FP32" << opt;
    for (size_t i = 1; i < f32.size(); ++i)
      EXPECT_NEAR(b16[i].loss, f32[i].loss, 1e-2 * f32[i].loss) << "step " << i + 1;
  }
}

TEST(DataParallelOverlapCpu, ParamGatherOverlapNeedsTheDistributedOptimizer) {
  const test::CliRun r = test::run_nibble(kJob + "--train-iters 1 --overlap-param-gather");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("--overlap-param-gather overlaps the distributed optimizer's weight gather; add "
                       "--use-distributed-optimizer"),
            std::string::npos)
      << r.out;
  const test::CliRun b = test::run_nibble(kJob + "--train-iters 1 --ddp-bucket-size -5");
  EXPECT_NE(b.code, 0);
  EXPECT_NE(b.out.find("--ddp-bucket-size must be 0 (automatic) or a number of elements; got -5"), std::string::npos)
      << b.out;
}

}  // namespace
}  // namespace nb
