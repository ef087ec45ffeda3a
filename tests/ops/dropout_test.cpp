// Dropout CPU reference: the mask follows the documented Philox layout, keeps about 1 - p of the
// elements, scales the kept ones by the FP32 factor 1/(1-p), is a pure function of the key, and the
// backward recomputes the forward's mask.
#include <gtest/gtest.h>
#include <cmath>
#include <cstring>
#include <limits>
#include "ops/dropout.h"
#include "ops_test_util.h"

using namespace nb;
using namespace nb::ops;
using namespace nb::ops::testing;

namespace {

// Inputs without zeros, so an output of 0 means "dropped".
std::vector<float> nonzero_vec(size_t n, uint32_t seed) {
  auto v = random_vec(n, seed, 0.5f, 1.5f);
  for (size_t i = 0; i < n; i += 2) v[i] = -v[i];
  return v;
}

std::vector<float> run_forward(std::vector<float> x, float p, RngKey key) {
  std::vector<float> out(x.size(), 7.f);
  const auto n = int64_t(x.size());
  dropout_forward(host_f32(x, {n}), host_f32(out, {n}), p, key, nullptr);
  return out;
}

bool bit_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace

// The documented spec, written out independently of dropout.h's helpers: the word of element i is lane
// i % 4 of Philox4x32-10 at counter {i / 4 (64 bits), stream, step} with key {seed lo, seed hi}, and the
// element is kept when (bits + 0.5) / 2^32 >= p, compared in FP64 (exact).
TEST(Dropout, MaskFollowsTheDocumentedPhiloxLayout) {
  const RngKey key{0x123456789abcdefull, 17, 5};
  for (float p : {0.1f, 0.25f, 0.5f, 0.9f, 1e-12f}) {
    const int64_t n = 4099;  // not a multiple of 4
    auto x = nonzero_vec(size_t(n), 1);
    auto out = run_forward(x, p, key);
    const float scale = 1.f / (1.f - p);
    for (int64_t i = 0; i < n; ++i) {
      const uint64_t c = uint64_t(i) / 4;
      const Philox4x32 r = philox4x32_10(uint32_t(c), uint32_t(c >> 32), key.stream, key.step, uint32_t(key.seed),
                                         uint32_t(key.seed >> 32));
      const bool keep = (double(r.v[i % 4]) + 0.5) / 4294967296.0 >= double(p);
      ASSERT_EQ(out[i], keep ? x[i] * scale : 0.f) << "p " << p << " element " << i;
    }
  }
}

TEST(Dropout, ThresholdIsExactAtTheEdges) {
  EXPECT_EQ(dropout_threshold(0.f), 0u);
  EXPECT_EQ(dropout_threshold(0.5f), 0x80000000u);            // (b + 0.5) / 2^32 >= 1/2  <=>  b >= 2^31
  EXPECT_EQ(dropout_threshold(0x1p-32f), 1u);                 // b + 0.5 >= 1  <=>  b >= 1
  EXPECT_EQ(dropout_threshold(0x1p-33f), 0u);                 // b + 0.5 >= 0.5 always
  EXPECT_EQ(dropout_threshold(1.f - 0x1p-24f), 0xFFFFFF00u);  // the largest p below 1
  EXPECT_EQ(dropout_threshold(std::numeric_limits<float>::denorm_min()), 0u);
}

TEST(Dropout, KeptFractionIsOneMinusPAndKeptValuesAreScaled) {
  const int64_t n = 1000000;
  auto x = nonzero_vec(size_t(n), 2);
  for (float p : {0.05f, 0.1f, 0.3f, 0.5f, 0.9f}) {
    SCOPED_TRACE(::testing::Message() << "p " << p);
    auto out = run_forward(x, p, RngKey{42, 3, 1});
    const float scale = 1.f / (1.f - p);
    int64_t kept = 0;
    for (int64_t i = 0; i < n; ++i) {
      if (out[i] == 0.f) continue;
      ++kept;
      ASSERT_EQ(out[i], x[i] * scale) << "element " << i;
    }
    const double mean = double(n) * (1.0 - double(p)), sigma = std::sqrt(double(n) * double(p) * (1.0 - double(p)));
    EXPECT_LE(std::fabs(double(kept) - mean), 5.0 * sigma) << "kept " << kept << " of " << n;
  }
  // With p = 1/2 the factor is 2 and the kept values are exactly x / (1 - p).
  auto half = run_forward(x, 0.5f, RngKey{9});
  for (int64_t i = 0; i < n; ++i)
    if (half[i] != 0.f) { ASSERT_EQ(double(half[i]), double(x[i]) / 0.5) << "element " << i; }
}

TEST(Dropout, MaskIsAPureFunctionOfTheKey) {
  const int64_t n = 100003;
  auto x = nonzero_vec(size_t(n), 3);
  const float p = 0.3f;
  const RngKey key{1234, 7, 2};
  auto a = run_forward(x, p, key);
  EXPECT_TRUE(bit_equal(a, run_forward(x, p, key)));
  // Changing any part of the key (seed, step, stream) changes about 2 p (1 - p) of the mask.
  for (RngKey other : {RngKey{1235, 7, 2}, RngKey{1234, 8, 2}, RngKey{1234, 7, 3}, RngKey{1234ull << 32, 7, 2}}) {
    auto b = run_forward(x, p, other);
    int64_t differ = 0;
    for (int64_t i = 0; i < n; ++i) differ += (a[i] == 0.f) != (b[i] == 0.f);
    EXPECT_GT(differ, int64_t(0.8 * 2 * p * (1 - p) * double(n)));
  }
  // The mask of element i does not depend on the tensor's size: a prefix is the prefix's dropout.
  std::vector<float> prefix(x.begin(), x.begin() + 1001);
  auto ap = run_forward(prefix, p, key);
  EXPECT_TRUE(bit_equal(ap, std::vector<float>(a.begin(), a.begin() + 1001)));
}

TEST(Dropout, BackwardRecomputesTheForwardMask) {
  const int64_t n = 50001;
  auto x = nonzero_vec(size_t(n), 4), dy = nonzero_vec(size_t(n), 5);
  const float p = 0.2f, scale = 1.f / (1.f - p);
  const RngKey key{77, 1, 9};
  auto out = run_forward(x, p, key);
  std::vector<float> dx(size_t(n), 7.f);
  dropout_backward(host_f32(dy, {n}), host_f32(dx, {n}), p, key, nullptr);
  int64_t kept = 0;
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(out[i] == 0.f, dx[i] == 0.f) << "element " << i;
    if (out[i] != 0.f) {
      ++kept;
      ASSERT_EQ(dx[i], dy[i] * scale) << "element " << i;
    }
  }
  EXPECT_GT(kept, 0);
  EXPECT_LT(kept, n);
  // dx may be dy itself.
  auto inplace = dy;
  dropout_backward(host_f32(inplace, {n}), host_f32(inplace, {n}), p, key, nullptr);
  EXPECT_TRUE(bit_equal(inplace, dx));
}

TEST(Dropout, OutMayBeXAndShapeDoesNotMatter) {
  const int64_t rows = 37, cols = 29;
  auto x = nonzero_vec(size_t(rows * cols), 6);
  const RngKey key{5, 0, 0};
  auto flat = run_forward(x, 0.4f, key);
  auto y = x;
  dropout_forward(host_f32(y, {rows, cols}), host_f32(y, {rows, cols}), 0.4f, key, nullptr);
  EXPECT_TRUE(bit_equal(y, flat));
}

TEST(Dropout, ZeroProbabilityIsAnExactCopy) {
  const int64_t n = 1023;
  auto x = random_vec(size_t(n), 7);
  x[3] = std::numeric_limits<float>::quiet_NaN();
  x[5] = -std::numeric_limits<float>::infinity();
  x[6] = -0.f;
  EXPECT_TRUE(bit_equal(run_forward(x, 0.f, RngKey{1}), x));
  auto y = x;
  dropout_forward(host_f32(y, {n}), host_f32(y, {n}), 0.f, RngKey{1}, nullptr);
  EXPECT_TRUE(bit_equal(y, x));
  std::vector<float> dx(x.size());
  dropout_backward(host_f32(x, {n}), host_f32(dx, {n}), 0.f, RngKey{1}, nullptr);
  EXPECT_TRUE(bit_equal(dx, x));
  // Empty tensors are fine.
  std::vector<float> none;
  dropout_forward(host_f32(none, {0}), host_f32(none, {0}), 0.5f, RngKey{1}, nullptr);
}

// Tensor parallelism's row-parallel LoRA input: a rank's columns of the whole input draw the whole tensor's mask
// there, so T ranks' windows drop exactly what one GPU's whole dropout drops (forward and backward).
TEST(Dropout, ColumnWindowsDrawTheWholeTensorsMask) {
  const int64_t rows = 7, whole = 24;
  const RngKey key{99, 4, 0x80000105u};
  auto x = nonzero_vec(size_t(rows * whole), 5);
  for (float p : {0.1f, 0.5f}) {
    const auto ref = run_forward(x, p, key);
    for (int64_t ranks : {2, 3, 4}) {
      const int64_t cols = whole / ranks;
      for (int64_t r = 0; r < ranks; ++r) {
        std::vector<float> part(size_t(rows * cols)), out(part.size()), dx(part.size());
        for (int64_t i = 0; i < rows; ++i)
          for (int64_t c = 0; c < cols; ++c) part[size_t(i * cols + c)] = x[size_t(i * whole + r * cols + c)];
        const DropoutColumns w{whole, r * cols};
        dropout_forward(host_f32(part, {rows, cols}), host_f32(out, {rows, cols}), p, key, nullptr, w);
        dropout_backward(host_f32(part, {rows, cols}), host_f32(dx, {rows, cols}), p, key, nullptr, w);
        for (int64_t i = 0; i < rows; ++i)
          for (int64_t c = 0; c < cols; ++c) {
            ASSERT_EQ(out[size_t(i * cols + c)], ref[size_t(i * whole + r * cols + c)]) << r << " of " << ranks;
            ASSERT_EQ(dx[size_t(i * cols + c)], ref[size_t(i * whole + r * cols + c)]) << r << " of " << ranks;
          }
      }
    }
  }
}

TEST(DropoutDeathTest, ProbabilityOutsideZeroToOneIsABug) {
  std::vector<float> x(8, 1.f), out(8);
  for (float p : {-0.1f, 1.f, 1.5f, std::numeric_limits<float>::quiet_NaN()})
    EXPECT_DEATH(dropout_forward(host_f32(x, {8}), host_f32(out, {8}), p, RngKey{}, nullptr), "must be in \\[0, 1\\)");
  EXPECT_DEATH(dropout_backward(host_f32(x, {8}), host_f32(out, {8}), 1.f, RngKey{}, nullptr), "must be in \\[0, 1\\)");
}

TEST(DropoutDeathTest, MismatchedTensorsAreABug) {
  std::vector<float> x(8, 1.f), out(9);
  EXPECT_DEATH(dropout_forward(host_f32(x, {8}), host_f32(out, {9}), 0.5f, RngKey{}, nullptr), "must have 8 elements");
  EXPECT_DEATH(dropout_backward(host_f32(x, {2, 4}), host_f32(out, {3, 3}), 0.5f, RngKey{}, nullptr),
               "must have 8 elements");
  // Partial overlap (not the same tensor) would read elements after they were written.
  EXPECT_DEATH(dropout_forward(host_f32(out, {8}), Tensor::make(out.data() + 1, DType::f32, Device::cpu, {8}), 0.5f,
                               RngKey{}, nullptr),
               "not overlap");
  // The CPU backend is FP32.
  std::vector<uint16_t> h(8);
  const Tensor hb = Tensor::make(h.data(), DType::bf16, Device::cpu, {8});
  EXPECT_DEATH(dropout_forward(hb, hb, 0.5f, RngKey{}, nullptr), "must be f32");
  EXPECT_DEATH(dropout_forward(host_f32(x, {8}), hb, 0.5f, RngKey{}, nullptr), "dtype");
}
