// matmul_quantized() on the GPU: every format at realistic and odd valid shapes, sources quantized
// by the real CUDA quantizers, results checked on sampled output elements against the independent
// reference (format dequantize_ref x_hat, FP64 sums; qgemm_test_util.h). Also TFLOP/s of the FP8
// GEMMs and of the emulated NVFP4/MXFP8 paths against plain BF16.
//
// Tolerances, per element, S = sum_k |a_k b_k| (FP64), u = 2^-24:
//   reference x_hat rounding (FP32, <= 3 roundings per operand)         8u * S
//   emulated (BF16 GEMM, FP32 accumulation, any order, K terms)         acc = 2 (K + 3) u * S
//   FP8 split accumulator: Hopper FP8 MMAs align the addends of each MMA step (32 products and the
//   running partial) to the largest one and keep about 13-14 bits below it (DeepSeek-V3 §3.3.2);
//   cuBLASLt promotes the partials to FP32 regularly. A first model (2^-12 S: one 2^-13 truncation
//   per interval) was refuted on H200: 2^-11.8 S at M=48, N=80, K=144 with an f32 C. With the ~33
//   truncated addends of a step having errors of random sign, sqrt(33) * 2^-13 ~ 2^-10.5; we use
//                                                                       acc = (2^-10 + 2 (K + 3) u) * S
//   FP8 fast accumulation: no promotion, the running sum itself is truncated at each of the K/32
//   MMA steps:                                                          acc = ((K/32 + 1) 2^-13 + 2 (K + 3) u) * S
//   output rounding: bf16 C: 2^-8 (|ref| + acc); f32 C: 2^-24 (|ref| + acc); plus u |beta C| for beta != 0.
// A wrong scale layout changes an element by roughly |ref| ~ S / sqrt(K) times the scale spread
// (2^+-6 here), far above every tolerance except fast accumulation's (per-tensor scales only).
#include <gtest/gtest.h>
#include <cuda_runtime.h>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>
#include "common/gpu.h"
#include "core/tensor.h"
#include "gemm/gemm.h"
#include "qgemm/qgemm_test_util.h"

namespace nb::gemm {
namespace {
using namespace nb::gemm::testing;

struct Dev {
  void* p = nullptr;
  size_t bytes = 0;
  Dev() = default;
  explicit Dev(size_t n) : bytes(n) { NB_CHECK(device_malloc(&p, n ? n : 1).is_ok(), "device_malloc %zu", n); }
  ~Dev() {
    if (p) device_free(p);
  }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
};

__global__ void fill_bf16_kernel(bf16* x, int64_t n, uint32_t seed) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  uint32_t h = uint32_t(i) * 0x9E3779B9u ^ seed;
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  h ^= h >> 16;
  x[i] = f32_to_bf16(float(h >> 8) / 8388608.f - 1.f);
}

// One source tensor quantized on the GPU (both copies); host copies of the bytes for the reference.
struct DevQuant {
  QFormat f;
  int64_t r, c;
  Dev d[kSlots];
  void* dp[kSlots];
  std::vector<uint8_t> h[kSlots];
  void* hp[kSlots];
  DevQuant(QFormat fmt, int64_t rows, int64_t cols, uint64_t seed, bool host_copy = true) : f(fmt), r(rows), c(cols) {
    size_t bytes[kSlots];
    slot_bytes(f, r, c, bytes);
    for (int i = 0; i < kSlots; ++i) {
      new (&d[i]) Dev(bytes[i]);
      dp[i] = d[i].p;
    }
    Dev src(size_t(r * c) * sizeof(bf16));
    if (host_copy) {
      const std::vector<bf16> x = make_source(r, c, seed);
      NB_CHECK(copy_bytes(src.p, Device::cuda, x.data(), Device::cpu, src.bytes).is_ok(), "upload");
    } else {
      fill_bf16_kernel<<<unsigned((r * c + 255) / 256), 256>>>(static_cast<bf16*>(src.p), r * c, uint32_t(seed));
    }
    Status s = quantize_source(f, static_cast<const bf16*>(src.p), r, c, dp, true);
    EXPECT_TRUE(s.is_ok()) << s.message();
    NB_CHECK(cudaDeviceSynchronize() == cudaSuccess, "quantize");
    for (int i = 0; i < kSlots; ++i) {
      if (host_copy) {
        h[i].resize(bytes[i]);
        NB_CHECK(copy_bytes(h[i].data(), Device::cpu, dp[i], Device::cuda, bytes[i]).is_ok(), "download");
      }
      hp[i] = h[i].data();
    }
  }
  QOperand op(bool col) const { return operand_view(f, r, c, const_cast<void**>(dp), col); }
  std::vector<float> xhat(bool col) const { return operand_xhat(f, r, c, const_cast<void**>(hp), col); }
};

enum class Accum { fp32, fp8_split, fp8_fast };

struct Check {
  DType c_dtype = DType::bf16;
  float beta = 0.f;
  bool fast_accum = false;
  Accum accum = Accum::fp32;
};

// Runs C = A . B^T (+ beta C_old) on the GPU and checks sampled elements against x_hat [rows, K] of
// each operand; prints the worst err / S. C's bytes go to *raw_out when given.
void check_gpu_ops(const QOperand& a, const std::vector<float>& xa, const QOperand& b, const std::vector<float>& xb,
                   const Check& ck, std::vector<uint8_t>* raw_out = nullptr) {
  const int64_t m = a.rows, n = b.rows, k = a.k;
  const size_t esz = ck.c_dtype == DType::bf16 ? 2 : 4;
  Dev c(size_t(m * n) * esz);
  std::vector<float> c_old(size_t(m * n), 0.f);
  if (ck.beta != 0.f) {
    Rng rng(99);
    for (auto& v : c_old) v = round_to_bf16(rng.uniform() * 64.f);
    std::vector<uint8_t> raw(c.bytes);
    for (size_t i = 0; i < c_old.size(); ++i) {
      if (ck.c_dtype == DType::bf16) {
        bf16 v = f32_to_bf16(c_old[i]);
        std::memcpy(&raw[i * 2], &v, 2);
      } else
        std::memcpy(&raw[i * 4], &c_old[i], 4);
    }
    ASSERT_TRUE(copy_bytes(c.p, Device::cuda, raw.data(), Device::cpu, c.bytes).is_ok());
  } else {
    ASSERT_EQ(cudaMemset(c.p, 0xFF, c.bytes), cudaSuccess);  // NaN everywhere: beta = 0 must not read C
  }
  Tensor ct = Tensor::make(c.p, ck.c_dtype, Device::cuda, {m, n});
  Status s = matmul_quantized(a, b, ct, {.beta = ck.beta, .fast_accum = ck.fast_accum}, nullptr);
  ASSERT_TRUE(s.is_ok()) << s.message();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<uint8_t> raw(c.bytes);
  ASSERT_TRUE(copy_bytes(raw.data(), Device::cpu, c.p, Device::cuda, c.bytes).is_ok());
  if (raw_out) *raw_out = raw;
  auto got_at = [&](int64_t i) {
    if (ck.c_dtype == DType::f32) {
      float v;
      std::memcpy(&v, &raw[size_t(i) * 4], 4);
      return double(v);
    }
    bf16 v;
    std::memcpy(&v, &raw[size_t(i) * 2], 2);
    return double(bf16_to_f32(v));
  };
  const double u = std::ldexp(1.0, -24), gamma = 2.0 * double(k + 3) * u;
  double acc_coef = gamma;
  if (ck.accum == Accum::fp8_split) acc_coef += std::ldexp(1.0, -10);
  if (ck.accum == Accum::fp8_fast) acc_coef += double(k / 32 + 1) * std::ldexp(1.0, -13);
  const double u_out = ck.c_dtype == DType::bf16 ? std::ldexp(1.0, -8) : u;

  std::vector<std::pair<int64_t, int64_t>> samples;
  if (m * n <= 65536) {
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) samples.push_back({i, j});
  } else {
    Rng rng(1234);
    samples = {{0, 0}, {m - 1, n - 1}, {0, n - 1}, {m - 1, 0}};
    for (int t = 0; t < 4096; ++t)
      samples.push_back({int64_t(rng.next() % uint32_t(m)), int64_t(rng.next() % uint32_t(n))});
  }
  int bad = 0;
  double worst = 0.0;
  for (auto [i, j] : samples) {
    double abs_sum = 0;
    double ref = ref_dot(&xa[size_t(i * k)], &xb[size_t(j * k)], k, &abs_sum);
    const double cterm = double(ck.beta) * c_old[size_t(i * n + j)];
    ref += cterm;
    const double acc = acc_coef * abs_sum;
    const double tol = acc + 8 * u * abs_sum + u_out * (std::fabs(ref) + acc) + u * std::fabs(cterm);
    const double got = got_at(i * n + j), err = std::fabs(got - ref);
    if (abs_sum > 0) worst = std::max(worst, err / abs_sum);
    if (!(err <= tol) && ++bad <= 5)
      ADD_FAILURE() << qformat_name(a.format) << " x " << qformat_name(b.format) << " M=" << m << " N=" << n
                    << " K=" << k << " at (" << i << "," << j << "): got " << got << " ref " << ref << " tol " << tol
                    << " S " << abs_sum;
  }
  std::printf("  %-16s x %-16s M=%-5lld N=%-5lld K=%-5lld C=%s beta=%g%s: %zu elements, max |err|/S = %.3g\n",
              qformat_name(a.format), qformat_name(b.format), (long long)m, (long long)n, (long long)k,
              ck.c_dtype == DType::bf16 ? "bf16" : "f32", ck.beta, ck.fast_accum ? " fast_accum" : "", samples.size(),
              worst);
  EXPECT_EQ(bad, 0);
}

void check_gpu(const DevQuant& qa, bool a_col, const DevQuant& qb, bool b_col, const Check& ck,
               std::vector<uint8_t>* raw_out = nullptr) {
  check_gpu_ops(qa.op(a_col), qa.xhat(a_col), qb.op(b_col), qb.xhat(b_col), ck, raw_out);
}

std::vector<float> transposed(const std::vector<float>& v, int64_t rows, int64_t cols) {
  std::vector<float> t(v.size());
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) t[size_t(j * rows + i)] = v[size_t(i * cols + j)];
  return t;
}

// Elements whose bytes differ between two C buffers of `esz`-byte elements.
int64_t differing_elements(const std::vector<uint8_t>& x, const std::vector<uint8_t>& y, size_t esz) {
  int64_t d = 0;
  for (size_t i = 0; i + esz <= x.size() && i + esz <= y.size(); i += esz) d += std::memcmp(&x[i], &y[i], esz) != 0;
  return d + (x.size() != y.size() ? 1 : 0);
}

// ---- FP8 per-tensor ----------------------------------------------------------------------------
TEST(QGemmGpu, Fp8FpropDgradWgrad) {
  NB_REQUIRE_GPU();
  // Fprop Y = X W^T: X [8192, 4096] E4M3, W [4096, 4096] E4M3, bf16 Y; fast accumulation and split.
  DevQuant x(QFormat::fp8_e4m3, 8192, 4096, 1), w(QFormat::fp8_e4m3, 4096, 4096, 2);
  check_gpu(x, false, w, false, {.accum = Accum::fp8_split});
  check_gpu(x, false, w, false, {.fast_accum = true, .accum = Accum::fp8_fast});
  // Dgrad dX = dY W: dY [8192, 14336] E5M2 (HYBRID), W [14336, 4096] -> W's transposed copy [4096, 14336].
  DevQuant dy(QFormat::fp8_e5m2, 8192, 14336, 3), w2(QFormat::fp8_e4m3, 14336, 4096, 4);
  check_gpu(dy, false, w2, true, {.accum = Accum::fp8_split});
  // Wgrad dW += dY^T X: dY [4096 tokens, 1024] E5M2, X [4096, 2048] E4M3, f32 dW with beta = 1.
  DevQuant dy2(QFormat::fp8_e5m2, 4096, 1024, 5), x2(QFormat::fp8_e4m3, 4096, 2048, 6);
  check_gpu(dy2, true, x2, true, {.c_dtype = DType::f32, .beta = 1.f, .accum = Accum::fp8_split});
  // E4M3 x E5M2 as well (weights E5M2 is unusual but supported by cuBLASLt).
  check_gpu(x2, true, dy2, true, {.c_dtype = DType::f32, .accum = Accum::fp8_split});
}

TEST(QGemmGpu, Fp8OddShapes) {
  NB_REQUIRE_GPU();
  DevQuant a(QFormat::fp8_e4m3, 48, 144, 7), b(QFormat::fp8_e4m3, 80, 144, 8);
  check_gpu(a, false, b, false, {.accum = Accum::fp8_split});
  check_gpu(a, false, b, false, {.c_dtype = DType::f32, .beta = 1.f, .accum = Accum::fp8_split});
}

// ---- FP8 sub-channel (1x128 activations/gradients, 128x128 weights) ---------------------------
TEST(QGemmGpu, Fp8BlockScaled) {
  NB_REQUIRE_GPU();
  DevQuant x(QFormat::fp8_block128, 8192, 4096, 11), w(QFormat::fp8_block128x128, 4096, 4096, 12);
  check_gpu(x, false, w, false, {.accum = Accum::fp8_split});  // Fprop: 1D x 2D
  DevQuant dy(QFormat::fp8_block128, 8192, 4096, 13);
  check_gpu(dy, false, w, true, {.accum = Accum::fp8_split});  // Dgrad: W's transposed copy
  DevQuant dy2(QFormat::fp8_block128, 4096, 1024, 14), x2(QFormat::fp8_block128, 4096, 2048, 15);
  check_gpu(dy2, true, x2, true, {.c_dtype = DType::f32, .beta = 1.f, .accum = Accum::fp8_split});  // Wgrad 1D x 1D
  DevQuant wa(QFormat::fp8_block128x128, 384, 640, 16), xb(QFormat::fp8_block128, 256, 640, 17);
  check_gpu(wa, false, xb, false, {.accum = Accum::fp8_split});  // 2D x 1D, odd multiples of 128
}

// ---- MXFP8 and NVFP4 (emulated) ------------------------------------------------------------------
TEST(QGemmGpu, Mxfp8Emulated) {
  NB_REQUIRE_GPU();
  DevQuant x(QFormat::mxfp8, 8192, 4096, 21), w(QFormat::mxfp8, 4096, 4096, 22);
  check_gpu(x, false, w, false, {});
  // Wgrad from the un-transposed column-wise copies: dY [4096, 1024], X [4096, 2048], f32 beta = 1.
  DevQuant dy(QFormat::mxfp8, 4096, 1024, 23), x2(QFormat::mxfp8, 4096, 2048, 24);
  check_gpu(dy, true, x2, true, {.c_dtype = DType::f32, .beta = 1.f});
  DevQuant z(QFormat::mxfp8, 512, 4096, 27);
  check_gpu(dy, true, z, false, {.c_dtype = DType::f32});  // mixed: transposed storage x K-major
  DevQuant a(QFormat::mxfp8, 96, 224, 25), b(QFormat::mxfp8, 160, 224, 26);
  check_gpu(a, false, b, false, {});
}

TEST(QGemmGpu, Nvfp4Emulated) {
  NB_REQUIRE_GPU();
  DevQuant x(QFormat::nvfp4, 8192, 14336, 31), w(QFormat::nvfp4, 4096, 14336, 32);
  check_gpu(x, false, w, false, {});  // down-projection Fprop
  DevQuant dy(QFormat::nvfp4, 4096, 1024, 33), x2(QFormat::nvfp4, 4096, 2048, 34);
  check_gpu(dy, true, x2, true, {.c_dtype = DType::f32, .beta = 1.f});  // Wgrad
  DevQuant a(QFormat::nvfp4, 48, 96, 35), b(QFormat::nvfp4, 80, 96, 36);
  check_gpu(a, false, b, false, {});
  check_gpu(a, false, b, false, {.c_dtype = DType::f32, .beta = 1.f});
}

// The emulated GEMM with its scratch capped so that the larger operand is dequantized in 128-row
// blocks (one GEMM each, rows of A = rows of C, rows of B = columns of C, remainders included), for
// K-major and [K, rows]-stored operands of both formats, bf16 C and f32 C with beta = 1. Each chunked
// result is checked against the reference within the bound of the unchunked GEMM (the smaller
// cuBLASLt problems may use other algorithms, so bit identity is not asserted); how many elements
// differ from the unchunked result is printed.
TEST(QGemmGpu, ChunkedEmulationStaysWithinTheBoundOfTheUnchunkedGemm) {
  NB_REQUIRE_GPU();
  struct ChunkCase {
    const char* what;
    QFormat f;
    int64_t ar, ac, br, bc;  // sources: A [ar, ac], B [br, bc]
    bool a_col, b_col;
    Check ck;
    bool expect_chunk_b;
  };
  const ChunkCase cases[] = {
      {"A blocks, K-major", QFormat::nvfp4, 704, 384, 256, 384, false, false, {}, false},
      {"B blocks, K-major",
       QFormat::nvfp4,
       256,
       384,
       704,
       384,
       false,
       false,
       {.c_dtype = DType::f32, .beta = 1.f},
       true},
      {"A blocks, Wgrad transposed copies",
       QFormat::nvfp4,
       384,
       704,
       384,
       256,
       true,
       true,
       {.c_dtype = DType::f32, .beta = 1.f},
       false},
      {"A blocks, [K, rows] storage",
       QFormat::mxfp8,
       384,
       704,
       384,
       256,
       true,
       true,
       {.c_dtype = DType::f32, .beta = 1.f},
       false},
      {"B blocks, [K, rows] storage", QFormat::mxfp8, 384, 256, 384, 704, true, true, {}, true},
  };
  for (const ChunkCase& cs : cases) {
    std::printf(" %s %s:\n", qformat_name(cs.f), cs.what);
    DevQuant qa(cs.f, cs.ar, cs.ac, 71), qb(cs.f, cs.br, cs.bc, 72);
    const QOperand a = qa.op(cs.a_col), b = qb.op(cs.b_col);
    std::vector<uint8_t> whole, chunked;
    check_gpu(qa, cs.a_col, qb, cs.b_col, cs.ck, &whole);
    ASSERT_EQ(detail::plan_emulation(a.rows, b.rows, a.k).chunk_rows, std::max(a.rows, b.rows)) << "unchunked";
    detail::set_emulation_chunk_elements(128 * a.k);
    const detail::EmulationPlan plan = detail::plan_emulation(a.rows, b.rows, a.k);
    EXPECT_EQ(plan.chunk_b, cs.expect_chunk_b);
    EXPECT_EQ(plan.chunk_rows, 128);
    check_gpu(qa, cs.a_col, qb, cs.b_col, cs.ck, &chunked);
    detail::set_emulation_chunk_elements(0);
    const size_t esz = cs.ck.c_dtype == DType::bf16 ? 2 : 4;
    std::printf("   chunked vs unchunked: %lld of %lld elements differ in their bits\n",
                (long long)differing_elements(whole, chunked, esz), (long long)(whole.size() / esz));
  }
  // The NVFP4 [K, rows] operand chunked as B (a 2D weight's row copy in a Dgrad wider than the cap).
  DevQuant dy(QFormat::nvfp4, 256, 384, 73), w(QFormat::nvfp4, 384, 704, 74);
  QOperand wk = w.op(false);
  wk.rows = 704;
  wk.k = 384;
  wk.k_major = false;
  const std::vector<float> xw = transposed(w.xhat(false), 384, 704);
  std::vector<uint8_t> whole, chunked;
  check_gpu_ops(dy.op(false), dy.xhat(false), wk, xw, {}, &whole);
  detail::set_emulation_chunk_elements(128 * 384);
  EXPECT_TRUE(detail::plan_emulation(256, 704, 384).chunk_b);
  check_gpu_ops(dy.op(false), dy.xhat(false), wk, xw, {}, &chunked);
  detail::set_emulation_chunk_elements(0);
  std::printf("   nvfp4 [K, rows] B chunked vs unchunked: %lld of %lld elements differ in their bits\n",
              (long long)differing_elements(whole, chunked, 2), (long long)(whole.size() / 2));
}

// A 2D NVFP4 weight's Dgrad through its row copy read as [K, rows] (what Linear does) against the
// explicit K-major column copy (what it did before): same values, so both match the reference within
// the emulated bound; the number of elements whose bits differ is printed (the two BF16 GEMMs have
// different operand layouts, so cuBLASLt may run different kernels).
TEST(QGemmGpu, Nvfp4TwoDRowCopyAsDgradOperand) {
  NB_REQUIRE_GPU();
  const int64_t out = 1024, in = 2048;  // W [out, in]; dY [2048 tokens, out]
  DevQuant dy(QFormat::nvfp4, 2048, out, 81);
  const std::vector<bf16> wsrc = make_source(out, in, 82);
  Dev src(wsrc.size() * 2), rd(size_t(out * in / 2)), rs(size_t(out * in / 16)), cd(size_t(out * in / 2)),
      cs(size_t(out * in / 16)), amax(8);
  ASSERT_TRUE(copy_bytes(src.p, Device::cuda, wsrc.data(), Device::cpu, src.bytes).is_ok());
  nvfp4::Options o;
  o.two_d = true;
  float* am = static_cast<float*>(amax.p);
  nvfp4::QuantizedView v{out,
                         in,
                         static_cast<uint8_t*>(rd.p),
                         static_cast<uint8_t*>(rs.p),
                         static_cast<uint8_t*>(cd.p),
                         static_cast<uint8_t*>(cs.p),
                         am,
                         am + 1,
                         nullptr};
  ASSERT_TRUE(nvfp4::quantize_cuda(static_cast<const bf16*>(src.p), o, v, nullptr).is_ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<uint8_t> hrd(rd.bytes), hrs(rs.bytes), hcd(cd.bytes), hcs(cs.bytes);
  float hamax[2];
  ASSERT_TRUE(copy_bytes(hrd.data(), Device::cpu, rd.p, Device::cuda, rd.bytes).is_ok());
  ASSERT_TRUE(copy_bytes(hrs.data(), Device::cpu, rs.p, Device::cuda, rs.bytes).is_ok());
  ASSERT_TRUE(copy_bytes(hcd.data(), Device::cpu, cd.p, Device::cuda, cd.bytes).is_ok());
  ASSERT_TRUE(copy_bytes(hcs.data(), Device::cpu, cs.p, Device::cuda, cs.bytes).is_ok());
  ASSERT_TRUE(copy_bytes(hamax, Device::cpu, amax.p, Device::cuda, sizeof hamax).is_ok());
  ASSERT_EQ(hamax[0], hamax[1]);
  std::vector<float> xrow(size_t(out * in)), xcol(size_t(out * in));
  nvfp4::dequantize_ref(hrd.data(), hrs.data(), hamax[0], out, in, xrow.data());
  nvfp4::dequantize_ref(hcd.data(), hcs.data(), hamax[1], in, out, xcol.data());
  const std::vector<float> xrow_t = transposed(xrow, out, in);  // [in, out]
  ASSERT_TRUE(xrow_t == xcol) << "2D copies must hold identical values";
  const QOperand col{QFormat::nvfp4, in, out, cd.p, cs.p, am + 1};
  const QOperand row_kfirst{QFormat::nvfp4, in, out, rd.p, rs.p, am, false};
  std::vector<uint8_t> via_col, via_row;
  check_gpu_ops(dy.op(false), dy.xhat(false), col, xcol, {}, &via_col);
  check_gpu_ops(dy.op(false), dy.xhat(false), row_kfirst, xcol, {}, &via_row);
  std::printf("   Dgrad via the row copy vs via the column copy: %lld of %lld elements differ in their bits\n",
              (long long)differing_elements(via_col, via_row, 2), (long long)(via_col.size() / 2));
}

// Mixture of Representations' mixed GEMM on the GPU: a BF16 operand (K-major or stored [K, rows]) with a per-tensor
// FP8 one, or two BF16 ones, against the FP64 reference of the same values (BF16 operand's x_hat = its values).
// One case forces the FP8 operand to be decoded in blocks of rows (the emulation's chunk plan).
TEST(QGemmGpu, Bf16PairsWithPerTensorFp8) {
  NB_REQUIRE_GPU();
  auto upload = [](const std::vector<bf16>& v) {
    auto d = std::make_unique<Dev>(v.size() * sizeof(bf16));
    NB_CHECK(copy_bytes(d->p, Device::cuda, v.data(), Device::cpu, d->bytes).is_ok(), "upload");
    return d;
  };
  DevQuant x(QFormat::fp8_e4m3, 1024, 512, 41), w(QFormat::fp8_e5m2, 768, 512, 42);
  const std::vector<bf16> xv = make_source(1024, 512, 43), wv = make_source(768, 512, 44);
  const auto xd = upload(xv), wd = upload(wv);
  const QOperand xb = bf16_operand(static_cast<const bf16*>(xd->p), 1024, 512, true);
  const QOperand wb = bf16_operand(static_cast<const bf16*>(wd->p), 768, 512, true);
  const std::vector<float> xbh = bf16_xhat(xv, 1024, 512, true), wbh = bf16_xhat(wv, 768, 512, true);
  check_gpu_ops(xb, xbh, w.op(false), w.xhat(false), {});
  check_gpu_ops(x.op(false), x.xhat(false), wb, wbh, {.c_dtype = DType::f32});
  check_gpu_ops(xb, xbh, wb, wbh, {});
  const int64_t old_cap = detail::set_emulation_chunk_elements(128 * 512);
  check_gpu_ops(x.op(false), x.xhat(false), wb, wbh, {.c_dtype = DType::f32, .beta = 1.f});
  detail::set_emulation_chunk_elements(old_cap);
  // Wgrad: dY^T [256, K = 1024 tokens] from a BF16 dY [1024, 256] (stored [K, rows]) x the E4M3 X's column copy.
  const std::vector<bf16> dy = make_source(1024, 256, 45);
  const auto dyd = upload(dy);
  check_gpu_ops(bf16_operand(static_cast<const bf16*>(dyd->p), 256, 1024, false), bf16_xhat(dy, 256, 1024, false),
                x.op(true), x.xhat(true), {.c_dtype = DType::f32, .beta = 1.f});
}

// Mixture of Representations' NVFP4 ladder on the GPU: an NVFP4 operand with a per-tensor FP8 or a BF16 one (alpha =
// the NVFP4 operand's global scale times the FP8 one's scale_inv, on the device), row copies and Wgrad-like column
// copies, one case chunked, against the FP64 reference of the same values.
TEST(QGemmGpu, Nvfp4PairsWithPerTensorFp8AndBf16) {
  NB_REQUIRE_GPU();
  DevQuant xn(QFormat::nvfp4, 1024, 512, 61), w8(QFormat::fp8_e4m3, 768, 512, 62);
  DevQuant x8(QFormat::fp8_e4m3, 1024, 512, 63), wn(QFormat::nvfp4, 768, 512, 64);
  check_gpu_ops(xn.op(false), xn.xhat(false), w8.op(false), w8.xhat(false), {});
  check_gpu_ops(x8.op(false), x8.xhat(false), wn.op(false), wn.xhat(false), {.c_dtype = DType::f32});
  const std::vector<bf16> wv = make_source(768, 512, 65);
  auto wd = std::make_unique<Dev>(wv.size() * sizeof(bf16));
  ASSERT_TRUE(copy_bytes(wd->p, Device::cuda, wv.data(), Device::cpu, wd->bytes).is_ok());
  const QOperand wb = bf16_operand(static_cast<const bf16*>(wd->p), 768, 512, true);
  check_gpu_ops(xn.op(false), xn.xhat(false), wb, bf16_xhat(wv, 768, 512, true), {});
  const int64_t old_cap = detail::set_emulation_chunk_elements(128 * 512);
  check_gpu_ops(wb, bf16_xhat(wv, 768, 512, true), xn.op(false), xn.xhat(false), {.c_dtype = DType::f32, .beta = 1.f});
  detail::set_emulation_chunk_elements(old_cap);
  // Wgrad: dY^T (NVFP4 column copy, K = 1024 tokens) x X^T (E4M3 column copy), beta = 1.
  DevQuant dyn(QFormat::nvfp4, 1024, 256, 66);
  check_gpu_ops(dyn.op(true), dyn.xhat(true), x8.op(true), x8.xhat(true), {.c_dtype = DType::f32, .beta = 1.f});
}

// A weight dequantized once per step (QOperand::dequantized): dequantize_operand_cuda writes exactly the
// BF16 values of the reference decoder in the operand's stored layout, and a GEMM that reads them gives
// the same bits as the one that dequantizes the operand itself (same problem, same cuBLASLt plan).
TEST(QGemmGpu, DequantizedOperandIsExactAndGivesTheSameGemm) {
  NB_REQUIRE_GPU();
  // B is [512, K = 384]: the row copy of a [512, 384] source, or (`from_col`) the column copy of a
  // [384, 512] source (MXFP8: stored [K, rows]; NVFP4: transposed, K-major), or (`kfirst`) the NVFP4 row
  // copy of a [384, 512] source read as [K, rows] (a 2D weight's Dgrad operand).
  struct Case {
    QFormat f;
    bool from_col, kfirst;
  };
  for (const Case cs :
       {Case{QFormat::mxfp8, false, false}, Case{QFormat::mxfp8, true, false}, Case{QFormat::nvfp4, false, false},
        Case{QFormat::nvfp4, true, false}, Case{QFormat::nvfp4, false, true}}) {
    const bool wide = cs.from_col || cs.kfirst;
    DevQuant x(cs.f, 256, 384, 91), w(cs.f, wide ? 384 : 512, wide ? 512 : 384, 92);
    auto as_b = [&](QOperand q) {
      if (cs.kfirst) {
        q.rows = 512;
        q.k = 384;
        q.k_major = false;
      }
      return q;
    };
    QOperand b = as_b(w.op(cs.from_col));
    const QOperand b_host = as_b(operand_view(cs.f, w.r, w.c, const_cast<void**>(w.hp), cs.from_col));
    const std::vector<float> xb = cs.kfirst ? transposed(w.xhat(false), 384, 512) : w.xhat(cs.from_col);
    ASSERT_EQ(b.rows, 512);
    ASSERT_EQ(b.k, 384);
    Dev deq(size_t(b.rows * b.k) * 2);
    ASSERT_TRUE(dequantize_operand_cuda(b, deq.p, nullptr).is_ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<bf16> got(size_t(b.rows * b.k));
    ASSERT_TRUE(copy_bytes(got.data(), Device::cpu, deq.p, Device::cuda, deq.bytes).is_ok());
    std::vector<double> ref(got.size());
    ASSERT_TRUE(dequantize_operand_ref(b_host, ref.data()).is_ok());
    int64_t mismatches = 0;
    for (int64_t r = 0; r < b.rows; ++r)
      for (int64_t kk = 0; kk < b.k; ++kk) {
        const size_t stored = size_t(b.k_major ? r * b.k + kk : kk * b.rows + r);
        mismatches += bf16_to_f32(got[stored]) != float(ref[size_t(r * b.k + kk)]);
      }
    const char* layout = b.k_major ? "K-major" : "[K, rows]";
    EXPECT_EQ(mismatches, 0) << qformat_name(cs.f) << " " << layout;
    std::vector<uint8_t> own, given;
    check_gpu_ops(x.op(false), x.xhat(false), b, xb, {}, &own);
    b.dequantized = deq.p;
    check_gpu_ops(x.op(false), x.xhat(false), b, xb, {}, &given);
    EXPECT_EQ(differing_elements(own, given, 2), 0) << qformat_name(cs.f) << " " << layout;
  }
}

// The combinations matmul_quantized() rejects up front are indeed rejected by cuBLASLt on this GPU
// (called through the internal entry point that skips the up-front checks).
TEST(QGemmGpu, CublasLtRejectsWhatWeReject) {
  NB_REQUIRE_GPU();
  DevQuant e5(QFormat::fp8_e5m2, 256, 512, 43), blk(QFormat::fp8_block128x128, 256, 512, 44);
  Dev c(256 * 256 * 2);
  auto run = [&](const DevQuant& q, detail::ScaleMode mode, detail::ElemType type) {
    detail::LtProblem p;
    p.m = 256;
    p.n = 256;
    p.k = 512;
    p.a = {q.dp[kRowData], type, true, mode, static_cast<const float*>(q.dp[kRowScales])};
    p.b = p.a;
    p.c = {c.p, DType::bf16, 256};
    return detail::lt_matmul(p, nullptr);
  };
  Status s1 = run(e5, detail::ScaleMode::tensor, detail::ElemType::e5m2);
  std::printf("  cuBLASLt E5M2 x E5M2: %s\n", s1.is_ok() ? "accepted" : s1.message().c_str());
  EXPECT_FALSE(s1.is_ok());
  Status s2 = run(blk, detail::ScaleMode::blk128x128, detail::ElemType::e4m3);
  std::printf("  cuBLASLt 128x128 x 128x128: %s\n", s2.is_ok() ? "accepted" : s2.message().c_str());
  EXPECT_FALSE(s2.is_ok());
  cudaDeviceSynchronize();
}

TEST(QGemmGpu, PlansAreCached) {
  NB_REQUIRE_GPU();
  DevQuant a(QFormat::fp8_e4m3, 256, 512, 41), b(QFormat::fp8_e4m3, 128, 512, 42);
  Dev c(256 * 128 * 2);
  Tensor ct = Tensor::make(c.p, DType::bf16, Device::cuda, {256, 128});
  ASSERT_TRUE(matmul_quantized(a.op(false), b.op(false), ct, {}, nullptr).is_ok());
  const size_t plans = quantized_plan_count();
  ASSERT_TRUE(matmul_quantized(a.op(false), b.op(false), ct, {}, nullptr).is_ok());
  EXPECT_EQ(quantized_plan_count(), plans);
  ASSERT_TRUE(matmul_quantized(a.op(false), b.op(false), ct, {.fast_accum = true}, nullptr).is_ok());
  EXPECT_EQ(quantized_plan_count(), plans + 1);
}

// ---- Throughput -----------------------------------------------------------------------------------
template <typename F>
double time_ms(F&& f, int iters = 20) {
  for (int i = 0; i < 3; ++i) f();
  cudaEvent_t t0, t1;
  cudaEventCreate(&t0);
  cudaEventCreate(&t1);
  cudaEventRecord(t0);
  for (int i = 0; i < iters; ++i) f();
  cudaEventRecord(t1);
  cudaEventSynchronize(t1);
  float ms = 0;
  cudaEventElapsedTime(&ms, t0, t1);
  cudaEventDestroy(t0);
  cudaEventDestroy(t1);
  return double(ms) / iters;
}

double bench_quantized(QFormat fa, QFormat fb, int64_t m, int64_t n, int64_t k, bool fast_accum) {
  DevQuant a(fa, m, k, 51, false), b(fb, n, k, 52, false);
  Dev c(size_t(m * n) * 2);
  Tensor ct = Tensor::make(c.p, DType::bf16, Device::cuda, {m, n});
  Status s = matmul_quantized(a.op(false), b.op(false), ct, {.fast_accum = fast_accum}, nullptr);
  EXPECT_TRUE(s.is_ok()) << s.message();
  if (!s.is_ok()) return 0;
  const double ms =
      time_ms([&] { (void)matmul_quantized(a.op(false), b.op(false), ct, {.fast_accum = fast_accum}, nullptr); });
  const double tflops = 2.0 * double(m) * double(n) * double(k) / (ms * 1e-3) / 1e12;
  std::printf("  %-16s x %-16s M=%-5lld N=%-5lld K=%-5lld%s: %.3f ms, %.0f TFLOP/s\n", qformat_name(fa),
              qformat_name(fb), (long long)m, (long long)n, (long long)k, fast_accum ? " fast_accum" : "", ms, tflops);
  return ms;
}

double bench_bf16(int64_t m, int64_t n, int64_t k) {
  Dev a(size_t(m * k) * 2), b(size_t(n * k) * 2), c(size_t(m * n) * 2);
  fill_bf16_kernel<<<unsigned((m * k + 255) / 256), 256>>>(static_cast<bf16*>(a.p), m * k, 1);
  fill_bf16_kernel<<<unsigned((n * k + 255) / 256), 256>>>(static_cast<bf16*>(b.p), n * k, 2);
  Tensor at = Tensor::make(a.p, DType::bf16, Device::cuda, {m, k});
  Tensor bt = Tensor::make(b.p, DType::bf16, Device::cuda, {n, k});
  Tensor ct = Tensor::make(c.p, DType::bf16, Device::cuda, {m, n});
  EXPECT_TRUE(matmul(at, bt, ct, {.trans_b = true}, nullptr).is_ok());
  const double ms = time_ms([&] { (void)matmul(at, bt, ct, {.trans_b = true}, nullptr); });
  std::printf("  bf16 x bf16 (plain matmul)          M=%-5lld N=%-5lld K=%-5lld: %.3f ms, %.0f TFLOP/s\n", (long long)m,
              (long long)n, (long long)k, ms, 2.0 * double(m) * double(n) * double(k) / (ms * 1e-3) / 1e12);
  return ms;
}

TEST(QGemmGpu, Throughput) {
  NB_REQUIRE_GPU();
  std::printf("FP8 per-tensor (cuBLASLt):\n");
  bench_quantized(QFormat::fp8_e4m3, QFormat::fp8_e4m3, 8192, 8192, 8192, true);
  bench_quantized(QFormat::fp8_e4m3, QFormat::fp8_e4m3, 8192, 8192, 8192, false);
  bench_quantized(QFormat::fp8_e5m2, QFormat::fp8_e4m3, 8192, 8192, 8192, false);
  std::printf("FP8 per-tensor, Llama-3 8B linears, 8192 tokens (Fprop, fast accumulation):\n");
  bench_quantized(QFormat::fp8_e4m3, QFormat::fp8_e4m3, 8192, 6144, 4096, true);   // QKV
  bench_quantized(QFormat::fp8_e4m3, QFormat::fp8_e4m3, 8192, 4096, 4096, true);   // O
  bench_quantized(QFormat::fp8_e4m3, QFormat::fp8_e4m3, 8192, 28672, 4096, true);  // gate + up
  bench_quantized(QFormat::fp8_e4m3, QFormat::fp8_e4m3, 8192, 4096, 14336, true);  // down
  std::printf("FP8 sub-channel (1x128 x 128x128):\n");
  bench_quantized(QFormat::fp8_block128, QFormat::fp8_block128x128, 8192, 8192, 8192, false);
  std::printf("Emulated (dequantize to BF16 + BF16 GEMM) vs plain BF16:\n");
  const double bf = bench_bf16(8192, 8192, 8192);
  const double nv = bench_quantized(QFormat::nvfp4, QFormat::nvfp4, 8192, 8192, 8192, false);
  const double mx = bench_quantized(QFormat::mxfp8, QFormat::mxfp8, 8192, 8192, 8192, false);
  std::printf("  overhead vs BF16 at 8192^3: nvfp4 %+.1f%%, mxfp8 %+.1f%%\n", 100.0 * (nv / bf - 1.0),
              100.0 * (mx / bf - 1.0));
  const double bf_down = bench_bf16(8192, 4096, 14336);
  const double nv_down = bench_quantized(QFormat::nvfp4, QFormat::nvfp4, 8192, 4096, 14336, false);
  std::printf("  overhead vs BF16 at the down projection: nvfp4 %+.1f%%\n", 100.0 * (nv_down / bf_down - 1.0));
  // Where the overhead goes: the BF16 GEMM alone with alpha/beta read from device memory (as the
  // NVFP4 path runs it); the rest of the emulated time is the dequantization of both operands.
  {
    const int64_t m = 8192, n = 4096, k = 14336;
    Dev a(size_t(m * k) * 2), b(size_t(n * k) * 2), c(size_t(m * n) * 2), scalars(8);
    const float ab[2] = {1.f, 0.f};
    ASSERT_TRUE(copy_bytes(scalars.p, Device::cuda, ab, Device::cpu, 8).is_ok());
    detail::LtProblem p;
    p.m = m;
    p.n = n;
    p.k = k;
    p.a = {a.p, detail::ElemType::bf16, true, detail::ScaleMode::none, nullptr};
    p.b = {b.p, detail::ElemType::bf16, true, detail::ScaleMode::none, nullptr};
    p.c = {c.p, DType::bf16, n};
    p.device_alpha_beta = static_cast<const float*>(scalars.p);
    ASSERT_TRUE(detail::lt_matmul(p, nullptr).is_ok());
    const double dev_ms = time_ms([&] { (void)detail::lt_matmul(p, nullptr); });
    std::printf("  down projection: BF16 GEMM with device alpha %.3f ms (plain %.3f ms), dequantization ~%.3f ms\n",
                dev_ms, bf_down, nv_down - dev_ms);
  }
}

}  // namespace
}  // namespace nb::gemm
