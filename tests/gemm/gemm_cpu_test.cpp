// CPU reference GEMM (f32) against an FP64 triple loop and against an in-order FP32 loop.
//
// Tolerance vs FP64: every output is an FP32 dot product of K terms plus the alpha and beta steps,
// so |cpu - exact| <= (K + 3) * 2^-24 * (|alpha| * sum_k |a_ik b_kj| + |beta c_ij|) (the standard
// gamma_n bound for n = K + 3 roundings). Bit-exact vs FP32 loop: the reference promises sequential
// FP32 accumulation over k for each element, which an FP32 loop in the same order reproduces exactly
// (the build disables FMA contraction), whatever the blocking and the number of threads.
#include <gtest/gtest.h>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>
#include "gemm/gemm.h"

namespace nb::gemm {
namespace {

struct Mat {
  std::vector<float> v;
  int64_t rows = 0, cols = 0, ld = 0;
  float at(int64_t r, int64_t c) const { return v[size_t(r * ld + c)]; }
  Tensor tensor() {
    Tensor t = Tensor::make(v.data(), DType::f32, Device::cpu, {rows, cols});
    t.stride[0] = ld;
    return t;
  }
};

Mat random_mat(int64_t rows, int64_t cols, std::mt19937& rng, int64_t pad = 0) {
  std::uniform_real_distribution<float> d(-1.f, 1.f);
  Mat m;
  m.rows = rows;
  m.cols = cols;
  m.ld = cols + pad;
  m.v.resize(size_t(std::max<int64_t>(1, rows * m.ld)));
  for (auto& x : m.v) x = d(rng);
  return m;
}

// op(X)[i, j]
float op_at(const Mat& x, bool trans, int64_t i, int64_t j) { return trans ? x.at(j, i) : x.at(i, j); }

struct Case {
  int64_t m, n, k;
};

void check_against_fp64(const Case& cs, bool ta, bool tb, float alpha, float beta, int64_t pad) {
  SCOPED_TRACE(testing::Message() << "M=" << cs.m << " N=" << cs.n << " K=" << cs.k << " ta=" << ta << " tb=" << tb
                                  << " alpha=" << alpha << " beta=" << beta << " pad=" << pad);
  std::mt19937 rng(uint32_t(cs.m * 131 + cs.n * 7 + cs.k + ta * 2 + tb));
  Mat a = ta ? random_mat(cs.k, cs.m, rng, pad) : random_mat(cs.m, cs.k, rng, pad);
  Mat b = tb ? random_mat(cs.n, cs.k, rng, pad) : random_mat(cs.k, cs.n, rng, pad);
  Mat c = random_mat(cs.m, cs.n, rng, pad);
  const Mat c0 = c;
  GemmArgs args{ta, tb, alpha, beta};
  ASSERT_TRUE(matmul(a.tensor(), b.tensor(), c.tensor(), args, nullptr).is_ok());

  int64_t bad = 0;
  for (int64_t i = 0; i < cs.m; ++i) {
    for (int64_t j = 0; j < cs.n; ++j) {
      double exact = 0, mag = 0;
      float in_order = 0.f;  // sequential FP32, the promised accumulation order
      for (int64_t k = 0; k < cs.k; ++k) {
        const float x = op_at(a, ta, i, k), y = op_at(b, tb, k, j);
        exact += double(x) * double(y);
        mag += std::fabs(double(x) * double(y));
        in_order += x * y;
      }
      exact = double(alpha) * exact + double(beta) * double(c0.at(i, j));
      const double tol = double(cs.k + 3) * std::ldexp(1.0, -24) *
                         (std::fabs(alpha) * mag + std::fabs(double(beta) * double(c0.at(i, j))));
      const float expect_bits = beta == 0.f ? alpha * in_order : alpha * in_order + beta * c0.at(i, j);
      const float got = c.at(i, j);
      if (std::fabs(double(got) - exact) > tol || std::memcmp(&got, &expect_bits, 4) != 0) {
        if (++bad <= 5)
          ADD_FAILURE() << "C[" << i << "," << j << "] = " << got << ", exact " << exact << " (tol " << tol
                        << "), in-order FP32 " << expect_bits;
      }
    }
  }
  EXPECT_EQ(bad, 0);
  // Padding between rows is not part of C and must be left alone.
  for (int64_t i = 0; i < cs.m; ++i)
    for (int64_t j = cs.n; j < c.ld; ++j) EXPECT_EQ(c.at(i, j), c0.at(i, j));
}

TEST(GemmCpu, MatchesFp64AllTransposesOddShapes) {
  // Odd sizes, and sizes that cross the 64 x 256 x 256 blocking and use several threads.
  const Case cases[] = {{1, 1, 1}, {17, 33, 64}, {5, 7, 3}, {3, 1, 9}, {65, 257, 300}, {130, 70, 513}};
  const float ab[][2] = {{1.f, 0.f}, {0.5f, -1.25f}, {-2.f, 1.f}};
  for (const Case& cs : cases)
    for (int t = 0; t < 4; ++t)
      for (const auto& s : ab) check_against_fp64(cs, t & 1, t & 2, s[0], s[1], 0);
}

TEST(GemmCpu, RowStridesLargerThanRows) {
  for (int t = 0; t < 4; ++t) check_against_fp64({19, 45, 37}, t & 1, t & 2, 1.f, 1.f, 5);
}

TEST(GemmCpu, BetaZeroNeverReadsC) {
  std::mt19937 rng(7);
  Mat a = random_mat(9, 11, rng), b = random_mat(11, 13, rng), c = random_mat(9, 13, rng);
  for (auto& x : c.v) x = std::numeric_limits<float>::quiet_NaN();
  ASSERT_TRUE(matmul(a.tensor(), b.tensor(), c.tensor(), {}, nullptr).is_ok());
  for (float x : c.v) EXPECT_TRUE(std::isfinite(x));
}

TEST(GemmCpu, EmptyKScalesC) {
  std::vector<float> a(1), b(1), c = {1.f, 2.f, 3.f, 4.f, 5.f, 6.f};
  Tensor ta = Tensor::make(a.data(), DType::f32, Device::cpu, {2, 0});
  Tensor tb = Tensor::make(b.data(), DType::f32, Device::cpu, {0, 3});
  Tensor tc = Tensor::make(c.data(), DType::f32, Device::cpu, {2, 3});
  ASSERT_TRUE(matmul(ta, tb, tc, {false, false, 1.f, 0.5f}, nullptr).is_ok());
  EXPECT_EQ(c, (std::vector<float>{0.5f, 1.f, 1.5f, 2.f, 2.5f, 3.f}));
}

TEST(GemmCpu, ThreeDimensionalActivationsAreFlattened) {
  // X [2,3,4] @ W[5,4]^T == X viewed as [6,4].
  std::mt19937 rng(3);
  Mat x = random_mat(6, 4, rng), w = random_mat(5, 4, rng);
  std::vector<float> y3(30), y2(30);
  Tensor x3 = Tensor::make(x.v.data(), DType::f32, Device::cpu, {2, 3, 4});
  Tensor out3 = Tensor::make(y3.data(), DType::f32, Device::cpu, {2, 3, 5});
  Tensor out2 = Tensor::make(y2.data(), DType::f32, Device::cpu, {6, 5});
  ASSERT_TRUE(matmul(x3, w.tensor(), out3, {.trans_b = true}, nullptr).is_ok());
  ASSERT_TRUE(matmul(x.tensor(), w.tensor(), out2, {.trans_b = true}, nullptr).is_ok());
  EXPECT_EQ(y3, y2);
  EXPECT_NE(y2[7], 0.f);
}

TEST(GemmCpu, RejectsMismatchedShapesAndTypes) {
  std::vector<float> buf(64);
  Tensor a = Tensor::make(buf.data(), DType::f32, Device::cpu, {4, 3});
  Tensor b = Tensor::make(buf.data(), DType::f32, Device::cpu, {4, 5});
  Tensor c = Tensor::make(buf.data(), DType::f32, Device::cpu, {4, 5});
  Status s = matmul(a, b, c, {}, nullptr);
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("shapes do not match"), std::string::npos) << s.message();
  // With A transposed, op(A) is [3,4] and C must be [3,5].
  EXPECT_FALSE(matmul(a, b, c, {.trans_a = true}, nullptr).is_ok());
  Tensor c35 = Tensor::make(buf.data(), DType::f32, Device::cpu, {3, 5});
  std::vector<float> out(15);
  c35.data = out.data();
  EXPECT_TRUE(matmul(a, b, c35, {.trans_a = true}, nullptr).is_ok());

  Tensor half = Tensor::make(buf.data(), DType::bf16, Device::cpu, {4, 3});
  s = matmul(half, b, c35, {.trans_a = true}, nullptr);
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("f32"), std::string::npos) << s.message();

  Tensor strided = a;
  strided.stride[1] = 2;
  EXPECT_FALSE(matmul(strided, b, c35, {.trans_a = true}, nullptr).is_ok());
  Tensor on_gpu = b;
  on_gpu.device = Device::cuda;
  s = matmul(a, on_gpu, c35, {.trans_a = true}, nullptr);
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("different devices"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace nb::gemm
