// CUDA kernel for dropout (see dropout.h). One thread handles V consecutive elements (V = 16 bytes of
// BF16 or FP32, one Philox call per 4 elements) with 16-byte accesses when both pointers are aligned,
// then a per-element tail; the mask and the arithmetic are the header's dropout_bits/dropout_apply, so
// the results are bit-identical to the CPU reference. Each element is read before the same thread
// writes it, so out may be x itself.
#include "ops/cuda_common.cuh"
#include "ops/dropout.h"
#include "ops/ops_common.h"

namespace nb::ops {
namespace {
using namespace cuda;
constexpr int kThreads = 256;

template <typename T, int V>
__global__ void dropout_kernel(const T* x, T* out, int64_t n, bool vec, RngKey key, uint32_t threshold, float scale) {
  static_assert(V % 4 == 0, "one Philox call covers 4 elements");
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t groups = n / V;
  for (int64_t g = tid; g < groups; g += stride) {
    float v[V];
    if (vec) {
      load_vec<T, V>(x + g * V, v);
    } else {
      NB_UNROLL for (int k = 0; k < V; ++k) v[k] = to_f32(x[g * V + k]);
    }
    NB_UNROLL for (int b = 0; b < V / 4; ++b) {
      const Philox4x32 r = philox_block(key, uint64_t(g) * (V / 4) + b);
      NB_UNROLL for (int k = 0; k < 4; ++k) v[b * 4 + k] = dropout_apply(v[b * 4 + k], r.v[k], threshold, scale);
    }
    if (vec) {
      store_vec<T, V>(out + g * V, v);
    } else {
      NB_UNROLL for (int k = 0; k < V; ++k) out[g * V + k] = from_f32<T>(v[k]);
    }
  }
  for (int64_t i = groups * V + tid; i < n; i += stride)
    out[i] = from_f32<T>(dropout_apply(to_f32(x[i]), dropout_bits(key, uint64_t(i)), threshold, scale));
}

// A column window: one element per step, each drawing the bits of its index in the whole tensor.
template <typename T>
__global__ void dropout_window_kernel(const T* x, T* out, int64_t n, int64_t cols, DropoutColumns w, RngKey key,
                                      uint32_t threshold, float scale) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    out[i] =
        from_f32<T>(dropout_apply(to_f32(x[i]), dropout_bits(key, dropout_whole_index(i, cols, w)), threshold, scale));
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

namespace detail {

void dropout_cuda(const Tensor& x, const Tensor& out, uint32_t threshold, float scale, RngKey key, Stream s) {
  const int64_t n = x.numel();
  if (n == 0) return;
  if (threshold == 0 && scale == 1.f) {  // p == 0: an exact copy, as on the CPU
    if (out.data != x.data)
      CUDA_CHECK(cudaMemcpyAsync(out.data, x.data, size_t(x.bytes()), cudaMemcpyDeviceToDevice, as_cuda(s)));
    return;
  }
  const bool vec = aligned16(x.data) && aligned16(out.data);
  auto launch = [&](auto tt) {
    using E = decltype(tt);
    constexpr int V = kVec<E>;
    dropout_kernel<E, V><<<grid_for((n + V - 1) / V, kThreads, 4096), kThreads, 0, as_cuda(s)>>>(
        x.ptr<E>(), out.ptr<E>(), n, vec, key, threshold, scale);
    CUDA_CHECK_LAUNCH();
  };
  if (x.dtype == DType::bf16)
    launch(bf16{});
  else
    launch(float{});
}

void dropout_window_cuda(const Tensor& x, const Tensor& out, uint32_t threshold, float scale, RngKey key, int64_t cols,
                         DropoutColumns w, Stream s) {
  const int64_t n = x.numel();
  if (n == 0) return;
  auto launch = [&](auto tt) {
    using E = decltype(tt);
    dropout_window_kernel<E><<<grid_for(n, kThreads, 4096), kThreads, 0, as_cuda(s)>>>(x.ptr<E>(), out.ptr<E>(), n,
                                                                                       cols, w, key, threshold, scale);
    CUDA_CHECK_LAUNCH();
  };
  if (x.dtype == DType::bf16)
    launch(bf16{});
  else
    launch(float{});
}

}  // namespace detail
}  // namespace nb::ops
