// CUDA kernels for the elementwise helpers (see elementwise.h). Each thread handles 8 elements per
// step with 16-byte accesses when both pointers are aligned, and a scalar tail otherwise; math is FP32.
// The sum of squares reduces in a fixed order (grid size depends only on n), so it is deterministic.
#include "ops/cuda_common.cuh"
#include "ops/elementwise.h"
#include "ops/ops_common.h"

namespace nb::ops {
namespace {
using namespace cuda;
constexpr int kThreads = 256;
constexpr int kElems = 8;

template <typename F>
void dispatch_float(DType t, F&& f) {
  if (t == DType::bf16)
    f(bf16{});
  else
    f(float{});
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

int grid_elems(int64_t n) { return grid_for((n + kElems - 1) / kElems, kThreads, 4096); }

// dst[i] = op(a[i], b[i]); `a` may alias `dst` (in-place ops).
template <typename D, typename A, typename B, typename Op>
__global__ void binary_kernel(D* dst, const A* a, const B* b, int64_t n, bool vec, Op op) {
  int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, stride = int64_t(gridDim.x) * blockDim.x;
  int64_t nvec = vec ? n / kElems : 0;
  for (int64_t i = tid; i < nvec; i += stride) {
    float va[kElems], vb[kElems];
    load_vec<A, kElems>(a + i * kElems, va);
    load_vec<B, kElems>(b + i * kElems, vb);
    NB_UNROLL for (int k = 0; k < kElems; ++k) va[k] = op(va[k], vb[k]);
    store_vec<D, kElems>(dst + i * kElems, va);
  }
  for (int64_t i = nvec * kElems + tid; i < n; i += stride) dst[i] = from_f32<D>(op(to_f32(a[i]), to_f32(b[i])));
}

template <typename D, typename A, typename B, typename Op>
void launch_binary(D* dst, const A* a, const B* b, int64_t n, Op op, Stream s) {
  if (n == 0) return;
  bool vec = aligned16(dst) && aligned16(a) && aligned16(b);
  binary_kernel<<<grid_elems(n), kThreads, 0, as_cuda(s)>>>(dst, a, b, n, vec, op);
  CUDA_CHECK_LAUNCH();
}

struct TakeFirst {
  NB_DEVICE float operator()(float a, float) const { return a; }
};
struct Add {
  NB_DEVICE float operator()(float a, float b) const { return a + b; }
};
struct Scale {
  float s;
  NB_DEVICE float operator()(float a, float) const { return a * s; }
};
struct Constant {
  float v;
  NB_DEVICE float operator()(float, float) const { return v; }
};

template <typename T>
__global__ void nonfinite_kernel(const T* x, int64_t n, int* flag) {
  int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, stride = int64_t(gridDim.x) * blockDim.x;
  bool bad = false;
  for (int64_t i = tid; i < n; i += stride) bad |= !isfinite(to_f32(x[i]));
  if (__syncthreads_or(bad) && threadIdx.x == 0) *flag = 1;
}

// Pass 1: each block writes the sum of squares of its grid-stride share to partial[blockIdx.x].
template <typename T>
__global__ void sumsq_partial_kernel(const T* x, int64_t n, bool vec, float* partial) {
  __shared__ float shared[32];
  int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, stride = int64_t(gridDim.x) * blockDim.x;
  int64_t nvec = vec ? n / kElems : 0;
  float acc = 0.f;
  for (int64_t i = tid; i < nvec; i += stride) {
    float v[kElems];
    load_vec<T, kElems>(x + i * kElems, v);
    NB_UNROLL for (int k = 0; k < kElems; ++k) acc += v[k] * v[k];
  }
  for (int64_t i = nvec * kElems + tid; i < n; i += stride) {
    float v = to_f32(x[i]);
    acc += v * v;
  }
  float total = block_sum(acc, shared);
  if (threadIdx.x == 0) partial[blockIdx.x] = total;
}

// Pass 2: one block adds the partials (at most 1024, one per thread) into *out.
__global__ void sumsq_final_kernel(const float* partial, int count, float* out) {
  __shared__ float shared[32];
  float v = int(threadIdx.x) < count ? partial[threadIdx.x] : 0.f;
  float total = block_sum(v, shared);
  if (threadIdx.x == 0) *out += total;
}

}  // namespace

namespace detail {

void cast_cuda(const Tensor& src, const Tensor& dst, Stream s) {
  dispatch_float(src.dtype, [&](auto st) {
    dispatch_float(dst.dtype, [&](auto dt) {
      using S = decltype(st);
      using D = decltype(dt);
      launch_binary(dst.ptr<D>(), src.ptr<S>(), src.ptr<S>(), src.numel(), TakeFirst{}, s);
    });
  });
}

void add_inplace_cuda(const Tensor& y, const Tensor& x, Stream s) {
  dispatch_float(y.dtype, [&](auto yt) {
    dispatch_float(x.dtype, [&](auto xt) {
      using Y = decltype(yt);
      using X = decltype(xt);
      launch_binary(y.ptr<Y>(), y.ptr<Y>(), x.ptr<X>(), y.numel(), Add{}, s);
    });
  });
}

void fill_cuda(const Tensor& t, float value, Stream s) {
  dispatch_float(t.dtype, [&](auto tt) {
    using T = decltype(tt);
    launch_binary(t.ptr<T>(), t.ptr<T>(), t.ptr<T>(), t.numel(), Constant{value}, s);
  });
}

void scale_inplace_cuda(const Tensor& t, float sc, Stream s) {
  dispatch_float(t.dtype, [&](auto tt) {
    using T = decltype(tt);
    launch_binary(t.ptr<T>(), t.ptr<T>(), t.ptr<T>(), t.numel(), Scale{sc}, s);
  });
}

bool all_finite_cuda(const Tensor& t, Stream s) {
  if (t.numel() == 0) return true;
  cudaStream_t cs = as_cuda(s);
  int* flag = scratch_alloc<int>(1, cs);
  CUDA_CHECK(cudaMemsetAsync(flag, 0, sizeof(int), cs));
  dispatch_float(t.dtype, [&](auto tt) {
    using T = decltype(tt);
    nonfinite_kernel<<<grid_for(t.numel(), kThreads, 2048), kThreads, 0, cs>>>(t.ptr<T>(), t.numel(), flag);
    CUDA_CHECK_LAUNCH();
  });
  int host_flag = 0;
  CUDA_CHECK(cudaMemcpyAsync(&host_flag, flag, sizeof(int), cudaMemcpyDeviceToHost, cs));
  scratch_free(flag, cs);
  CUDA_CHECK(cudaStreamSynchronize(cs));
  return host_flag == 0;
}

void sum_squares_accumulate_cuda(const Tensor& x, float* out, Stream s) {
  int64_t n = x.numel();
  if (n == 0) return;
  cudaStream_t cs = as_cuda(s);
  int blocks = grid_elems(n) < 1024 ? grid_elems(n) : 1024;
  float* partial = scratch_alloc<float>(blocks, cs);
  dispatch_float(x.dtype, [&](auto tt) {
    using T = decltype(tt);
    sumsq_partial_kernel<<<blocks, kThreads, 0, cs>>>(x.ptr<T>(), n, aligned16(x.data), partial);
    CUDA_CHECK_LAUNCH();
  });
  sumsq_final_kernel<<<1, 1024, 0, cs>>>(partial, blocks, out);
  CUDA_CHECK_LAUNCH();
  scratch_free(partial, cs);
}

}  // namespace detail
}  // namespace nb::ops
