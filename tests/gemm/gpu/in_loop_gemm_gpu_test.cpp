// The in-loop dequantizing wgmma GEMM (gemm/wgmma_gemm.h) against an FP64 host reference built from
// the exact dequantized operand (dequantize_operand_ref, the emulation's own oracle).
//
// Tolerance per element, with S = |alpha| * sum_k |a_k b_k| and the GPU's FP32 accumulation:
//   |gpu - ref| <= (K + 3) * 2^-23 * S + 2^-8 * (|ref| + (K + 3) * 2^-23 * S)
// (the gamma bound of FP32 summation in any order, doubled, plus one BF16 rounding of the result).
// Shapes cover several K steps around the 4-stage ring, several C tiles in both directions, and more
// than one 16-row group of M tiles with a partial last group (the tile raster's edge).
#include <gtest/gtest.h>
#include <cuda_runtime.h>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>
#include "common/gpu.h"
#include "core/bf16.h"
#include "core/tensor.h"
#include "gemm/gemm_quantized.h"
#include "gemm/wgmma_gemm.h"

namespace nb::gemm {
namespace {

struct Device {
  void* p = nullptr;
  explicit Device(size_t bytes) { EXPECT_EQ(cudaMalloc(&p, bytes), cudaSuccess); }
  ~Device() { cudaFree(p); }
  template <class T>
  void upload(const std::vector<T>& v) {
    ASSERT_EQ(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
};

// Random A in `f`: host bytes of the codes and scales, and its exact values [m, k] in FP64.
struct HostA {
  std::vector<uint8_t> data, scales;
  std::vector<double> values;
};

HostA make_a(InLoopFormat f, int64_t m, int64_t k, std::mt19937& rng) {
  HostA a;
  std::uniform_int_distribution<int> byte(0, 255);
  if (f == InLoopFormat::bf16) {
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    a.data.resize(size_t(m * k) * 2);
    a.values.resize(size_t(m * k));
    for (int64_t i = 0; i < m * k; ++i) {
      const bf16 v = f32_to_bf16(u(rng));
      std::memcpy(&a.data[size_t(2 * i)], &v.bits, 2);
      a.values[size_t(i)] = bf16_to_f32(v);
    }
    return a;
  }
  QOperand q;
  q.rows = m;
  q.k = k;
  const float amax = 1.f;
  if (f == InLoopFormat::mxfp8) {
    q.format = QFormat::mxfp8;
    a.data.resize(size_t(m * k));
    for (auto& b : a.data) do
        b = uint8_t(byte(rng));
      while ((b & 0x7F) == 0x7F);  // no NaN codes
    a.scales.resize(size_t(m * k / 32));
    std::uniform_int_distribution<int> e8m0(118, 134);
    for (auto& s : a.scales) s = uint8_t(e8m0(rng));
  } else {
    q.format = QFormat::nvfp4;
    q.amax = &amax;
    a.data.resize(size_t(m * k / 2));
    for (auto& b : a.data) b = uint8_t(byte(rng));
    a.scales.resize(size_t(m * k / 16));
    std::uniform_int_distribution<int> e4m3(0x08, 0x7E);  // positive, finite, normal and subnormal
    for (auto& s : a.scales) s = uint8_t(e4m3(rng));
  }
  q.data = a.data.data();
  q.scales = a.scales.data();
  a.values.resize(size_t(m * k));
  EXPECT_TRUE(dequantize_operand_ref(q, a.values.data()));
  return a;
}

void check(InLoopFormat f, int64_t m, int64_t n, int64_t k, float alpha) {
  std::mt19937 rng(uint32_t(m * 7 + n * 3 + k + int(f)));
  const HostA a = make_a(f, m, k, rng);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<uint16_t> b_bits(size_t(n * k));
  std::vector<double> b(size_t(n * k));
  for (size_t i = 0; i < b.size(); ++i) {
    const bf16 v = f32_to_bf16(u(rng));
    b_bits[i] = v.bits;
    b[i] = bf16_to_f32(v);
  }
  Device da(a.data.size()), ds(a.scales.size() + 16), db(b_bits.size() * 2), dc(size_t(m * n) * 2), dalpha(4);
  da.upload(a.data);
  if (!a.scales.empty()) ds.upload(a.scales);
  db.upload(b_bits);
  ASSERT_EQ(cudaMemcpy(dalpha.p, &alpha, 4, cudaMemcpyHostToDevice), cudaSuccess);
  InLoopOperand op{f, da.p, static_cast<const uint8_t*>(ds.p)};
  ASSERT_TRUE(in_loop_gemm_cuda(op, static_cast<const bf16*>(db.p), static_cast<bf16*>(dc.p), m, n, k,
                                static_cast<const float*>(dalpha.p), nullptr));
  std::vector<uint16_t> c(size_t(m * n));
  ASSERT_EQ(cudaMemcpy(c.data(), dc.p, c.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
  int64_t bad = 0;
  for (int64_t i = 0; i < m && bad < 5; ++i)
    for (int64_t j = 0; j < n && bad < 5; ++j) {
      double ref = 0, s = 0;
      for (int64_t kk = 0; kk < k; ++kk) {
        const double p = a.values[size_t(i * k + kk)] * b[size_t(j * k + kk)];
        ref += p;
        s += std::fabs(p);
      }
      ref *= alpha;
      s *= std::fabs(alpha);
      const double acc = double(k + 3) * std::ldexp(1.0, -23) * s;
      const double tol = acc + std::ldexp(1.0, -8) * (std::fabs(ref) + acc);
      const double got = bf16_to_f32(bf16{c[size_t(i * n + j)]});
      if (!(std::fabs(got - ref) <= tol)) {
        ADD_FAILURE() << in_loop_format_name(f) << " C[" << i << "," << j << "] = " << got << ", reference " << ref
                      << " (tolerance " << tol << ")";
        ++bad;
      }
    }
}

TEST(InLoopGemmGpu, Bf16MatchesTheReference) {
  NB_REQUIRE_GPU();
  check(InLoopFormat::bf16, 256, 512, 512, 1.f);
}

TEST(InLoopGemmGpu, Mxfp8DequantizedInTheLoopMatchesTheReference) {
  NB_REQUIRE_GPU();
  check(InLoopFormat::mxfp8, 256, 512, 512, 1.f);
}

TEST(InLoopGemmGpu, Nvfp4DequantizedInTheLoopMatchesTheReferenceWithAlpha) {
  NB_REQUIRE_GPU();
  check(InLoopFormat::nvfp4, 256, 512, 512, 0.375f);
}

// B = [I | 0] (N = K) makes C = A exactly (one non-zero product per output): the kernel's dequantized A must
// equal dequantize_operand_cuda's bit for bit, codes with subnormal values and every scale code included.
void check_dequantized_values_exact(InLoopFormat f) {
  const int64_t m = 128, n = 256, k = 256;
  std::mt19937 rng(7);
  HostA a = make_a(f, m, k, rng);
  // E8M0 codes 0..246: from 2^-127 (BF16 subnormal results) up to where 448 x 2^(e-127) is still finite (an
  // Inf in A would turn C's row into NaN through its products with B's zeros).
  if (f == InLoopFormat::mxfp8)
    for (size_t i = 0; i < a.scales.size(); ++i) a.scales[i] = uint8_t(i % 247);
  std::vector<uint16_t> eye(size_t(n * k), 0);
  for (int64_t j = 0; j < n; ++j) eye[size_t(j * k + j)] = 0x3F80;  // 1.0
  Device da(a.data.size()), ds(a.scales.size()), db(eye.size() * 2), dc(size_t(m * n) * 2), dd(size_t(m * k) * 2);
  da.upload(a.data);
  ds.upload(a.scales);
  db.upload(eye);
  QOperand q;
  q.format = f == InLoopFormat::mxfp8 ? QFormat::mxfp8 : QFormat::nvfp4;
  q.rows = m;
  q.k = k;
  q.data = da.p;
  q.scales = ds.p;
  ASSERT_TRUE(dequantize_operand_cuda(q, dd.p, nullptr));
  InLoopOperand op{f, da.p, static_cast<const uint8_t*>(ds.p)};
  ASSERT_TRUE(
      in_loop_gemm_cuda(op, static_cast<const bf16*>(db.p), static_cast<bf16*>(dc.p), m, n, k, nullptr, nullptr));
  std::vector<uint16_t> c(size_t(m * n)), d(size_t(m * k));
  ASSERT_EQ(cudaMemcpy(c.data(), dc.p, c.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d.data(), dd.p, d.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
  int bad = 0;
  for (size_t i = 0; i < c.size() && bad < 5; ++i)
    if (c[i] != d[i] && !(bf16_to_f32(bf16{c[i]}) == 0.f && bf16_to_f32(bf16{d[i]}) == 0.f)) {
      ADD_FAILURE() << in_loop_format_name(f) << " element " << i << ": in-loop 0x" << std::hex << c[i]
                    << ", dequantize_operand_cuda 0x" << d[i] << std::dec;
      ++bad;
    }
}

TEST(InLoopGemmGpu, Mxfp8DequantizedValuesAreExact) {
  NB_REQUIRE_GPU();
  check_dequantized_values_exact(InLoopFormat::mxfp8);
}

TEST(InLoopGemmGpu, Nvfp4DequantizedValuesAreExact) {
  NB_REQUIRE_GPU();
  check_dequantized_values_exact(InLoopFormat::nvfp4);
}

TEST(InLoopGemmGpu, TileRasterCoversEveryTileOfAPartialGroup) {
  NB_REQUIRE_GPU();
  check(InLoopFormat::nvfp4, 128 * 18, 512, 128, 1.f);  // 18 M tiles: a group of 16 and one of 2
}

TEST(InLoopGemmGpu, RejectsShapesOffTheTileGrid) {
  NB_REQUIRE_GPU();
  InLoopOperand op{InLoopFormat::bf16, reinterpret_cast<void*>(16), nullptr};
  const Status s = in_loop_gemm_cuda(op, reinterpret_cast<const bf16*>(16), reinterpret_cast<bf16*>(16), 128, 200, 64,
                                     nullptr, nullptr);
  ASSERT_FALSE(s);
  EXPECT_NE(s.message().find("multiples of 128, 256, 64"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace nb::gemm
