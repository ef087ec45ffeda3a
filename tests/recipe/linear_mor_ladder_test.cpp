// Mixture of Representations' NVFP4 ladder (bf16_with_mor_nvfp4_mixed) inside one Linear on the CPU backend: each
// rung runs exactly what the recipe of that rung runs (every operand NVFP4 = bf16_with_nvfp4_mixed; every operand
// E4M3 or BF16 = bf16_with_mor_fp8_mixed with the same decisions), bit for bit; an NVFP4 operand beside an E4M3 or
// BF16 one gives a Wgrad near the exact one (the RHT is off for that pair: with it on one side only, dW would be
// unrelated to dY^T X); a measured step fills six statistic cells (E4M3's equal formats/mor's reference, NVFP4's
// the statistic of the row copy the Linear made); a paused step quantizes no E4M3 copy.
#include <gtest/gtest.h>
#include <cmath>
#include <string>
#include <vector>
#include "formats/mor/mor.h"
#include "formats/mor/mor_stat.h"
#include "recipe/mor_test_util.h"

namespace nb::recipe {
namespace {
using namespace nb::recipe::testing;

constexpr int64_t kLadderM = 64, kLadderK = 128, kLadderN = 96;

Recipe preset(const char* name) {
  Recipe r;
  EXPECT_TRUE(recipe_preset(name, &r).is_ok()) << name;
  r.bf16_layers_at_end = 0;  // the NVFP4 recipe keeps its last layers BF16; one Linear is never one of them
  return r;
}

// One Linear and its tensors on the CPU, with the ladder's test inputs.
struct LadderJob {
  Linear lin;
  Buffer x, w, dy, y, dx, dw;
  std::vector<float> xv, wv, dyv;
  explicit LadderJob(const Recipe& r)
      : xv(random_bf16_values(kLadderM * kLadderK, 1.0, 61)),
        wv(random_bf16_values(kLadderN * kLadderK, 0.05, 62)),
        dyv(random_bf16_values(kLadderM * kLadderN, 1e-3, 63)) {
    EXPECT_TRUE(lin.init(r, false, "ladder", 5, kLadderM, kLadderK, kLadderN, Device::cpu).is_ok());
    fill(&x, xv, kLadderM, kLadderK);
    fill(&w, wv, kLadderN, kLadderK);
    fill(&dy, dyv, kLadderM, kLadderN);
    EXPECT_TRUE(Buffer::allocate(&y, DType::f32, Device::cpu, {kLadderM, kLadderN}).is_ok());
    EXPECT_TRUE(Buffer::allocate(&dx, DType::f32, Device::cpu, {kLadderM, kLadderK}).is_ok());
    fill(&dw, std::vector<float>(size_t(kLadderN * kLadderK), 0.f), kLadderN, kLadderK);
  }
  static void fill(Buffer* b, const std::vector<float>& v, int64_t rows, int64_t cols) {
    ASSERT_TRUE(Buffer::allocate(b, DType::f32, Device::cpu, {rows, cols}).is_ok());
    std::copy(v.begin(), v.end(), b->ptr<float>());
  }
  Status pass() {
    lin.new_step(1);
    NB_TRY(lin.forward(x.tensor(), w.tensor(), y.tensor(), 0.f, nullptr));
    return lin.backward(dy.tensor(), x.tensor(), w.tensor(), dx.tensor(), 0.f, dw.tensor(), nullptr);
  }
  std::vector<float> out(const Buffer& b) const {
    const float* p = b.ptr<float>();
    return {p, p + b.tensor().numel()};
  }
};

void expect_same_outputs(const LadderJob& a, const LadderJob& b, const std::string& what) {
  EXPECT_EQ(a.out(a.y), b.out(b.y)) << "y, " << what;
  EXPECT_EQ(a.out(a.dx), b.out(b.dx)) << "dx, " << what;
  EXPECT_EQ(a.out(a.dw), b.out(b.dw)) << "dw, " << what;
}

TEST(LinearMorLadder, EveryOperandNvfp4IsTheNvfp4Recipe) {
  LadderJob ladder(preset("bf16_with_mor_nvfp4_mixed")), nvfp4(preset("bf16_with_nvfp4_mixed"));
  ASSERT_TRUE(ladder.lin.mor());
  for (int r = 0; r < 3; ++r) EXPECT_EQ(ladder.lin.mor_rung(r), MorRung::nvfp4) << "the top rung before any decision";
  ASSERT_TRUE(ladder.pass().is_ok());
  ASSERT_TRUE(nvfp4.pass().is_ok());
  expect_same_outputs(ladder, nvfp4, "all NVFP4 (the RHT on the Wgrad pair)");
}

// Every mix of E4M3 and BF16 over the three roles: the ladder's E4M3 copies and BF16 operands are the E4M3 MoR
// recipe's.
TEST(LinearMorLadder, E4m3AndBf16RungsAreTheE4m3Recipe) {
  for (int mask = 0; mask < 8; ++mask) {
    LadderJob ladder(preset("bf16_with_mor_nvfp4_mixed")), fp8(preset("bf16_with_mor_fp8_mixed"));
    for (int r = 0; r < 3; ++r) {
      const bool e4m3 = (mask >> r) & 1;
      ASSERT_TRUE(ladder.lin.set_mor_rung(r, e4m3 ? MorRung::fp8 : MorRung::bf16).is_ok());
      ASSERT_TRUE(fp8.lin.set_mor_fp8(r, e4m3).is_ok());
    }
    ASSERT_TRUE(ladder.pass().is_ok());
    ASSERT_TRUE(fp8.pass().is_ok());
    expect_same_outputs(ladder, fp8, "E4M3 roles mask " + std::to_string(mask));
  }
}

// Relative Frobenius distance of got from the FP64 product of the BF16 sources.
double wgrad_error(const LadderJob& j) {
  const std::vector<float> dw = j.out(j.dw);
  double diff = 0, norm = 0;
  for (int64_t n = 0; n < kLadderN; ++n)
    for (int64_t k = 0; k < kLadderK; ++k) {
      double ref = 0;
      for (int64_t m = 0; m < kLadderM; ++m)
        ref += double(j.dyv[size_t(m * kLadderN + n)]) * double(j.xv[size_t(m * kLadderK + k)]);  // BF16 values
      diff += (dw[size_t(n * kLadderK + k)] - ref) * (dw[size_t(n * kLadderK + k)] - ref);
      norm += ref * ref;
    }
  return std::sqrt(diff / norm);
}

TEST(LinearMorLadder, AnNvfp4OperandBesideAnotherRungKeepsItsWgradRight) {
  LadderJob all(preset("bf16_with_mor_nvfp4_mixed"));
  ASSERT_TRUE(all.pass().is_ok());
  const double all_nvfp4 = wgrad_error(all);
  EXPECT_LT(all_nvfp4, 0.3);
  struct Mix {
    MorRung input, grad;
  };
  for (const Mix& m : {Mix{MorRung::nvfp4, MorRung::fp8}, Mix{MorRung::nvfp4, MorRung::bf16},
                       Mix{MorRung::fp8, MorRung::nvfp4}, Mix{MorRung::bf16, MorRung::nvfp4}}) {
    LadderJob j(preset("bf16_with_mor_nvfp4_mixed"));
    ASSERT_TRUE(j.lin.set_mor_rung(0, m.input).is_ok());
    ASSERT_TRUE(j.lin.set_mor_rung(2, m.grad).is_ok());
    ASSERT_TRUE(j.pass().is_ok());
    // One NVFP4 side: its error alone, below the two-sided NVFP4 Wgrad's. An RHT on one side only would leave
    // dW unrelated to dY^T X (a relative error near 1.4).
    EXPECT_LT(wgrad_error(j), all_nvfp4) << "input rung " << int(m.input) << ", grad rung " << int(m.grad);
    if (m.input == MorRung::nvfp4) EXPECT_EQ(all.out(all.y), j.out(j.y)) << "Fprop reads the same NVFP4 operands";
  }
}

TEST(LinearMorLadder, AMeasuredStepFillsSixCells) {
  LadderJob j(preset("bf16_with_mor_nvfp4_mixed"));
  ASSERT_EQ(j.lin.mor_cell_count(), 6);
  ASSERT_TRUE(j.pass().is_ok());
  mor::ErrorStat got[6];
  ASSERT_TRUE(j.lin.mor_stats(got).is_ok());
  const std::vector<float>* src[3] = {&j.xv, &j.wv, &j.dyv};
  const int64_t rows[3] = {kLadderM, kLadderN, kLadderM}, cols[3] = {kLadderK, kLadderK, kLadderN};
  for (int r = 0; r < 3; ++r) {
    std::vector<bf16> b(src[r]->size());
    for (size_t i = 0; i < b.size(); ++i) b[i] = f32_to_bf16((*src[r])[i]);
    mor::ErrorStat e4m3;
    ASSERT_TRUE(mor::tensor_stat_ref(b.data(), rows[r], cols[r], mor::TensorRule{}, -1.0f, &e4m3).is_ok());
    EXPECT_EQ(got[r].err_fixed, e4m3.err_fixed) << "E4M3 statistic of role " << r;
    EXPECT_EQ(got[r].nonzero, e4m3.nonzero) << "role " << r;
    QuantizedBytes q;
    ASSERT_TRUE(j.lin.debug_copies(r, &q).is_ok());
    mor::StatCell nv;
    mor::add_nvfp4_stat_host(b.data(), rows[r], cols[r], q.row_data.data(), q.row_scales.data(), q.row_amax, &nv);
    EXPECT_EQ(uint64_t(got[3 + r].err_fixed), nv.err_fixed) << "NVFP4 statistic of role " << r;
    EXPECT_EQ(uint64_t(got[3 + r].nonzero), nv.nonzero) << "role " << r;
    EXPECT_GT(got[3 + r].mean(), got[r].mean()) << "NVFP4 is coarser than E4M3, role " << r;
  }
  // Paused (a step between decisions, an evaluation): nothing measured.
  ASSERT_TRUE(j.lin.clear_mor_stats(nullptr).is_ok());
  j.lin.pause_mor_stats(true);
  ASSERT_TRUE(j.pass().is_ok());
  ASSERT_TRUE(j.lin.mor_stats(got).is_ok());
  for (const mor::ErrorStat& s : got) EXPECT_EQ(s.nonzero, 0);
}

TEST(LinearMorLadder, TheE4m3RecipeHasNoNvfp4Rung) {
  LadderJob fp8(preset("bf16_with_mor_fp8_mixed"));
  EXPECT_EQ(fp8.lin.mor_cell_count(), 3);
  const Status st = fp8.lin.set_mor_rung(0, MorRung::nvfp4);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("no NVFP4 rung"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace nb::recipe
