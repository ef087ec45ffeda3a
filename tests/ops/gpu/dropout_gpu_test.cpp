// CUDA dropout against the CPU reference, bit for bit: FP32 and BF16 (the CPU result on the same
// BF16 inputs, rounded once to BF16), sizes that are not multiples of 4 or of the vector width,
// misaligned views (scalar path), out aliasing x, the backward's recomputed mask, p == 0, and column windows
// (a tensor-parallel rank's columns of the whole input).
#include <gtest/gtest.h>
#include <cmath>
#include <limits>
#include "../ops_test_util.h"
#include "common/gpu.h"
#include "gpu_util.h"
#include "ops/dropout.h"

using namespace nb;
using namespace nb::ops;
using namespace nb::ops::testing;

namespace {

struct DropoutCase {
  int64_t n;
  float p;
  DType dt;
};

// The CPU reference (FP32 on the already-rounded inputs), then one rounding to the device dtype.
std::vector<float> cpu_dropout(std::vector<float> x, float p, RngKey key, DType dt, bool backward) {
  std::vector<float> out(x.size());
  const auto n = int64_t(x.size());
  if (backward)
    dropout_backward(host_f32(x, {n}), host_f32(out, {n}), p, key, nullptr);
  else
    dropout_forward(host_f32(x, {n}), host_f32(out, {n}), p, key, nullptr);
  return rounded(out, dt);
}

// A view of `count` elements starting `offset` elements into a device tensor.
Tensor view(const Tensor& t, int64_t offset, int64_t count) {
  return Tensor::make(static_cast<char*>(t.data) + offset * dtype_bytes(t.dtype, 1), t.dtype, Device::cuda, {count});
}

}  // namespace

class DropoutGpu : public ::testing::TestWithParam<DropoutCase> {};

TEST_P(DropoutGpu, MatchesCpuBitForBit) {
  NB_REQUIRE_GPU();
  const auto [n, p, dt] = GetParam();
  const RngKey key{0xfeedbeef12345ull, 11, 3};
  auto x = rounded(random_vec(size_t(n), 91, -3.f, 3.f), dt), dy = rounded(random_vec(size_t(n), 92), dt);
  const auto want = cpu_dropout(x, p, key, dt, false), want_dx = cpu_dropout(dy, p, key, dt, true);

  auto gx = upload(x, dt, {n}), gout = upload(std::vector<float>(size_t(n), 5.f), dt, {n});
  dropout_forward(gx.t(), gout.t(), p, key, nullptr);
  EXPECT_TRUE(same_bits(download(gout.t()), want)) << "forward";
  auto gdy = upload(dy, dt, {n}), gdx = upload(std::vector<float>(size_t(n), 5.f), dt, {n});
  dropout_backward(gdy.t(), gdx.t(), p, key, nullptr);
  EXPECT_TRUE(same_bits(download(gdx.t()), want_dx)) << "backward";

  // In place: out is x, dx is dy.
  dropout_forward(gx.t(), gx.t(), p, key, nullptr);
  EXPECT_TRUE(same_bits(download(gx.t()), want)) << "forward in place";
  dropout_backward(gdy.t(), gdy.t(), p, key, nullptr);
  EXPECT_TRUE(same_bits(download(gdy.t()), want_dx)) << "backward in place";

  // Views one element into their buffers: not 16-byte aligned, so the kernel takes its scalar path.
  if (n > 1) {
    std::vector<float> padded(size_t(n) + 1, 0.f);
    std::copy(x.begin(), x.end(), padded.begin() + 1);
    auto gpx = upload(padded, dt, {n + 1}), gpo = upload(std::vector<float>(size_t(n) + 1, 5.f), dt, {n + 1});
    dropout_forward(view(gpx.t(), 1, n), view(gpo.t(), 1, n), p, key, nullptr);
    auto got = download(gpo.t());
    EXPECT_EQ(got[0], 5.f);
    EXPECT_TRUE(same_bits(std::vector<float>(got.begin() + 1, got.end()), want)) << "misaligned";
  }
}

INSTANTIATE_TEST_SUITE_P(Sizes, DropoutGpu,
                         ::testing::Values(DropoutCase{1, 0.5f, DType::f32}, DropoutCase{3, 0.1f, DType::bf16},
                                           DropoutCase{13, 0.3f, DType::f32}, DropoutCase{13, 0.3f, DType::bf16},
                                           DropoutCase{1001, 0.05f, DType::bf16}, DropoutCase{4096, 0.1f, DType::f32},
                                           DropoutCase{(1 << 20) + 5, 0.1f, DType::bf16},
                                           DropoutCase{(1 << 20) + 7, 0.9f, DType::f32},
                                           DropoutCase{3 * 1000003, 0.25f, DType::bf16}));

TEST(DropoutGpuCopy, ZeroProbabilityCopiesBits) {
  NB_REQUIRE_GPU();
  for (DType dt : {DType::f32, DType::bf16}) {
    const int64_t n = 1027;
    auto x = rounded(random_vec(size_t(n), 93), dt);
    x[4] = -0.f;
    x[9] = std::numeric_limits<float>::infinity();
    auto gx = upload(x, dt, {n}), gout = upload(std::vector<float>(size_t(n), 5.f), dt, {n});
    dropout_forward(gx.t(), gout.t(), 0.f, RngKey{1}, nullptr);
    EXPECT_TRUE(same_bits(download(gout.t()), x));
    dropout_backward(gx.t(), gx.t(), 0.f, RngKey{1}, nullptr);
    EXPECT_TRUE(same_bits(download(gx.t()), x));
  }
}

TEST(DropoutGpuWindow, ColumnWindowMatchesCpu) {
  NB_REQUIRE_GPU();
  const RngKey key{0xabcdefull, 2, 0x80000301u};
  const int64_t rows = 37, whole = 96, cols = 48;
  for (DType dt : {DType::f32, DType::bf16}) {
    auto x = rounded(random_vec(size_t(rows * cols), 94, -2.f, 2.f), dt);
    std::vector<float> want(x.size());
    const DropoutColumns w{whole, cols};  // the second of two ranks
    dropout_forward(host_f32(x, {rows, cols}), host_f32(want, {rows, cols}), 0.2f, key, nullptr, w);
    want = rounded(want, dt);
    auto gx = upload(x, dt, {rows, cols}), gout = upload(std::vector<float>(x.size(), 5.f), dt, {rows, cols});
    dropout_forward(gx.t(), gout.t(), 0.2f, key, nullptr, w);
    EXPECT_TRUE(same_bits(download(gout.t()), want)) << dtype_name(dt);
    dropout_backward(gx.t(), gx.t(), 0.2f, key, nullptr, w);
    EXPECT_TRUE(same_bits(download(gx.t()), want)) << dtype_name(dt) << " backward in place";
  }
}
