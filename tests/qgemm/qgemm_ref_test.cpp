// CPU reference of matmul_quantized() on small shapes, every format, against an independent
// computation: the format's own dequantize_ref (FP32 x_hat) and an FP64 sum of products.
// Tolerance: the reference here rounds each x_hat to FP32 (at most 3 roundings per operand for
// NVFP4, x_hat = e2m1 * s_b * amax / 2688; 1 for FP8), the GEMM rounds alpha to FP32 (2 roundings)
// and its result to FP32, so per element, with S = sum |products| and u = 2^-24:
//   |gemm - ref| <= 8u * S + 2u * (|ref| + |beta C|)   (written as 2^-21 S + 2^-23 (...))
// Also: beta = 1 accumulation into an f32 C, the MXFP8 un-transposed column copy, NVFP4 stored
// [K, rows], the emulated GPU GEMM's chunk plan, and the error Statuses of unsupported combinations.
#include <gtest/gtest.h>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>
#include "qgemm/qgemm_test_util.h"

namespace nb::gemm {
namespace {
using namespace nb::gemm::testing;

// One source quantized on the host: buffers + views.
struct HostQuant {
  QFormat f;
  int64_t r, c;
  std::vector<uint8_t> buf[kSlots];
  void* p[kSlots];
  HostQuant(QFormat fmt, int64_t rows, int64_t cols, uint64_t seed) : f(fmt), r(rows), c(cols) {
    size_t bytes[kSlots];
    slot_bytes(f, r, c, bytes);
    for (int i = 0; i < kSlots; ++i) {
      buf[i].assign(bytes[i], 0);
      p[i] = buf[i].data();
    }
    const std::vector<bf16> x = make_source(r, c, seed);
    Status s = quantize_source(f, x.data(), r, c, p, false);
    EXPECT_TRUE(s.is_ok()) << s.message();
  }
  QOperand op(bool col) const { return operand_view(f, r, c, p, col); }
  std::vector<float> xhat(bool col) const { return operand_xhat(f, r, c, p, col); }
};

// C = A . B^T (+ beta C_old) on the CPU backend, checked element by element against x_hat [rows, K]
// of each operand.
void check_cpu_ops(const QOperand& a, const std::vector<float>& xa, const QOperand& b, const std::vector<float>& xb,
                   float beta) {
  const int64_t m = a.rows, n = b.rows, k = a.k;
  ASSERT_EQ(k, b.k);
  std::vector<float> c(size_t(m * n)), c_old(size_t(m * n));
  Rng rng(77);
  for (auto& v : c_old) v = beta != 0.f ? rng.uniform() * 64.f : NAN;  // beta = 0: C must never be read
  c = c_old;
  Tensor ct = Tensor::make(c.data(), DType::f32, Device::cpu, {m, n});
  Status s = matmul_quantized(a, b, ct, {.beta = beta}, nullptr);
  ASSERT_TRUE(s.is_ok()) << s.message();
  const double u = std::ldexp(1.0, -24);
  int bad = 0;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double abs_sum = 0;
      double ref = ref_dot(&xa[size_t(i * k)], &xb[size_t(j * k)], k, &abs_sum);
      const double cterm = beta != 0.f ? double(beta) * c_old[size_t(i * n + j)] : 0.0;
      ref += cterm;
      const double tol = 8 * u * abs_sum + 2 * u * (std::fabs(ref) + std::fabs(cterm));
      const double got = c[size_t(i * n + j)];
      if (!(std::fabs(got - ref) <= tol) && ++bad <= 5)
        ADD_FAILURE() << qformat_name(a.format) << " x " << qformat_name(b.format) << " at (" << i << "," << j
                      << "): got " << got << " ref " << ref << " tol " << tol;
    }
  EXPECT_EQ(bad, 0);
}

void check_cpu(const HostQuant& qa, bool a_col, const HostQuant& qb, bool b_col, float beta) {
  check_cpu_ops(qa.op(a_col), qa.xhat(a_col), qb.op(b_col), qb.xhat(b_col), beta);
}

std::vector<float> transposed(const std::vector<float>& v, int64_t rows, int64_t cols) {
  std::vector<float> t(v.size());
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) t[size_t(j * rows + i)] = v[size_t(i * cols + j)];
  return t;
}

struct Case {
  QFormat a, b;
};

class CpuQGemm : public ::testing::TestWithParam<Case> {};

// Fprop-like: row-wise copies, A [M,K] x B [N,K]; beta = 0 with a NaN-filled C.
TEST_P(CpuQGemm, RowCopies) {
  const Case cs = GetParam();
  HostQuant x(cs.a, 256, 384, 1), w(cs.b, 128, 384, 2);
  check_cpu(x, false, w, false, 0.f);
}

// Wgrad-like: column-wise copies (K = the token dim), f32 C accumulated with beta = 1.
TEST_P(CpuQGemm, ColumnCopiesAccumulate) {
  const Case cs = GetParam();
  HostQuant dy(cs.a, 384, 128, 3), x(cs.b, 384, 256, 4);
  check_cpu(dy, true, x, true, 1.f);
}

INSTANTIATE_TEST_SUITE_P(Formats, CpuQGemm,
                         ::testing::Values(Case{QFormat::fp8_e4m3, QFormat::fp8_e4m3},
                                           Case{QFormat::fp8_e5m2, QFormat::fp8_e4m3},
                                           Case{QFormat::fp8_e4m3, QFormat::fp8_e5m2},
                                           Case{QFormat::fp8_block128, QFormat::fp8_block128x128},
                                           Case{QFormat::fp8_block128x128, QFormat::fp8_block128},
                                           Case{QFormat::fp8_block128, QFormat::fp8_block128},
                                           Case{QFormat::mxfp8, QFormat::mxfp8}, Case{QFormat::nvfp4, QFormat::nvfp4}),
                         [](const auto& info) {
                           return std::string(qformat_name(info.param.a)) + "_x_" + qformat_name(info.param.b);
                         });

// Mixture of Representations' mixed GEMM: a BF16 operand, K-major or stored [K, rows], with a per-tensor E4M3 or
// E5M2 one (each side), or two BF16 ones; the BF16 operand's x_hat is its own values. Fprop-like row copies
// and a Wgrad-like pair (K = tokens, the BF16 operand stored [K, rows], beta = 1).
TEST(CpuQGemm, Bf16PairsWithPerTensorFp8) {
  HostQuant x(QFormat::fp8_e4m3, 128, 256, 31), w(QFormat::fp8_e5m2, 96, 256, 32);
  const std::vector<bf16> xv = make_source(128, 256, 33), wv = make_source(96, 256, 34);
  const QOperand xb = bf16_operand(xv.data(), 128, 256, true), wb = bf16_operand(wv.data(), 96, 256, true);
  const std::vector<float> xbh = bf16_xhat(xv, 128, 256, true), wbh = bf16_xhat(wv, 96, 256, true);
  check_cpu_ops(xb, xbh, w.op(false), w.xhat(false), 0.f);
  check_cpu_ops(x.op(false), x.xhat(false), wb, wbh, 0.f);
  check_cpu_ops(xb, xbh, wb, wbh, 0.f);
  // Wgrad: dY^T [64, K = 384] from a BF16 dY [384 tokens, 64] (stored [K, rows]) x the E4M3 X's column copy.
  const std::vector<bf16> dy = make_source(384, 64, 35);
  HostQuant xt(QFormat::fp8_e4m3, 384, 160, 36);
  check_cpu_ops(bf16_operand(dy.data(), 64, 384, false), bf16_xhat(dy, 64, 384, false), xt.op(true), xt.xhat(true),
                1.f);
}

// Mixture of Representations' NVFP4 ladder: an NVFP4 operand with a per-tensor FP8 one or a BF16 one, either side;
// Fprop-like row copies and a Wgrad-like pair of column copies (beta = 1), and a BF16 operand stored [K, rows].
TEST(CpuQGemm, Nvfp4PairsWithPerTensorFp8AndBf16) {
  HostQuant xn(QFormat::nvfp4, 128, 256, 51), wn(QFormat::nvfp4, 96, 256, 52);
  HostQuant x8(QFormat::fp8_e4m3, 128, 256, 53), w8(QFormat::fp8_e4m3, 96, 256, 54);
  check_cpu(xn, false, w8, false, 0.f);
  check_cpu(x8, false, wn, false, 0.f);
  const std::vector<bf16> wv = make_source(96, 256, 55);
  check_cpu_ops(xn.op(false), xn.xhat(false), bf16_operand(wv.data(), 96, 256, true), bf16_xhat(wv, 96, 256, true),
                0.f);
  // Wgrad: dY^T (NVFP4 column copy, K = 384 tokens) x X^T (E4M3 column copy), and a BF16 dY stored [K, rows].
  HostQuant dyn(QFormat::nvfp4, 384, 64, 56), xt(QFormat::fp8_e4m3, 384, 160, 57), xtn(QFormat::nvfp4, 384, 160, 58);
  check_cpu(dyn, true, xt, true, 1.f);
  const std::vector<bf16> dy = make_source(384, 64, 59);
  check_cpu_ops(bf16_operand(dy.data(), 64, 384, false), bf16_xhat(dy, 64, 384, false), xtn.op(true), xtn.xhat(true),
                1.f);
}

// The decoder of the GEMM reference agrees with the format's dequantizer (nvfp4: without the
// global scale, which the GEMM applies as alpha).
TEST(CpuQGemm, DequantizeOperandMatchesFormatDecoder) {
  for (QFormat f :
       {QFormat::fp8_e5m2, QFormat::fp8_block128, QFormat::fp8_block128x128, QFormat::mxfp8, QFormat::nvfp4}) {
    HostQuant q(f, 256, 128, 9);
    for (bool col : {false, true}) {
      const QOperand op = q.op(col);
      std::vector<double> mine(size_t(op.rows * op.k));
      ASSERT_TRUE(dequantize_operand_ref(op, mine.data()).is_ok());
      const std::vector<float> theirs = q.xhat(col);
      const double global = f == QFormat::nvfp4 ? double(*op.amax) / (6.0 * 448.0) : 1.0;
      for (size_t i = 0; i < mine.size(); ++i) {
        const double want = theirs[i], got = mine[i] * global;
        ASSERT_LE(std::fabs(got - want), std::ldexp(std::fabs(want), -22))
            << qformat_name(f) << (col ? " col" : " row") << " element " << i;
      }
    }
  }
}

// NVFP4 stored [K, rows] (k_major = false; how a 2D weight's row copy is Dgrad's operand): the row copy
// of a [256, 160] source is the operand [160, K = 256]. Its decoder gives the row copy transposed, and
// the GEMM matches the reference on those values (as A and as B, with beta = 1 accumulation).
TEST(CpuQGemm, Nvfp4StoredKFirst) {
  HostQuant src(QFormat::nvfp4, 256, 160, 61), a(QFormat::nvfp4, 96, 256, 62), b(QFormat::nvfp4, 64, 256, 63);
  QOperand kfirst = src.op(false);
  kfirst.rows = 160;
  kfirst.k = 256;
  kfirst.k_major = false;
  const std::vector<float> xk = transposed(src.xhat(false), 256, 160);  // [160, 256]
  std::vector<double> mine(size_t(160 * 256));
  ASSERT_TRUE(dequantize_operand_ref(kfirst, mine.data()).is_ok());
  const double global = double(*kfirst.amax) / (6.0 * 448.0);
  for (size_t i = 0; i < mine.size(); ++i)
    ASSERT_LE(std::fabs(mine[i] * global - xk[i]), std::ldexp(std::fabs(double(xk[i])), -22)) << "element " << i;
  check_cpu_ops(a.op(false), a.xhat(false), kfirst, xk, 0.f);
  check_cpu_ops(kfirst, xk, b.op(false), b.xhat(false), 1.f);
  // The layout rules still apply: rows (the stored row length) must hold whole 16-blocks.
  QOperand odd = kfirst;
  odd.rows = 152;
  std::vector<float> c(size_t(96 * 152));
  Tensor ct = Tensor::make(c.data(), DType::f32, Device::cpu, {96, 152});
  EXPECT_FALSE(matmul_quantized(a.op(false), odd, ct, {}, nullptr).is_ok());
}

// The emulated GPU GEMM's scratch plan (pure host arithmetic): the operand with more elements is
// dequantized in blocks of a multiple of 128 rows under the cap; the scratch holds one block.
TEST(EmulationPlan, LargerOperandIsChunkedUnderTheCap) {
  using namespace detail;
  ASSERT_EQ(emulation_chunk_elements(), kDefaultEmulationChunkElements);
  const size_t mib = size_t(1) << 20;
  // Llama-3-8B gate+up Wgrad at 8192 tokens: dY^T [28672, 8192] x X^T [4096, 8192]: 534 MB unchunked.
  EmulationPlan p = plan_emulation(28672, 4096, 8192);
  EXPECT_FALSE(p.chunk_b);
  EXPECT_EQ(p.chunk_rows, 8192);
  EXPECT_EQ(p.scratch_bytes, 128 * mib + 64 * mib + 256);
  // Its Dgrad: dY [8192, K = 28672] x W [4096, K = 28672]: 64 Mi / 28672 = 2340 rows -> 2304.
  p = plan_emulation(8192, 4096, 28672);
  EXPECT_FALSE(p.chunk_b);
  EXPECT_EQ(p.chunk_rows, 2304);
  EXPECT_EQ(p.scratch_bytes, size_t(2304 * 28672) * 2 + size_t(4096 * 28672) * 2 + 256);
  // Down-projection Wgrad: dY^T [4096, 8192] x X^T [14336, 8192]: B is the larger one (C column blocks).
  p = plan_emulation(4096, 14336, 8192);
  EXPECT_TRUE(p.chunk_b);
  EXPECT_EQ(p.chunk_rows, 8192);
  // Under the cap: one block, the scratch of both operands whole (as before chunking existed).
  p = plan_emulation(8192, 4096, 4096);
  EXPECT_FALSE(p.chunk_b);
  EXPECT_EQ(p.chunk_rows, 8192);
  EXPECT_EQ(p.scratch_bytes, size_t(8192 + 4096) * 4096 * 2 + 256);
  // A tie chunks A; a cap below 128 rows still gives 128-row blocks; the cap can be set and restored.
  EXPECT_EQ(set_emulation_chunk_elements(100 * 384), kDefaultEmulationChunkElements);
  p = plan_emulation(512, 512, 384);
  EXPECT_FALSE(p.chunk_b);
  EXPECT_EQ(p.chunk_rows, 128);
  EXPECT_EQ(p.scratch_bytes, size_t(128 * 384) * 2 + size_t(512 * 384) * 2 + 256);
  set_emulation_chunk_elements(300 * 384);
  p = plan_emulation(256, 704, 384);
  EXPECT_TRUE(p.chunk_b);
  EXPECT_EQ(p.chunk_rows, 256);
  p = plan_emulation(256, 128, 384);  // 256 * 384 <= cap: not chunked
  EXPECT_EQ(p.chunk_rows, 256);
  EXPECT_EQ(set_emulation_chunk_elements(0), 300 * 384);
  EXPECT_EQ(emulation_chunk_elements(), kDefaultEmulationChunkElements);
}

// An operand given already dequantized (QOperand::dequantized: a weight kept in BF16 for the step) takes
// no scratch and is never chunked; the other operand is chunked under the cap even when it is the smaller.
TEST(EmulationPlan, GivenOperandIsNeitherChunkedNorInScratch) {
  using namespace detail;
  const size_t mib = size_t(1) << 20;
  // gate+up Fprop at 8192 tokens: X [8192, 4096] x W [28672, 4096] given: only X is dequantized, whole.
  EmulationPlan p = plan_emulation(8192, 28672, 4096, false, true);
  EXPECT_FALSE(p.chunk_b);
  EXPECT_EQ(p.chunk_rows, 8192);
  EXPECT_EQ(p.scratch_bytes, 64 * mib + 256);
  // Its Dgrad: dY [8192, K = 28672] x W^T [4096, K = 28672] given: dY is chunked (2304 rows) as before,
  // without W's 224 MiB.
  p = plan_emulation(8192, 4096, 28672, false, true);
  EXPECT_FALSE(p.chunk_b);
  EXPECT_EQ(p.chunk_rows, 2304);
  EXPECT_EQ(p.scratch_bytes, size_t(2304 * 28672) * 2 + 256);
  // A given A makes B the chunked operand although A is the larger.
  set_emulation_chunk_elements(128 * 384);
  p = plan_emulation(1024, 256, 384, true, false);
  EXPECT_TRUE(p.chunk_b);
  EXPECT_EQ(p.chunk_rows, 128);
  EXPECT_EQ(p.scratch_bytes, size_t(128 * 384) * 2 + 256);
  // Both given: one GEMM, only the scalars in scratch.
  p = plan_emulation(1024, 256, 384, true, true);
  EXPECT_EQ(p.chunk_rows, p.chunk_b ? 256 : 1024);
  EXPECT_EQ(p.scratch_bytes, size_t(256));
  set_emulation_chunk_elements(0);
}

// A dequantized copy is for the emulated formats only: an FP8 operand that carries one is refused.
TEST(QuantizedGemm, DequantizedCopyOnlyForEmulatedFormats) {
  const uint8_t codes[16 * 16] = {};
  const float scale_inv = 1.f;
  QOperand a{QFormat::fp8_e4m3, 16, 16, codes, &scale_inv};
  QOperand b = a;
  float dummy = 0;
  b.dequantized = &dummy;
  std::vector<float> c(16 * 16);
  Tensor ct = Tensor::make(c.data(), DType::f32, Device::cpu, {16, 16});
  Status st = matmul_quantized(a, b, ct, {}, nullptr);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("dequantized BF16 copy"), std::string::npos) << st.message();
}

// Odd but valid shapes (per-tensor FP8: K a multiple of 16 only).
TEST(CpuQGemm, OddShapes) {
  HostQuant a(QFormat::fp8_e4m3, 48, 80, 5), b(QFormat::fp8_e4m3, 16, 80, 6);
  check_cpu(a, false, b, false, 0.f);
  HostQuant na(QFormat::nvfp4, 48, 96, 7), nb4(QFormat::nvfp4, 80, 96, 8);
  check_cpu(na, false, nb4, false, 0.f);
}

// The reference's tiled FP64 product (two rows and eight columns of C side by side) against the plain loop,
// one sum per element over k in order, written here: equal bit for bit, with beta = 1 and shapes that leave an
// odd last row and a partial column tile.
void expect_plain_loop(const HostQuant& qa, const HostQuant& qb, double alpha) {
  const QOperand a = qa.op(false), b = qb.op(false);
  const int64_t m = a.rows, n = b.rows, k = a.k;
  std::vector<double> da(size_t(m * k)), db(size_t(n * k));
  ASSERT_TRUE(dequantize_operand_ref(a, da.data()).is_ok());
  ASSERT_TRUE(dequantize_operand_ref(b, db.data()).is_ok());
  std::vector<float> c(size_t(m * n)), want(size_t(m * n));
  Rng rng(5);
  for (auto& v : c) v = rng.uniform() * 8.f;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double acc = 0.0;
      for (int64_t kk = 0; kk < k; ++kk) acc += da[size_t(i * k + kk)] * db[size_t(j * k + kk)];
      want[size_t(i * n + j)] = float(alpha * acc + double(c[size_t(i * n + j)]));
    }
  Tensor ct = Tensor::make(c.data(), DType::f32, Device::cpu, {m, n});
  ASSERT_TRUE(matmul_quantized(a, b, ct, {.beta = 1.f}, nullptr).is_ok());
  EXPECT_EQ(std::memcmp(c.data(), want.data(), c.size() * sizeof(float)), 0) << qformat_name(a.format);
}

TEST(CpuQGemm, TiledProductEqualsThePlainLoop) {
  HostQuant a(QFormat::fp8_e4m3, 33, 80, 11), b(QFormat::fp8_e4m3, 19, 80, 12);
  expect_plain_loop(a, b, 1.0);
  HostQuant na(QFormat::nvfp4, 48, 96, 13), nb4(QFormat::nvfp4, 80, 96, 14);
  expect_plain_loop(na, nb4, double(nvfp4_global_alpha(*na.op(false).amax, *nb4.op(false).amax)));
}

TEST(CpuQGemm, RejectsUnsupportedCombinations) {
  HostQuant e5(QFormat::fp8_e5m2, 128, 128, 1), e4(QFormat::fp8_e4m3, 128, 128, 2);
  HostQuant blk2(QFormat::fp8_block128x128, 128, 128, 3), nv(QFormat::nvfp4, 128, 128, 4);
  std::vector<float> c(128 * 128);
  Tensor ct = Tensor::make(c.data(), DType::f32, Device::cpu, {128, 128});
  auto expect_error = [&](const QOperand& a, const QOperand& b, QGemmOptions o, const char* needle) {
    Status s = matmul_quantized(a, b, ct, o, nullptr);
    ASSERT_FALSE(s.is_ok()) << needle;
    EXPECT_NE(s.message().find(needle), std::string::npos) << s.message();
  };
  expect_error(e5.op(false), e5.op(false), {}, "E5M2 x E5M2");
  expect_error(blk2.op(false), blk2.op(false), {}, "fp8_block128x128 x fp8_block128x128");
  HostQuant mx(QFormat::mxfp8, 128, 128, 5);
  expect_error(mx.op(false), nv.op(false), {}, "one recipe");
  expect_error(e4.op(false), nv.op(false), {.fast_accum = true}, "fast_accum");
  expect_error(nv.op(false), nv.op(false), {.fast_accum = true}, "fast_accum");
  const std::vector<bf16> values = make_source(64, 128, 6);
  const QOperand plain = bf16_operand(values.data(), 64, 128, true);
  expect_error(plain, mx.op(false), {}, "pair bf16, fp8 per-tensor and nvfp4");
  expect_error(plain, e4.op(false), {.fast_accum = true}, "fast_accum");
  QOperand not_kmajor = e4.op(false);
  not_kmajor.k_major = false;
  expect_error(not_kmajor, e4.op(false), {}, "K-major");
  QOperand blk_not_kmajor = blk2.op(false);
  blk_not_kmajor.k_major = false;
  expect_error(blk_not_kmajor, blk2.op(false), {}, "K-major");
  QOperand bad_k = e4.op(false);
  bad_k.k = 120;
  expect_error(bad_k, e4.op(false), {}, "multiple of 16");
  QOperand no_amax = nv.op(false);
  no_amax.amax = nullptr;
  expect_error(no_amax, nv.op(false), {}, "amax");
  HostQuant wide(QFormat::fp8_e4m3, 128, 256, 5);
  expect_error(e4.op(false), wide.op(false), {}, "same K");
  std::vector<float> small(64 * 128);
  Tensor wrong_c = Tensor::make(small.data(), DType::f32, Device::cpu, {64, 128});
  Status s = matmul_quantized(e4.op(false), e4.op(false), wrong_c, {}, nullptr);
  EXPECT_FALSE(s.is_ok());
}

}  // namespace
}  // namespace nb::gemm
