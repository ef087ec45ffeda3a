// CPU tests of recipe::Linear's quantized input gather (linear.h, sequence parallelism): an input X [M, K] spread
// over T ranks by tokens, each rank's Linear quantizing its rows with the whole tensor's amax and "gathering"
// every rank's chunk (a fake group standing for the all-gather), must hold the copies one Linear's quantization of
// the whole X gives, byte for byte, and compute the same Fprop y, Dgrad dx and Wgrad dw; the same for an output
// gradient dY spread by tokens (NVFP4's SR included); formats a chunk cannot reproduce (1x128 FP8 blocks) and a
// BF16 layer report no gather (they gather BF16).
#include <gtest/gtest.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include "recipe/frozen_test_util.h"

namespace nb::recipe {
namespace {

using namespace testing;

constexpr int64_t kGIn = 256, kGOut = 192, kGTokens = 128;

// One process stands for T ranks that run at once: pass 0 records every rank's amaxes, pass 1 hands back their
// MAX and records every rank's chunk (quantized with it), pass 2 hands back both.
struct FakeRanks {
  int ranks = 1;
  int pass = 0;
  std::vector<std::vector<float>> amaxes;  // per rank, the values max() was given (in call order)
  std::vector<std::vector<uint8_t>> chunks;
  int rank = 0;  // whose call this is
  size_t amax_calls = 0;
};

class FakeAmax : public AmaxGroup {
 public:
  explicit FakeAmax(FakeRanks* k) : k_(k) {}
  Status max(float* v, int n, Stream) override {
    auto& mine = k_->amaxes[size_t(k_->rank)];
    if (k_->pass == 0) {
      mine.insert(mine.end(), v, v + n);
      return Status::ok();
    }
    for (int i = 0; i < n; ++i) {  // the MAX over every rank's same call
      float m = 0;
      for (const auto& a : k_->amaxes) m = std::max(m, a[k_->amax_calls + size_t(i)]);
      v[i] = m;
    }
    k_->amax_calls += size_t(n);
    return Status::ok();
  }

 private:
  FakeRanks* k_;
};

class FakeBytes : public ByteGroup {
 public:
  explicit FakeBytes(FakeRanks* k) : k_(k) {}
  int rank() const override { return k_->rank; }
  int size() const override { return k_->ranks; }
  Status all_gather(const uint8_t* local, size_t bytes, uint8_t* gathered, Stream) override {
    if (k_->pass < 2) {
      k_->chunks[size_t(k_->rank)].assign(local, local + bytes);
      std::memset(gathered, 0xEE, bytes * size_t(k_->ranks));
      return Status::ok();
    }
    for (int r = 0; r < k_->ranks; ++r) {
      if (k_->chunks[size_t(r)].size() != bytes) return errorf("chunk sizes differ");
      std::memcpy(gathered + size_t(r) * bytes, k_->chunks[size_t(r)].data(), bytes);
    }
    return Status::ok();
  }

 private:
  FakeRanks* k_;
};

Tensor cpu_tensor(std::vector<float>& v, int64_t rows, int64_t cols) {
  return Tensor::make(v.data(), DType::f32, Device::cpu, {rows, cols});
}

struct RunOut {
  std::vector<float> y, dx, dw;
  QuantizedBytes input, grad;
};

// Fprop, Dgrad and Wgrad of one micro-batch; x_rows / dy_rows: the rows this Linear is given (this rank's, when
// it gathers that role).
Status run_one(Linear& lin, std::vector<float>& x_rows, std::vector<float>& w, std::vector<float>& dy_rows,
               RunOut* out) {
  out->y.assign(size_t(kGTokens * kGOut), 0.f);
  out->dx.assign(size_t(kGTokens * kGIn), 0.f);
  out->dw.assign(size_t(kGOut * kGIn), 0.f);
  const Tensor wt = cpu_tensor(w, kGOut, kGIn), y = cpu_tensor(out->y, kGTokens, kGOut);
  const int64_t x_rows_n = int64_t(x_rows.size()) / kGIn, dy_rows_n = int64_t(dy_rows.size()) / kGOut;
  const Tensor x = cpu_tensor(x_rows, x_rows_n, kGIn), dy = cpu_tensor(dy_rows, dy_rows_n, kGOut);
  NB_TRY(x_rows_n < kGTokens ? lin.forward_gathered(x, wt, y, 0.f, nullptr) : lin.forward(x, wt, y, 0.f, nullptr));
  NB_TRY(lin.debug_copies(0, &out->input));
  const Tensor dx = cpu_tensor(out->dx, kGTokens, kGIn), dw = cpu_tensor(out->dw, kGOut, kGIn);
  if (dy_rows_n < kGTokens)
    NB_TRY(lin.backward_gathered(dy, dx, 0.f, dw, nullptr));
  else
    NB_TRY(lin.backward(dy, x_rows_n < kGTokens ? Tensor{} : x, wt, dx, 0.f, dw, nullptr));
  return lin.debug_copies(2, &out->grad);
}

void expect_same(const QuantizedBytes& got, const QuantizedBytes& ref, const char* role) {
  EXPECT_EQ(got.rows, ref.rows) << role;
  EXPECT_TRUE(got.row_data == ref.row_data) << role << " row data";
  EXPECT_TRUE(got.row_scales == ref.row_scales) << role << " row scales";
  EXPECT_TRUE(got.col_data == ref.col_data) << role << " column data";
  EXPECT_TRUE(got.col_scales == ref.col_scales) << role << " column scales";
  EXPECT_EQ(got.row_amax, ref.row_amax) << role;
  EXPECT_EQ(got.col_amax, ref.col_amax) << role;
  EXPECT_EQ(got.scale_inv, ref.scale_inv) << role;
}

// role 0 gathers the input (a column-parallel Linear), 2 the output gradient (a row-parallel one).
void run_gathered(const std::string& name, int ranks, int role) {
  Recipe r;
  ASSERT_TRUE(recipe_preset(name, &r).is_ok());
  r.seed = 0xbeef;
  std::vector<float> x = random_bf16_values(kGTokens * kGIn, 1.0, 5), w = random_bf16_values(kGOut * kGIn, 0.05, 6),
                     dy = random_bf16_values(kGTokens * kGOut, 1e-3, 7);
  x[17] = 40.f;  // outliers in one rank's rows: the others must scale by them too
  dy[kGTokens * kGOut - 5] = 0.5f;
  Linear whole;
  ASSERT_TRUE(whole.init(r, false, "whole", 3, kGTokens, kGIn, kGOut, Device::cpu).is_ok());
  RunOut ref;
  Status st = run_one(whole, x, w, dy, &ref);
  ASSERT_TRUE(st.is_ok()) << st.message();
  FakeRanks k;
  k.ranks = ranks;
  k.amaxes.resize(size_t(ranks));
  k.chunks.resize(size_t(ranks));
  FakeAmax amax(&k);
  FakeBytes bytes(&k);
  const int64_t rows = kGTokens / ranks;
  for (int pass : {0, 1, 2}) {
    k.pass = pass;
    for (int rank = 0; rank < ranks; ++rank) {
      k.rank = rank;
      k.amax_calls = 0;
      Linear lin;
      ASSERT_TRUE(lin.init(r, false, "whole", 3, kGTokens, kGIn, kGOut, Device::cpu).is_ok());
      std::vector<float> mx = x, mdy = dy;
      if (role == 0) {
        lin.set_amax_groups(&amax, nullptr, nullptr);
        lin.set_input_gather(&bytes);
        ASSERT_TRUE(lin.gathers_quantized_input());
        mx.assign(x.begin() + rank * rows * kGIn, x.begin() + (rank + 1) * rows * kGIn);
      } else {
        lin.set_amax_groups(nullptr, nullptr, &amax);
        lin.set_grad_gather(&bytes);
        ASSERT_TRUE(lin.gathers_quantized_grad());
        mdy.assign(dy.begin() + rank * rows * kGOut, dy.begin() + (rank + 1) * rows * kGOut);
      }
      RunOut got;
      st = run_one(lin, mx, w, mdy, &got);
      ASSERT_TRUE(st.is_ok()) << st.message();
      if (pass < 2) continue;
      SCOPED_TRACE("rank " + std::to_string(rank));
      expect_same(got.input, ref.input, "input");
      expect_same(got.grad, ref.grad, "grad");
      EXPECT_TRUE(got.y == ref.y) << "Fprop";
      EXPECT_TRUE(got.dx == ref.dx) << "Dgrad";
      EXPECT_TRUE(got.dw == ref.dw) << "Wgrad";
    }
  }
}

class LinearGather : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

TEST_P(LinearGather, InputChunksGiveTheWholeTensorsCopiesAndGemms) {
  run_gathered(std::get<0>(GetParam()), std::get<1>(GetParam()), 0);
}

// The output gradient: NVFP4's stochastic rounding (the preset's gradients) draws at each element's place in the
// whole dY, so its chunks reproduce one GPU's random bytes too.
TEST_P(LinearGather, GradientChunksGiveTheWholeTensorsCopiesAndGemms) {
  run_gathered(std::get<0>(GetParam()), std::get<1>(GetParam()), 2);
}

INSTANTIATE_TEST_SUITE_P(
    Formats, LinearGather,
    ::testing::Combine(::testing::Values("bf16_with_fp8_current_scaling_mixed", "bf16_with_fp8_delayed_scaling_mixed",
                                         "bf16_with_mxfp8_mixed", "bf16_with_nvfp4_mixed"),
                       ::testing::Values(2, 4)),
    [](const auto& info) { return std::get<0>(info.param) + "_" + std::to_string(std::get<1>(info.param)) + "ranks"; });

TEST(LinearGatherRefusals, ChunksThatCannotReproduceTheWholeGatherBf16) {
  Recipe sub, nvfp4, bf16;
  ASSERT_TRUE(recipe_preset("bf16_with_fp8_subchannel_scaling_mixed", &sub).is_ok());
  ASSERT_TRUE(recipe_preset("bf16_with_nvfp4_mixed", &nvfp4).is_ok());
  ASSERT_TRUE(recipe_preset("bf16_mixed", &bf16).is_ok());
  EXPECT_EQ(Linear::input_gather_bytes(sub, false, kGTokens, kGIn, 2), 0u) << "1x128 blocks: scales along tokens";
  EXPECT_EQ(Linear::input_gather_bytes(bf16, false, kGTokens, kGIn, 2), 0u);
  EXPECT_EQ(Linear::input_gather_bytes(nvfp4, true, kGTokens, kGIn, 2), 0u) << "a BF16 layer";
  EXPECT_EQ(Linear::input_gather_bytes(nvfp4, false, 48, kGIn, 2), 0u) << "24 tokens per rank: not whole blocks";
  EXPECT_EQ(Linear::input_gather_bytes(nvfp4, false, kGTokens, kGIn, 1), 0u) << "one rank";
  EXPECT_EQ(Linear::grad_gather_bytes(sub, false, kGTokens, kGOut, 2), 0u);
  EXPECT_GT(Linear::grad_gather_bytes(nvfp4, false, kGTokens, kGOut, 2), 0u) << "SR gradients gather quantized";
  // NVFP4 at T = 2: each rank's chunk holds both copies at 0.5 + 1/16 bytes per element.
  const size_t chunk = size_t(kGTokens / 2 * kGIn) * 9 / 8;
  EXPECT_EQ(Linear::input_gather_bytes(nvfp4, false, kGTokens, kGIn, 2), 3 * chunk);
  // A Linear with a gather that collects statistics gathers BF16 (their Wgrad error reads the whole X).
  Linear lin;
  ASSERT_TRUE(lin.init(nvfp4, false, "l", 1, kGTokens, kGIn, kGOut, Device::cpu).is_ok());
  FakeRanks k;
  k.ranks = 2;
  FakeBytes bytes(&k);
  lin.set_input_gather(&bytes);
  EXPECT_TRUE(lin.gathers_quantized_input());
  lin.set_collect_stats(true);
  EXPECT_FALSE(lin.gathers_quantized_input());
  std::vector<float> x(size_t(kGTokens / 2 * kGIn), 1.f), w(size_t(kGOut * kGIn), 0.f), y(size_t(kGTokens * kGOut));
  const Status st = lin.forward_gathered(cpu_tensor(x, kGTokens / 2, kGIn), cpu_tensor(w, kGOut, kGIn),
                                         cpu_tensor(y, kGTokens, kGOut), 0.f, nullptr);
  EXPECT_FALSE(st.is_ok());
}

}  // namespace
}  // namespace nb::recipe
