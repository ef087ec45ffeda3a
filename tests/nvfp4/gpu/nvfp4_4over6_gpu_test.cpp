// CUDA NVFP4 4/6 adaptive block scaling (nvfp4_4over6.cu) against the CPU reference, bit for bit:
// codes, scales, the stored (true) amaxes and the non-finite flag, for RNE, RHT, SR, 2D and one-copy
// modes under both error metrics (MAE, MSE) on random and adversarial inputs at edge-tile and realistic
// shapes, and NaN/Inf input; plus a timing report of the 4/6 path against the fused quantizer.
#include <gtest/gtest.h>
#include <cuda_runtime.h>
#include <cmath>
#include <cstdio>
#include <string>
#include "common/gpu.h"
#include "formats/nvfp4/nvfp4.h"
#include "nvfp4/gpu/nvfp4_gpu_util.h"
#include "nvfp4/nvfp4_test_util.h"

namespace nb::nvfp4 {
namespace {
using testing::DeviceBytes;
using testing::HostQuantized;
using testing::view_of;

// quantize_cuda (or the amax pre-pass + quantize_cuda_with_amax) with every output copied back.
HostQuantized quantize_4over6_on_gpu(const std::vector<bf16>& x, int64_t rows, int64_t cols, const Options& opts,
                                     bool split_amax) {
  HostQuantized h{rows, cols};
  DeviceBytes dx(x.size() * sizeof(bf16), x.data());
  DeviceBytes rd(h.row_data.size()), rs(h.row_scales.size()), cd(h.col_data.size()), cs(h.col_scales.size());
  DeviceBytes amax(2 * sizeof(float)), flag(sizeof(int));
  const QuantizedView v = view_of(rows, cols, rd, rs, cd, cs, amax, flag);
  if (split_amax) {
    EXPECT_TRUE(compute_amax_cuda(dx.as<bf16>(), rows, cols, opts.rht && opts.colwise,
                                  opts.rowwise ? v.row_amax : nullptr, opts.colwise ? v.col_amax : nullptr, nullptr));
    EXPECT_TRUE(quantize_cuda_with_amax(dx.as<bf16>(), opts, v, nullptr));
  } else {
    Status st = quantize_cuda(dx.as<bf16>(), opts, v, nullptr);
    EXPECT_TRUE(st) << st.message();
  }
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  testing::read_back(rd, rs, cd, cs, amax, &h);
  flag.to_host(&h.nonfinite);
  return h;
}

size_t first_diff_index(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) return i;
  return a.size();
}

void expect_same(const std::vector<bf16>& x, int64_t rows, int64_t cols, const Options& opts, const std::string& what,
                 bool split_amax = false) {
  HostQuantized ref{rows, cols};
  ASSERT_TRUE(quantize_ref(x.data(), opts, ref.view()));
  HostQuantized gpu = quantize_4over6_on_gpu(x, rows, cols, opts, split_amax);
  SCOPED_TRACE(what + " " + std::to_string(rows) + "x" + std::to_string(cols));
  if (opts.rowwise) {
    EXPECT_EQ(f32_bits(gpu.row_amax), f32_bits(ref.row_amax));
    EXPECT_TRUE(gpu.row_data == ref.row_data) << "row data, byte " << first_diff_index(gpu.row_data, ref.row_data);
    EXPECT_TRUE(gpu.row_scales == ref.row_scales)
        << "row scales, byte " << first_diff_index(gpu.row_scales, ref.row_scales);
  }
  if (opts.colwise) {
    EXPECT_EQ(f32_bits(gpu.col_amax), f32_bits(ref.col_amax));
    EXPECT_TRUE(gpu.col_data == ref.col_data) << "col data, byte " << first_diff_index(gpu.col_data, ref.col_data);
    EXPECT_TRUE(gpu.col_scales == ref.col_scales)
        << "col scales, byte " << first_diff_index(gpu.col_scales, ref.col_scales);
  }
  EXPECT_EQ(gpu.nonfinite, ref.nonfinite);
}

std::vector<std::pair<std::string, Options>> modes_for(ErrMode mode) {
  Options o;
  o.four_over_six = true;
  o.err_mode = mode;
  const std::string tag = std::string("4/6 ") + err_mode_name(mode);
  std::vector<std::pair<std::string, Options>> m;
  m.push_back({tag + " both", o});
  Options row = o, col = o;
  row.colwise = false;
  col.rowwise = false;
  m.push_back({tag + " rowwise", row});
  m.push_back({tag + " colwise", col});
  Options rht = o;
  rht.rht = true;
  m.push_back({tag + " rht", rht});
  rht.rowwise = false;
  m.push_back({tag + " rht colwise", rht});
  Options sr = o;
  sr.sr = true;
  sr.rng = RngKey{99, 5, 6};
  m.push_back({tag + " sr", sr});
  sr.rht = true;
  m.push_back({tag + " rht+sr", sr});
  sr.colwise = false;
  m.push_back({tag + " sr rowwise", sr});
  Options t = o;
  t.two_d = true;
  m.push_back({tag + " 2d", t});
  t.colwise = false;
  m.push_back({tag + " 2d rowwise", t});
  t.colwise = true;
  t.rowwise = false;
  m.push_back({tag + " 2d colwise", t});
  return m;
}

// Every mode under MAE (TE's default) and MSE.
std::vector<std::pair<std::string, Options>> modes() {
  auto m = modes_for(ErrMode::mae);
  for (auto& e : modes_for(ErrMode::mse)) m.push_back(e);
  return m;
}

TEST(Nvfp4FourOverSixGpu, MatchesReferenceOnEdgeAndMidShapes) {
  NB_REQUIRE_GPU();
  const int64_t shapes[][2] = {{16, 16}, {48, 80}, {208, 144}, {256, 512}, {1008, 336}};
  for (auto [rows, cols] : shapes) {
    auto normal = testing::random_normal_bf16(rows * cols, uint32_t(rows + cols), 0.02f);
    auto adv = testing::adversarial_bf16(rows, cols, uint32_t(rows * 3 + cols));
    for (auto& [name, opts] : modes()) {
      expect_same(normal, rows, cols, opts, name + " normal");
      expect_same(adv, rows, cols, opts, name + " adversarial");
    }
    expect_same(normal, rows, cols, modes()[0].second, "4/6 mae both, split amax", /*split_amax=*/true);
  }
}

TEST(Nvfp4FourOverSixGpu, MatchesReferenceAtRealisticShape) {
  NB_REQUIRE_GPU();
  const int64_t rows = 4096, cols = 2048;
  auto x = testing::random_normal_bf16(rows * cols, 2025, 0.02f);
  for (auto& [name, opts] : modes()) {
    if (name.find("wise") != std::string::npos) continue;  // one-copy modes: covered above
    expect_same(x, rows, cols, opts, name, /*split_amax=*/name == "4/6 mae both");
  }
}

// NaN/Inf input: the same bytes as the reference and the flag. A huge finite value (2.5e38) is stored as
// the true amax and flags nothing (the former decode amax 1.75 * amax overflowed there).
TEST(Nvfp4FourOverSixGpu, NonFiniteInputMatchesAndIsFlagged) {
  NB_REQUIRE_GPU();
  const int64_t rows = 96, cols = 160;
  for (float bad : {NAN, INFINITY, -INFINITY, 2.5e38f}) {
    auto x = testing::random_normal_bf16(rows * cols, 3);
    x[size_t(37 * cols + 101)] = f32_to_bf16(bad);
    for (auto& [name, opts] : modes()) {
      HostQuantized gpu = quantize_4over6_on_gpu(x, rows, cols, opts, false);
      EXPECT_EQ(gpu.nonfinite, std::isfinite(bad) ? 0 : 1) << name << " " << bad;
      expect_same(x, rows, cols, opts, name + " with " + std::to_string(bad));
    }
  }
}

// Timing report (not pass/fail): quantize_cuda with and without 4/6 at 8192 x 8192, both copies,
// amax pre-pass included, mean over 20 runs after one warm-up.
TEST(Nvfp4FourOverSixGpu, TimingReport) {
  NB_REQUIRE_GPU();
  const int64_t rows = 8192, cols = 8192, n = rows * cols;
  auto x = testing::random_normal_bf16(n, 1, 0.02f);
  DeviceBytes dx(size_t(n) * sizeof(bf16), x.data());
  DeviceBytes rd(size_t(n / 2)), rs(size_t(n / 16)), cd(size_t(n / 2)), cs(size_t(n / 16)), amax(8), flag(4);
  const QuantizedView v = view_of(rows, cols, rd, rs, cd, cs, amax, flag);
  Options full;
  full.rht = full.sr = true;
  Options weights;
  weights.two_d = true;
  for (auto [name, base] : {std::pair<const char*, Options>{"row+col RNE", Options{}},
                            std::pair<const char*, Options>{"row+col+RHT+SR", full},
                            std::pair<const char*, Options>{"2D row+col", weights}}) {
    float ms[2] = {0, 0};
    for (int fos = 0; fos < 2; ++fos) {
      Options o = base;
      o.four_over_six = fos == 1;
      ASSERT_TRUE(quantize_cuda(dx.as<bf16>(), o, v, nullptr));
      cudaEvent_t start, stop;
      cudaEventCreate(&start);
      cudaEventCreate(&stop);
      cudaEventRecord(start);
      for (int i = 0; i < 20; ++i) ASSERT_TRUE(quantize_cuda(dx.as<bf16>(), o, v, nullptr));
      cudaEventRecord(stop);
      ASSERT_EQ(cudaEventSynchronize(stop), cudaSuccess);
      cudaEventElapsedTime(&ms[fos], start, stop);
      ms[fos] /= 20;
      cudaEventDestroy(start);
      cudaEventDestroy(stop);
    }
    std::printf("[bench] nvfp4 8192x8192 %-15s fused %.3f ms, 4/6 %.3f ms (%.1fx)\n", name, ms[0], ms[1],
                ms[1] / ms[0]);
  }
}

}  // namespace
}  // namespace nb::nvfp4
