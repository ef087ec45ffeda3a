// CUDA kernels for RMSNorm (see rmsnorm.h). Forward and dx: one block per row, 16-byte accesses when
// the row allows (H a multiple of the vector width), FP32 sums via a fixed-order block reduction; the
// row is read twice (the second read hits L1/L2). dw: blocks own 256 columns x a chunk of 256 rows and
// write FP32 partials; a second kernel sums the chunks in order into dw (deterministic, no atomics).
#include "ops/cuda_common.cuh"
#include "ops/ops_common.h"
#include "ops/rmsnorm.h"

namespace nb::ops {
namespace {
using namespace cuda;

int row_threads(int64_t H, int vec) {
  int64_t per = (H + vec - 1) / vec;
  int t = 32;
  while (t < 512 && t < per) t *= 2;
  return t;
}

template <typename T, typename W, int V>
__global__ void rmsnorm_fwd_kernel(const T* x, const W* w, float eps, T* y, float* rstd, int64_t H) {
  __shared__ float shared[32];
  const T* xr = x + int64_t(blockIdx.x) * H;
  T* yr = y + int64_t(blockIdx.x) * H;
  float acc = 0.f;
  for (int64_t c = int64_t(threadIdx.x) * V; c < H; c += int64_t(blockDim.x) * V) {
    float v[V];
    load_vec<T, V>(xr + c, v);
    NB_UNROLL for (int k = 0; k < V; ++k) acc += v[k] * v[k];
  }
  float r = 1.f / sqrtf(block_sum(acc, shared) / float(H) + eps);
  if (threadIdx.x == 0) rstd[blockIdx.x] = r;
  for (int64_t c = int64_t(threadIdx.x) * V; c < H; c += int64_t(blockDim.x) * V) {
    float v[V], wv[V];
    load_vec<T, V>(xr + c, v);
    load_vec<W, V>(w + c, wv);
    NB_UNROLL for (int k = 0; k < V; ++k) v[k] = v[k] * r * wv[k];
    store_vec<T, V>(yr + c, v);
  }
}

template <typename T, typename W, int V>
__global__ void rmsnorm_dx_kernel(const T* x, const W* w, const float* rstd, const T* dy, T* dx, int64_t H) {
  __shared__ float shared[32];
  int64_t off = int64_t(blockIdx.x) * H;
  float r = rstd[blockIdx.x];
  float acc = 0.f;
  for (int64_t c = int64_t(threadIdx.x) * V; c < H; c += int64_t(blockDim.x) * V) {
    float xv[V], wv[V], gv[V];
    load_vec<T, V>(x + off + c, xv);
    load_vec<W, V>(w + c, wv);
    load_vec<T, V>(dy + off + c, gv);
    NB_UNROLL for (int k = 0; k < V; ++k) acc += wv[k] * gv[k] * xv[k];
  }
  float coef = r * r * r * (block_sum(acc, shared) / float(H));
  for (int64_t c = int64_t(threadIdx.x) * V; c < H; c += int64_t(blockDim.x) * V) {
    float xv[V], wv[V], gv[V];
    load_vec<T, V>(x + off + c, xv);
    load_vec<W, V>(w + c, wv);
    load_vec<T, V>(dy + off + c, gv);
    NB_UNROLL for (int k = 0; k < V; ++k) gv[k] = r * (wv[k] * gv[k]) - coef * xv[k];
    store_vec<T, V>(dx + off + c, gv);
  }
}

constexpr int kDwRowsY = 8;    // thread rows per block
constexpr int kDwChunk = 256;  // rows per partial

// partial[chunk][col] = sum over the chunk's rows of dy * x * rstd. A block is 32 x 8 threads over
// 32*V columns; each thread sums its V columns over rows y, y+8, ... of the chunk, then the 8 row
// groups are added in a fixed order. V = 8 uses 16-byte loads (BF16) when H allows.
template <typename T, int V>
__global__ void rmsnorm_dw_partial_kernel(const T* x, const T* dy, const float* rstd, int64_t rows, int64_t H,
                                          float* partial) {
  __shared__ float sh[kDwRowsY][32 * V];
  int64_t col0 = (int64_t(blockIdx.x) * 32 + threadIdx.x) * V;
  int64_t r0 = int64_t(blockIdx.y) * kDwChunk;
  int64_t r1 = r0 + kDwChunk < rows ? r0 + kDwChunk : rows;
  float acc[V];
  NB_UNROLL for (int k = 0; k < V; ++k) acc[k] = 0.f;
  if (col0 < H) {  // with V > 1, H is a multiple of V, so the whole vector is in range
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kDwRowsY) {
      float rs = rstd[r], xv[V], gv[V];
      load_vec<T, V>(x + r * H + col0, xv);
      load_vec<T, V>(dy + r * H + col0, gv);
      NB_UNROLL for (int k = 0; k < V; ++k) acc[k] += gv[k] * xv[k] * rs;
    }
  }
  NB_UNROLL for (int k = 0; k < V; ++k) sh[threadIdx.y][threadIdx.x * V + k] = acc[k];
  __syncthreads();
  if (threadIdx.y == 0 && col0 < H) {
    NB_UNROLL for (int k = 0; k < V; ++k) {
      float s = 0.f;
      for (int yy = 0; yy < kDwRowsY; ++yy) s += sh[yy][threadIdx.x * V + k];
      partial[int64_t(blockIdx.y) * H + col0 + k] = s;
    }
  }
}

__global__ void rmsnorm_dw_final_kernel(const float* partial, int64_t chunks, int64_t H, float* dw) {
  int64_t col = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (col >= H) return;
  float s = 0.f;
  for (int64_t c = 0; c < chunks; ++c) s += partial[c * H + col];
  dw[col] += s;
}

template <typename F>
void dispatch_tw(const Tensor& x, const Tensor& w, F&& f) {
  auto with_w = [&](auto tt) {
    if (w.dtype == DType::bf16)
      f(tt, bf16{});
    else
      f(tt, float{});
  };
  if (x.dtype == DType::bf16)
    with_w(bf16{});
  else
    with_w(float{});
}

}  // namespace

namespace detail {

void rmsnorm_forward_cuda(const Tensor& x, const Tensor& w, float eps, const Tensor& y, const Tensor& rstd, Stream s) {
  NB_CHECK(y.dtype == x.dtype, "rmsnorm_forward: y must have x's dtype on cuda");
  const int64_t rows = rows_of(x), H = cols_of(x);
  if (rows == 0) return;
  dispatch_tw(x, w, [&](auto tt, auto wt) {
    using T = decltype(tt);
    using W = decltype(wt);
    bool vec = vec_ok<T>(x.data, H) && vec_ok<T>(y.data, H) && vec_ok<W>(w.data, H) && H % 8 == 0;
    if (vec) {
      rmsnorm_fwd_kernel<T, W, 8><<<unsigned(rows), row_threads(H, 8), 0, as_cuda(s)>>>(
          x.ptr<T>(), w.ptr<W>(), eps, y.ptr<T>(), rstd.ptr<float>(), H);
    } else {
      rmsnorm_fwd_kernel<T, W, 1><<<unsigned(rows), row_threads(H, 1), 0, as_cuda(s)>>>(
          x.ptr<T>(), w.ptr<W>(), eps, y.ptr<T>(), rstd.ptr<float>(), H);
    }
    CUDA_CHECK_LAUNCH();
  });
}

void rmsnorm_backward_cuda(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy, const Tensor& dx,
                           const Tensor& dw_f32, Stream s) {
  NB_CHECK(dy.dtype == x.dtype && dx.dtype == x.dtype, "rmsnorm_backward: dy and dx must have x's dtype on cuda");
  const int64_t rows = rows_of(x), H = cols_of(x);
  if (rows == 0) return;
  cudaStream_t cs = as_cuda(s);
  dispatch_tw(x, w, [&](auto tt, auto wt) {
    using T = decltype(tt);
    using W = decltype(wt);
    bool vec =
        vec_ok<T>(x.data, H) && vec_ok<T>(dy.data, H) && vec_ok<T>(dx.data, H) && vec_ok<W>(w.data, H) && H % 8 == 0;
    if (vec) {
      rmsnorm_dx_kernel<T, W, 8><<<unsigned(rows), row_threads(H, 8), 0, cs>>>(
          x.ptr<T>(), w.ptr<W>(), rstd.ptr<float>(), dy.ptr<T>(), dx.ptr<T>(), H);
    } else {
      rmsnorm_dx_kernel<T, W, 1><<<unsigned(rows), row_threads(H, 1), 0, cs>>>(
          x.ptr<T>(), w.ptr<W>(), rstd.ptr<float>(), dy.ptr<T>(), dx.ptr<T>(), H);
    }
    CUDA_CHECK_LAUNCH();
    int64_t chunks = (rows + kDwChunk - 1) / kDwChunk;
    float* partial = scratch_alloc<float>(size_t(chunks * H), cs);
    if (vec) {
      dim3 grid(unsigned((H + 32 * 8 - 1) / (32 * 8)), unsigned(chunks));
      rmsnorm_dw_partial_kernel<T, 8>
          <<<grid, dim3(32, kDwRowsY), 0, cs>>>(x.ptr<T>(), dy.ptr<T>(), rstd.ptr<float>(), rows, H, partial);
    } else {
      dim3 grid(unsigned((H + 31) / 32), unsigned(chunks));
      rmsnorm_dw_partial_kernel<T, 1>
          <<<grid, dim3(32, kDwRowsY), 0, cs>>>(x.ptr<T>(), dy.ptr<T>(), rstd.ptr<float>(), rows, H, partial);
    }
    CUDA_CHECK_LAUNCH();
    rmsnorm_dw_final_kernel<<<grid_for(H, 256), 256, 0, cs>>>(partial, chunks, H, dw_f32.ptr<float>());
    CUDA_CHECK_LAUNCH();
    scratch_free(partial, cs);
  });
}

}  // namespace detail
}  // namespace nb::ops
