// Shared by the LinearWorkspace tests (CPU and GPU): a chain of three Linears of different shapes run in a
// model's order -- forward A, B, C, then backward C, B, A -- over 2 steps of 2 micro-batches each, with
// the outputs of one feeding the next (y of A is x of B, dx of C is dy of B). The chain runs with one
// workspace shared by the three, or with a private workspace each; every y, dx and dw is recorded so the
// two can be compared bit for bit.
//   A [in 256, out 128]  B [in 128, out 384]  C [in 384, out 256], M = 128 tokens (every preset's multiple)
// The largest input-row need is C's, the largest grad need B's: the shared slots come from different Linears.
#pragma once
#include <gtest/gtest.h>
#include <cstring>
#include <memory>
#include <string>
#include <vector>
#include "recipe/recipe_test_util.h"

namespace nb::recipe::testing {

struct ChainShape {
  int64_t in, out;
};
inline constexpr int64_t kChainTokens = 128;
inline constexpr ChainShape kChain[3] = {{256, 128}, {128, 384}, {384, 256}};

struct ChainRun {
  std::vector<std::vector<double>> y, dx, dw;                // in the order produced
  std::vector<std::shared_ptr<LinearWorkspace>> workspaces;  // the Linears' (one object when shared)
  std::vector<size_t> linear_bytes;
};

inline Status upload_values(Buffer* b, const std::vector<float>& v, int64_t rows, int64_t cols, Device dev) {
  const bool cuda = dev == Device::cuda;
  NB_TRY(Buffer::allocate(b, cuda ? DType::bf16 : DType::f32, dev, {rows, cols}));
  if (!cuda) return copy_bytes(b->data(), dev, v.data(), Device::cpu, v.size() * 4);
  std::vector<bf16> h(v.size());
  for (size_t i = 0; i < v.size(); ++i) h[i] = f32_to_bf16(v[i]);
  return copy_bytes(b->data(), dev, h.data(), Device::cpu, h.size() * 2);
}

inline Status download_values(const Buffer& b, std::vector<double>* v) {
  const Tensor& t = b.tensor();
  v->resize(size_t(t.numel()));
  if (t.dtype == DType::f32) {
    std::vector<float> h(v->size());
    NB_TRY(copy_bytes(h.data(), Device::cpu, b.data(), t.device, h.size() * 4));
    std::copy(h.begin(), h.end(), v->begin());
  } else {
    std::vector<bf16> h(v->size());
    NB_TRY(copy_bytes(h.data(), Device::cpu, b.data(), t.device, h.size() * 2));
    for (size_t i = 0; i < h.size(); ++i) (*v)[i] = bf16_to_f32(h[i]);
  }
  return Status::ok();
}

// shared: one workspace for the three Linears (allocate() after the inits when call_allocate; else the
// first quantization allocates it); otherwise each Linear makes its own.
inline Status run_chain(const Recipe& r, Device dev, bool shared, bool call_allocate, ChainRun* out) {
  const bool cuda = dev == Device::cuda;
  const DType act = cuda ? DType::bf16 : DType::f32;
  const int64_t m = kChainTokens;
  std::shared_ptr<LinearWorkspace> ws = shared ? std::make_shared<LinearWorkspace>(dev) : nullptr;
  Linear lin[3];
  Buffer w[3], dw[3], act_in[4], grad[4];  // act_in[l]: x of Linear l (act_in[3]: y of C); grad[l]: dy of l-1
  for (int l = 0; l < 3; ++l) {
    NB_TRY(
        lin[l].init(r, false, "chain." + std::to_string(l), uint32_t(11 + l), m, kChain[l].in, kChain[l].out, dev, ws));
    NB_TRY(Buffer::allocate(&dw[l], DType::f32, dev, {kChain[l].out, kChain[l].in}));
    NB_TRY(Buffer::allocate(&act_in[l + 1], act, dev, {m, kChain[l].out}));
    NB_TRY(Buffer::allocate(&grad[l], act, dev, {m, kChain[l].in}));
  }
  if (shared && call_allocate) NB_TRY(ws->allocate());
  for (uint32_t step = 0; step < 2; ++step) {
    for (int l = 0; l < 3; ++l) {
      const int64_t n = kChain[l].out * kChain[l].in;
      NB_TRY(upload_values(&w[l], random_bf16_values(n, 0.05, 100 + 10 * step + uint32_t(l)), kChain[l].out,
                           kChain[l].in, dev));
      std::vector<float> zeros(size_t(n), 0.f);
      NB_TRY(copy_bytes(dw[l].data(), dev, zeros.data(), Device::cpu, zeros.size() * 4));
      lin[l].new_step(7 + step);
    }
    for (uint32_t micro = 0; micro < 2; ++micro) {
      const uint32_t seed = 1000 + 10 * step + micro;
      NB_TRY(upload_values(&act_in[0], random_bf16_values(m * kChain[0].in, 1.0, seed), m, kChain[0].in, dev));
      for (int l = 0; l < 3; ++l) {
        NB_TRY(lin[l].forward(act_in[l].tensor(), w[l].tensor(), act_in[l + 1].tensor(), 0.f, nullptr));
        out->y.emplace_back();
        NB_TRY(download_values(act_in[l + 1], &out->y.back()));
      }
      NB_TRY(upload_values(&grad[3], random_bf16_values(m * kChain[2].out, 1e-3, seed + 500), m, kChain[2].out, dev));
      for (int l = 2; l >= 0; --l) {
        NB_TRY(lin[l].backward(grad[l + 1].tensor(), act_in[l].tensor(), w[l].tensor(), grad[l].tensor(), 0.f,
                               dw[l].tensor(), nullptr));
        out->dx.emplace_back();
        NB_TRY(download_values(grad[l], &out->dx.back()));
      }
    }
    for (int l = 0; l < 3; ++l) {
      out->dw.emplace_back();
      NB_TRY(download_values(dw[l], &out->dw.back()));
    }
  }
  if (cuda) device_synchronize();
  for (int l = 0; l < 3; ++l) {
    out->workspaces.push_back(lin[l].workspace());
    out->linear_bytes.push_back(lin[l].bytes());
  }
  return Status::ok();
}

// Bitwise equality (the same numbers through the same kernels: no tolerance), and outputs that are not
// all zero (a chain that silently produced nothing would compare equal).
inline void expect_bit_identical(const char* what, const std::vector<std::vector<double>>& a,
                                 const std::vector<std::vector<double>>& b) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t t = 0; t < a.size(); ++t) {
    ASSERT_EQ(a[t].size(), b[t].size()) << what << " #" << t;
    int64_t differ = 0, nonzero = 0;
    for (size_t i = 0; i < a[t].size(); ++i) {
      differ += std::memcmp(&a[t][i], &b[t][i], sizeof(double)) != 0;
      nonzero += a[t][i] != 0;
    }
    EXPECT_EQ(differ, 0) << what << " #" << t << ": " << differ << " elements differ";
    EXPECT_GT(nonzero, 0) << what << " #" << t << " is all zero";
  }
}

// Every quantized preset, and MoR's block rule as "bf16_with_mor_fp8_mixed:block" (preset_or_block reads it).
inline std::vector<std::string> quantized_recipe_names() {
  std::vector<std::string> names;
  for (const std::string& n : recipe_names()) {
    Recipe r;
    if (recipe_preset(n, &r).is_ok() && r.quantized()) names.push_back(n);
  }
  names.push_back("bf16_with_mor_fp8_mixed:block");
  return names;
}

inline Status preset_or_block(const std::string& name, Recipe* r) {
  const size_t colon = name.find(':');
  NB_TRY(recipe_preset(name.substr(0, colon), r));
  if (colon == std::string::npos) return Status::ok();
  RecipeKnobs k;
  k.mor_granularity = name.substr(colon + 1);
  return apply_knobs(k, r);
}

}  // namespace nb::recipe::testing
