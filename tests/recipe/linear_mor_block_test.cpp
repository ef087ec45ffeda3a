// MoR's block rule inside one Linear on the CPU backend (--mor-granularity block): each role's operand is
// formats/mor's apply_block_rule_ref of its values byte for byte, the three GEMMs equal an FP64 model over those
// operands, each quantization adds the role's E4M3 statistic and blocks per choice into its cells (the weight once per
// step, nothing while paused), and the knobs that do not apply to the block rule are refused in one sentence.
#include <gtest/gtest.h>
#include <cstring>
#include <string>
#include <vector>
#include "formats/mor/mor_block.h"
#include "recipe/mor_test_util.h"

namespace nb::recipe {
namespace {
using namespace nb::recipe::testing;

constexpr int64_t kM = 192, kK = 256, kN = 160;  // clipped blocks in every dimension

Recipe block_recipe(bool three_way, const std::string& scaling) {
  Recipe r;
  EXPECT_TRUE(recipe_preset("bf16_with_mor_fp8_mixed", &r).is_ok());
  RecipeKnobs k;
  k.mor_granularity = "block";
  k.mor_three_way = three_way;
  k.mor_scaling = scaling;
  EXPECT_TRUE(apply_knobs(k, &r).is_ok());
  return r;
}

// Values with one outlier in a few 128x128 blocks, so the two-way rule keeps some blocks BF16.
std::vector<float> with_outliers(int64_t rows, int64_t cols, double sigma, uint64_t seed) {
  std::vector<float> v = random_bf16_values(rows * cols, sigma, seed);
  for (int64_t r = 0; r < rows; r += 128)
    if ((r / 128) % 2 == 0) v[size_t(r * cols + 3)] = bf16_to_f32(f32_to_bf16(float(sigma * 1e5)));
  return v;
}

std::vector<bf16> applied(const std::vector<float>& v, int64_t rows, int64_t cols, const Recipe& r, mor::StatCell* stat,
                          mor::BlockCounts* counts) {
  std::vector<bf16> in(v.size()), out(v.size());
  for (size_t i = 0; i < v.size(); ++i) in[i] = f32_to_bf16(v[i]);
  const mor::BlockRule rule{r.mor.three_way, r.mor.scaling, r.mor.threshold};
  EXPECT_TRUE(mor::apply_block_rule_ref(in.data(), rows, cols, rule, out.data(), stat, counts).is_ok());
  return out;
}

struct Tensors {
  Buffer x, w, dy, y, dx, dw;
  static void fill(Buffer* b, const std::vector<float>& v, int64_t rows, int64_t cols) {
    ASSERT_TRUE(Buffer::allocate(b, DType::f32, Device::cpu, {rows, cols}).is_ok());
    std::copy(v.begin(), v.end(), b->ptr<float>());
  }
};

void check_block_linear(bool three_way, const std::string& scaling) {
  SCOPED_TRACE(::testing::Message() << scaling << (three_way ? " three-way" : " two-way"));
  const Recipe r = block_recipe(three_way, scaling);
  const auto x = with_outliers(kM, kK, 1.0, 1), w = with_outliers(kN, kK, 0.05, 2), dy = with_outliers(kM, kN, 1e-3, 3);
  Linear lin;
  ASSERT_TRUE(lin.init(r, false, "mor_block", 3, kM, kK, kN, Device::cpu).is_ok());
  ASSERT_TRUE(lin.mor());
  ASSERT_EQ(lin.mor_cell_count(), 6);
  std::vector<mor::StatCell> cells(6);
  ASSERT_TRUE(lin.set_mor_cells(cells.data()).is_ok());
  Tensors t;
  Tensors::fill(&t.x, x, kM, kK);
  Tensors::fill(&t.w, w, kN, kK);
  Tensors::fill(&t.dy, dy, kM, kN);
  Tensors::fill(&t.dw, std::vector<float>(size_t(kN * kK), 0.f), kN, kK);
  ASSERT_TRUE(Buffer::allocate(&t.y, DType::f32, Device::cpu, {kM, kN}).is_ok());
  ASSERT_TRUE(Buffer::allocate(&t.dx, DType::f32, Device::cpu, {kM, kK}).is_ok());
  lin.new_step(1);
  ASSERT_TRUE(lin.forward(t.x.tensor(), t.w.tensor(), t.y.tensor(), 0.f, nullptr).is_ok());
  ASSERT_TRUE(
      lin.backward(t.dy.tensor(), t.x.tensor(), t.w.tensor(), t.dx.tensor(), 0.f, t.dw.tensor(), nullptr).is_ok());
  // Each role's one copy is the rule's operand, byte for byte, and its cells hold the rule's statistic and counts.
  const std::vector<float>* src[3] = {&x, &w, &dy};
  const int64_t rows[3] = {kM, kN, kM}, cols[3] = {kK, kK, kN};
  QuantizedBytes q[3];
  uint64_t bf16_blocks = 0;
  for (int i = 0; i < 3; ++i) {
    mor::StatCell stat;
    mor::BlockCounts counts;
    const std::vector<bf16> want = applied(*src[i], rows[i], cols[i], r, &stat, &counts);
    ASSERT_TRUE(lin.debug_copies(i, &q[i]).is_ok());
    ASSERT_EQ(q[i].row_data.size(), want.size() * 2);
    EXPECT_EQ(std::memcmp(q[i].row_data.data(), want.data(), q[i].row_data.size()), 0) << "role " << i;
    if (i == 0)  // the input's Fprop copy is transient: Wgrad reads its own copy of the same bytes
      EXPECT_EQ(q[i].col_data, q[i].row_data);
    else
      EXPECT_TRUE(q[i].col_data.empty()) << "one copy serves both ways";
    const mor::BlockCounts got = mor::block_counts_of(cells[size_t(3 + i)]);
    EXPECT_EQ(got.e4m3, counts.e4m3) << i;
    EXPECT_EQ(got.e5m2, counts.e5m2) << i;
    EXPECT_EQ(got.bf16, counts.bf16) << i;
    EXPECT_EQ(cells[size_t(i)].err_fixed, stat.err_fixed) << i;
    EXPECT_EQ(cells[size_t(i)].nonzero, stat.nonzero) << i;
    bf16_blocks += got.bf16;
  }
  if (!three_way) { EXPECT_GT(bf16_blocks, 0u) << "the outliers keep some blocks BF16"; }
  const MixedModel ref = mixed_model(-1, x, w, dy, q, kM, kK, kN);
  const Bound fp64{true};
  auto out = [](const Buffer& b) { return std::vector<double>(b.ptr<float>(), b.ptr<float>() + b.tensor().numel()); };
  expect_close("y", out(t.y), ref.y, ref.mag_y, kK, fp64, ref.exact_y);
  expect_close("dx", out(t.dx), ref.dx, ref.mag_dx, kN, fp64, ref.exact_dx);
  expect_close("dw", out(t.dw), ref.dw, ref.mag_dw, kM, fp64, ref.exact_dw);
  // A second micro-batch adds its input and gradient blocks; the weight was quantized once this step. Paused
  // (evaluation), the operand is still made but nothing is counted.
  mor::BlockCounts before[3];
  for (int i = 0; i < 3; ++i) before[i] = mor::block_counts_of(cells[size_t(3 + i)]);
  ASSERT_TRUE(lin.forward(t.x.tensor(), t.w.tensor(), t.y.tensor(), 0.f, nullptr).is_ok());
  ASSERT_TRUE(
      lin.backward(t.dy.tensor(), t.x.tensor(), t.w.tensor(), t.dx.tensor(), 0.f, t.dw.tensor(), nullptr).is_ok());
  mor::BlockCounts after[3];
  for (int i = 0; i < 3; ++i) after[i] = mor::block_counts_of(cells[size_t(3 + i)]);
  EXPECT_EQ(after[0].e4m3 + after[0].bf16 + after[0].e5m2, 2 * (before[0].e4m3 + before[0].bf16 + before[0].e5m2));
  EXPECT_EQ(after[1].e4m3, before[1].e4m3);
  EXPECT_EQ(after[2].bf16, 2 * before[2].bf16);
  lin.pause_mor_stats(true);
  ASSERT_TRUE(lin.forward(t.x.tensor(), t.w.tensor(), t.y.tensor(), 0.f, nullptr).is_ok());
  const mor::BlockCounts paused = mor::block_counts_of(cells[3]);
  EXPECT_EQ(paused.e4m3, after[0].e4m3);
  EXPECT_EQ(paused.bf16, after[0].bf16);
}

TEST(LinearMorBlock, OperandsAreTheRulesAndTheGemmsReadThem) {
  check_block_linear(false, "");
  check_block_linear(false, "pow2");
  check_block_linear(true, "amax");
}

TEST(LinearMorBlock, KnobsThatDoNotApplyAreRefused) {
  struct Case {
    std::string recipe;
    RecipeKnobs knobs;
    const char* says;
  };
  RecipeKnobs block;
  block.mor_granularity = "block";
  RecipeKnobs interval = block, now = block, bad_scaling = block, three_alone, scaling_alone, unknown;
  interval.mor_interval = 4;
  now.mor_decide_now = true;
  bad_scaling.mor_scaling = "channel";
  three_alone.mor_three_way = true;
  scaling_alone.mor_scaling = "pow2";
  unknown.mor_granularity = "row";
  const Case cases[] = {
      {"bf16_with_mor_nvfp4_mixed", block, "global scale"},
      {"bf16_with_mor_fp8_mixed", interval, "no lag"},
      {"bf16_with_mor_fp8_mixed", now, "no lag"},
      {"bf16_with_mor_fp8_mixed", bad_scaling, "unknown mor-scaling"},
      {"bf16_with_mor_fp8_mixed", three_alone, "belong to the block rule"},
      {"bf16_with_mor_fp8_mixed", scaling_alone, "belong to the block rule"},
      {"bf16_with_mor_fp8_mixed", unknown, "unknown mor-granularity"},
      {"bf16_with_fp8_current_scaling_mixed", block, "has no Mixture of Representations"},
  };
  for (const Case& c : cases) {
    Recipe r;
    ASSERT_TRUE(recipe_preset(c.recipe, &r).is_ok());
    const Status s = apply_knobs(c.knobs, &r);
    ASSERT_FALSE(s.is_ok()) << c.says;
    EXPECT_NE(s.message().find(c.says), std::string::npos) << s.message();
  }
}

}  // namespace
}  // namespace nb::recipe
