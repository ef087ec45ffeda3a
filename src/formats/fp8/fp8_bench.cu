// Timing of the FP8-family quantizers (see fp8_bench.h).
#include <algorithm>
#include <functional>
#include "core/cuda_check.h"
#include "core/tensor.h"
#include "formats/fp8/fp8.h"
#include "formats/fp8/fp8_bench.h"
#include "formats/fp8/fp8_block.h"
#include "formats/mxfp8/mxfp8.h"

namespace nb::fp8 {
namespace {

// Deterministic non-zero BF16 noise (a hash per element): no host transfer needed.
__global__ void fill_random_bf16(bf16* x, int64_t n, uint32_t seed) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 0x9E3779B1u ^ seed;
    h ^= h >> 15;
    h *= 0x2C1B3C6Du;
    h ^= h >> 12;
    h *= 0x297A2D39u;
    h ^= h >> 15;
    float u = (float(h >> 8) + 0.5f) * (1.0f / 16777216.0f);  // (0, 1)
    x[i] = f32_to_bf16((u - 0.5f) * 8.0f);
  }
}

struct DeviceBuffers {
  std::vector<void*> ptrs;
  ~DeviceBuffers() {
    for (void* p : ptrs) device_free(p);
  }
  template <typename T>
  Status alloc(T** p, size_t bytes) {
    void* d = nullptr;
    NB_TRY(device_malloc(&d, bytes));
    ptrs.push_back(d);
    *p = static_cast<T*>(d);
    return Status::ok();
  }
};

double median_ms(const std::function<void()>& launch, int iters) {
  cudaEvent_t a, b;
  CUDA_CHECK(cudaEventCreate(&a));
  CUDA_CHECK(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) launch();  // warm-up
  std::vector<float> t;
  for (int i = 0; i < iters; ++i) {
    CUDA_CHECK(cudaEventRecord(a));
    launch();
    CUDA_CHECK(cudaEventRecord(b));
    CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  CUDA_CHECK(cudaEventDestroy(a));
  CUDA_CHECK(cudaEventDestroy(b));
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

Status bench_formats_cuda(int64_t rows, int64_t cols, int iters, FormatsBenchResult* r) {
  NB_TRY(mxfp8::check_shape(rows, cols));
  NB_TRY(check_block_shape(BlockKind::vec128, rows, cols));
  if (iters < 1) iters = 1;
  const size_t n = size_t(rows * cols);
  DeviceBuffers b;
  bf16 *x = nullptr, *copy = nullptr;
  uint8_t *d0 = nullptr, *d1 = nullptr, *s0 = nullptr, *s1 = nullptr;
  float *f0 = nullptr, *f1 = nullptr, *amax = nullptr, *scale_inv = nullptr;
  int32_t* flag = nullptr;
  const size_t nvec = size_t(std::max(block_scale_count(BlockKind::vec128, rows, cols, false),
                                      block_scale_count(BlockKind::vec128, rows, cols, true)));
  NB_TRY(b.alloc(&x, 2 * n));
  NB_TRY(b.alloc(&copy, 2 * n));
  NB_TRY(b.alloc(&d0, n));
  NB_TRY(b.alloc(&d1, n));
  NB_TRY(b.alloc(&s0, n / 32));
  NB_TRY(b.alloc(&s1, n / 32));
  NB_TRY(b.alloc(&f0, 4 * nvec));
  NB_TRY(b.alloc(&f1, 4 * nvec));
  NB_TRY(b.alloc(&amax, 4));
  NB_TRY(b.alloc(&scale_inv, 4));
  NB_TRY(b.alloc(&flag, 4));
  fill_random_bf16<<<1024, 256>>>(x, int64_t(n), 12345u);
  CUDA_CHECK_LAUNCH();

  Status st = Status::ok();
  auto keep = [&st](Status s) {
    if (st.is_ok() && !s.is_ok()) st = s;
  };
  r->copy_bytes = 4.0 * double(n);
  r->ms_copy = median_ms([&] { CUDA_CHECK(cudaMemcpyAsync(copy, x, 2 * n, cudaMemcpyDeviceToDevice)); }, iters);

  mxfp8::QuantizedView mv{rows, cols, d0, s0, d1, s1, flag};
  double ms = median_ms([&] { keep(mxfp8::quantize_cuda(x, {}, mv)); }, iters);
  r->quantizers.push_back({"MXFP8 row + column (1x32, E8M0)", ms, 2.0 * n + 2.0 * n + 2.0 * n / 32});

  TensorView tv{rows, cols, d0, d1, scale_inv, amax, flag};
  ms = median_ms([&] { keep(quantize_current_cuda(x, Format::e4m3, false, tv)); }, iters);
  r->quantizers.push_back({"FP8 current scaling E4M3, row + transposed", ms, 2.0 * n + 2.0 * n + 8});
  // The quantize pass alone (no amax pass): delayed scaling with a given scale; current - delayed
  // is about the amax pass.
  float* scale = nullptr;
  NB_TRY(b.alloc(&scale, 4));
  const float one = 1.0f;
  CUDA_CHECK(cudaMemcpy(scale, &one, sizeof one, cudaMemcpyHostToDevice));
  ms = median_ms([&] { keep(quantize_with_scale_cuda(x, Format::e4m3, scale, tv)); }, iters);
  r->quantizers.push_back({"FP8 delayed scaling E4M3, row + transposed", ms, 2.0 * n + 2.0 * n + 8});

  for (BlockKind kind : {BlockKind::vec128, BlockKind::blk128x128}) {
    BlockView bv{rows, cols, d0, f0, d1, f1, flag};
    BlockOptions opt{kind};
    ms = median_ms([&] { keep(quantize_block_cuda(x, opt, bv)); }, iters);
    double scale_bytes =
        4.0 * double(block_scale_count(kind, rows, cols, false) + block_scale_count(kind, rows, cols, true));
    r->quantizers.push_back({kind == BlockKind::vec128 ? "FP8 sub-channel 1x128, row + transposed"
                                                       : "FP8 sub-channel 128x128, row + transposed",
                             ms, 2.0 * n + 2.0 * n + scale_bytes});
  }
  CUDA_CHECK(cudaDeviceSynchronize());
  return st;
}

}  // namespace nb::fp8
