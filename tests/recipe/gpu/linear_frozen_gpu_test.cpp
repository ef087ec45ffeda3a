// GPU tests of the frozen-weight mode of recipe::Linear: on CUDA a frozen chain gives the trained chain's
// y and dx bit for bit (per-tensor FP8: Dgrad through the transposed transient; 2D NVFP4: through the row
// copy), a frozen Linear's operands equal the CPU backend's byte for byte and its Fprop/Dgrad match the
// FP64 model on them, bytes() drops the input column copy (and a per-tensor FP8 weight's column copy),
// and the byte transpose kernel equals the host loop on shapes that are not whole 64x64 tiles.
#include <gtest/gtest.h>
#include <algorithm>
#include <random>
#include "common/gpu.h"
#include "recipe/frozen_test_util.h"
#include "recipe/linear_device.h"

namespace nb::recipe {
namespace {

using namespace testing;

class FrozenPresetGpuTest : public ::testing::TestWithParam<std::string> {};

static void expect_same_copies(const QuantizedBytes& c, const QuantizedBytes& g, const char* role) {
  EXPECT_EQ(c.rows, g.rows) << role;
  EXPECT_EQ(c.cols, g.cols) << role;
  EXPECT_TRUE(c.row_data == g.row_data) << role << " row data differ";
  EXPECT_TRUE(c.row_scales == g.row_scales) << role << " row scales differ";
  EXPECT_TRUE(c.col_data == g.col_data) << role << " column data differ";
  EXPECT_TRUE(c.col_scales == g.col_scales) << role << " column scales differ";
  EXPECT_EQ(c.row_amax, g.row_amax) << role;
  EXPECT_EQ(c.scale_inv, g.scale_inv) << role;
}

TEST_P(FrozenPresetGpuTest, SameYAndDxAsTheTrainedLinearBitForBit) {
  NB_REQUIRE_GPU();
  Recipe r;
  ASSERT_TRUE(frozen_recipe(GetParam(), &r).is_ok());
  FrozenChainRun trained, frozen, frozen_shared;
  Status st = run_frozen_chain(r, Device::cuda, false, false, &trained);
  ASSERT_TRUE(st.is_ok()) << st.message();
  st = run_frozen_chain(r, Device::cuda, true, false, &frozen);
  ASSERT_TRUE(st.is_ok()) << st.message();
  st = run_frozen_chain(r, Device::cuda, true, true, &frozen_shared);
  ASSERT_TRUE(st.is_ok()) << st.message();
  expect_bit_identical("y", trained.y, frozen.y);
  expect_bit_identical("dx", trained.dx, frozen.dx);
  expect_bit_identical("y (shared workspace)", trained.y, frozen_shared.y);
  expect_bit_identical("dx (shared workspace)", trained.dx, frozen_shared.dx);
  EXPECT_TRUE(frozen.dw_untouched && frozen_shared.dw_untouched) << "a frozen Linear wrote dw";

  // bytes(): the input column copy (tokens rounded to the recipe's multiple: 128 is one) is gone, and a
  // per-tensor FP8 weight keeps its row copy only.
  const bool per_tensor = r.weight.fmt == Fmt::fp8_e4m3 || r.weight.fmt == Fmt::fp8_e5m2;
  constexpr size_t kStates = 84;  // three roles' state blocks (5 floats, 2 ints)
  for (int l = 0; l < 3; ++l) {
    SCOPED_TRACE("linear " + std::to_string(l));
    const int64_t in = kChain[l].in, out = kChain[l].out;
    const size_t saved = col_copy_bytes(r.input.fmt, kChainTokens, in) + (per_tensor ? size_t(out * in) : 0);
    EXPECT_EQ(trained.linear_bytes[size_t(l)] - frozen.linear_bytes[size_t(l)], saved);
    EXPECT_EQ(frozen.linear_bytes[size_t(l)], frozen_shared.linear_bytes[size_t(l)]);
    if (!r.quantized()) { EXPECT_EQ(frozen.linear_bytes[size_t(l)], 0u); }
    // By hand: the weight's kept copies plus three 28-byte state blocks.
    if (per_tensor) { EXPECT_EQ(frozen.linear_bytes[size_t(l)], size_t(out * in) + kStates); }
    if (r.weight.fmt == Fmt::nvfp4 && r.weight.two_d) {
      EXPECT_EQ(frozen.linear_bytes[size_t(l)], size_t(out * in) * 9 / 16 + kStates);
    }
  }
}

TEST_P(FrozenPresetGpuTest, SameOperandsAsCpuAndGemmsWithinTheFp32Bound) {
  NB_REQUIRE_GPU();
  Recipe r;
  ASSERT_TRUE(frozen_recipe(GetParam(), &r).is_ok());
  constexpr int64_t m = 256, k = 384, n = 128;
  std::vector<float> x = random_bf16_values(m * k, 1.0, 21), w = random_bf16_values(n * k, 0.05, 22),
                     dy = random_bf16_values(m * n, 1e-3, 23);
  LinearRun cpu, gpu;
  Status st = run_frozen_single(r, Device::cpu, m, k, n, x, w, dy, &cpu);
  ASSERT_TRUE(st.is_ok()) << st.message();
  st = run_frozen_single(r, Device::cuda, m, k, n, x, w, dy, &gpu);
  ASSERT_TRUE(st.is_ok()) << st.message();
  if (r.quantized()) {
    const char* names[3] = {"input", "weight", "grad"};
    for (int i = 0; i < 3; ++i) expect_same_copies(cpu.q[i], gpu.q[i], names[i]);
  }
  const double dist = check_frozen_run(r, Device::cuda, m, k, n, x, w, dy, gpu);
  if (r.quantized()) { EXPECT_GT(dist, 1e-4); }
  EXPECT_LT(dist, r.input.fmt == Fmt::nvfp4 ? 0.3 : 0.1);
  EXPECT_EQ(gpu.health.nonfinite, 0);
}

INSTANTIATE_TEST_SUITE_P(FrozenRecipes, FrozenPresetGpuTest, ::testing::ValuesIn(frozen_recipe_names()),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           std::string s = info.param;
                           std::replace(s.begin(), s.end(), '+', '_');
                           return s;
                         });

TEST(FrozenGpu, TransposeBytesMatchesTheHostLoop) {
  NB_REQUIRE_GPU();
  std::mt19937 rng(5);
  const int64_t shapes[][2] = {{4, 4}, {16, 48}, {48, 80}, {100, 68}, {64, 64}, {200, 4}, {4, 260}, {1040, 3088}};
  for (const auto& s : shapes) {
    const int64_t rows = s[0], cols = s[1];
    SCOPED_TRACE(std::to_string(rows) + "x" + std::to_string(cols));
    std::vector<uint8_t> src(size_t(rows * cols)), want(src.size()), got(src.size());
    for (uint8_t& b : src) b = uint8_t(rng());
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j) want[size_t(j * rows + i)] = src[size_t(i * cols + j)];
    Buffer d_src, d_dst;
    ASSERT_TRUE(Buffer::allocate(&d_src, DType::u8, Device::cuda, {rows * cols}).is_ok());
    ASSERT_TRUE(Buffer::allocate(&d_dst, DType::u8, Device::cuda, {rows * cols}).is_ok());
    ASSERT_TRUE(copy_bytes(d_src.data(), Device::cuda, src.data(), Device::cpu, src.size()).is_ok());
    Status st = detail::transpose_bytes_cuda(d_src.ptr<uint8_t>(), rows, cols, d_dst.ptr<uint8_t>(), nullptr);
    ASSERT_TRUE(st.is_ok()) << st.message();
    device_synchronize();
    ASSERT_TRUE(copy_bytes(got.data(), Device::cpu, d_dst.data(), Device::cuda, got.size()).is_ok());
    EXPECT_TRUE(got == want);
  }
  EXPECT_FALSE(detail::transpose_bytes_cuda(nullptr, 6, 8, nullptr, nullptr).is_ok());  // not multiples of 4
}

}  // namespace
}  // namespace nb::recipe
