// GPU tests of Mixture of Representations inside recipe::Linear: the CUDA statistics (one atomic pass per
// quantization, mor_stat.cu) equal the CPU Linear's bit for bit for every role, and with any one role decided BF16
// the three GEMMs (FP8 x BF16 through the mixed emulated path, or FP8 x FP8 on tensor cores) match the FP64 model
// of their operands within the FP32-accumulation bound and BF16 outputs.
#include <gtest/gtest.h>
#include <string>
#include "common/gpu.h"
#include "formats/mor/mor.h"
#include "recipe/recipe_test_util.h"

namespace nb::recipe {
namespace {

using namespace testing;

constexpr int64_t kM = 512, kK = 384, kN = 256;

struct MorRun {
  LinearRun run;
  mor::ErrorStat stats[3];
};

// forward and backward of one MoR Linear on `dev` with role `bf16_role` (-1: none) decided BF16.
Status run_mor(Device dev, int bf16_role, const std::vector<float>& x, const std::vector<float>& w,
               const std::vector<float>& dy, MorRun* out) {
  Recipe r;
  NB_TRY(recipe_preset("bf16_with_mor_fp8_mixed", &r));
  const bool cuda = dev == Device::cuda;
  const DType act = cuda ? DType::bf16 : DType::f32;
  auto upload = [&](Buffer* b, const std::vector<float>& v, int64_t rows, int64_t cols) -> Status {
    NB_TRY(Buffer::allocate(b, act, dev, {rows, cols}));
    if (!cuda) return copy_bytes(b->data(), dev, v.data(), Device::cpu, v.size() * 4);
    std::vector<bf16> h(v.size());
    for (size_t i = 0; i < v.size(); ++i) h[i] = f32_to_bf16(v[i]);
    return copy_bytes(b->data(), dev, h.data(), Device::cpu, h.size() * 2);
  };
  auto download = [&](const Buffer& b, std::vector<double>* v) -> Status {
    const int64_t n = b.tensor().numel();
    v->resize(size_t(n));
    if (b.tensor().dtype == DType::f32) {
      std::vector<float> h(static_cast<size_t>(n));
      NB_TRY(copy_bytes(h.data(), Device::cpu, b.data(), dev, h.size() * 4));
      for (int64_t i = 0; i < n; ++i) (*v)[size_t(i)] = h[size_t(i)];
    } else {
      std::vector<bf16> h(static_cast<size_t>(n));
      NB_TRY(copy_bytes(h.data(), Device::cpu, b.data(), dev, h.size() * 2));
      for (int64_t i = 0; i < n; ++i) (*v)[size_t(i)] = bf16_to_f32(h[size_t(i)]);
    }
    return Status::ok();
  };
  Buffer bx, bw, bdy, by, bdx, bdw;
  NB_TRY(upload(&bx, x, kM, kK));
  NB_TRY(upload(&bw, w, kN, kK));
  NB_TRY(upload(&bdy, dy, kM, kN));
  NB_TRY(Buffer::allocate(&by, act, dev, {kM, kN}));
  NB_TRY(Buffer::allocate(&bdx, act, dev, {kM, kK}));
  NB_TRY(Buffer::allocate(&bdw, DType::f32, dev, {kN, kK}));
  const std::vector<float> zeros(size_t(kN * kK), 0.f);
  NB_TRY(copy_bytes(bdw.data(), dev, zeros.data(), Device::cpu, zeros.size() * 4));
  Linear lin;
  NB_TRY(lin.init(r, false, "mor", 5, kM, kK, kN, dev));
  if (bf16_role >= 0) NB_TRY(lin.set_mor_fp8(bf16_role, false));
  lin.new_step(2);
  NB_TRY(lin.forward(bx.tensor(), bw.tensor(), by.tensor(), 0.f, nullptr));
  NB_TRY(lin.backward(bdy.tensor(), bx.tensor(), bw.tensor(), bdx.tensor(), 0.f, bdw.tensor(), nullptr));
  if (cuda) device_synchronize();
  NB_TRY(download(by, &out->run.y));
  NB_TRY(download(bdx, &out->run.dx));
  NB_TRY(download(bdw, &out->run.dw));
  for (int i = 0; i < 3; ++i) NB_TRY(lin.debug_copies(i, &out->run.q[i]));
  return lin.mor_stats(out->stats);
}

TEST(LinearMorGpu, StatisticsEqualTheCpusAndMixedGemmsStayWithinTheBound) {
  NB_REQUIRE_GPU();
  const auto x = random_bf16_values(kM * kK, 1.0, 31), w = random_bf16_values(kN * kK, 0.05, 32),
             dy = random_bf16_values(kM * kN, 1e-3, 33);
  for (int role = -1; role < 3; ++role) {
    MorRun cpu, gpu;
    Status st = run_mor(Device::cpu, role, x, w, dy, &cpu);
    ASSERT_TRUE(st.is_ok()) << st.message();
    st = run_mor(Device::cuda, role, x, w, dy, &gpu);
    ASSERT_TRUE(st.is_ok()) << st.message();
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ(gpu.stats[i].err_fixed, cpu.stats[i].err_fixed) << "role " << i;
      EXPECT_EQ(gpu.stats[i].nonzero, cpu.stats[i].nonzero) << "role " << i;
      EXPECT_EQ(gpu.stats[i].nonfinite, cpu.stats[i].nonfinite) << "role " << i;
      EXPECT_GT(gpu.stats[i].nonzero, 0);
    }
    // The FP64 model: each role's FP8 copies, or its BF16 values for the BF16 role.
    const std::vector<double> xd = to_double(x), wd = to_double(w), dyd = to_double(dy);
    const QuantizedBytes* q = gpu.run.q;
    std::vector<double> a_y = dequant_copy(q[0], false), b_y = dequant_copy(q[1], false);
    std::vector<double> a_dx = dequant_copy(q[2], false), b_dx = dequant_copy(q[1], true);
    std::vector<double> a_dw = dequant_copy(q[2], true), b_dw = dequant_copy(q[0], true);
    if (role == 0) {
      a_y = xd;
      b_dw = transpose(xd, kM, kK);
    } else if (role == 1) {
      b_y = wd;
      b_dx = transpose(wd, kN, kK);
    } else if (role == 2) {
      a_dx = dyd;
      a_dw = transpose(dyd, kM, kN);
    }
    std::vector<double> ry, rdx, rdw, my, mdx, mdw, ey, edx, edw, m2;
    product_nt(a_y, b_y, kM, kN, kK, &ry, &my);
    product_nt(a_dx, b_dx, kM, kK, kN, &rdx, &mdx);
    product_nt(a_dw, b_dw, kN, kK, kM, &rdw, &mdw);
    product_nt(xd, wd, kM, kN, kK, &ey, &m2);
    product_nt(dyd, transpose(wd, kN, kK), kM, kK, kN, &edx, &m2);
    product_nt(transpose(dyd, kM, kN), transpose(xd, kM, kK), kN, kK, kM, &edw, &m2);
    // Both operands FP8: tensor cores (fast accumulation in Fprop, split accumulation elsewhere); a BF16 operand:
    // the BF16 GEMM with FP32 accumulation.
    const bool fprop_fp8 = role != 0 && role != 1, dgrad_fp8 = role != 2 && role != 1,
               wgrad_fp8 = role != 2 && role != 0;
    const std::string what = " (bf16 role " + std::to_string(role) + ")";
    expect_close(("y" + what).c_str(), gpu.run.y, ry, my, kK, Bound{false, fprop_fp8, true, false}, ey);
    expect_close(("dx" + what).c_str(), gpu.run.dx, rdx, mdx, kN, Bound{false, false, true, dgrad_fp8}, edx);
    expect_close(("dw" + what).c_str(), gpu.run.dw, rdw, mdw, kM, Bound{false, false, false, wgrad_fp8}, edw);
  }
}

}  // namespace
}  // namespace nb::recipe
