// cuDNN attention over packed segments (the ragged "THD" graphs) against the FP64-accumulating CPU
// reference given the same segments: short, single-token and odd-length segments, many segments (slot
// padding), one segment per row, MHA/GQA/MQA, B = 2, starts with and without the host copy; plus a
// check that nothing is written past the last token, that nothing past it is read, and a timing print.
//
// Tolerance: exactly attention_cudnn_test's (inputs are bf16 and fed to the reference exactly; cuDNN's
// bf16 outputs and its bf16 P and dS give relative L2 errors ~2e-3 .. 4e-3): relative L2 <= 1e-2 for
// out, dq, dk, dv over the whole tensors and max |lse diff| <= 1e-3. Stricter, the same 1e-2 holds for
// each segment's own tokens, so that one wrong short segment cannot hide in the average: for out and dv
// of every segment, for dq and dk of segments of 16 tokens or more. A shorter segment's dq/dk come from
// a few dS = P (dP - rowsum(dO * O)) terms that nearly cancel, and the bf16 roundings of O and dS do not
// average out: emulating cuDNN's roundings on the CPU gives up to 4e-2 for 2-token and 1e-2 for 3-token
// segments, but <= 4.6e-3 from 16 tokens on (and <= 5e-3 over the whole tensors). Where a reference is
// exactly 0 (dq and dk when every segment is one token) a relative error means nothing and is skipped.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/gpu.h"
#include "core/bf16.h"
#include "ops/attention.h"

namespace nb::ops {
namespace {

constexpr int64_t kTail = 256;  // tokens past T in every device buffer: outputs must leave them alone

// A device buffer of `main` bytes followed by `tail` bytes, every byte 0xFF at first (NaN in bf16/f32).
struct Buf {
  void* p = nullptr;
  size_t main = 0, tail = 0;
  Buf(size_t main_bytes, size_t tail_bytes) : main(main_bytes), tail(tail_bytes) {
    EXPECT_EQ(cudaMalloc(&p, main + tail), cudaSuccess);
    EXPECT_EQ(cudaMemset(p, 0xFF, main + tail), cudaSuccess);
  }
  ~Buf() { cudaFree(p); }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  char* at(size_t byte) const { return static_cast<char*>(p) + byte; }
  bool tail_untouched() const {
    std::vector<unsigned char> h(tail);
    EXPECT_EQ(cudaMemcpy(h.data(), at(main), tail, cudaMemcpyDeviceToHost), cudaSuccess);
    return std::all_of(h.begin(), h.end(), [](unsigned char c) { return c == 0xFF; });
  }
};

std::vector<float> random_bf16_values(size_t n, std::mt19937& rng) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> x(n);
  for (float& v : x) v = round_to_bf16(dist(rng));
  return x;
}

// Uploads x as bf16 into b's main part; the tail gets finite noise, or stays NaN with nan_tail.
void upload_bf16(const Buf& b, const std::vector<float>& x, bool nan_tail, std::mt19937& rng) {
  std::vector<bf16> h(x.size() + b.tail / 2);
  for (size_t i = 0; i < x.size(); ++i) h[i] = f32_to_bf16(x[i]);
  const std::vector<float> noise = random_bf16_values(h.size() - x.size(), rng);
  for (size_t i = x.size(); i < h.size(); ++i)
    h[i] = nan_tail ? f32_to_bf16(std::numeric_limits<float>::quiet_NaN()) : f32_to_bf16(noise[i - x.size()]);
  ASSERT_EQ(cudaMemcpy(b.p, h.data(), h.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
}

std::vector<float> download_bf16(const Buf& b, size_t n) {
  std::vector<bf16> h(n);
  EXPECT_EQ(cudaMemcpy(h.data(), b.p, n * 2, cudaMemcpyDeviceToHost), cudaSuccess);
  std::vector<float> r(n);
  for (size_t i = 0; i < n; ++i) r[i] = bf16_to_f32(h[i]);
  return r;
}

// Relative L2 error over tokens [t0, t0 + n) of [T, width] tensors.
double segment_rel_l2(const std::vector<float>& got, const std::vector<float>& want, int64_t t0, int64_t n,
                      int64_t width) {
  double num = 0.0, den = 0.0;
  for (int64_t i = t0 * width; i < (t0 + n) * width; ++i) {
    const double d = double(got[size_t(i)]) - double(want[size_t(i)]);
    num += d * d;
    den += double(want[size_t(i)]) * double(want[size_t(i)]);
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

// Starts of rows of S tokens cut into segments of the given lengths (each row's lengths sum to S).
std::vector<int32_t> starts_from_lengths(const std::vector<int32_t>& lengths) {
  std::vector<int32_t> starts = {0};
  for (int32_t n : lengths) starts.push_back(starts.back() + n);
  return starts;
}

// Random lengths in [lo, hi] filling `rows` rows of S tokens (the last one of a row takes the rest).
std::vector<int32_t> random_lengths(int64_t rows, int64_t S, int32_t lo, int32_t hi, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> len(lo, hi);
  std::vector<int32_t> out;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t left = S; left > 0;) {
      const int32_t n = int32_t(std::min<int64_t>(left, len(rng)));
      out.push_back(n);
      left -= n;
    }
  return out;
}

struct Options {
  bool host_starts = true;  // else only starts_device and max_len are given
  bool nan_tails = false;   // inputs' tails NaN: any read past the last token poisons the results
};

// The host side of one problem: bf16-exact inputs and the CPU reference outputs.
struct Reference {
  std::vector<float> q, k, v, dout, out, lse, dq, dk, dv;
};

Reference reference(const AttentionShape& sh, const AttentionSegments& seg, std::mt19937& rng) {
  const int64_t B = sh.batch, S = sh.seq, Hq = sh.heads, Hkv = sh.kv_heads, D = sh.head_dim;
  const size_t nq = size_t(B * S * Hq * D), nkv = size_t(B * S * Hkv * D);
  Reference r;
  r.q = random_bf16_values(nq, rng);
  r.k = random_bf16_values(nkv, rng);
  r.v = random_bf16_values(nkv, rng);
  r.dout = random_bf16_values(nq, rng);
  r.out.resize(nq);
  r.lse.resize(size_t(B * S * Hq));
  r.dq.resize(nq);
  r.dk.resize(nkv);
  r.dv.resize(nkv);
  auto host = [](std::vector<float>& x, std::initializer_list<int64_t> dims) {
    return Tensor::make(x.data(), DType::f32, Device::cpu, dims);
  };
  const Tensor q = host(r.q, {B, S, Hq, D}), k = host(r.k, {B, S, Hkv, D}), v = host(r.v, {B, S, Hkv, D});
  const Tensor out = host(r.out, {B, S, Hq, D}), lse = host(r.lse, {B, S, Hq});
  Status st = attention_forward_ref(sh, q, k, v, out, lse, &seg);
  EXPECT_TRUE(st.is_ok()) << st.message();
  st = attention_backward_ref(sh, q, k, v, out, host(r.dout, {B, S, Hq, D}), lse, host(r.dq, {B, S, Hq, D}),
                              host(r.dk, {B, S, Hkv, D}), host(r.dv, {B, S, Hkv, D}), &seg);
  EXPECT_TRUE(st.is_ok()) << st.message();
  return r;
}

// Whole-tensor and per-segment comparison of one output or gradient ([T, width] tensors); segments
// shorter than min_len are left to the whole-tensor check (see the top of the file).
void expect_close(const char* name, const std::vector<float>& got, const std::vector<float>& want,
                  const std::vector<int32_t>& starts, int64_t width, int64_t min_len) {
  const int64_t T = starts.back();
  const bool all_zero = std::all_of(want.begin(), want.end(), [](float x) { return x == 0.0f; });
  if (!all_zero) { EXPECT_LE(segment_rel_l2(got, want, 0, T, width), 1e-2) << name << " over all tokens"; }
  int64_t bad = 0;
  for (size_t i = 0; i + 1 < starts.size(); ++i) {
    const int64_t t0 = starts[i], n = starts[i + 1] - starts[i];
    if (n < min_len) continue;
    const double e = segment_rel_l2(got, want, t0, n, width);
    if (!(e <= 1e-2) && bad++ < 5)
      ADD_FAILURE() << name << " of segment " << i << " (" << n << " tokens): rel L2 " << e;
  }
  EXPECT_EQ(bad, 0) << name << ": segments over tolerance";
}

void check_packed(const AttentionShape& sh, const std::vector<int32_t>& starts, uint32_t seed, Options opt = {}) {
  const int64_t B = sh.batch, S = sh.seq, Hq = sh.heads, Hkv = sh.kv_heads, D = sh.head_dim, T = B * S;
  SCOPED_TRACE(testing::Message() << "B=" << B << " S=" << S << " Hq=" << Hq << " Hkv=" << Hkv << " D=" << D << ", "
                                  << starts.size() - 1 << " segments");
  ASSERT_EQ(starts.back(), T);
  AttentionSegments seg;
  seg.count = int64_t(starts.size()) - 1;
  seg.starts = starts.data();
  std::mt19937 rng(seed);
  const Reference r = reference(sh, seg, rng);

  const size_t nq = size_t(T * Hq * D), nkv = size_t(T * Hkv * D);
  const size_t tq = size_t(kTail * Hq * D) * 2, tkv = size_t(kTail * Hkv * D) * 2;
  Buf q(nq * 2, tq), k(nkv * 2, tkv), v(nkv * 2, tkv), dout(nq * 2, tq), out(nq * 2, tq), dq(nq * 2, tq);
  Buf dk(nkv * 2, tkv), dv(nkv * 2, tkv), lse(size_t(T * Hq) * 4, size_t(kTail * Hq) * 4),
      dstarts(starts.size() * 4, 0);
  upload_bf16(q, r.q, opt.nan_tails, rng);
  upload_bf16(k, r.k, opt.nan_tails, rng);
  upload_bf16(v, r.v, opt.nan_tails, rng);
  upload_bf16(dout, r.dout, opt.nan_tails, rng);
  ASSERT_EQ(cudaMemcpy(dstarts.p, starts.data(), starts.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  seg.starts_device = static_cast<const int32_t*>(dstarts.p);
  if (!opt.host_starts) {
    seg.max_len = attention_segments_max_len(seg);
    seg.starts = nullptr;
  }
  auto dev = [](const Buf& b, DType dt, std::initializer_list<int64_t> dims) {
    return Tensor::make(b.p, dt, Device::cuda, dims);
  };
  const Tensor Q = dev(q, DType::bf16, {B, S, Hq, D}), K = dev(k, DType::bf16, {B, S, Hkv, D});
  const Tensor V = dev(v, DType::bf16, {B, S, Hkv, D}), O = dev(out, DType::bf16, {B, S, Hq, D});
  const Tensor L = dev(lse, DType::f32, {B, Hq, S}), DO = dev(dout, DType::bf16, {B, S, Hq, D});
  Status st = attention_forward(sh, Q, K, V, O, L, nullptr, &seg);
  ASSERT_TRUE(st.is_ok()) << st.message();
  st = attention_backward(sh, Q, K, V, O, DO, L, dev(dq, DType::bf16, {B, S, Hq, D}),
                          dev(dk, DType::bf16, {B, S, Hkv, D}), dev(dv, DType::bf16, {B, S, Hkv, D}), nullptr, &seg);
  ASSERT_TRUE(st.is_ok()) << st.message();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  std::vector<float> g_lse(size_t(T * Hq));
  ASSERT_EQ(cudaMemcpy(g_lse.data(), lse.p, g_lse.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  double lse_err = 0.0;
  for (size_t i = 0; i < g_lse.size(); ++i) lse_err = std::max(lse_err, std::fabs(double(g_lse[i]) - r.lse[i]));
  EXPECT_LE(lse_err, 1e-3) << "lse (token-major [T, Hq])";
  const std::vector<float> g_out = download_bf16(out, nq), g_dq = download_bf16(dq, nq);
  const std::vector<float> g_dk = download_bf16(dk, nkv), g_dv = download_bf16(dv, nkv);
  expect_close("out", g_out, r.out, starts, Hq * D, 1);
  expect_close("dq", g_dq, r.dq, starts, Hq * D, 16);
  expect_close("dk", g_dk, r.dk, starts, Hkv * D, 16);
  expect_close("dv", g_dv, r.dv, starts, Hkv * D, 1);
  std::printf(
      "  B=%lld S=%lld Hq=%lld Hkv=%lld D=%lld, %zu segments: rel L2 out %.2e dq %.2e dk %.2e dv %.2e, lse %.2e\n",
      (long long)B, (long long)S, (long long)Hq, (long long)Hkv, (long long)D, starts.size() - 1,
      segment_rel_l2(g_out, r.out, 0, T, Hq * D), segment_rel_l2(g_dq, r.dq, 0, T, Hq * D),
      segment_rel_l2(g_dk, r.dk, 0, T, Hkv * D), segment_rel_l2(g_dv, r.dv, 0, T, Hkv * D), lse_err);
  EXPECT_TRUE(out.tail_untouched()) << "out written past the last token";
  EXPECT_TRUE(lse.tail_untouched()) << "lse written past the last token";
  EXPECT_TRUE(dq.tail_untouched()) << "dq written past the last token";
  EXPECT_TRUE(dk.tail_untouched()) << "dk written past the last token";
  EXPECT_TRUE(dv.tail_untouched()) << "dv written past the last token";
}

AttentionShape shape(int64_t B, int64_t S, int64_t Hq, int64_t Hkv, int64_t D) {
  return {B, S, Hq, Hkv, D, float(1.0 / std::sqrt(double(D)))};
}

// Two rows: single tokens, odd lengths, a segment ending at the row end, a whole row.
TEST(AttentionSegmentsCudnn, MixedLengthsGqa) {
  NB_REQUIRE_GPU();
  check_packed(shape(2, 128, 4, 2, 64), starts_from_lengths({1, 7, 33, 64, 23, 50, 1, 1, 76}), 1);
  check_packed(shape(2, 128, 4, 2, 64), starts_from_lengths({128, 1, 127}), 2);
}

// 86 short segments (odd lengths, slots padded from 86 to 128), MQA and MHA.
TEST(AttentionSegmentsCudnn, ManyShortSegments) {
  NB_REQUIRE_GPU();
  std::vector<int32_t> threes(85, 3);
  threes.push_back(1);
  check_packed(shape(1, 256, 4, 1, 128), starts_from_lengths(threes), 3);
  check_packed(shape(1, 256, 4, 4, 64), starts_from_lengths(threes), 4);
}

// 32 segments fill the smallest slot bucket exactly; 33 need the next one.
TEST(AttentionSegmentsCudnn, SlotBucketEdges) {
  NB_REQUIRE_GPU();
  check_packed(shape(1, 96, 4, 2, 64), starts_from_lengths(std::vector<int32_t>(32, 3)), 5);
  check_packed(shape(1, 99, 4, 2, 64), starts_from_lengths(std::vector<int32_t>(33, 3)), 6);
}

// Every token its own segment: out copies v, dv is dout summed over each head group, dq = dk = 0.
TEST(AttentionSegmentsCudnn, AllSingleTokens) {
  NB_REQUIRE_GPU();
  check_packed(shape(2, 40, 4, 2, 64), starts_from_lengths(std::vector<int32_t>(80, 1)), 7);
}

// One segment per row (odd S, MHA) is plain causal attention; and the whole-row graphs still work
// next to the packed ones in the plan cache.
TEST(AttentionSegmentsCudnn, OneSegmentPerRow) {
  NB_REQUIRE_GPU();
  check_packed(shape(2, 77, 4, 4, 64), {0, 77, 154}, 8);
  check_packed(shape(2, 128, 4, 2, 64), {0, 128, 256}, 9);
}

// Llama-like heads, random segment lengths 1..400 over two rows of 1024.
TEST(AttentionSegmentsCudnn, LlamaHeadsRandomLengths) {
  NB_REQUIRE_GPU();
  check_packed(shape(2, 1024, 32, 8, 128), starts_from_lengths(random_lengths(2, 1024, 1, 400, 10)), 10);
}

// The CUDA path needs only starts_device and max_len.
TEST(AttentionSegmentsCudnn, DeviceStartsOnly) {
  NB_REQUIRE_GPU();
  Options opt;
  opt.host_starts = false;
  check_packed(shape(2, 128, 4, 2, 64), starts_from_lengths({1, 7, 33, 64, 23, 50, 1, 1, 76}), 11, opt);
}

// NaN past the last token of q/k/v/dout: a read of it (by the last segment's tiles) would poison out
// or the gradients. Our arena keeps other buffers there, so such reads must not matter.
TEST(AttentionSegmentsCudnn, ReadsNothingPastTheLastToken) {
  NB_REQUIRE_GPU();
  Options opt;
  opt.nan_tails = true;
  check_packed(shape(2, 128, 4, 2, 64), starts_from_lengths({1, 7, 33, 64, 23, 50, 1, 1, 75, 1}), 12, opt);
  check_packed(shape(1, 256, 4, 1, 128), starts_from_lengths(std::vector<int32_t>(128, 2)), 13, opt);
}

TEST(AttentionSegmentsCudnn, RefusesSegmentsCrossingRows) {
  NB_REQUIRE_GPU();
  const AttentionShape sh = shape(2, 64, 4, 2, 64);
  Buf buf(size_t(2 * 64 * 4 * 64) * 4, 0);
  const std::vector<int32_t> starts = {0, 60, 70, 128};
  AttentionSegments seg;
  seg.count = 3;
  seg.starts = starts.data();
  seg.starts_device = starts.data();  // never read: the host check refuses first
  const Tensor q = Tensor::make(buf.p, DType::bf16, Device::cuda, {2, 64, 4, 64});
  const Tensor kv = Tensor::make(buf.p, DType::bf16, Device::cuda, {2, 64, 2, 64});
  const Tensor lse = Tensor::make(buf.p, DType::f32, Device::cuda, {2, 4, 64});
  const Status st = attention_forward(sh, q, kv, kv, q, lse, nullptr, &seg);
  EXPECT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("crosses the end of row 0"), std::string::npos) << st.message();
}

// The device tensors of one timed problem.
struct Io {
  Tensor q, k, v, o, lse, dout, dq, dk, dv;
};

// Mean forward and backward time of `iters` calls after two warm-up rounds (plan builds), printed with
// TFLOP/s counted over `pairs` causal (query, key) pairs per head.
void time_calls(const char* what, const AttentionShape& sh, const Io& t, const AttentionSegments* seg, double pairs) {
  for (int warm = 0; warm < 2; ++warm) {
    ASSERT_TRUE(attention_forward(sh, t.q, t.k, t.v, t.o, t.lse, nullptr, seg).is_ok());
    ASSERT_TRUE(attention_backward(sh, t.q, t.k, t.v, t.o, t.dout, t.lse, t.dq, t.dk, t.dv, nullptr, seg).is_ok());
  }
  cudaEvent_t a, b, c;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  cudaEventCreate(&c);
  const int iters = 20;
  cudaEventRecord(a);
  for (int i = 0; i < iters; ++i) ASSERT_TRUE(attention_forward(sh, t.q, t.k, t.v, t.o, t.lse, nullptr, seg).is_ok());
  cudaEventRecord(b);
  for (int i = 0; i < iters; ++i)
    ASSERT_TRUE(attention_backward(sh, t.q, t.k, t.v, t.o, t.dout, t.lse, t.dq, t.dk, t.dv, nullptr, seg).is_ok());
  cudaEventRecord(c);
  ASSERT_EQ(cudaEventSynchronize(c), cudaSuccess);
  float fwd_ms = 0, bwd_ms = 0;
  cudaEventElapsedTime(&fwd_ms, a, b);
  cudaEventElapsedTime(&bwd_ms, b, c);
  fwd_ms /= iters;
  bwd_ms /= iters;
  const double fwd_flops = 4.0 * double(sh.heads) * double(sh.head_dim) * pairs;
  std::printf("  timing %s: forward %.3f ms = %.0f TFLOP/s, backward %.3f ms = %.0f TFLOP/s, workspace %.1f MiB\n",
              what, fwd_ms, fwd_flops / (fwd_ms * 1e-3) / 1e12, bwd_ms, 2.5 * fwd_flops / (bwd_ms * 1e-3) / 1e12,
              attention_workspace_bytes() / 1048576.0);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  cudaEventDestroy(c);
}

// Packed training shape vs the same tokens as whole rows; TFLOP/s count the causal scores each really
// needs (len^2 / 2 per segment, S^2 / 2 per row).
TEST(AttentionSegmentsCudnn, TimingPrint) {
  NB_REQUIRE_GPU();
  const AttentionShape sh = shape(2, 4096, 32, 8, 128);
  const int64_t B = sh.batch, S = sh.seq, T = B * S, nq = T * 32 * 128, nkv = T * 8 * 128;
  const std::vector<int32_t> starts = starts_from_lengths(random_lengths(B, S, 100, 1500, 20));
  Buf q(nq * 2, 0), k(nkv * 2, 0), v(nkv * 2, 0), o(nq * 2, 0), lse(T * 32 * 4, 0), dO(nq * 2, 0);
  Buf dq(nq * 2, 0), dk(nkv * 2, 0), dv(nkv * 2, 0), dstarts(starts.size() * 4, 0);
  std::mt19937 rng(21);
  upload_bf16(q, random_bf16_values(size_t(nq), rng), false, rng);
  upload_bf16(k, random_bf16_values(size_t(nkv), rng), false, rng);
  upload_bf16(v, random_bf16_values(size_t(nkv), rng), false, rng);
  upload_bf16(dO, random_bf16_values(size_t(nq), rng), false, rng);
  ASSERT_EQ(cudaMemcpy(dstarts.p, starts.data(), starts.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  AttentionSegments seg;
  seg.count = int64_t(starts.size()) - 1;
  seg.starts = starts.data();
  seg.starts_device = static_cast<const int32_t*>(dstarts.p);
  auto dev = [](const Buf& b, DType dt, std::initializer_list<int64_t> dims) {
    return Tensor::make(b.p, dt, Device::cuda, dims);
  };
  const Io io{dev(q, DType::bf16, {B, S, 32, 128}),  dev(k, DType::bf16, {B, S, 8, 128}),
              dev(v, DType::bf16, {B, S, 8, 128}),   dev(o, DType::bf16, {B, S, 32, 128}),
              dev(lse, DType::f32, {B, 32, S}),      dev(dO, DType::bf16, {B, S, 32, 128}),
              dev(dq, DType::bf16, {B, S, 32, 128}), dev(dk, DType::bf16, {B, S, 8, 128}),
              dev(dv, DType::bf16, {B, S, 8, 128})};
  double pairs = 0;
  for (size_t i = 0; i + 1 < starts.size(); ++i) {
    const double n = starts[i + 1] - starts[i];
    pairs += 0.5 * n * n;
  }
  time_calls("whole rows B=2 S=4096 Hq=32 Hkv=8 D=128", sh, io, nullptr, double(B) * S * S / 2.0);
  const std::string what = "packed, " + std::to_string(seg.count) + " segments of 100..1500 tokens";
  time_calls(what.c_str(), sh, io, &seg, pairs);
}

}  // namespace
}  // namespace nb::ops
