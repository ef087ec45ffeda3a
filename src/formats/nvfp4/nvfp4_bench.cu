// Benchmark of the CUDA NVFP4 quantizer (see nvfp4_bench.h): CUDA events around each launch, warm-up,
// the median of `iters` timings per measured operation.
#include <algorithm>
#include <utility>
#include <vector>
#include "core/cuda_check.h"
#include "formats/nvfp4/nvfp4_bench.h"
#include "formats/scalar_codecs.h"

namespace nb::nvfp4 {
namespace {

// Deterministic non-zero BF16 values of varied magnitude (a hash, not a distribution claim).
__global__ void fill_random_kernel(bf16* x, int64_t n) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  Philox4x32 r = philox_block(RngKey{1234, 0, 7}, uint64_t(i));
  const float u = float((r.v[0] >> 8) + 1) * (1.0f / 16777216.0f);  // (0, 1]
  const float mag = u * pow2f(int(r.v[1] % 16) - 8);
  x[i] = f32_to_bf16((r.v[2] & 1) ? -mag : mag);
}

template <typename F>
double median_ms(int iters, F launch) {
  cudaEvent_t a, b;
  CUDA_CHECK(cudaEventCreate(&a));
  CUDA_CHECK(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) launch();  // warm-up
  std::vector<float> ms(size_t(std::max(iters, 1)));
  for (auto& m : ms) {
    CUDA_CHECK(cudaEventRecord(a));
    launch();
    CUDA_CHECK(cudaEventRecord(b));
    CUDA_CHECK(cudaEventSynchronize(b));
    CUDA_CHECK(cudaEventElapsedTime(&m, a, b));
  }
  CUDA_CHECK(cudaEventDestroy(a));
  CUDA_CHECK(cudaEventDestroy(b));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace

Status bench_nvfp4_cuda(int64_t rows, int64_t cols, const Options& opts, int iters, BenchResult* result) {
  NB_TRY(check_shape(rows, cols, opts));
  const size_t n = size_t(rows * cols), codes = n / 2, scales = n / 16;
  const size_t out_bytes =
      (opts.rowwise ? codes + scales : 0) + (opts.colwise ? codes + scales : 0) + 2 * sizeof(float);
  std::vector<void*> allocations;
  auto alloc = [&](size_t bytes, void** p) -> Status {
    cudaError_t e = cudaMalloc(p, bytes);
    if (e != cudaSuccess)
      return errorf("NVFP4 benchmark of %lld x %lld could not allocate %zu bytes on the GPU (%s); use a smaller shape",
                    (long long)rows, (long long)cols, bytes, cudaGetErrorString(e));
    allocations.push_back(*p);
    return Status::ok();
  };
  auto release = [&] {
    for (void* p : allocations) cudaFree(p);
  };
  void *x = nullptr, *out = nullptr, *amax = nullptr, *flag = nullptr;
  for (auto [bytes, p] : {std::pair<size_t, void**>{n * 2, &x},
                          {2 * (codes + scales), &out},
                          {2 * sizeof(float), &amax},
                          {sizeof(int), &flag}}) {
    Status st = alloc(bytes, p);
    if (!st) {
      release();
      return st;
    }
  }
  fill_random_kernel<<<unsigned((n + 255) / 256), 256>>>(static_cast<bf16*>(x), int64_t(n));
  CUDA_CHECK_LAUNCH();
  CUDA_CHECK(cudaMemset(flag, 0, sizeof(int)));

  auto* o = static_cast<uint8_t*>(out);
  QuantizedView v;
  v.rows = rows;
  v.cols = cols;
  v.row_data = o;
  v.row_scales = o + codes;
  v.col_data = o + codes + scales;
  v.col_scales = o + 2 * codes + scales;
  v.row_amax = static_cast<float*>(amax);
  v.col_amax = static_cast<float*>(amax) + 1;
  v.nonfinite = static_cast<int*>(flag);
  const auto* xb = static_cast<const bf16*>(x);
  const bool rht = opts.rht && opts.colwise;

  Status run_st;
  auto keep = [&](Status s) {
    if (run_st && !s) run_st = s;
  };
  result->ms_amax = median_ms(iters, [&] {
    keep(compute_amax_cuda(xb, rows, cols, rht, opts.rowwise ? v.row_amax : nullptr,
                           opts.colwise ? v.col_amax : nullptr, nullptr));
  });
  result->ms_quantize = median_ms(iters, [&] { keep(quantize_cuda_with_amax(xb, opts, v, nullptr)); });
  result->ms_total = median_ms(iters, [&] { keep(quantize_cuda(xb, opts, v, nullptr)); });
  result->bytes_min = double(n * 2 + out_bytes);
  const size_t copy_bytes = size_t(result->bytes_min / 2);
  void* copy_dst = nullptr;
  // The copy reads from and writes into the (large enough) source and output buffers' storage.
  if (copy_bytes <= n * 2 && copy_bytes <= 2 * (codes + scales)) {
    result->ms_copy =
        median_ms(iters, [&] { CUDA_CHECK(cudaMemcpyAsync(out, x, copy_bytes, cudaMemcpyDeviceToDevice)); });
  } else if (alloc(copy_bytes, &copy_dst)) {
    result->ms_copy =
        median_ms(iters, [&] { CUDA_CHECK(cudaMemcpyAsync(copy_dst, x, copy_bytes, cudaMemcpyDeviceToDevice)); });
  }
  CUDA_CHECK(cudaDeviceSynchronize());
  release();
  return run_st;
}

}  // namespace nb::nvfp4
