// MoR's block rule inside one Linear on the CPU backend (--mor-granularity block): each role's operand is
// formats/mor's apply_block_rule_ref of its values byte for byte (the NVFP4 ladder per block: apply_block_ladder_ref,
// the gradient's SR with the Linear's key), the three GEMMs equal an FP64 model over those operands, each quantization
// adds the role's E4M3 statistic (the ladder: and its NVFP4 one) and blocks per choice into its cells (the weight once
// per step, nothing while paused), and the knobs that do not apply to the block rule are refused in one sentence.
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

constexpr uint32_t kTensorId = 3;
// Between the inputs' and weights' NVFP4 errors (about 0.23) and the SR gradient's (about 0.27): GEMMs of both rungs.
constexpr double kLadderThreshold = 0.25;
// With 1x16 blocks on X and dY: between the input's (about 0.18) and the SR gradient's (about 0.22) NVFP4 errors.
constexpr double kLadderRowsThreshold = 0.2;

Recipe block_recipe(bool three_way, const std::string& scaling, bool ladder = false, bool rows = false) {
  Recipe r;
  EXPECT_TRUE(recipe_preset(ladder ? "bf16_with_mor_nvfp4_mixed" : "bf16_with_mor_fp8_mixed", &r).is_ok());
  RecipeKnobs k;
  k.mor_granularity = "block";
  k.mor_three_way = three_way;
  k.mor_scaling = scaling;
  if (ladder) k.mor_nvfp4_threshold = rows ? kLadderRowsThreshold : kLadderThreshold;
  k.mor_nvfp4_rows = rows;
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

// role 2 (the gradient) draws SR with the Linear's key for step 1, micro-batch 0 (linear_internal.h rng_key). With
// 1x16 NVFP4 blocks (nvfp4_rows) the input and gradient have a second copy, the column copy, into *col (its blocks
// 16x1, its key's stream low bit flipped); both add to the cells.
std::vector<bf16> applied(const std::vector<float>& v, int64_t rows, int64_t cols, const Recipe& r, int role,
                          mor::StatCell* stat, mor::StatCell* nvfp4, mor::BlockCounts* counts, std::vector<bf16>* col) {
  std::vector<bf16> in(v.size()), out(v.size());
  for (size_t i = 0; i < v.size(); ++i) in[i] = f32_to_bf16(v[i]);
  const mor::BlockRule rule{r.mor.three_way, r.mor.scaling, r.mor.threshold};
  if (!r.mor.ladder) {
    EXPECT_TRUE(mor::apply_block_rule_ref(in.data(), rows, cols, rule, out.data(), stat, counts).is_ok());
    return out;
  }
  const bool sr = role == 2 && r.grad.sr;
  mor::BlockLadder top{r.mor.nvfp4_threshold, sr, RngKey{r.seed, 1, (kTensorId << 8) | (role == 2 ? 2u : 0u)}};
  const bool two = role != 1 && (role == 0 ? r.input : r.grad).nvfp4_rows;
  if (two) top.blocks = mor::Nvfp4Blocks::rows;
  EXPECT_TRUE(mor::apply_block_ladder_ref(in.data(), rows, cols, rule, top, out.data(), {stat, nvfp4, counts}).is_ok());
  if (two) {
    col->resize(v.size());
    top.blocks = mor::Nvfp4Blocks::cols;
    top.rng.stream ^= 1u;
    EXPECT_TRUE(
        mor::apply_block_ladder_ref(in.data(), rows, cols, rule, top, col->data(), {stat, nvfp4, counts}).is_ok());
  }
  return out;
}

struct Tensors {
  Buffer x, w, dy, y, dx, dw;
  static void fill(Buffer* b, const std::vector<float>& v, int64_t rows, int64_t cols) {
    ASSERT_TRUE(Buffer::allocate(b, DType::f32, Device::cpu, {rows, cols}).is_ok());
    std::copy(v.begin(), v.end(), b->ptr<float>());
  }
};

void check_block_linear(bool three_way, const std::string& scaling, bool ladder = false, bool nvfp4_rows = false) {
  SCOPED_TRACE(::testing::Message() << scaling << (three_way ? " three-way" : " two-way") << (ladder ? " ladder" : "")
                                    << (nvfp4_rows ? " 1x16" : ""));
  const Recipe r = block_recipe(three_way, scaling, ladder, nvfp4_rows);
  const auto x = with_outliers(kM, kK, 1.0, 1), w = with_outliers(kN, kK, 0.05, 2), dy = with_outliers(kM, kN, 1e-3, 3);
  Linear lin;
  ASSERT_TRUE(lin.init(r, false, "mor_block", kTensorId, kM, kK, kN, Device::cpu).is_ok());
  ASSERT_TRUE(lin.mor());
  const int n_cells = ladder ? 9 : 6;
  ASSERT_EQ(lin.mor_cell_count(), n_cells);
  std::vector<mor::StatCell> cells(static_cast<size_t>(n_cells), mor::StatCell{});
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
  uint64_t bf16_blocks = 0, nvfp4_blocks = 0, below_nvfp4 = 0;
  for (int i = 0; i < 3; ++i) {
    mor::StatCell stat, nvfp4;
    mor::BlockCounts counts;
    std::vector<bf16> col;
    const std::vector<bf16> want = applied(*src[i], rows[i], cols[i], r, i, &stat, &nvfp4, &counts, &col);
    ASSERT_TRUE(lin.debug_copies(i, &q[i]).is_ok());
    ASSERT_EQ(q[i].row_data.size(), want.size() * 2);
    EXPECT_EQ(std::memcmp(q[i].row_data.data(), want.data(), q[i].row_data.size()), 0) << "role " << i;
    if (!col.empty()) {  // 1x16 NVFP4 blocks: the Wgrad copy is a quantization of its own
      ASSERT_EQ(q[i].col_data.size(), col.size() * 2);
      EXPECT_EQ(std::memcmp(q[i].col_data.data(), col.data(), q[i].col_data.size()), 0) << "role " << i;
    } else if (i == 0) {  // the input's Fprop copy is transient: Wgrad reads its own copy of the same bytes
      EXPECT_EQ(q[i].col_data, q[i].row_data);
    } else {
      EXPECT_TRUE(q[i].col_data.empty()) << "one copy serves both ways";
    }
    const mor::BlockCounts got = mor::block_counts_of(cells[size_t(3 + i)]);
    EXPECT_EQ(got.e4m3, counts.e4m3) << i;
    EXPECT_EQ(got.e5m2, counts.e5m2) << i;
    EXPECT_EQ(got.bf16, counts.bf16) << i;
    EXPECT_EQ(got.nvfp4, counts.nvfp4) << i;
    EXPECT_EQ(cells[size_t(i)].err_fixed, stat.err_fixed) << i;
    EXPECT_EQ(cells[size_t(i)].nonzero, stat.nonzero) << i;
    if (ladder) {
      EXPECT_EQ(cells[size_t(6 + i)].err_fixed, nvfp4.err_fixed) << i;
      EXPECT_EQ(cells[size_t(6 + i)].nonzero, nvfp4.nonzero) << i;
    }
    bf16_blocks += got.bf16;
    nvfp4_blocks += got.nvfp4;
    below_nvfp4 += got.e4m3 + got.bf16;
  }
  // The FP8 rule keeps the outliers' blocks BF16; the ladder's 16x16 tiles hold an outlier in its own tile, while the
  // outlier's S_enc leaves other tensors' small tiles too coarse, so some blocks leave NVFP4 and some keep it.
  if (!three_way && !ladder) { EXPECT_GT(bf16_blocks, 0u) << "the outliers keep some blocks BF16"; }
  if (ladder) {
    EXPECT_GT(nvfp4_blocks, 0u);
    EXPECT_GT(below_nvfp4, 0u);
  }
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
  const auto all = [](const mor::BlockCounts& b) { return b.e4m3 + b.bf16 + b.e5m2 + b.nvfp4; };
  EXPECT_EQ(all(after[0]), 2 * all(before[0]));
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
  check_block_linear(false, "", /*ladder=*/true);
  check_block_linear(false, "pow2", /*ladder=*/true);
  check_block_linear(false, "", /*ladder=*/true, /*nvfp4_rows=*/true);
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
  RecipeKnobs rht = block, two_d = block, rows_fp8 = block, rows_tensor;
  rows_fp8.mor_nvfp4_rows = rows_tensor.mor_nvfp4_rows = true;
  rht.fp4_disable_rht = true;
  two_d.fp4_disable_2d = true;
  const Case cases[] = {
      {"bf16_with_mor_nvfp4_mixed", rht, "has no RHT"},
      {"bf16_with_mor_nvfp4_mixed", two_d, "16x16 tiles"},
      {"bf16_with_mor_fp8_mixed", rows_fp8, "has no NVFP4 rung"},
      {"bf16_with_mor_nvfp4_mixed", rows_tensor, "add mor-granularity block"},
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
