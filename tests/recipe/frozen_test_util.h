// Shared by the frozen-Linear tests (CPU and GPU).
//   run_frozen_chain   the three Linears of workspace_test_util.h's chain, in a model's call order over
//                      2 steps x 2 micro-batches, trained (the reference) or frozen: the frozen Linears get
//                      freeze_weight(w) once, then w = x = dw = Tensor{} (one backward gets a sentinel dw,
//                      which must stay as is). The weights do not change between steps, so a frozen chain
//                      must give the trained chain's y and dx bit for bit.
//   run_frozen_single  one frozen Linear, one micro-batch (run_linear's frozen twin), with its copies.
//   check_frozen_run   Fprop and Dgrad of a frozen run against the FP64 model on its own quantized operands.
#pragma once
#include <gtest/gtest.h>
#include <memory>
#include <string>
#include <vector>
#include "recipe/workspace_test_util.h"

namespace nb::recipe::testing {

// The presets a frozen Linear runs (delayed scaling is refused at init), plus NVFP4 with 1D weights (the
// knob), whose frozen weight keeps both copies.
inline std::vector<std::string> frozen_recipe_names() {
  std::vector<std::string> names;
  for (const std::string& n : recipe_names())
    // Delayed scaling cannot follow a frozen weight; MoR's ladder refuses frozen weights (linear_mor_test.cpp).
    if (n != "bf16_with_fp8_delayed_scaling_mixed" && n != "bf16_with_mor_nvfp4_mixed") names.push_back(n);
  names.push_back("bf16_with_nvfp4_mixed+1d_weight");
  return names;
}

inline Status frozen_recipe(const std::string& name, Recipe* r) {
  const std::string suffix = "+1d_weight";
  const bool one_d = name.size() > suffix.size() && name.substr(name.size() - suffix.size()) == suffix;
  NB_TRY(recipe_preset(one_d ? name.substr(0, name.size() - suffix.size()) : name, r));
  r->seed = 0xf00d;
  if (!one_d) return Status::ok();
  RecipeKnobs k;
  k.fp4_disable_2d = true;
  return apply_knobs(k, r);
}

struct FrozenChainRun {
  std::vector<std::vector<double>> y, dx;                    // in the order produced
  std::vector<std::shared_ptr<LinearWorkspace>> workspaces;  // the Linears' (one object when shared)
  std::vector<size_t> linear_bytes;
  std::vector<QuantizedBytes> weight;  // each Linear's weight copies (quantized recipes)
  bool dw_untouched = true;            // frozen: the sentinel dw kept its values
};

inline Status run_frozen_chain(const Recipe& r, Device dev, bool frozen, bool shared, FrozenChainRun* out) {
  const bool cuda = dev == Device::cuda;
  const DType act = cuda ? DType::bf16 : DType::f32;
  const int64_t m = kChainTokens;
  std::shared_ptr<LinearWorkspace> ws = shared ? std::make_shared<LinearWorkspace>(dev) : nullptr;
  Linear lin[3];
  Buffer w[3], dw[3], act_in[4], grad[4];  // as run_chain: act_in[l] is x of Linear l, grad[l] dy of l-1
  std::vector<float> sentinel;
  for (int l = 0; l < 3; ++l) {
    const int64_t in = kChain[l].in, o = kChain[l].out;
    NB_TRY(lin[l].init(r, false, "chain." + std::to_string(l), uint32_t(11 + l), m, in, o, dev, ws, frozen));
    NB_TRY(upload_values(&w[l], random_bf16_values(o * in, 0.05, 100 + uint32_t(l)), o, in, dev));
    sentinel.assign(size_t(o * in), 7.f);
    NB_TRY(Buffer::allocate(&dw[l], DType::f32, dev, {o, in}));
    NB_TRY(copy_bytes(dw[l].data(), dev, sentinel.data(), Device::cpu, sentinel.size() * 4));
    NB_TRY(Buffer::allocate(&act_in[l + 1], act, dev, {m, o}));
    NB_TRY(Buffer::allocate(&grad[l], act, dev, {m, in}));
  }
  if (shared) NB_TRY(ws->allocate());
  const bool quantized = r.quantized();
  if (frozen && quantized)
    for (int l = 0; l < 3; ++l) NB_TRY(lin[l].freeze_weight(w[l].tensor(), nullptr));
  auto w_arg = [&](int l) { return frozen && quantized ? Tensor{} : w[l].tensor(); };
  for (uint32_t step = 0; step < 2; ++step) {
    for (Linear& li : lin) li.new_step(7 + step);
    for (uint32_t micro = 0; micro < 2; ++micro) {
      const uint32_t seed = 1000 + 10 * step + micro;
      NB_TRY(upload_values(&act_in[0], random_bf16_values(m * kChain[0].in, 1.0, seed), m, kChain[0].in, dev));
      for (int l = 0; l < 3; ++l) {
        NB_TRY(lin[l].forward(act_in[l].tensor(), w_arg(l), act_in[l + 1].tensor(), 0.f, nullptr));
        out->y.emplace_back();
        NB_TRY(download_values(act_in[l + 1], &out->y.back()));
      }
      NB_TRY(upload_values(&grad[3], random_bf16_values(m * kChain[2].out, 1e-3, seed + 500), m, kChain[2].out, dev));
      for (int l = 2; l >= 0; --l) {
        const bool sentinel_call = step == 1 && micro == 0;  // frozen: a non-empty dw is ignored too
        const Tensor x_arg = frozen ? Tensor{} : act_in[l].tensor();
        const Tensor dw_arg = !frozen || sentinel_call ? dw[l].tensor() : Tensor{};
        NB_TRY(lin[l].backward(grad[l + 1].tensor(), x_arg, w_arg(l), grad[l].tensor(), 0.f, dw_arg, nullptr));
        out->dx.emplace_back();
        NB_TRY(download_values(grad[l], &out->dx.back()));
      }
    }
  }
  if (cuda) device_synchronize();
  for (int l = 0; l < 3; ++l) {
    out->workspaces.push_back(lin[l].workspace());
    out->linear_bytes.push_back(lin[l].bytes());
    out->weight.emplace_back();
    if (quantized) NB_TRY(lin[l].debug_copies(1, &out->weight.back()));
    std::vector<double> got;
    NB_TRY(download_values(dw[l], &got));
    if (frozen)
      for (double v : got) out->dw_untouched &= v == 7.0;
  }
  return Status::ok();
}

// One frozen Linear on dev: freeze_weight(w), forward(x), backward(dy) with beta = 0 and every ignored
// argument empty. Fills y, dx, q (quantized recipes) and health; dw stays empty.
inline Status run_frozen_single(const Recipe& r, Device dev, int64_t m, int64_t k, int64_t n,
                                const std::vector<float>& x, const std::vector<float>& w, const std::vector<float>& dy,
                                LinearRun* out) {
  const DType act = dev == Device::cuda ? DType::bf16 : DType::f32;
  Buffer bx, bw, bdy, by, bdx;
  NB_TRY(upload_values(&bx, x, m, k, dev));
  NB_TRY(upload_values(&bw, w, n, k, dev));
  NB_TRY(upload_values(&bdy, dy, m, n, dev));
  NB_TRY(Buffer::allocate(&by, act, dev, {m, n}));
  NB_TRY(Buffer::allocate(&bdx, act, dev, {m, k}));
  Linear lin;
  NB_TRY(lin.init(r, false, "test", 7, m, k, n, dev, nullptr, /*frozen=*/true));
  const bool quantized = r.quantized();
  if (quantized) NB_TRY(lin.freeze_weight(bw.tensor(), nullptr));
  const Tensor w_arg = quantized ? Tensor{} : bw.tensor();
  lin.new_step(3);
  NB_TRY(lin.forward(bx.tensor(), w_arg, by.tensor(), 0.f, nullptr));
  NB_TRY(lin.backward(bdy.tensor(), Tensor{}, w_arg, bdx.tensor(), 0.f, Tensor{}, nullptr));
  if (dev == Device::cuda) device_synchronize();
  NB_TRY(download_values(by, &out->y));
  NB_TRY(download_values(bdx, &out->dx));
  if (quantized)
    for (int i = 0; i < 3; ++i) NB_TRY(lin.debug_copies(i, &out->q[i]));
  return lin.take_health(&out->health);
}

// check_run without Wgrad: Fprop on the input and weight row copies, Dgrad on the grad row copy and the
// weight's column operand (a frozen per-tensor FP8 or 2D NVFP4 weight has no column copy: its row copy
// transposed). Returns the larger relative distance of the two references to the unquantized products.
inline double check_frozen_run(const Recipe& r, Device dev, int64_t m, int64_t k, int64_t n,
                               const std::vector<float>& x, const std::vector<float>& w, const std::vector<float>& dy,
                               const LinearRun& run) {
  std::vector<double> xd = to_double(x), wd = to_double(w), dyd = to_double(dy), wt = transpose(wd, n, k);
  std::vector<double> ey, edx, mag, ref;
  product_nt(xd, wd, m, n, k, &ey, &mag);
  product_nt(dyd, wt, m, k, n, &edx, &mag);
  std::vector<double> a_y = xd, b_y = wd, a_dx = dyd, b_dx = wt;
  if (r.quantized()) {
    a_y = dequant_copy(run.q[0], false);
    b_y = dequant_copy(run.q[1], false);
    a_dx = dequant_copy(run.q[2], false);
    b_dx = run.q[1].col_data.empty() ? transpose(dequant_copy(run.q[1], false), n, k) : dequant_copy(run.q[1], true);
  }
  const bool cuda = dev == Device::cuda;
  const bool per_tensor = r.input.fmt == Fmt::fp8_e4m3;
  const bool fp8 = cuda && (per_tensor || r.input.fmt == Fmt::fp8_block128);
  const bool fp64 = !cuda && r.quantized();
  product_nt(a_y, b_y, m, n, k, &ref, &mag);
  double worst = expect_close("Fprop", run.y, ref, mag, k, {fp64, cuda && per_tensor, cuda, fp8 && !per_tensor}, ey);
  product_nt(a_dx, b_dx, m, k, n, &ref, &mag);
  return std::max(worst, expect_close("Dgrad", run.dx, ref, mag, n, {fp64, false, cuda, fp8}, edx));
}

// The bytes one column-wise copy of a [rows, cols] source takes in format f (data + scales).
inline size_t col_copy_bytes(Fmt f, int64_t rows, int64_t cols) {
  const size_t n = size_t(rows * cols);
  switch (f) {
    case Fmt::fp8_e4m3:
    case Fmt::fp8_e5m2: return n;
    case Fmt::fp8_block128: return n + 4 * size_t(fp8::block_scale_count(fp8::BlockKind::vec128, rows, cols, true));
    case Fmt::fp8_block128x128:
      return n + 4 * size_t(fp8::block_scale_count(fp8::BlockKind::blk128x128, rows, cols, true));
    case Fmt::mxfp8: return n + n / 32;
    case Fmt::nvfp4: return n / 2 + n / 16;
    case Fmt::bf16:
    case Fmt::mor_block: return 0;  // its one BF16 copy serves both ways
  }
  return 0;
}

}  // namespace nb::recipe::testing
