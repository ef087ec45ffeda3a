// CPU tests of recipe::Linear's sharded-weight mode (linear.h, Megatron-FSDP's training-format gathers):
// for every quantized preset (and 1D NVFP4 weights), a weight cut into 2, 3 and 4 row chunks (the last ones
// padded with zero rows), each chunk quantized by its own Linear with the max of the chunks' amaxes, the
// chunks "gathered" (laid side by side, as an all-gather leaves them) and assembled, gives every rank the
// weight copies that quantizing the whole weight on one Linear gives, byte for byte, and the same y, dx and
// dw over two steps (the second one with delayed scaling's history); a frozen weight (a LoRA base) sharded
// and quantized once per chunk gives a frozen whole weight's y and dx; plus the refusals.
#include <gtest/gtest.h>
#include <algorithm>
#include "recipe/frozen_test_util.h"

namespace nb::recipe {
namespace {

using namespace testing;

constexpr int64_t kOut = 384, kIn = 256, kTokens = 128;  // multiples of every format's blocks

// The rows of rank `rank`'s chunk, zero past the weight's last row.
std::vector<float> chunk_values(const std::vector<float>& w, int64_t rows_per_rank, int rank) {
  std::vector<float> c(size_t(rows_per_rank * kIn), 0.f);
  for (int64_t i = 0; i < rows_per_rank; ++i) {
    const int64_t row = rank * rows_per_rank + i;
    if (row < kOut) std::copy_n(w.begin() + row * kIn, kIn, c.begin() + i * kIn);
  }
  return c;
}

struct Ranks {
  std::vector<Linear> lin;
  std::vector<std::vector<uint8_t>> windows;
  std::vector<uint8_t> staging;
  int64_t rows_per_rank = 0;
};

// Every rank's chunk quantized with the weight's amax, gathered, assembled and bound.
void quantize_and_gather(Ranks* k, const std::vector<float>& w) {
  const int ranks = int(k->lin.size());
  std::vector<std::vector<float>> chunks;
  float amax = 0.f;
  for (int r = 0; r < ranks; ++r) {
    chunks.push_back(chunk_values(w, k->rows_per_rank, r));
    const Tensor c = Tensor::make(chunks.back().data(), DType::f32, Device::cpu, {k->rows_per_rank, kIn});
    float a = -1.f;
    ASSERT_TRUE(k->lin[size_t(r)].weight_chunk_amax(c, &a, nullptr).is_ok());
    amax = std::max(amax, a);
  }
  const size_t stride = k->lin[0].weight_chunk_bytes();
  k->staging.assign(stride * size_t(ranks), 0xAB);
  for (int r = 0; r < ranks; ++r) {
    const Tensor c = Tensor::make(chunks[size_t(r)].data(), DType::f32, Device::cpu, {k->rows_per_rank, kIn});
    Status st = k->lin[size_t(r)].quantize_weight_chunk(c, &amax, k->staging.data() + size_t(r) * stride, nullptr);
    ASSERT_TRUE(st.is_ok()) << st.message();
  }
  for (int r = 0; r < ranks; ++r) {
    k->windows[size_t(r)].assign(k->lin[size_t(r)].weight_window_bytes(), 0xCD);  // stale bytes must not leak
    Status st = k->lin[size_t(r)].assemble_weight(k->staging.data(), stride, k->windows[size_t(r)].data(), nullptr);
    ASSERT_TRUE(st.is_ok()) << st.message();
    k->lin[size_t(r)].bind_weight(k->windows[size_t(r)].data());
  }
}

void expect_same_copies(const QuantizedBytes& whole, const QuantizedBytes& rank, bool per_tensor) {
  EXPECT_EQ(whole.rows, rank.rows);
  EXPECT_TRUE(whole.row_data == rank.row_data) << "row data differ";
  EXPECT_TRUE(whole.row_scales == rank.row_scales) << "row scales differ";
  EXPECT_EQ(whole.row_amax, rank.row_amax);
  EXPECT_EQ(whole.col_amax, rank.col_amax);
  EXPECT_EQ(whole.scale_inv, rank.scale_inv);
  if (per_tensor) {  // gathered row copy only; the whole one's column copy is its transpose (frozen tests)
    EXPECT_TRUE(rank.col_data.empty());
    return;
  }
  EXPECT_TRUE(whole.col_data == rank.col_data) << "column data differ";
  EXPECT_TRUE(whole.col_scales == rank.col_scales) << "column scales differ";
}

struct Case {
  std::string recipe;
  int ranks;
};

class ShardedWeightTest : public ::testing::TestWithParam<Case> {};

TEST_P(ShardedWeightTest, GatheredCopiesAndGemmsEqualTheWholeWeights) {
  Recipe r;
  ASSERT_TRUE(frozen_recipe(GetParam().recipe, &r).is_ok());
  const int ranks = GetParam().ranks;
  const int64_t blk = weight_block_rows(r.weight.fmt);
  Ranks k;
  k.rows_per_rank = ((kOut + ranks - 1) / ranks + blk - 1) / blk * blk;
  k.lin.resize(size_t(ranks));
  k.windows.resize(size_t(ranks));
  Linear whole;
  ASSERT_TRUE(whole.init(r, false, "whole", 5, kTokens, kIn, kOut, Device::cpu).is_ok());
  for (Linear& l : k.lin) {
    ASSERT_TRUE(l.init(r, false, "rank", 5, kTokens, kIn, kOut, Device::cpu).is_ok());
    Status st = l.set_sharded_weight(k.rows_per_rank, ranks);
    ASSERT_TRUE(st.is_ok()) << st.message();
  }
  const bool per_tensor = r.weight.fmt == Fmt::fp8_e4m3 || r.weight.fmt == Fmt::fp8_e5m2;
  std::vector<float> y0(size_t(kTokens * kOut)), y1 = y0, dx0(size_t(kTokens * kIn)), dx1 = dx0;
  std::vector<float> dw0(size_t(kOut * kIn), 0.f), dw1 = dw0;
  for (uint32_t step = 1; step <= 2; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    // An outlier row in the last real chunk: its amax is the weight's, which every chunk must scale by.
    std::vector<float> w = random_bf16_values(kOut * kIn, 0.05, 40 + step);
    w[size_t((kOut - 3) * kIn + 7)] = 3.5f;
    whole.new_step(step);
    for (Linear& l : k.lin) l.new_step(step);
    quantize_and_gather(&k, w);
    std::vector<float> x = random_bf16_values(kTokens * kIn, 1.0, 70 + step);
    std::vector<float> dy = random_bf16_values(kTokens * kOut, 1e-2, 90 + step);
    const Tensor X = Tensor::make(x.data(), DType::f32, Device::cpu, {kTokens, kIn});
    const Tensor W = Tensor::make(w.data(), DType::f32, Device::cpu, {kOut, kIn});
    const Tensor DY = Tensor::make(dy.data(), DType::f32, Device::cpu, {kTokens, kOut});
    auto t = [](std::vector<float>& v, int64_t a, int64_t b) {
      return Tensor::make(v.data(), DType::f32, Device::cpu, {a, b});
    };
    std::fill(dw0.begin(), dw0.end(), 0.f);
    ASSERT_TRUE(whole.forward(X, W, t(y0, kTokens, kOut), 0.f, nullptr).is_ok());
    ASSERT_TRUE(whole.backward(DY, X, W, t(dx0, kTokens, kIn), 0.f, t(dw0, kOut, kIn), nullptr).is_ok());
    QuantizedBytes ref;
    ASSERT_TRUE(whole.debug_copies(1, &ref).is_ok());
    for (int rank = 0; rank < ranks; ++rank) {
      SCOPED_TRACE("rank " + std::to_string(rank));
      Linear& l = k.lin[size_t(rank)];
      QuantizedBytes mine;
      ASSERT_TRUE(l.debug_copies(1, &mine).is_ok());
      expect_same_copies(ref, mine, per_tensor);
      std::fill(dw1.begin(), dw1.end(), 0.f);
      Status st = l.forward(X, Tensor{}, t(y1, kTokens, kOut), 0.f, nullptr);
      ASSERT_TRUE(st.is_ok()) << st.message();
      st = l.backward(DY, X, Tensor{}, t(dx1, kTokens, kIn), 0.f, t(dw1, kOut, kIn), nullptr);
      ASSERT_TRUE(st.is_ok()) << st.message();
      EXPECT_TRUE(y0 == y1) << "y differs";
      EXPECT_TRUE(dx0 == dx1) << "dx differs";
      EXPECT_TRUE(dw0 == dw1) << "dw differs";
    }
  }
  for (Linear& l : k.lin) l.bind_weight(nullptr);
  std::vector<float> x(size_t(kTokens * kIn), 0.f);
  Status st = k.lin[0].forward(Tensor::make(x.data(), DType::f32, Device::cpu, {kTokens, kIn}), Tensor{},
                               Tensor::make(y1.data(), DType::f32, Device::cpu, {kTokens, kOut}), 0.f, nullptr);
  EXPECT_FALSE(st.is_ok()) << "an unbound sharded weight ran its forward";
}

std::vector<Case> cases() {
  std::vector<Case> out;
  std::vector<std::string> names = frozen_recipe_names();
  names.push_back("bf16_with_fp8_delayed_scaling_mixed");
  for (const std::string& n : names) {
    Recipe r;
    if (!frozen_recipe(n, &r).is_ok() || !r.quantized()) continue;
    if (r.weight.fmt == Fmt::fp8_block128) continue;  // refused (see below)
    if (r.mor.on) continue;  // MoR decides from the whole weight: refused (LinearMor.WhatItCannotServeIsRefused)
    for (int ranks : {2, 3, 4}) out.push_back({n, ranks});
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Recipes, ShardedWeightTest, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           std::string s = info.param.recipe + "_" + std::to_string(info.param.ranks) + "ranks";
                           std::replace(s.begin(), s.end(), '+', '_');
                           return s;
                         });

TEST(ShardedWeight, Refusals) {
  Recipe bf16, fp4;
  ASSERT_TRUE(recipe_preset("bf16_mixed", &bf16).is_ok());
  ASSERT_TRUE(recipe_preset("bf16_with_nvfp4_mixed", &fp4).is_ok());
  Linear a, b, c;
  ASSERT_TRUE(a.init(bf16, false, "a", 1, kTokens, kIn, kOut, Device::cpu).is_ok());
  EXPECT_FALSE(a.set_sharded_weight(192, 2).is_ok()) << "a BF16 layer has no quantized weight";
  ASSERT_TRUE(b.init(fp4, false, "b", 2, kTokens, kIn, kOut, Device::cpu).is_ok());
  EXPECT_FALSE(b.set_sharded_weight(100, 4).is_ok()) << "100 rows are not whole 16-row tiles";
  EXPECT_FALSE(b.set_sharded_weight(64, 4).is_ok()) << "4 x 64 rows do not cover 384";
  EXPECT_TRUE(b.set_sharded_weight(96, 4).is_ok());
  ASSERT_TRUE(c.init(fp4, false, "c", 3, kTokens, kIn, kOut, Device::cpu, nullptr, true).is_ok());
  EXPECT_TRUE(c.set_sharded_weight(96, 4).is_ok()) << "a frozen weight (a LoRA base) is sharded too";
  EXPECT_FALSE(b.set_fprop_bf16(true).is_ok()) << "a sharded weight has no BF16 copy for Fprop";
  std::vector<float> chunk(size_t(96 * kIn), 0.f);
  const float amax = 1.f;
  EXPECT_FALSE(
      b.freeze_weight_chunk(Tensor::make(chunk.data(), DType::f32, Device::cpu, {96, kIn}), &amax, nullptr).is_ok())
      << "a trained weight is quantized at each gather, not frozen";
}

// A LoRA base under Megatron-FSDP: each rank freezes its chunk once (the whole weight's amax), the chunks are
// gathered and assembled each time, and Fprop and Dgrad equal a frozen Linear holding the whole weight.
TEST(ShardedWeight, FrozenChunksGiveTheWholeFrozenWeight) {
  for (const std::string& name : frozen_recipe_names()) {
    SCOPED_TRACE(name);
    Recipe r;
    ASSERT_TRUE(frozen_recipe(name, &r).is_ok());
    if (!r.quantized() || r.weight.fmt == Fmt::fp8_block128 || r.mor.on) continue;
    const int ranks = 3;
    const int64_t rows = 128;  // 3 x 128 rows cover 384 in whole blocks of every format
    std::vector<float> w = random_bf16_values(kOut * kIn, 0.05, 7), x = random_bf16_values(kTokens * kIn, 1.0, 8);
    std::vector<float> dy = random_bf16_values(kTokens * kOut, 1e-2, 9);
    auto t = [](std::vector<float>& v, int64_t a, int64_t b) {
      return Tensor::make(v.data(), DType::f32, Device::cpu, {a, b});
    };
    Linear whole;
    std::vector<Linear> lin(ranks);
    ASSERT_TRUE(whole.init(r, false, "whole", 5, kTokens, kIn, kOut, Device::cpu, nullptr, true).is_ok());
    ASSERT_TRUE(whole.freeze_weight(t(w, kOut, kIn), nullptr).is_ok());
    float amax = 0.f;
    for (int k = 0; k < ranks; ++k) {
      ASSERT_TRUE(lin[size_t(k)].init(r, false, "rank", 5, kTokens, kIn, kOut, Device::cpu, nullptr, true).is_ok());
      ASSERT_TRUE(lin[size_t(k)].set_sharded_weight(rows, ranks).is_ok());
      std::vector<float> c = chunk_values(w, rows, k);
      float a = 0.f;
      ASSERT_TRUE(lin[size_t(k)].weight_chunk_amax(t(c, rows, kIn), &a, nullptr).is_ok());
      amax = std::max(amax, a);
    }
    const size_t stride = lin[0].weight_chunk_bytes();
    std::vector<uint8_t> staging(stride * ranks), window(lin[0].weight_window_bytes());
    for (int k = 0; k < ranks; ++k) {
      std::vector<float> c = chunk_values(w, rows, k);
      ASSERT_TRUE(lin[size_t(k)].freeze_weight_chunk(t(c, rows, kIn), &amax, nullptr).is_ok());
      std::copy_n(lin[size_t(k)].frozen_chunk(), stride, staging.begin() + std::ptrdiff_t(size_t(k) * stride));
    }
    std::vector<float> y0(size_t(kTokens * kOut)), y1 = y0, dx0(size_t(kTokens * kIn)), dx1 = dx0;
    ASSERT_TRUE(whole.forward(t(x, kTokens, kIn), Tensor{}, t(y0, kTokens, kOut), 0.f, nullptr).is_ok());
    ASSERT_TRUE(
        whole.backward(t(dy, kTokens, kOut), Tensor{}, Tensor{}, t(dx0, kTokens, kIn), 0.f, Tensor{}, nullptr).is_ok());
    Linear& mine = lin[1];
    ASSERT_TRUE(mine.assemble_weight(staging.data(), stride, window.data(), nullptr).is_ok());
    mine.bind_weight(window.data());
    Status st = mine.forward(t(x, kTokens, kIn), Tensor{}, t(y1, kTokens, kOut), 0.f, nullptr);
    ASSERT_TRUE(st.is_ok()) << st.message();
    st = mine.backward(t(dy, kTokens, kOut), Tensor{}, Tensor{}, t(dx1, kTokens, kIn), 0.f, Tensor{}, nullptr);
    ASSERT_TRUE(st.is_ok()) << st.message();
    EXPECT_TRUE(y0 == y1) << "y differs";
    EXPECT_TRUE(dx0 == dx1) << "dx differs";
  }
}

}  // namespace
}  // namespace nb::recipe
