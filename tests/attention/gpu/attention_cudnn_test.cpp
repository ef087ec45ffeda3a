// cuDNN fused attention (bf16) against the FP64-accumulating CPU reference, forward and backward, at
// tiny, odd and realistic shapes; plus a timing print at the Llama-8B-like training shape.
//
// Tolerance: inputs are bf16 and fed to the reference exactly, so the only differences are cuDNN's
// rounding. Its outputs are bf16 (RMS relative rounding ~2^-9/sqrt(3) ~ 1.1e-3) and it rounds P and dS
// to bf16 before the second GEMMs (another ~1e-3 each, averaged over the row). Expected relative L2
// errors are therefore ~2e-3 .. 4e-3; we require <= 1e-2 (a wrong mask, scale or GQA mapping gives
// errors of order 1e-1 .. 1). lse is FP32 in both: we require max |diff| <= 1e-3 (lse ~ log S ~ 8).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "attention/gpu/attention_gpu_util.h"
#include "common/gpu.h"
#include "core/bf16.h"
#include "ops/attention.h"

namespace nb::ops {
namespace {

struct DeviceArray {
  void* p = nullptr;
  explicit DeviceArray(size_t bytes) { EXPECT_EQ(cudaMalloc(&p, bytes), cudaSuccess); }
  ~DeviceArray() { cudaFree(p); }
};

std::vector<bf16> to_bf16(const std::vector<float>& x) {
  std::vector<bf16> r(x.size());
  for (size_t i = 0; i < x.size(); ++i) r[i] = f32_to_bf16(x[i]);
  return r;
}

std::vector<float> download_bf16(const void* d, size_t n) {
  std::vector<bf16> h(n);
  EXPECT_EQ(cudaMemcpy(h.data(), d, n * 2, cudaMemcpyDeviceToHost), cudaSuccess);
  std::vector<float> r(n);
  for (size_t i = 0; i < n; ++i) r[i] = bf16_to_f32(h[i]);
  return r;
}

Tensor host_tensor(std::vector<float>& v, std::initializer_list<int64_t> dims) {
  return Tensor::make(v.data(), DType::f32, Device::cpu, dims);
}

void check_against_reference(int64_t B, int64_t S, int64_t Hq, int64_t Hkv, int64_t D, uint32_t seed) {
  SCOPED_TRACE(testing::Message() << "B=" << B << " S=" << S << " Hq=" << Hq << " Hkv=" << Hkv << " D=" << D);
  const AttentionShape sh{B, S, Hq, Hkv, D, float(1.0 / std::sqrt(double(D)))};
  const size_t nq = size_t(B * S * Hq * D), nkv = size_t(B * S * Hkv * D), nstat = size_t(B * Hq * S);
  std::mt19937 rng(seed);
  std::vector<float> q = random_bf16_values(nq, rng), k = random_bf16_values(nkv, rng);
  std::vector<float> v = random_bf16_values(nkv, rng), dout = random_bf16_values(nq, rng);

  // Reference on the exact bf16 values.
  std::vector<float> out(nq), lse(nstat), dq(nq), dk(nkv), dv(nkv);
  const Tensor tq = host_tensor(q, {B, S, Hq, D}), tk = host_tensor(k, {B, S, Hkv, D});
  const Tensor tv = host_tensor(v, {B, S, Hkv, D}), tout = host_tensor(out, {B, S, Hq, D});
  const Tensor tlse = host_tensor(lse, {B, Hq, S}), tdout = host_tensor(dout, {B, S, Hq, D});
  ASSERT_TRUE(attention_forward_ref(sh, tq, tk, tv, tout, tlse).is_ok());
  ASSERT_TRUE(attention_backward_ref(sh, tq, tk, tv, tout, tdout, tlse, host_tensor(dq, {B, S, Hq, D}),
                                     host_tensor(dk, {B, S, Hkv, D}), host_tensor(dv, {B, S, Hkv, D}))
                  .is_ok());

  // cuDNN.
  DeviceArray dq_(nq * 2), dk_(nkv * 2), dv_(nkv * 2), dout_(nq * 2), gq(nq * 2), gk(nkv * 2), gv(nkv * 2);
  DeviceArray gout(nq * 2), glse(nstat * 4);
  ASSERT_EQ(cudaMemcpy(gq.p, to_bf16(q).data(), nq * 2, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(gk.p, to_bf16(k).data(), nkv * 2, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(gv.p, to_bf16(v).data(), nkv * 2, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dout_.p, to_bf16(dout).data(), nq * 2, cudaMemcpyHostToDevice), cudaSuccess);
  auto dev = [](void* p, DType dt, std::initializer_list<int64_t> dims) {
    return Tensor::make(p, dt, Device::cuda, dims);
  };
  const Tensor Q = dev(gq.p, DType::bf16, {B, S, Hq, D}), K = dev(gk.p, DType::bf16, {B, S, Hkv, D});
  const Tensor V = dev(gv.p, DType::bf16, {B, S, Hkv, D}), O = dev(gout.p, DType::bf16, {B, S, Hq, D});
  const Tensor LSE = dev(glse.p, DType::f32, {B, Hq, S}), DO = dev(dout_.p, DType::bf16, {B, S, Hq, D});
  const Tensor DQ = dev(dq_.p, DType::bf16, {B, S, Hq, D}), DK = dev(dk_.p, DType::bf16, {B, S, Hkv, D});
  const Tensor DV = dev(dv_.p, DType::bf16, {B, S, Hkv, D});
  Status st = attention_forward(sh, Q, K, V, O, LSE, nullptr);
  ASSERT_TRUE(st.is_ok()) << st.message();
  st = attention_backward(sh, Q, K, V, O, DO, LSE, DQ, DK, DV, nullptr);
  ASSERT_TRUE(st.is_ok()) << st.message();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  std::vector<float> g_lse(nstat);
  ASSERT_EQ(cudaMemcpy(g_lse.data(), glse.p, nstat * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  double lse_err = 0.0;
  for (size_t i = 0; i < nstat; ++i) lse_err = std::max(lse_err, std::fabs(double(g_lse[i]) - lse[i]));
  const double e_out = rel_l2(download_bf16(gout.p, nq), out);
  const double e_dq = rel_l2(download_bf16(dq_.p, nq), dq);
  const double e_dk = rel_l2(download_bf16(dk_.p, nkv), dk);
  const double e_dv = rel_l2(download_bf16(dv_.p, nkv), dv);
  std::printf("  B=%lld S=%lld Hq=%lld Hkv=%lld D=%lld: rel L2 out %.2e dq %.2e dk %.2e dv %.2e, lse max err %.2e\n",
              (long long)B, (long long)S, (long long)Hq, (long long)Hkv, (long long)D, e_out, e_dq, e_dk, e_dv,
              lse_err);
  EXPECT_LE(lse_err, 1e-3);
  EXPECT_LE(e_out, 1e-2);
  EXPECT_LE(e_dq, 1e-2);
  EXPECT_LE(e_dk, 1e-2);
  EXPECT_LE(e_dv, 1e-2);
}

TEST(AttentionCudnn, TinyGqa) {
  NB_REQUIRE_GPU();
  check_against_reference(2, 128, 4, 2, 64, 1);
}

TEST(AttentionCudnn, OddSequenceLengths) {
  NB_REQUIRE_GPU();
  check_against_reference(1, 333, 4, 2, 64, 2);
  check_against_reference(2, 77, 4, 4, 64, 3);  // MHA path (no head-group reduction)
}

TEST(AttentionCudnn, LlamaHeadsShort) {
  NB_REQUIRE_GPU();
  check_against_reference(2, 128, 32, 8, 128, 4);
  check_against_reference(1, 1000, 32, 8, 128, 5);
}

TEST(AttentionCudnn, LlamaHeadsLong) {
  NB_REQUIRE_GPU();
  check_against_reference(1, 4096, 32, 8, 128, 6);
}

// Median-free simple timing: warm-up (builds and caches the plans), then the mean of `iters` runs.
void time_shape(int64_t B, int64_t S, int64_t Hq, int64_t Hkv, int64_t D) {
  const AttentionShape sh{B, S, Hq, Hkv, D, float(1.0 / std::sqrt(double(D)))};
  const size_t nq = size_t(B * S * Hq * D), nkv = size_t(B * S * Hkv * D), nstat = size_t(B * Hq * S);
  DeviceArray q(nq * 2), k(nkv * 2), v(nkv * 2), o(nq * 2), lse(nstat * 4), dO(nq * 2), dq(nq * 2), dk(nkv * 2),
      dv(nkv * 2);
  std::mt19937 rng(9);
  ASSERT_EQ(cudaMemcpy(q.p, to_bf16(random_bf16_values(nq, rng)).data(), nq * 2, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(k.p, to_bf16(random_bf16_values(nkv, rng)).data(), nkv * 2, cudaMemcpyHostToDevice),
            cudaSuccess);
  ASSERT_EQ(cudaMemcpy(v.p, to_bf16(random_bf16_values(nkv, rng)).data(), nkv * 2, cudaMemcpyHostToDevice),
            cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dO.p, to_bf16(random_bf16_values(nq, rng)).data(), nq * 2, cudaMemcpyHostToDevice), cudaSuccess);
  auto dev = [](void* p, DType dt, std::initializer_list<int64_t> dims) {
    return Tensor::make(p, dt, Device::cuda, dims);
  };
  const Tensor Q = dev(q.p, DType::bf16, {B, S, Hq, D}), K = dev(k.p, DType::bf16, {B, S, Hkv, D});
  const Tensor V = dev(v.p, DType::bf16, {B, S, Hkv, D}), O = dev(o.p, DType::bf16, {B, S, Hq, D});
  const Tensor L = dev(lse.p, DType::f32, {B, Hq, S}), DO = dev(dO.p, DType::bf16, {B, S, Hq, D});
  const Tensor DQ = dev(dq.p, DType::bf16, {B, S, Hq, D}), DK = dev(dk.p, DType::bf16, {B, S, Hkv, D});
  const Tensor DV = dev(dv.p, DType::bf16, {B, S, Hkv, D});

  auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(attention_forward(sh, Q, K, V, O, L, nullptr).is_ok());
  ASSERT_TRUE(attention_backward(sh, Q, K, V, O, DO, L, DQ, DK, DV, nullptr).is_ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const double first_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();

  cudaEvent_t a, b, c;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  cudaEventCreate(&c);
  const int iters = 20;
  cudaEventRecord(a);
  for (int i = 0; i < iters; ++i) ASSERT_TRUE(attention_forward(sh, Q, K, V, O, L, nullptr).is_ok());
  cudaEventRecord(b);
  for (int i = 0; i < iters; ++i) ASSERT_TRUE(attention_backward(sh, Q, K, V, O, DO, L, DQ, DK, DV, nullptr).is_ok());
  cudaEventRecord(c);
  ASSERT_EQ(cudaEventSynchronize(c), cudaSuccess);
  float fwd_ms = 0, bwd_ms = 0;
  cudaEventElapsedTime(&fwd_ms, a, b);
  cudaEventElapsedTime(&bwd_ms, b, c);
  fwd_ms /= iters;
  bwd_ms /= iters;
  const double fwd_flops = 2.0 * 2.0 * double(B) * Hq * double(S) * S * D / 2.0;  // causal: half the scores
  const double bwd_flops = 2.5 * fwd_flops;
  std::printf(
      "  timing B=%lld S=%lld Hq=%lld Hkv=%lld D=%lld: forward %.3f ms = %.0f TFLOP/s, backward %.3f ms = "
      "%.0f TFLOP/s (first call incl. plan build %.0f ms, workspace %.1f MiB)\n",
      (long long)B, (long long)S, (long long)Hq, (long long)Hkv, (long long)D, fwd_ms,
      fwd_flops / (fwd_ms * 1e-3) / 1e12, bwd_ms, bwd_flops / (bwd_ms * 1e-3) / 1e12, first_ms,
      attention_workspace_bytes() / 1048576.0);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  cudaEventDestroy(c);
}

TEST(AttentionCudnn, TimingPrint) {
  NB_REQUIRE_GPU();
  time_shape(2, 4096, 32, 8, 128);
  time_shape(1, 8192, 32, 8, 128);
}

TEST(AttentionCudnn, RejectsWrongDtype) {
  NB_REQUIRE_GPU();
  const AttentionShape sh{1, 64, 4, 2, 64, 0.125f};
  DeviceArray buf(64 * 4 * 64 * 4);
  const Tensor f32_q = Tensor::make(buf.p, DType::f32, Device::cuda, {1, 64, 4, 64});
  const Tensor kv = Tensor::make(buf.p, DType::bf16, Device::cuda, {1, 64, 2, 64});
  const Tensor lse = Tensor::make(buf.p, DType::f32, Device::cuda, {1, 4, 64});
  Status st = attention_forward(sh, f32_q, kv, kv, f32_q, lse, nullptr);
  EXPECT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("bf16"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace nb::ops
