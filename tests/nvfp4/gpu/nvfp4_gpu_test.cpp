// CUDA NVFP4 kernels against the CPU reference, bit for bit: codes, scales, amaxes, SR codes for the
// same seed, the non-finite flag, dequantization and the cuBLAS scale swizzle, on random and
// adversarial inputs at small, edge-tile and realistic (8192 x 4096) shapes.
#include <gtest/gtest.h>
#include <cuda_runtime.h>
#include <cmath>
#include <cstring>
#include <string>
#include "common/gpu.h"
#include "formats/nvfp4/nvfp4.h"
#include "formats/nvfp4/nvfp4_bench.h"
#include "nvfp4/gpu/nvfp4_gpu_util.h"
#include "nvfp4/nvfp4_test_util.h"

namespace nb::nvfp4 {
namespace {
using testing::DeviceBytes;
using testing::HostQuantized;
using testing::view_of;

// Device copy of a host vector (or zero-filled storage), freed on scope exit.
// Runs quantize_cuda (or the amax pre-pass + quantize_cuda_with_amax) and copies every output back.
HostQuantized quantize_on_gpu(const std::vector<bf16>& x, int64_t rows, int64_t cols, const Options& opts,
                              bool split_amax = false) {
  HostQuantized h{rows, cols};
  DeviceBytes dx(x.size() * sizeof(bf16), x.data());
  DeviceBytes rd(h.row_data.size()), rs(h.row_scales.size()), cd(h.col_data.size()), cs(h.col_scales.size());
  DeviceBytes amax(2 * sizeof(float)), flag(sizeof(int));
  QuantizedView v = view_of(rows, cols, rd, rs, cd, cs, amax, flag);
  if (split_amax) {
    EXPECT_TRUE(
        compute_amax_cuda(dx.as<bf16>(), rows, cols, opts.rht && opts.colwise, v.row_amax, v.col_amax, nullptr));
    EXPECT_TRUE(quantize_cuda_with_amax(dx.as<bf16>(), opts, v, nullptr));
  } else {
    Status st = quantize_cuda(dx.as<bf16>(), opts, v, nullptr);
    EXPECT_TRUE(st) << st.message();
  }
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  if (opts.rowwise) {
    rd.to_host(h.row_data.data());
    rs.to_host(h.row_scales.data());
  }
  if (opts.colwise) {
    cd.to_host(h.col_data.data());
    cs.to_host(h.col_scales.data());
  }
  float a[2];
  amax.to_host(a);
  h.row_amax = a[0];
  h.col_amax = a[1];
  flag.to_host(&h.nonfinite);
  return h;
}

// First differing byte, for a readable failure.
std::string first_diff(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) return "byte " + std::to_string(i) + ": " + std::to_string(a[i]) + " vs " + std::to_string(b[i]);
  return "identical";
}

void expect_same(const std::vector<bf16>& x, int64_t rows, int64_t cols, const Options& opts, const char* what,
                 bool split_amax = false) {
  HostQuantized ref{rows, cols};
  ASSERT_TRUE(quantize_ref(x.data(), opts, ref.view()));
  HostQuantized gpu = quantize_on_gpu(x, rows, cols, opts, split_amax);
  SCOPED_TRACE(std::string(what) + " " + std::to_string(rows) + "x" + std::to_string(cols));
  if (opts.rowwise) {
    EXPECT_EQ(f32_bits(gpu.row_amax), f32_bits(ref.row_amax));
    EXPECT_TRUE(gpu.row_data == ref.row_data) << "row data " << first_diff(gpu.row_data, ref.row_data);
    EXPECT_TRUE(gpu.row_scales == ref.row_scales) << "row scales " << first_diff(gpu.row_scales, ref.row_scales);
  }
  if (opts.colwise) {
    EXPECT_EQ(f32_bits(gpu.col_amax), f32_bits(ref.col_amax));
    EXPECT_TRUE(gpu.col_data == ref.col_data) << "col data " << first_diff(gpu.col_data, ref.col_data);
    EXPECT_TRUE(gpu.col_scales == ref.col_scales) << "col scales " << first_diff(gpu.col_scales, ref.col_scales);
  }
  EXPECT_EQ(gpu.nonfinite, ref.nonfinite);
}

std::vector<std::pair<const char*, Options>> all_modes() {
  std::vector<std::pair<const char*, Options>> m;
  Options o;
  m.push_back({"both", o});
  o.colwise = false;
  m.push_back({"rowwise", o});
  o = Options{};
  o.rowwise = false;
  m.push_back({"colwise", o});
  o = Options{};
  o.two_d = true;
  m.push_back({"2d", o});
  o = Options{};
  o.rht = true;
  m.push_back({"rht", o});
  o = Options{};
  o.rht = true;
  o.rowwise = false;
  m.push_back({"rht colwise", o});
  o = Options{};
  o.sr = true;
  o.rng = RngKey{99, 5, 6};
  m.push_back({"sr", o});
  o.rht = true;
  m.push_back({"rht+sr", o});
  return m;
}

TEST(Nvfp4Gpu, MatchesReferenceOnSmallAndEdgeTileShapes) {
  NB_REQUIRE_GPU();
  const int64_t shapes[][2] = {{16, 16}, {64, 128}, {48, 80}, {208, 144}, {256, 400}};
  for (auto [rows, cols] : shapes) {
    auto normal = testing::random_normal_bf16(rows * cols, uint32_t(rows + cols));
    auto adv = testing::adversarial_bf16(rows, cols, uint32_t(rows * 3 + cols));
    for (auto& [name, opts] : all_modes()) {
      expect_same(normal, rows, cols, opts, name);
      expect_same(adv, rows, cols, opts, name);
    }
  }
}

TEST(Nvfp4Gpu, MatchesReferenceAtRealisticShape) {
  NB_REQUIRE_GPU();
  const int64_t rows = 8192, cols = 4096;
  auto x = testing::random_normal_bf16(rows * cols, 2024, 0.02f);
  auto adv = testing::adversarial_bf16(rows, cols, 77);
  for (auto& [name, opts] : all_modes()) {
    if (std::string(name) == "rht colwise" || std::string(name) == "rowwise") continue;  // covered above
    expect_same(x, rows, cols, opts, name, /*split_amax=*/std::string(name) == "both");
  }
  Options rs;
  rs.rht = true;
  rs.sr = true;
  rs.rng = RngKey{1, 2, 3};
  expect_same(adv, rows, cols, rs, "adversarial rht+sr");
  Options two_d;
  two_d.two_d = true;
  expect_same(adv, rows, cols, two_d, "adversarial 2d");
}

TEST(Nvfp4Gpu, NonFiniteInputIsFlaggedAndMatches) {
  NB_REQUIRE_GPU();
  const int64_t rows = 96, cols = 160;
  for (float bad : {INFINITY, -INFINITY, NAN}) {
    auto x = testing::random_normal_bf16(rows * cols, 3);
    x[size_t(37 * cols + 101)] = f32_to_bf16(bad);
    for (auto& [name, opts] : all_modes()) {
      HostQuantized gpu = quantize_on_gpu(x, rows, cols, opts);
      EXPECT_EQ(gpu.nonfinite, 1) << name << " " << bad;
      expect_same(x, rows, cols, opts, name);
    }
  }
}

TEST(Nvfp4Gpu, DequantizeAndSwizzleMatchReference) {
  NB_REQUIRE_GPU();
  const int64_t rows = 336, cols = 208;
  auto x = testing::adversarial_bf16(rows, cols, 5);
  HostQuantized q{rows, cols};
  ASSERT_TRUE(quantize_ref(x.data(), Options{}, q.view()));
  std::vector<float> ref(rows * cols), got(rows * cols);
  dequantize_ref(q.row_data.data(), q.row_scales.data(), q.row_amax, rows, cols, ref.data());
  DeviceBytes d(q.row_data.size(), q.row_data.data()), s(q.row_scales.size(), q.row_scales.data());
  DeviceBytes a(sizeof(float), &q.row_amax), out(got.size() * sizeof(float));
  ASSERT_TRUE(dequantize_cuda(d.as<uint8_t>(), s.as<uint8_t>(), a.as<float>(), rows, cols, out.as<float>(), nullptr));
  out.to_host(got.data());
  EXPECT_EQ(std::memcmp(got.data(), ref.data(), got.size() * sizeof(float)), 0);

  const int64_t sc = cols / 16;  // 13: padded to 16 scale columns; 336 rows pad to 384
  std::vector<uint8_t> swz_ref(swizzled_scale_bytes(rows, sc)), swz(swz_ref.size()), back(q.row_scales.size());
  swizzle_scales_ref(q.row_scales.data(), rows, sc, swz_ref.data());
  DeviceBytes dsw(swz.size()), dback(back.size());
  std::vector<uint8_t> poison(swz.size(), 0xCD);
  ASSERT_EQ(cudaMemcpy(dsw.p, poison.data(), poison.size(), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_TRUE(swizzle_scales_cuda(s.as<uint8_t>(), rows, sc, dsw.as<uint8_t>(), nullptr));
  ASSERT_TRUE(unswizzle_scales_cuda(dsw.as<uint8_t>(), rows, sc, dback.as<uint8_t>(), nullptr));
  dsw.to_host(swz.data());
  dback.to_host(back.data());
  EXPECT_TRUE(swz == swz_ref) << first_diff(swz, swz_ref);
  EXPECT_EQ(back, q.row_scales);
}

TEST(Nvfp4Gpu, RejectsBadShapes) {
  NB_REQUIRE_GPU();
  QuantizedView v;
  v.rows = 24;
  v.cols = 32;
  Status st = quantize_cuda(nullptr, Options{}, v, nullptr);
  ASSERT_FALSE(st);
  EXPECT_NE(st.message().find("24 x 32"), std::string::npos) << st.message();
}

// Performance report (not a pass/fail on speed): fused row + column + RHT + SR at 8192 x 8192
// against a device-to-device copy of the same number of bytes.
TEST(Nvfp4Gpu, BenchmarkReport) {
  NB_REQUIRE_GPU();
  struct Mode {
    const char* name;
    Options o;
  };
  Options full;
  full.rht = true;
  full.sr = true;
  full.rng = RngKey{3, 1, 0};
  Options plain;
  Options two_d;
  two_d.two_d = true;
  Options row;
  row.colwise = false;
  for (const Mode& m :
       {Mode{"row+col+RHT+SR", full}, Mode{"row+col RNE", plain}, Mode{"2D row+col", two_d}, Mode{"row only", row}}) {
    BenchResult r;
    Status st = bench_nvfp4_cuda(8192, 8192, m.o, 20, &r);
    ASSERT_TRUE(st) << st.message();
    const double gbs_q = r.bytes_min / (r.ms_quantize * 1e6), gbs_t = r.bytes_min / (r.ms_total * 1e6);
    const double gbs_copy = r.bytes_min / (r.ms_copy * 1e6);
    std::printf(
        "[bench] nvfp4 8192x8192 %-16s quantize %.3f ms (%.0f GB/s, %.0f%% of copy)  amax %.3f ms  "
        "total %.3f ms (%.0f GB/s)  d2d copy of same bytes %.3f ms (%.0f GB/s)\n",
        m.name, r.ms_quantize, gbs_q, 100 * gbs_q / gbs_copy, r.ms_amax, r.ms_total, gbs_t, r.ms_copy, gbs_copy);
    EXPECT_GT(r.ms_quantize, 0.0);
  }
}

}  // namespace
}  // namespace nb::nvfp4
