// GPU ceiling measurements: GEMM TFLOP/s through matmul() and matmul_quantized() and D2D copy bandwidth (see
// gemm_bench.h for the method). Inputs come from Philox so every run measures the same data.
#include <algorithm>
#include <functional>
#include <vector>
#include "core/bf16.h"
#include "core/cuda_check.h"
#include "core/philox.h"
#include "gemm/gemm.h"
#include "gemm/gemm_bench.h"
#include "gemm/gemm_quantized.h"
#include "gemm/wgmma_gemm.h"

namespace nb::gemm {
namespace {

constexpr int kWarmupRuns = 3;

// Non-zero values (2r - 255) / 256 for a random byte r: odd multiples of 1/256 in (-1, 1), exact in BF16.
// Zeros would let the hardware save power and overstate the ceiling.
__global__ void fill_random_bf16(bf16* x, int64_t n, uint64_t seed) {
  const int64_t block = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (block * 16 >= n) return;
  const Philox4x32 r = philox_block(RngKey{seed, 0, 0}, uint64_t(block));
  for (int j = 0; j < 16 && block * 16 + j < n; ++j) {
    const float v = float(2 * int(philox_byte(r, j)) - 255) * (1.0f / 256.0f);
    x[block * 16 + j] = f32_to_bf16(v);
  }
}

void fill_random(bf16* x, int64_t n, uint64_t seed, cudaStream_t stream) {
  const int64_t blocks16 = (n + 15) / 16;
  const int threads = 256;
  fill_random_bf16<<<unsigned((blocks16 + threads - 1) / threads), threads, 0, stream>>>(x, n, seed);
  CUDA_CHECK_LAUNCH();
}

// Bytes written between timed runs so that each run starts with a cold L2, as it does inside a training
// step, where the operands were last touched by other kernels (a replay back to back would find part of a
// small GEMM's weight in L2 and overstate its ceiling): twice the L2 size. The buffer lives for the process.
Status l2_flush_buffer(void** buf, size_t* bytes) {
  static void* flush = nullptr;
  static size_t flush_bytes = 0;
  if (!flush) {
    int dev = 0, l2 = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev));
    flush_bytes = 2 * size_t(std::max(l2, 1 << 20));
    if (cudaMalloc(&flush, flush_bytes) != cudaSuccess) {
      (void)cudaGetLastError();
      flush = nullptr;
      return errorf("benchmark: cannot allocate %zu bytes to flush the L2 between timed runs", flush_bytes);
    }
  }
  *buf = flush;
  *bytes = flush_bytes;
  return Status::ok();
}

// Runs `step` kWarmupRuns times, then `iters` times between event pairs, each after an L2 flush (outside
// the events); returns the median in ms.
Status median_ms(int iters, cudaStream_t stream, const std::function<Status()>& step, double* ms) {
  if (iters < 1) return errorf("benchmark: iters must be at least 1, got %d", iters);
  void* flush = nullptr;
  size_t flush_bytes = 0;
  NB_TRY(l2_flush_buffer(&flush, &flush_bytes));
  for (int i = 0; i < kWarmupRuns; ++i) NB_TRY(step());
  std::vector<cudaEvent_t> events(size_t(2 * iters));
  for (auto& e : events) CUDA_CHECK(cudaEventCreate(&e));
  auto destroy_events = [&] {
    CUDA_CHECK(cudaStreamSynchronize(stream));
    for (auto& e : events) CUDA_CHECK(cudaEventDestroy(e));
  };
  for (int i = 0; i < iters; ++i) {
    CUDA_CHECK(cudaMemsetAsync(flush, i & 0xff, flush_bytes, stream));
    CUDA_CHECK(cudaEventRecord(events[2 * i], stream));
    Status st = step();
    CUDA_CHECK(cudaEventRecord(events[2 * i + 1], stream));
    if (!st) {
      destroy_events();
      return st;
    }
  }
  CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<double> times;
  for (int i = 0; i < iters; ++i) {
    float t = 0.f;
    CUDA_CHECK(cudaEventElapsedTime(&t, events[2 * i], events[2 * i + 1]));
    times.push_back(t);
  }
  destroy_events();
  std::sort(times.begin(), times.end());
  const size_t h = times.size() / 2;
  *ms = times.size() % 2 ? times[h] : 0.5 * (times[h - 1] + times[h]);
  return Status::ok();
}

// Random bytes for quantized codes and scales: byte & and_mask | or_mask, so that the bench never feeds
// NaN codes (they would not change the speed, but keep the operands what training produces).
__global__ void fill_random_bytes(uint8_t* x, int64_t n, uint64_t seed, uint32_t and_mask, uint32_t or_mask) {
  const int64_t block = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (block * 16 >= n) return;
  const Philox4x32 r = philox_block(RngKey{seed, 0, 0}, uint64_t(block));
  for (int j = 0; j < 16 && block * 16 + j < n; ++j)
    x[block * 16 + j] = uint8_t((philox_byte(r, j) & and_mask) | or_mask);
}

void fill_bytes(Buffer& b, uint64_t seed, uint32_t and_mask, uint32_t or_mask, cudaStream_t stream) {
  const int64_t n = b.tensor().bytes(), blocks16 = (n + 15) / 16;
  fill_random_bytes<<<unsigned((blocks16 + 255) / 256), 256, 0, stream>>>(b.ptr<uint8_t>(), n, seed, and_mask, or_mask);
  CUDA_CHECK_LAUNCH();
}

struct StreamOwner {
  cudaStream_t s = nullptr;
  StreamOwner() { CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); }
  ~StreamOwner() { CUDA_CHECK(cudaStreamDestroy(s)); }
};

}  // namespace

Status measure_matmul_tflops(int64_t m, int64_t n, int64_t k, const GemmArgs& args, DType c_dtype, int iters,
                             double* tflops) {
  if (m < 1 || n < 1 || k < 1)
    return errorf("GEMM timing: M, N, K must be positive, got %lld, %lld, %lld", (long long)m, (long long)n,
                  (long long)k);
  if (c_dtype != DType::bf16 && c_dtype != DType::f32) return errorf("GEMM timing: C must be bf16 or f32");
  Buffer a, b, c;
  if (args.trans_a)
    NB_TRY(Buffer::allocate(&a, DType::bf16, Device::cuda, {k, m}).context("GEMM timing"));
  else
    NB_TRY(Buffer::allocate(&a, DType::bf16, Device::cuda, {m, k}).context("GEMM timing"));
  if (args.trans_b)
    NB_TRY(Buffer::allocate(&b, DType::bf16, Device::cuda, {n, k}).context("GEMM timing"));
  else
    NB_TRY(Buffer::allocate(&b, DType::bf16, Device::cuda, {k, n}).context("GEMM timing"));
  NB_TRY(Buffer::allocate(&c, c_dtype, Device::cuda, {m, n}).context("GEMM timing"));
  StreamOwner stream;
  fill_random(a.ptr<bf16>(), m * k, 1, stream.s);
  fill_random(b.ptr<bf16>(), n * k, 2, stream.s);
  // C starts defined so that beta != 0 timings read real numbers, not leftover NaN bit patterns.
  CUDA_CHECK(cudaMemsetAsync(c.data(), 0, size_t(c.tensor().bytes()), stream.s));
  double ms = 0;
  NB_TRY(median_ms(
      iters, stream.s, [&] { return matmul(a.tensor(), b.tensor(), c.tensor(), args, stream.s); }, &ms));
  *tflops = 2.0 * double(m) * double(n) * double(k) / (ms * 1e-3) / 1e12;
  return Status::ok();
}

Status measure_gemm_tflops(int64_t m, int64_t n, int64_t k, int iters, double* tflops) {
  GemmArgs args;
  args.trans_b = true;
  return measure_matmul_tflops(m, n, k, args, DType::bf16, iters, tflops);
}

Status measure_in_loop_gemms(int64_t m, int64_t n, int64_t k, int iters, InLoopTflops* out) {
  Buffer a16, b16, c, scratch, codes8, scales8, codes4, scales4;
  NB_TRY(Buffer::allocate(&a16, DType::bf16, Device::cuda, {m, k}).context("in-loop GEMM timing"));
  NB_TRY(Buffer::allocate(&b16, DType::bf16, Device::cuda, {n, k}).context("in-loop GEMM timing"));
  NB_TRY(Buffer::allocate(&c, DType::bf16, Device::cuda, {m, n}).context("in-loop GEMM timing"));
  NB_TRY(Buffer::allocate(&scratch, DType::bf16, Device::cuda, {m, k}).context("in-loop GEMM timing"));
  NB_TRY(Buffer::allocate(&codes8, DType::u8, Device::cuda, {m, k}).context("in-loop GEMM timing"));
  NB_TRY(Buffer::allocate(&scales8, DType::u8, Device::cuda, {m, k / 32}).context("in-loop GEMM timing"));
  NB_TRY(Buffer::allocate(&codes4, DType::u8, Device::cuda, {m, k / 2}).context("in-loop GEMM timing"));
  NB_TRY(Buffer::allocate(&scales4, DType::u8, Device::cuda, {m, k / 16}).context("in-loop GEMM timing"));
  StreamOwner stream;
  fill_random(a16.ptr<bf16>(), m * k, 1, stream.s);
  fill_random(b16.ptr<bf16>(), n * k, 2, stream.s);
  fill_bytes(codes8, 3, 0xF7u, 0, stream.s);      // E4M3 without 0x7F/0xFF (NaN)
  fill_bytes(scales8, 4, 0x07u, 120, stream.s);   // E8M0 2^-7 .. 2^0
  fill_bytes(codes4, 5, 0xFFu, 0, stream.s);      // every E2M1 code
  fill_bytes(scales4, 6, 0x1Fu, 0x30, stream.s);  // positive normal E4M3
  const Tensor b = b16.tensor(), ct = c.tensor();
  GemmArgs args;
  args.trans_b = true;
  const double flop = 2.0 * double(m) * double(n) * double(k);
  auto tflops = [&](const std::function<Status()>& step, double* result) -> Status {
    double ms = 0;
    NB_TRY(median_ms(iters, stream.s, step, &ms));
    *result = flop / (ms * 1e-3) / 1e12;
    return Status::ok();
  };
  auto in_loop = [&](InLoopFormat f, const Buffer& data, const Buffer* scales) {
    const InLoopOperand op{f, data.data(), scales ? scales->ptr<uint8_t>() : nullptr};
    return [&, op] { return in_loop_gemm_cuda(op, b16.ptr<bf16>(), c.ptr<bf16>(), m, n, k, nullptr, stream.s); };
  };
  // The emulation with B given: dequantize A into BF16, then the BF16 cuBLASLt GEMM.
  auto emulated = [&](QFormat f, const Buffer& data, const Buffer& scales) {
    QOperand q;
    q.format = f;
    q.rows = m;
    q.k = k;
    q.data = data.data();
    q.scales = scales.data();
    return [&, q] {
      NB_TRY(dequantize_operand_cuda(q, scratch.data(), stream.s));
      return matmul(scratch.tensor(), b, ct, args, stream.s);
    };
  };
  NB_TRY(tflops([&] { return matmul(a16.tensor(), b, ct, args, stream.s); }, &out->cublaslt_bf16));
  NB_TRY(tflops(in_loop(InLoopFormat::bf16, a16, nullptr), &out->in_loop_bf16));
  NB_TRY(tflops(emulated(QFormat::mxfp8, codes8, scales8), &out->emulated_mxfp8));
  NB_TRY(tflops(in_loop(InLoopFormat::mxfp8, codes8, &scales8), &out->in_loop_mxfp8));
  NB_TRY(tflops(emulated(QFormat::nvfp4, codes4, scales4), &out->emulated_nvfp4));
  NB_TRY(tflops(in_loop(InLoopFormat::nvfp4, codes4, &scales4), &out->in_loop_nvfp4));
  return Status::ok();
}

namespace {
int64_t round_up(int64_t v, int64_t d) { return (v + d - 1) / d * d; }

// Bytes of an operand's codes and scales in `d`'s format (upper bounds that hold for either layout).
void operand_sizes(const GemmOperandDesc& d, int64_t rows, int64_t k, int64_t* data, int64_t* scales) {
  const int64_t kb = (k + 127) / 128, rb = (rows + 127) / 128;
  *data = rows * k;
  switch (d.format) {
    case QFormat::fp8_e4m3:
    case QFormat::fp8_e5m2: *scales = 4; break;
    case QFormat::fp8_block128: *scales = kb * round_up(rows, 4) * 4; break;
    case QFormat::fp8_block128x128: *scales = rb * round_up(kb, 4) * 4; break;
    case QFormat::mxfp8: *scales = rows * ((k + 31) / 32); break;
    case QFormat::nvfp4:
      *data = rows * ((k + 1) / 2);
      *scales = rows * ((k + 15) / 16);
      break;
    case QFormat::bf16:
      *data = rows * k * 2;
      *scales = 4;
      break;
  }
}

// One operand of a replayed call: random codes without NaN, positive scales (FP32 scales as the bytes
// 0x3C3C3C3C, about 0.0115; E8M0 2^-5; E4M3 1.0), an FP32 amax, and the BF16 copy when it is given.
struct ReplayOperand {
  Buffer data, scales, amax, bf16;
  QOperand op;
};
Status make_operand(const GemmOperandDesc& d, int64_t rows, int64_t k, uint64_t seed, cudaStream_t s,
                    ReplayOperand* out) {
  int64_t data_bytes = 0, scale_bytes = 0;
  operand_sizes(d, rows, k, &data_bytes, &scale_bytes);
  NB_TRY(Buffer::allocate(&out->data, DType::u8, Device::cuda, {data_bytes + 256}).context("GEMM replay"));
  NB_TRY(Buffer::allocate(&out->scales, DType::u8, Device::cuda, {scale_bytes + 256}).context("GEMM replay"));
  NB_TRY(Buffer::allocate(&out->amax, DType::f32, Device::cuda, {1}).context("GEMM replay"));
  const bool e5m2 = d.format == QFormat::fp8_e5m2, nvfp4 = d.format == QFormat::nvfp4;
  if (d.format == QFormat::bf16)
    fill_random(static_cast<bf16*>(out->data.data()), rows * k, seed, s);
  else
    fill_bytes(out->data, seed, nvfp4 ? 0xFFu : e5m2 ? 0xBFu : 0xF7u, 0, s);  // E4M3 without 0x7F, E5M2 finite
  const int scale_byte = nvfp4 ? 0x38 : d.format == QFormat::mxfp8 ? 122 : 0x3C;
  CUDA_CHECK(cudaMemsetAsync(out->scales.data(), scale_byte, size_t(scale_bytes + 256), s));
  CUDA_CHECK(cudaMemsetAsync(out->amax.data(), 0x43, sizeof(float), s));
  QOperand& q = out->op;
  q.format = d.format;
  q.rows = rows;
  q.k = k;
  q.data = out->data.data();
  q.scales = out->scales.data();
  q.amax = out->amax.ptr<float>();
  q.k_major = d.k_major;
  q.nvfp4_4over6 = d.four_over_six;
  if (d.given) {
    NB_TRY(Buffer::allocate(&out->bf16, DType::bf16, Device::cuda, {rows, k}).context("GEMM replay"));
    fill_random(out->bf16.ptr<bf16>(), rows * k, seed + 100, s);
    q.dequantized = out->bf16.data();
  }
  return Status::ok();
}
}  // namespace

Status measure_gemm_call_tflops(const GemmCall& call, int iters, double* tflops) {
  if (!call.quantized) return measure_matmul_tflops(call.m, call.n, call.k, call.args, call.c_dtype, iters, tflops);
  if (call.m < 1 || call.n < 1 || call.k < 1) return errorf("GEMM replay: M, N, K must be positive");
  StreamOwner stream;
  ReplayOperand a, b;
  NB_TRY(make_operand(call.a, call.m, call.k, 11, stream.s, &a));
  NB_TRY(make_operand(call.b, call.n, call.k, 12, stream.s, &b));
  Buffer c;
  NB_TRY(Buffer::allocate(&c, call.c_dtype, Device::cuda, {call.m, call.n}).context("GEMM replay"));
  CUDA_CHECK(cudaMemsetAsync(c.data(), 0, size_t(c.tensor().bytes()), stream.s));
  double ms = 0;
  NB_TRY(median_ms(
      iters, stream.s, [&] { return matmul_quantized(a.op, b.op, c.tensor(), call.qopt, stream.s); }, &ms));
  *tflops = call.flops() / (ms * 1e-3) / 1e12;
  return Status::ok();
}

Status measure_copy_bandwidth(size_t bytes, int iters, double* gbps) {
  if (bytes == 0) return errorf("copy bandwidth: bytes must be positive");
  Buffer src, dst;
  NB_TRY(Buffer::allocate(&src, DType::u8, Device::cuda, {int64_t(bytes)}).context("copy bandwidth"));
  NB_TRY(Buffer::allocate(&dst, DType::u8, Device::cuda, {int64_t(bytes)}).context("copy bandwidth"));
  StreamOwner stream;
  CUDA_CHECK(cudaMemsetAsync(src.data(), 0x5a, bytes, stream.s));
  double ms = 0;
  NB_TRY(median_ms(
      iters, stream.s,
      [&] {
        CUDA_CHECK(cudaMemcpyAsync(dst.data(), src.data(), bytes, cudaMemcpyDeviceToDevice, stream.s));
        return Status::ok();
      },
      &ms));
  *gbps = 2.0 * double(bytes) / (ms * 1e-3) / 1e9;
  return Status::ok();
}

}  // namespace nb::gemm
