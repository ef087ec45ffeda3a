// CUDA kernels for SwiGLU (see swiglu.h). One thread handles V consecutive columns of one row (16-byte
// accesses when F is a multiple of V); FP32 math with expf, the same formulas as the CPU reference.
#include "ops/cuda_common.cuh"
#include "ops/ops_common.h"
#include "ops/swiglu.h"

namespace nb::ops {
namespace {
using namespace cuda;

template <typename T, int V>
__global__ void swiglu_fwd_kernel(const T* gate_up, T* out, int64_t T_rows, int64_t F) {
  int64_t groups = F / V, items = T_rows * groups, stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t it = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; it < items; it += stride) {
    int64_t t = it / groups, j = (it % groups) * V;
    float g[V], u[V], o[V];
    load_vec<T, V>(gate_up + t * 2 * F + j, g);
    load_vec<T, V>(gate_up + t * 2 * F + F + j, u);
    NB_UNROLL for (int k = 0; k < V; ++k) o[k] = g[k] / (1.f + expf(-g[k])) * u[k];
    store_vec<T, V>(out + t * F + j, o);
  }
}

template <typename T, int V>
__global__ void swiglu_bwd_kernel(const T* gate_up, const T* dout, T* dgate_up, int64_t T_rows, int64_t F) {
  int64_t groups = F / V, items = T_rows * groups, stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t it = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; it < items; it += stride) {
    int64_t t = it / groups, j = (it % groups) * V;
    float g[V], u[V], d[V], dg[V], du[V];
    load_vec<T, V>(gate_up + t * 2 * F + j, g);
    load_vec<T, V>(gate_up + t * 2 * F + F + j, u);
    load_vec<T, V>(dout + t * F + j, d);
    NB_UNROLL for (int k = 0; k < V; ++k) {
      float sig = 1.f / (1.f + expf(-g[k]));
      dg[k] = d[k] * u[k] * sig * (1.f + g[k] * (1.f - sig));
      du[k] = d[k] * g[k] * sig;
    }
    store_vec<T, V>(dgate_up + t * 2 * F + j, dg);
    store_vec<T, V>(dgate_up + t * 2 * F + F + j, du);
  }
}

template <typename F>
void dispatch(DType t, F&& f) {
  if (t == DType::bf16)
    f(bf16{});
  else
    f(float{});
}

}  // namespace

namespace detail {

void swiglu_forward_cuda(const Tensor& gate_up, const Tensor& out, Stream s) {
  NB_CHECK(out.dtype == gate_up.dtype, "swiglu_forward: out must have gate_up's dtype on cuda");
  const int64_t T = rows_of(out), F = cols_of(out);
  if (T * F == 0) return;
  dispatch(out.dtype, [&](auto tt) {
    using E = decltype(tt);
    if (F % 8 == 0 && vec_ok<E>(gate_up.data, F) && vec_ok<E>(out.data, F))
      swiglu_fwd_kernel<E, 8>
          <<<grid_for(T * F / 8, 256, 16384), 256, 0, as_cuda(s)>>>(gate_up.ptr<E>(), out.ptr<E>(), T, F);
    else
      swiglu_fwd_kernel<E, 1>
          <<<grid_for(T * F, 256, 16384), 256, 0, as_cuda(s)>>>(gate_up.ptr<E>(), out.ptr<E>(), T, F);
    CUDA_CHECK_LAUNCH();
  });
}

void swiglu_backward_cuda(const Tensor& gate_up, const Tensor& dout, const Tensor& dgate_up, Stream s) {
  NB_CHECK(dout.dtype == gate_up.dtype && dgate_up.dtype == gate_up.dtype,
           "swiglu_backward: dout and dgate_up must have gate_up's dtype on cuda");
  const int64_t T = rows_of(dout), F = cols_of(dout);
  if (T * F == 0) return;
  dispatch(dout.dtype, [&](auto tt) {
    using E = decltype(tt);
    if (F % 8 == 0 && vec_ok<E>(gate_up.data, F) && vec_ok<E>(dout.data, F) && vec_ok<E>(dgate_up.data, F))
      swiglu_bwd_kernel<E, 8><<<grid_for(T * F / 8, 256, 16384), 256, 0, as_cuda(s)>>>(gate_up.ptr<E>(), dout.ptr<E>(),
                                                                                       dgate_up.ptr<E>(), T, F);
    else
      swiglu_bwd_kernel<E, 1><<<grid_for(T * F, 256, 16384), 256, 0, as_cuda(s)>>>(gate_up.ptr<E>(), dout.ptr<E>(),
                                                                                   dgate_up.ptr<E>(), T, F);
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace detail
}  // namespace nb::ops
