// Mixture of Representations inside one Linear on the CPU backend: each role's statistic equals formats/mor's
// reference (tensor_stat_ref: per-tensor E4M3 with amax scaling) exactly, summed over a step's micro-batches and
// the weight counted once per step; a role decided BF16 makes its GEMM operands its BF16 values, checked against an
// FP64 model of the three GEMMs on those mixed operands; a NaN is counted and decides BF16; and what MoR cannot
// serve is refused in one sentence.
#include <gtest/gtest.h>
#include <string>
#include <vector>
#include "formats/mor/mor.h"
#include "formats/mor/mor_stat.h"
#include "recipe/mor_test_util.h"

namespace nb::recipe {
namespace {
using namespace nb::recipe::testing;

constexpr int64_t kMorM = 64, kMorK = 128, kMorN = 96;

Recipe mor_recipe() {
  Recipe r;
  EXPECT_TRUE(recipe_preset("bf16_with_mor_fp8_mixed", &r).is_ok());
  return r;
}

std::vector<bf16> as_bf16(const std::vector<float>& v) {
  std::vector<bf16> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = f32_to_bf16(v[i]);
  return out;
}

mor::ErrorStat reference(const std::vector<float>& v, int64_t rows, int64_t cols) {
  const std::vector<bf16> b = as_bf16(v);
  mor::ErrorStat s;
  EXPECT_TRUE(mor::tensor_stat_ref(b.data(), rows, cols, mor::TensorRule{}, -1.0f, &s).is_ok());
  return s;
}

void expect_equal(const mor::ErrorStat& got, const mor::ErrorStat& want, const char* what) {
  EXPECT_EQ(got.err_fixed, want.err_fixed) << what;
  EXPECT_EQ(got.nonzero, want.nonzero) << what;
  EXPECT_EQ(got.nonfinite, want.nonfinite) << what;
}

// A Linear and its tensors on the CPU.
struct Job {
  Linear lin;
  Buffer x, w, dy, y, dx, dw;
  Job(const Recipe& r, const std::vector<float>& xv, const std::vector<float>& wv, const std::vector<float>& dyv) {
    EXPECT_TRUE(lin.init(r, false, "mor", 3, kMorM, kMorK, kMorN, Device::cpu).is_ok());
    fill(&x, xv, kMorM, kMorK);
    fill(&w, wv, kMorN, kMorK);
    fill(&dy, dyv, kMorM, kMorN);
    EXPECT_TRUE(Buffer::allocate(&y, DType::f32, Device::cpu, {kMorM, kMorN}).is_ok());
    EXPECT_TRUE(Buffer::allocate(&dx, DType::f32, Device::cpu, {kMorM, kMorK}).is_ok());
    fill(&dw, std::vector<float>(size_t(kMorN * kMorK), 0.f), kMorN, kMorK);
  }
  static void fill(Buffer* b, const std::vector<float>& v, int64_t rows, int64_t cols) {
    ASSERT_TRUE(Buffer::allocate(b, DType::f32, Device::cpu, {rows, cols}).is_ok());
    std::copy(v.begin(), v.end(), b->ptr<float>());
  }
  Status pass() {
    NB_TRY(lin.forward(x.tensor(), w.tensor(), y.tensor(), 0.f, nullptr));
    return lin.backward(dy.tensor(), x.tensor(), w.tensor(), dx.tensor(), 0.f, dw.tensor(), nullptr);
  }
  std::vector<double> out(const Buffer& b) const {
    const float* p = b.ptr<float>();
    return {p, p + b.tensor().numel()};
  }
};

// --mor-channel-statistic: cells 3 + role hold each role's per-row scaled statistic of the same quantizations (the
// step's one input, weight and gradient), and the outputs, the per-tensor cells and the decisions are the run's
// without.
TEST(LinearMor, ChannelStatisticMeasuresEachRoleAndChangesNothing) {
  const auto x = random_bf16_values(kMorM * kMorK, 1.0, 11), w = random_bf16_values(kMorN * kMorK, 0.05, 12),
             dy = random_bf16_values(kMorM * kMorN, 1e-3, 13);
  Recipe channel = mor_recipe();
  channel.mor.channel_stat = true;
  Job plain(mor_recipe(), x, w, dy), measured(channel, x, w, dy);
  ASSERT_EQ(measured.lin.mor_cell_count(), 6);
  for (Job* j : {&plain, &measured}) {
    j->lin.new_step(1);
    ASSERT_TRUE(j->pass().is_ok());
  }
  EXPECT_EQ(measured.out(measured.y), plain.out(plain.y));
  EXPECT_EQ(measured.out(measured.dx), plain.out(plain.dx));
  EXPECT_EQ(measured.out(measured.dw), plain.out(plain.dw));
  mor::ErrorStat a[3], b[6];
  ASSERT_TRUE(plain.lin.mor_stats(a).is_ok());
  ASSERT_TRUE(measured.lin.mor_stats(b).is_ok());
  const std::vector<float>* src[3] = {&x, &w, &dy};
  const int64_t rows[3] = {kMorM, kMorN, kMorM}, cols[3] = {kMorK, kMorK, kMorN};
  for (int r = 0; r < 3; ++r) {
    expect_equal(b[r], a[r], "per-tensor cell");
    EXPECT_EQ(measured.lin.mor_rung(r), plain.lin.mor_rung(r));
    const std::vector<bf16> v = as_bf16(*src[r]);
    mor::StatCell want;
    mor::add_fp8_rowwise_stat_host(v.data(), rows[r], cols[r], fp8::Format::e4m3, &want);
    expect_equal(b[3 + r], mor::stat_of(want), "per-row cell");
    EXPECT_GT(b[3 + r].nonzero, 0);
    EXPECT_LE(b[3 + r].mean(), a[r].mean() * 1.05) << r;
  }
}

TEST(LinearMor, StatisticsEqualTheReference) {
  const auto x1 = random_bf16_values(kMorM * kMorK, 1.0, 1), x2 = random_bf16_values(kMorM * kMorK, 3.0, 2);
  const auto w = random_bf16_values(kMorN * kMorK, 0.05, 3), dy1 = random_bf16_values(kMorM * kMorN, 1e-3, 4),
             dy2 = random_bf16_values(kMorM * kMorN, 2e-3, 5);
  Job j(mor_recipe(), x1, w, dy1);
  ASSERT_TRUE(j.lin.mor());
  j.lin.new_step(1);
  ASSERT_TRUE(j.pass().is_ok());
  mor::ErrorStat got[3];
  ASSERT_TRUE(j.lin.mor_stats(got).is_ok());
  expect_equal(got[0], reference(x1, kMorM, kMorK), "input");
  expect_equal(got[1], reference(w, kMorN, kMorK), "weight");
  expect_equal(got[2], reference(dy1, kMorM, kMorN), "grad");
  EXPECT_GT(got[0].nonzero, 0);
  // A second micro-batch of the step adds its input and gradient; the weight is quantized once per step.
  std::copy(x2.begin(), x2.end(), j.x.ptr<float>());
  std::copy(dy2.begin(), dy2.end(), j.dy.ptr<float>());
  ASSERT_TRUE(j.pass().is_ok());
  ASSERT_TRUE(j.lin.mor_stats(got).is_ok());
  mor::ErrorStat in = reference(x1, kMorM, kMorK), g = reference(dy1, kMorM, kMorN);
  in.add(reference(x2, kMorM, kMorK));
  g.add(reference(dy2, kMorM, kMorN));
  expect_equal(got[0], in, "input, two micro-batches");
  expect_equal(got[1], reference(w, kMorN, kMorK), "weight, once per step");
  expect_equal(got[2], g, "grad, two micro-batches");
  // Paused (evaluation), nothing adds; cleared, nothing is left.
  j.lin.pause_mor_stats(true);
  ASSERT_TRUE(j.lin.forward(j.x.tensor(), j.w.tensor(), j.y.tensor(), 0.f, nullptr).is_ok());
  ASSERT_TRUE(j.lin.mor_stats(got).is_ok());
  expect_equal(got[0], in, "input, paused");
  ASSERT_TRUE(j.lin.clear_mor_stats(nullptr).is_ok());
  ASSERT_TRUE(j.lin.mor_stats(got).is_ok());
  for (const mor::ErrorStat& s : got) expect_equal(s, mor::ErrorStat{}, "cleared");
}

// With role `bf16_role` decided BF16, each GEMM reads that role's BF16 values and the others' FP8 copies; the CPU
// backend sums in FP64 and rounds once to FP32.
void check_mixed(int bf16_role) {
  const auto x = random_bf16_values(kMorM * kMorK, 1.0, 11), w = random_bf16_values(kMorN * kMorK, 0.05, 12),
             dy = random_bf16_values(kMorM * kMorN, 1e-3, 13);
  Job j(mor_recipe(), x, w, dy);
  ASSERT_TRUE(j.lin.set_mor_fp8(bf16_role, false).is_ok());
  EXPECT_FALSE(j.lin.mor_fp8(bf16_role));
  j.lin.new_step(1);
  ASSERT_TRUE(j.pass().is_ok());
  QuantizedBytes q[3];
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(j.lin.debug_copies(i, &q[i]).is_ok());
  const MixedModel ref = mixed_model(bf16_role, x, w, dy, q, kMorM, kMorK, kMorN);
  const Bound fp64{true};
  const std::string role = std::to_string(bf16_role);
  expect_close(("y, bf16 role " + role).c_str(), j.out(j.y), ref.y, ref.mag_y, kMorK, fp64, ref.exact_y);
  expect_close(("dx, bf16 role " + role).c_str(), j.out(j.dx), ref.dx, ref.mag_dx, kMorN, fp64, ref.exact_dx);
  expect_close(("dw, bf16 role " + role).c_str(), j.out(j.dw), ref.dw, ref.mag_dw, kMorM, fp64, ref.exact_dw);
  // The statistic is still measured for a BF16 role: the next decision reads it.
  mor::ErrorStat got[3];
  ASSERT_TRUE(j.lin.mor_stats(got).is_ok());
  EXPECT_GT(got[bf16_role].nonzero, 0);
}

TEST(LinearMor, ABf16RoleFeedsItsValuesToEachGemm) {
  for (int role = 0; role < 3; ++role) check_mixed(role);
}

TEST(LinearMor, ANonFiniteInputIsCountedAndDecidesBf16) {
  auto x = random_bf16_values(kMorM * kMorK, 1.0, 21);
  x[77] = std::numeric_limits<float>::quiet_NaN();
  Job j(mor_recipe(), x, random_bf16_values(kMorN * kMorK, 0.05, 22), random_bf16_values(kMorM * kMorN, 1e-3, 23));
  j.lin.new_step(1);
  ASSERT_TRUE(j.lin.forward(j.x.tensor(), j.w.tensor(), j.y.tensor(), 0.f, nullptr).is_ok());
  mor::ErrorStat got[3];
  ASSERT_TRUE(j.lin.mor_stats(got).is_ok());
  EXPECT_TRUE(got[0].nonfinite);
  EXPECT_EQ(got[0].nonzero, reference(x, kMorM, kMorK).nonzero);  // the NaN is not in the mean
  const mor::TensorDecision d = mor::decide_from_stat(got[0], mor::kDefaultE4M3Threshold);
  EXPECT_EQ(d.choice, mor::Choice::bf16);
  EXPECT_EQ(d.reason, mor::Reason::nonfinite);
  EXPECT_FALSE(got[1].nonfinite);
}

// --mor-decide-now: each quantization decides its own role at once, from its own statistic.
TEST(LinearMor, DecideNowDecidesEachQuantizationFromItself) {
  Recipe r = mor_recipe();
  r.mor.decide_now = true;
  r.mor.threshold = 1e-9;  // below every error: each measured role turns BF16 as soon as it is quantized
  Job j(r, random_bf16_values(kMorM * kMorK, 1.0, 41), random_bf16_values(kMorN * kMorK, 0.05, 42),
        random_bf16_values(kMorM * kMorN, 1e-3, 43));
  j.lin.new_step(1);
  ASSERT_TRUE(j.lin.forward(j.x.tensor(), j.w.tensor(), j.y.tensor(), 0.f, nullptr).is_ok());
  EXPECT_FALSE(j.lin.mor_fp8(0));
  EXPECT_FALSE(j.lin.mor_fp8(1));
  EXPECT_TRUE(j.lin.mor_fp8(2)) << "the gradient is not quantized yet";
  ASSERT_TRUE(
      j.lin.backward(j.dy.tensor(), j.x.tensor(), j.w.tensor(), j.dx.tensor(), 0.f, j.dw.tensor(), nullptr).is_ok());
  EXPECT_FALSE(j.lin.mor_fp8(2));
}

// A frozen (LoRA base) weight is decided once, from all of it, when it is frozen: a well-behaved weight E4M3, one with
// outliers BF16 at a threshold below its error, whose Fprop and Dgrad then read its BF16 values. Each measured step
// the board's weight cell holds its statistic (so the trainer decides it as it was frozen), once per step.
TEST(LinearMor, AFrozenWeightIsDecidedOnceAndReadAsDecided) {
  auto x = random_bf16_values(kMorM * kMorK, 1.0, 21), w = random_bf16_values(kMorN * kMorK, 0.05, 22),
       dy = random_bf16_values(kMorM * kMorN, 1e-3, 23);
  for (size_t i = 0; i < w.size(); i += 37) w[i] = bf16_to_f32(f32_to_bf16(w[i] * 400.0f));  // outliers
  const mor::ErrorStat w_stat = reference(w, kMorN, kMorK);
  for (bool keep_fp8 : {true, false}) {
    Recipe r = mor_recipe();
    r.mor.threshold = keep_fp8 ? 0.999 : w_stat.mean() * 0.5;
    Linear lin;
    ASSERT_TRUE(lin.init(r, false, "base", 1, kMorM, kMorK, kMorN, Device::cpu, nullptr, /*frozen=*/true).is_ok());
    std::vector<mor::StatCell> cells(3);
    ASSERT_TRUE(lin.set_mor_cells(cells.data()).is_ok());
    Job j(r, x, w, dy);  // its tensors; its own Linear is not used
    ASSERT_TRUE(lin.freeze_weight(j.w.tensor(), nullptr).is_ok());
    EXPECT_EQ(lin.mor_fp8(1), keep_fp8);
    EXPECT_EQ(cells[1].nonzero, 0u) << "freezing measures into the Linear's own cell";
    for (int step = 1; step <= 2; ++step) {
      lin.new_step(uint32_t(step));
      ASSERT_TRUE(lin.forward(j.x.tensor(), Tensor{}, j.y.tensor(), 0.f, nullptr).is_ok());
      ASSERT_TRUE(lin.forward(j.x.tensor(), Tensor{}, j.y.tensor(), 0.f, nullptr).is_ok());  // a second micro-batch
      ASSERT_TRUE(lin.backward(j.dy.tensor(), Tensor{}, Tensor{}, j.dx.tensor(), 0.f, Tensor{}, nullptr).is_ok());
      mor::ErrorStat got[3];
      ASSERT_TRUE(lin.mor_stats(got).is_ok());
      expect_equal(got[1], w_stat, "the frozen weight's statistic, once per step");
      ASSERT_TRUE(lin.clear_mor_stats(nullptr).is_ok());
    }
    // A frozen Linear keeps row copies only (per-tensor FP8: the column copy is the row copy's bytes transposed).
    QuantizedBytes q[3];
    for (int i = 0; i < 3; ++i) {
      ASSERT_TRUE(lin.debug_copies(i, &q[i]).is_ok());
      q[i].col_data.resize(q[i].row_data.size());
      for (int64_t rr = 0; rr < q[i].rows; ++rr)
        for (int64_t cc = 0; cc < q[i].cols; ++cc)
          q[i].col_data[size_t(cc * q[i].rows + rr)] = q[i].row_data[size_t(rr * q[i].cols + cc)];
    }
    const MixedModel ref = mixed_model(keep_fp8 ? -1 : 1, x, w, dy, q, kMorM, kMorK, kMorN);
    const Bound fp64{true};
    expect_close(keep_fp8 ? "y, frozen E4M3 weight" : "y, frozen BF16 weight", j.out(j.y), ref.y, ref.mag_y, kMorK,
                 fp64, ref.exact_y);
    expect_close(keep_fp8 ? "dx, frozen E4M3 weight" : "dx, frozen BF16 weight", j.out(j.dx), ref.dx, ref.mag_dx, kMorN,
                 fp64, ref.exact_dx);
  }
}

TEST(LinearMor, WhatItCannotServeIsRefused) {
  Recipe ladder;
  ASSERT_TRUE(recipe_preset("bf16_with_mor_nvfp4_mixed", &ladder).is_ok());
  Linear frozen;
  Status st = frozen.init(ladder, false, "base", 1, kMorM, kMorK, kMorN, Device::cpu, nullptr, /*frozen=*/true);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("Mixture of Representations"), std::string::npos) << st.message();
  Linear lin;
  ASSERT_TRUE(lin.init(mor_recipe(), false, "l", 1, kMorM, kMorK, kMorN, Device::cpu).is_ok());
  st = lin.set_sharded_weight(kMorN / 2, 2);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("Mixture of Representations"), std::string::npos) << st.message();
  EXPECT_FALSE(lin.set_mor_fp8(3, false).is_ok());
  // A BF16 layer of a MoR recipe, and another recipe, have no MoR.
  Linear bf16_layer, fp8;
  ASSERT_TRUE(bf16_layer.init(mor_recipe(), true, "b", 2, kMorM, kMorK, kMorN, Device::cpu).is_ok());
  EXPECT_FALSE(bf16_layer.mor());
  Recipe current;
  ASSERT_TRUE(recipe_preset("bf16_with_fp8_current_scaling_mixed", &current).is_ok());
  ASSERT_TRUE(fp8.init(current, false, "c", 3, kMorM, kMorK, kMorN, Device::cpu).is_ok());
  EXPECT_FALSE(fp8.mor());
  EXPECT_FALSE(fp8.mor_fp8(0));
  EXPECT_FALSE(fp8.set_mor_fp8(0, false).is_ok());
}

}  // namespace
}  // namespace nb::recipe
