// GPU tests of recipe::Linear: for every preset, the CUDA Linear's quantized operands equal the CPU
// Linear's byte for byte (same inputs, same SR key), and its three GEMMs match the FP64 model on those
// operands within the bound of FP32 accumulation (FP8 fast accumulation for the FP8 Fprop) and BF16 outputs.
#include <gtest/gtest.h>
#include <cstdio>
#include "common/gpu.h"
#include "gemm/gemm_quantized.h"
#include "recipe/recipe_test_util.h"

namespace nb::recipe {
namespace {

using namespace testing;

constexpr int64_t kM = 256, kK = 384, kN = 128;

class PresetGpuTest : public ::testing::TestWithParam<std::string> {};

static void expect_same_bytes(const QuantizedBytes& c, const QuantizedBytes& g, const char* role) {
  EXPECT_EQ(c.rows, g.rows) << role;
  EXPECT_EQ(c.cols, g.cols) << role;
  EXPECT_TRUE(c.row_data == g.row_data) << role << " row data differ";
  EXPECT_TRUE(c.row_scales == g.row_scales) << role << " row scales differ";
  EXPECT_TRUE(c.col_data == g.col_data) << role << " column data differ";
  EXPECT_TRUE(c.col_scales == g.col_scales) << role << " column scales differ";
  EXPECT_EQ(c.row_amax, g.row_amax) << role;
  EXPECT_EQ(c.col_amax, g.col_amax) << role;
  EXPECT_EQ(c.scale_inv, g.scale_inv) << role;
}

TEST_P(PresetGpuTest, SameOperandsAsCpuAndGemmsWithinTheFp32Bound) {
  NB_REQUIRE_GPU();
  Recipe r;
  ASSERT_TRUE(recipe_preset(GetParam(), &r).is_ok());
  r.seed = 0x1234abcd;
  std::vector<float> x = random_bf16_values(kM * kK, 1.0, 21), w = random_bf16_values(kN * kK, 0.05, 22),
                     dy = random_bf16_values(kM * kN, 1e-3, 23);
  LinearRun cpu, gpu;
  Status st = run_linear(r, Device::cpu, kM, kK, kN, x, w, dy, &cpu);
  ASSERT_TRUE(st.is_ok()) << st.message();
  st = run_linear(r, Device::cuda, kM, kK, kN, x, w, dy, &gpu);
  ASSERT_TRUE(st.is_ok()) << st.message();
  if (r.quantized()) {
    const char* names[3] = {"input", "weight", "grad"};
    for (int i = 0; i < 3; ++i) expect_same_bytes(cpu.q[i], gpu.q[i], names[i]);
  }
  double dist = check_run(r, Device::cuda, kM, kK, kN, x, w, dy, gpu);
  if (r.quantized()) { EXPECT_GT(dist, 1e-4); }
  EXPECT_LT(dist, r.input.fmt == Fmt::nvfp4 ? 0.3 : 0.1);
  EXPECT_EQ(gpu.health.nonfinite, 0);
}

INSTANTIATE_TEST_SUITE_P(AllPresets, PresetGpuTest, ::testing::ValuesIn(recipe_names()));

TEST(LinearGpu, NonFiniteGradientIsReported) {
  NB_REQUIRE_GPU();
  Recipe r;
  ASSERT_TRUE(recipe_preset("bf16_with_nvfp4_mixed", &r).is_ok());
  std::vector<float> x = random_bf16_values(kM * kK, 1.0, 31), w = random_bf16_values(kN * kK, 0.05, 32),
                     dy = random_bf16_values(kM * kN, 1e-3, 33);
  dy[5] = INFINITY;
  LinearRun gpu;
  ASSERT_TRUE(run_linear(r, Device::cuda, kM, kK, kN, x, w, dy, &gpu).is_ok());
  EXPECT_GT(gpu.health.nonfinite, 0);
  EXPECT_EQ(gpu.health.first_nonfinite_role, "grad");
}

TEST(LinearGpu, BytesCountsTheQuantizedCopies) {
  NB_REQUIRE_GPU();
  Recipe r;
  ASSERT_TRUE(recipe_preset("bf16_with_nvfp4_mixed", &r).is_ok());
  Linear lin;
  ASSERT_TRUE(lin.init(r, false, "l", 1, kM, kK, kN, Device::cuda).is_ok());
  // Two NVFP4 copies per role: 2 x (n/2 data + n/16 scales) = 9n/8 bytes, plus 28 bytes of state each,
  // except the 2D weight: its row copy only (9n/16; Dgrad reads it as the column operand). The
  // transient copies (input row copy, both grad copies) sit in the Linear's private workspace.
  const size_t n = size_t(kM * kK + kM * kN);
  EXPECT_EQ(lin.bytes() + lin.workspace()->bytes(), n * 9 / 8 + size_t(kN * kK) * 9 / 16 + 3 * 28);
  EXPECT_EQ(lin.bytes(), size_t(kM * kK) * 9 / 16 + size_t(kN * kK) * 9 / 16 + 3 * 28);
  EXPECT_EQ(lin.workspace()->bytes(), size_t(kM * kK) * 9 / 16 + size_t(kM * kN) * 9 / 8);
  EXPECT_TRUE(lin.keeps_quantized_input());
  Linear bf;
  ASSERT_TRUE(bf.init(r, true, "l", 2, kM, kK, kN, Device::cuda).is_ok());
  EXPECT_EQ(bf.bytes(), 0u);
  EXPECT_FALSE(bf.keeps_quantized_input());
}

// keep_dequantized_weights: the emulated GEMMs read the weight dequantized once (no per-GEMM pass) and
// give the same bits; the BF16 copies (one for a 2D NVFP4 weight, two otherwise) are counted in bytes().
TEST(LinearGpu, KeptDequantizedWeightsGiveTheSameResults) {
  NB_REQUIRE_GPU();
  struct Case {
    const char* preset;
    bool one_d;
    size_t copies;
  };
  for (const Case cs : {Case{"bf16_with_nvfp4_mixed", false, 1}, Case{"bf16_with_nvfp4_mixed", true, 2},
                        Case{"bf16_with_mxfp8_mixed", false, 2}}) {
    Recipe r;
    ASSERT_TRUE(recipe_preset(cs.preset, &r).is_ok());
    if (cs.one_d) r.weight.two_d = false;
    r.seed = 77;
    const std::vector<float> x = random_bf16_values(kM * kK, 1.0, 41), w = random_bf16_values(kN * kK, 0.05, 42),
                             dy = random_bf16_values(kM * kN, 1e-3, 43);
    LinearRun plain, kept;
    ASSERT_TRUE(run_linear(r, Device::cuda, kM, kK, kN, x, w, dy, &plain).is_ok());
    Recipe rk = r;
    rk.keep_dequantized_weights = true;
    ASSERT_TRUE(run_linear(rk, Device::cuda, kM, kK, kN, x, w, dy, &kept).is_ok());
    const std::string what = std::string(cs.preset) + (cs.one_d ? " 1D weights" : "");
    EXPECT_TRUE(plain.y == kept.y) << what << ": Fprop differs";
    EXPECT_TRUE(plain.dx == kept.dx) << what << ": Dgrad differs";
    EXPECT_TRUE(plain.dw == kept.dw) << what << ": Wgrad differs";
    Linear a, b;
    ASSERT_TRUE(a.init(r, false, "l", 1, kM, kK, kN, Device::cuda).is_ok());
    ASSERT_TRUE(b.init(rk, false, "l", 1, kM, kK, kN, Device::cuda).is_ok());
    EXPECT_EQ(b.bytes() - a.bytes(), cs.copies * size_t(kN * kK) * 2) << what;
  }
}

}  // namespace
}  // namespace nb::recipe

namespace nb::recipe {
namespace {

// Records which FP8 scale-pointer alignments cuBLASLt accepts (Linear keeps scale_inv 16-byte aligned).
TEST(LinearGpu, Fp8ScalePointerAlignment) {
  NB_REQUIRE_GPU();
  Buffer a, b, c, s;
  ASSERT_TRUE(Buffer::allocate(&a, DType::u8, Device::cuda, {256, 384}).is_ok());
  ASSERT_TRUE(Buffer::allocate(&b, DType::u8, Device::cuda, {128, 384}).is_ok());
  ASSERT_TRUE(Buffer::allocate(&c, DType::bf16, Device::cuda, {256, 128}).is_ok());
  ASSERT_TRUE(Buffer::allocate(&s, DType::f32, Device::cuda, {8}).is_ok());
  std::vector<uint8_t> zeros(256 * 384, 0);
  ASSERT_TRUE(copy_bytes(a.data(), Device::cuda, zeros.data(), Device::cpu, 256 * 384).is_ok());
  ASSERT_TRUE(copy_bytes(b.data(), Device::cuda, zeros.data(), Device::cpu, 128 * 384).is_ok());
  float ones[8] = {1, 1, 1, 1, 1, 1, 1, 1};
  ASSERT_TRUE(copy_bytes(s.data(), Device::cuda, ones, Device::cpu, sizeof ones).is_ok());
  for (int off : {0, 3}) {
    gemm::QOperand qa{gemm::QFormat::fp8_e4m3, 256, 384, a.data(), s.ptr<float>() + off};
    gemm::QOperand qb{gemm::QFormat::fp8_e4m3, 128, 384, b.data(), s.ptr<float>() + off};
    Status st = gemm::matmul_quantized(qa, qb, c.tensor(), {0.f, true}, nullptr);
    std::printf("fp8 scale pointer at float offset %d: %s\n", off, st.is_ok() ? "ok" : st.message().c_str());
    if (off == 0) { EXPECT_TRUE(st.is_ok()) << st.message(); }
  }
}

}  // namespace
}  // namespace nb::recipe
