// cuBLASLt matmul() against the CPU reference GEMM, and the GPU ceiling measurements.
//
// Inputs are BF16 values, so the CPU reference (f32 copies of the same BF16 values) and the GPU
// see identical operands; the only differences are the accumulation order and the output rounding.
// Two kinds of data:
//  * "exact": values m/8 with m in +-{1..7}. Every product is a multiple of 2^-6 below 1 and every
//    partial sum stays below 2^14 for K <= 16384, so it needs at most 20 significant bits: FP32
//    accumulation is exact in ANY order (split-K, tensor-core trees). Then the GPU must match
//    bit for bit: f32 C equal to the reference, bf16 C equal to the reference rounded to nearest even.
//  * "full": uniform values in [-1, 1] rounded to BF16 (all 8 significand bits used). Tolerance per
//    element, with S = |alpha| (|A| @ |B|) + |beta C| and u32 = 2^-24:
//      acc = (K + 3) * 2 * u32 * S   (gamma bound for the GPU, doubled to allow truncating adds)
//      |gpu - cpu| <= acc_gpu + acc_cpu + u_out * (|cpu| + acc_gpu + acc_cpu), u_out = 2^-8 for a
//      bf16 C (one rounding of an 8-bit significand) and 2^-24 for an f32 C.
// A bf16 C with beta != 0 may see two roundings (gemm.h: rne(rne(alpha * acc) + beta * C), which
// cuBLASLt does on H200 for beta = 1): exact data then accepts that value as well as the singly
// rounded one, and full data uses the two-rounding bound, with t = alpha * acc, |t| <= S:
//      e1 = acc_gpu + acc_cpu + u_out * (S + acc_gpu + acc_cpu);   |gpu - cpu| <= e1 + u_out * (|cpu| + e1).
#include <gtest/gtest.h>
#include <cuda_runtime.h>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>
#include "common/gpu.h"
#include "core/bf16.h"
#include "gemm/gemm.h"
#include "gemm/gemm_bench.h"

namespace nb::gemm {
namespace {

enum class Data { exact, full };

// Host matrix of BF16 values kept as f32 (exactly representable), row stride ld.
struct HostMat {
  int64_t rows = 0, cols = 0, ld = 0;
  std::vector<float> v;
  Tensor cpu_tensor() {
    Tensor t = Tensor::make(v.data(), DType::f32, Device::cpu, {rows, cols});
    t.stride[0] = ld;
    return t;
  }
};

HostMat make_mat(int64_t rows, int64_t cols, int64_t pad, Data kind, uint64_t seed) {
  HostMat m;
  m.rows = rows;
  m.cols = cols;
  m.ld = cols + pad;
  m.v.resize(size_t(rows * m.ld));
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  for (auto& x : m.v) {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;  // xorshift64: fast enough for the 100M-element Llama operands
    const uint32_t r = uint32_t(s >> 40);
    if (kind == Data::exact) {
      const int mag = 1 + int(r % 7);
      x = float((r & 0x100000) ? -mag : mag) / 8.f;
    } else {
      x = round_to_bf16(float(r) / 8388608.f - 1.f);
    }
  }
  return m;
}

// Device copy of a host matrix in `dt` (bf16 or f32), same shape and row stride.
struct DevMat {
  Buffer buf;
  Tensor t;
};

DevMat upload(const HostMat& m, DType dt) {
  DevMat d;
  NB_CHECK(Buffer::allocate(&d.buf, dt, Device::cuda, {m.rows, m.ld}).is_ok());
  if (dt == DType::bf16) {
    std::vector<bf16> bits(m.v.size());
    for (size_t i = 0; i < bits.size(); ++i) bits[i] = f32_to_bf16(m.v[i]);
    NB_CHECK(copy_bytes(d.buf.data(), Device::cuda, bits.data(), Device::cpu, bits.size() * 2).is_ok());
  } else {
    NB_CHECK(copy_bytes(d.buf.data(), Device::cuda, m.v.data(), Device::cpu, m.v.size() * 4).is_ok());
  }
  d.t = Tensor::make(d.buf.data(), dt, Device::cuda, {m.rows, m.cols});
  d.t.stride[0] = m.ld;
  return d;
}

std::vector<float> download(const DevMat& d) {
  const size_t n = size_t(d.t.shape[0] * d.t.stride[0]);
  std::vector<float> out(n);
  if (d.t.dtype == DType::bf16) {
    std::vector<bf16> bits(n);
    NB_CHECK(copy_bytes(bits.data(), Device::cpu, d.buf.data(), Device::cuda, n * 2).is_ok());
    for (size_t i = 0; i < n; ++i) out[i] = bf16_to_f32(bits[i]);
  } else {
    NB_CHECK(copy_bytes(out.data(), Device::cpu, d.buf.data(), Device::cuda, n * 4).is_ok());
  }
  return out;
}

HostMat abs_of(const HostMat& m) {
  HostMat r = m;
  for (auto& x : r.v) x = std::fabs(x);
  return r;
}

// One GPU matmul checked element by element against the CPU reference GEMM.
void check_vs_cpu(int64_t m, int64_t n, int64_t k, bool ta, bool tb, float alpha, float beta, DType c_dt, Data kind,
                  int64_t pad) {
  SCOPED_TRACE(testing::Message() << "M=" << m << " N=" << n << " K=" << k << " ta=" << ta << " tb=" << tb
                                  << " alpha=" << alpha << " beta=" << beta << " C=" << dtype_name(c_dt)
                                  << (kind == Data::exact ? " exact" : " full") << " pad=" << pad);
  HostMat a = ta ? make_mat(k, m, pad, kind, 11) : make_mat(m, k, pad, kind, 11);
  HostMat b = tb ? make_mat(n, k, pad, kind, 12) : make_mat(k, n, pad, kind, 12);
  HostMat c = make_mat(m, n, pad, kind, 13);  // BF16 values, so a bf16 C holds them exactly too
  DevMat da = upload(a, DType::bf16), db = upload(b, DType::bf16), dc = upload(c, c_dt);
  const GemmArgs args{ta, tb, alpha, beta};
  Status st = matmul(da.t, db.t, dc.t, args, nullptr);
  ASSERT_TRUE(st.is_ok()) << st.message();
  const std::vector<float> got = download(dc);

  HostMat ref = c, mag = abs_of(c);
  ASSERT_TRUE(matmul(a.cpu_tensor(), b.cpu_tensor(), ref.cpu_tensor(), args, nullptr).is_ok());
  HostMat abs_a = abs_of(a), abs_b = abs_of(b);
  ASSERT_TRUE(matmul(abs_a.cpu_tensor(), abs_b.cpu_tensor(), mag.cpu_tensor(),
                     {ta, tb, std::fabs(alpha), std::fabs(beta)}, nullptr)
                  .is_ok());
  // alpha * op(A) @ op(B) alone, for the two-rounding case of a bf16 C with beta != 0.
  const bool two_roundings = c_dt == DType::bf16 && beta != 0.f;
  HostMat product = c;
  ASSERT_TRUE(matmul(a.cpu_tensor(), b.cpu_tensor(), product.cpu_tensor(), {ta, tb, alpha, 0.f}, nullptr).is_ok());
  const double u_out = c_dt == DType::bf16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -24);
  int64_t bad = 0;
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      const size_t at = size_t(i * c.ld + j);
      const float r = ref.v[at], g = got[at];
      bool ok;
      if (kind == Data::exact) {
        const float want = c_dt == DType::bf16 ? round_to_bf16(r) : r;
        // Exact data: rne(t) + beta * c is exact in FP32, so this is the two-rounding result.
        const float want2 = round_to_bf16(round_to_bf16(product.v[at]) + beta * c.v[at]);
        ok = std::memcmp(&want, &g, 4) == 0 || (two_roundings && std::memcmp(&want2, &g, 4) == 0);
      } else {
        const double acc = double(k + 3) * std::ldexp(1.0, -23) * mag.v[at];
        const double acc_cpu = double(k + 3) * std::ldexp(1.0, -24) * mag.v[at];
        double tol = acc + acc_cpu + u_out * (std::fabs(r) + acc + acc_cpu);
        if (two_roundings) {
          const double e1 = acc + acc_cpu + u_out * (mag.v[at] + acc + acc_cpu);
          tol = e1 + u_out * (std::fabs(r) + e1);
        }
        ok = std::fabs(double(g) - r) <= tol;
      }
      if (!ok && ++bad <= 5) ADD_FAILURE() << "C[" << i << "," << j << "] gpu " << g << " cpu " << r;
    }
  }
  EXPECT_EQ(bad, 0);
  for (int64_t i = 0; i < m; ++i)  // the padding between rows is not C
    for (int64_t j = n; j < c.ld; ++j) EXPECT_EQ(got[size_t(i * c.ld + j)], c.v[size_t(i * c.ld + j)]);
}

struct Shape {
  int64_t m, n, k;
};

TEST(GemmGpu, OddShapesAllTransposesMatchCpuReference) {
  NB_REQUIRE_GPU();
  // Odd sizes (unaligned rows), aligned sizes (the fast kernels), and a small-M/N, long-K problem for
  // which the heuristic likes to split K (partial sums must still be added in FP32).
  const Shape shapes[] = {{17, 33, 64},    {5, 7, 3},    {31, 1, 129},   {1, 40, 16},
                          {130, 257, 300}, {48, 72, 96}, {64, 128, 256}, {16, 32, 8192}};
  const float ab[][2] = {{1.f, 0.f}, {0.5f, -1.25f}};
  for (const Shape& s : shapes)
    for (int t = 0; t < 4; ++t)
      for (const auto& x : ab)
        for (DType c_dt : {DType::bf16, DType::f32})
          for (Data kind : {Data::exact, Data::full})
            check_vs_cpu(s.m, s.n, s.k, t & 1, t & 2, x[0], x[1], c_dt, kind, 0);
}

TEST(GemmGpu, RowStridedOperands) {
  NB_REQUIRE_GPU();
  // pad 8 keeps rows 16-byte aligned (a column slice of a fused QKV output); pad 3 does not.
  for (int64_t pad : {8, 3})
    for (int t = 0; t < 4; ++t)
      for (Data kind : {Data::exact, Data::full})
        check_vs_cpu(48, 72, 96, t & 1, t & 2, 1.f, 1.f, DType::bf16, kind, pad);
}

TEST(GemmGpu, WeightGradientAccumulatesInFp32) {
  NB_REQUIRE_GPU();
  // dW[N,K] += dY^T X twice (two micro-batches) into an f32 buffer with beta = 1.
  const int64_t t = 96, n = 40, k = 24;
  HostMat dy = make_mat(t, n, 0, Data::exact, 21), x = make_mat(t, k, 0, Data::exact, 22);
  HostMat dw = make_mat(n, k, 0, Data::exact, 23);
  DevMat ddy = upload(dy, DType::bf16), dx = upload(x, DType::bf16), ddw = upload(dw, DType::f32);
  const GemmArgs wgrad{.trans_a = true, .beta = 1.f};
  for (int micro = 0; micro < 2; ++micro) {
    Status st = matmul(ddy.t, dx.t, ddw.t, wgrad, nullptr);
    ASSERT_TRUE(st.is_ok()) << st.message();
    ASSERT_TRUE(matmul(dy.cpu_tensor(), x.cpu_tensor(), dw.cpu_tensor(), wgrad, nullptr).is_ok());
  }
  EXPECT_EQ(download(ddw), dw.v);  // exact data: every partial sum is representable, so bit equality
}

// Checks `samples` random elements of a GPU result against FP64 dot products (exact for exact data).
void check_samples(const HostMat& a, bool ta, const HostMat& b, bool tb, const HostMat& c0, float beta,
                   const std::vector<float>& got, DType c_dt, int samples) {
  const int64_t m = ta ? a.cols : a.rows, k = ta ? a.rows : a.cols, n = tb ? b.rows : b.cols;
  std::mt19937_64 rng(uint64_t(m * n + k));
  int bad = 0;
  for (int s = 0; s < samples; ++s) {
    const int64_t i = int64_t(rng() % uint64_t(m)), j = int64_t(rng() % uint64_t(n));
    double sum = 0;
    for (int64_t kk = 0; kk < k; ++kk)
      sum += double(ta ? a.v[size_t(kk * a.ld + i)] : a.v[size_t(i * a.ld + kk)]) *
             double(tb ? b.v[size_t(j * b.ld + kk)] : b.v[size_t(kk * b.ld + j)]);
    if (beta != 0.f) sum += double(beta) * c0.v[size_t(i * c0.ld + j)];
    const float want = c_dt == DType::bf16 ? round_to_bf16(float(sum)) : float(sum);
    const float g = got[size_t(i * n + j)];
    if (std::memcmp(&want, &g, 4) != 0 && ++bad <= 5)
      ADD_FAILURE() << "C[" << i << "," << j << "] gpu " << g << " exact " << sum << " expected " << want;
  }
  EXPECT_EQ(bad, 0);
}

TEST(GemmGpu, Llama8BLayerShapesFpropDgradWgrad) {
  NB_REQUIRE_GPU();
  // T tokens of hidden h; layers: QKV (GQA, 6144 = 4096 + 2*1024), attention out, fused gate+up (2f), down.
  const int64_t T = 8192, h = 4096, f = 14336;
  const struct {
    const char* name;
    int64_t n, k;
  } layers[] = {{"qkv", 6144, h}, {"proj", h, h}, {"fc1", 2 * f, h}, {"fc2", h, f}};
  for (const auto& L : layers) {
    SCOPED_TRACE(L.name);
    HostMat x = make_mat(T, L.k, 0, Data::exact, 31), w = make_mat(L.n, L.k, 0, Data::exact, 32);
    HostMat dy = make_mat(T, L.n, 0, Data::exact, 33), dw0 = make_mat(L.n, L.k, 0, Data::exact, 34);
    HostMat none;  // C of the beta = 0 GEMMs is write-only
    DevMat dx_in = upload(x, DType::bf16), dw_in = upload(w, DType::bf16), ddy = upload(dy, DType::bf16);
    DevMat dwgrad = upload(dw0, DType::f32);
    {
      DevMat y = upload(make_mat(T, L.n, 0, Data::exact, 0), DType::bf16);
      Status st = matmul(dx_in.t, dw_in.t, y.t, {.trans_b = true}, nullptr);  // Fprop Y = X W^T
      ASSERT_TRUE(st.is_ok()) << st.message();
      check_samples(x, false, w, true, none, 0.f, download(y), DType::bf16, 256);
    }
    {
      DevMat dxg = upload(make_mat(T, L.k, 0, Data::exact, 0), DType::bf16);
      Status st = matmul(ddy.t, dw_in.t, dxg.t, {}, nullptr);  // Dgrad dX = dY W
      ASSERT_TRUE(st.is_ok()) << st.message();
      check_samples(dy, false, w, false, none, 0.f, download(dxg), DType::bf16, 256);
    }
    Status st = matmul(ddy.t, dx_in.t, dwgrad.t, {.trans_a = true, .beta = 1.f}, nullptr);  // Wgrad dW += dY^T X
    ASSERT_TRUE(st.is_ok()) << st.message();
    check_samples(dy, true, x, false, dw0, 1.f, download(dwgrad), DType::f32, 256);
  }
}

TEST(GemmGpu, PlansAreCachedPerProblem) {
  NB_REQUIRE_GPU();
  HostMat a = make_mat(24, 40, 0, Data::exact, 1), b = make_mat(56, 40, 0, Data::exact, 2);
  HostMat c = make_mat(24, 56, 0, Data::exact, 3);
  DevMat da = upload(a, DType::bf16), db = upload(b, DType::bf16), dc = upload(c, DType::bf16);
  const size_t before = cached_plan_count();
  ASSERT_TRUE(matmul(da.t, db.t, dc.t, {.trans_b = true}, nullptr).is_ok());
  EXPECT_EQ(cached_plan_count(), before + 1);
  ASSERT_TRUE(matmul(da.t, db.t, dc.t, {.trans_b = true, .alpha = 2.f}, nullptr).is_ok());  // alpha: same plan
  EXPECT_EQ(cached_plan_count(), before + 1);
  ASSERT_TRUE(matmul(da.t, db.t, dc.t, {.trans_b = true, .beta = 1.f}, nullptr).is_ok());  // beta != 0: new plan
  EXPECT_EQ(cached_plan_count(), before + 2);
}

TEST(GemmGpu, ErrorsAreStatuses) {
  NB_REQUIRE_GPU();
  HostMat a = make_mat(8, 8, 0, Data::exact, 1);
  DevMat f32a = upload(a, DType::f32), bfa = upload(a, DType::bf16);
  Status st = matmul(f32a.t, bfa.t, bfa.t, {}, nullptr);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("bf16"), std::string::npos) << st.message();
  Tensor k0a = Tensor::make(bfa.buf.data(), DType::bf16, Device::cuda, {8, 0});
  Tensor k0b = Tensor::make(bfa.buf.data(), DType::bf16, Device::cuda, {0, 8});
  st = matmul(k0a, k0b, bfa.t, {}, nullptr);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("K = 0"), std::string::npos) << st.message();
}

// The timing helpers behind `nibble bench gemm` work and return positive figures. Speed itself is the
// benchmark's business (its Hopper floor lives in cmd_bench_gemm.cpp): a test must not fail because the
// GPU is busy, slower, or running under compute-sanitizer.
TEST(GemmGpu, TimingHelpersReturnFigures) {
  NB_REQUIRE_GPU();
  double square = 0, fprop = 0, wgrad = 0, gbps = 0;
  Status st = measure_gemm_tflops(512, 512, 512, 3, &square);
  ASSERT_TRUE(st.is_ok()) << st.message();
  ASSERT_TRUE(measure_matmul_tflops(256, 384, 128, {.trans_b = true}, DType::bf16, 3, &fprop).is_ok());
  ASSERT_TRUE(measure_matmul_tflops(384, 128, 256, {.trans_a = true, .beta = 1.f}, DType::f32, 3, &wgrad).is_ok());
  ASSERT_TRUE(measure_copy_bandwidth(size_t(1) << 24, 3, &gbps).is_ok());
  EXPECT_GT(square, 0.0);
  EXPECT_GT(fprop, 0.0);
  EXPECT_GT(wgrad, 0.0);
  EXPECT_GT(gbps, 0.0);
}

}  // namespace
}  // namespace nb::gemm
