// CUDA kernel for softmax cross-entropy (see cross_entropy.h). One block per row of V logits:
// pass 1 keeps a per-thread online (max, sum of exp) pair and merges the pairs across the block in a
// fixed order; pass 2 rewrites the row as (softmax - onehot) * grad_scale. The target logit is read
// before the block barrier that precedes any write, so in-place overwrite is safe.
#include <cfloat>
#include "ops/cross_entropy.h"
#include "ops/cuda_common.cuh"
#include "ops/ops_common.h"

namespace nb::ops {
namespace {
using namespace cuda;
constexpr int kThreads = 512;

// Merges (m, s) pairs: the sum is rescaled to the larger max. -inf maxima (no elements yet) stay neutral.
NB_DEVICE void merge(float& m, float& s, float m2, float s2) {
  float mn = fmaxf(m, m2);
  if (mn == -INFINITY) return;
  s = s * expf(m - mn) + s2 * expf(m2 - mn);
  m = mn;
}

template <typename T, int V>
__global__ void ce_kernel(T* logits, const int32_t* targets, float grad_scale, float* losses, int64_t vocab) {
  __shared__ float sh_m[32], sh_s[32];
  __shared__ float target_logit;
  T* row = logits + int64_t(blockIdx.x) * vocab;
  const int32_t target = targets[blockIdx.x];
  const bool ignored = target < 0 || target >= vocab;
  if (ignored) {
    float z[V];
    NB_UNROLL for (int k = 0; k < V; ++k) z[k] = 0.f;
    for (int64_t c = int64_t(threadIdx.x) * V; c < vocab; c += int64_t(blockDim.x) * V) store_vec<T, V>(row + c, z);
    if (threadIdx.x == 0) losses[blockIdx.x] = 0.f;
    return;
  }
  if (threadIdx.x == 0) target_logit = to_f32(row[target]);
  float m = -INFINITY, s = 0.f;
  for (int64_t c = int64_t(threadIdx.x) * V; c < vocab; c += int64_t(blockDim.x) * V) {
    float v[V];
    load_vec<T, V>(row + c, v);
    float cm = v[0];
    NB_UNROLL for (int k = 1; k < V; ++k) cm = fmaxf(cm, v[k]);
    float cs = 0.f;
    NB_UNROLL for (int k = 0; k < V; ++k) cs += expf(v[k] - cm);
    merge(m, s, cm, cs);
  }
  NB_UNROLL for (int o = 16; o > 0; o >>= 1) {
    float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
    merge(m, s, m2, s2);
  }
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  if (lane == 0) {
    sh_m[warp] = m;
    sh_s[warp] = s;
  }
  __syncthreads();
  m = lane < nwarps ? sh_m[lane] : -INFINITY;
  s = lane < nwarps ? sh_s[lane] : 0.f;
  NB_UNROLL for (int o = 16; o > 0; o >>= 1) {
    float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
    merge(m, s, m2, s2);
  }
  if (threadIdx.x == 0) losses[blockIdx.x] = logf(s) + m - target_logit;
  const float inv_s = 1.f / s;
  for (int64_t c = int64_t(threadIdx.x) * V; c < vocab; c += int64_t(blockDim.x) * V) {
    float v[V];
    load_vec<T, V>(row + c, v);
    NB_UNROLL for (int k = 0; k < V; ++k) {
      float p = expf(v[k] - m) * inv_s;
      if (c + k == target) p -= 1.f;
      v[k] = p * grad_scale;
    }
    store_vec<T, V>(row + c, v);
  }
}

}  // namespace

namespace detail {

void cross_entropy_fwd_bwd_cuda(const Tensor& logits, const Tensor& targets, float grad_scale, const Tensor& losses,
                                Stream s) {
  const int64_t T = logits.shape[0], V = logits.shape[1];
  if (T == 0) return;
  NB_CHECK(T <= 0x7fffffff, "cross_entropy_fwd_bwd: too many rows (%lld)", (long long)T);
  auto launch = [&](auto tt) {
    using E = decltype(tt);
    if (V % 8 == 0 && vec_ok<E>(logits.data, V))
      ce_kernel<E, 8><<<unsigned(T), kThreads, 0, as_cuda(s)>>>(logits.ptr<E>(), targets.ptr<int32_t>(), grad_scale,
                                                                losses.ptr<float>(), V);
    else
      ce_kernel<E, 1><<<unsigned(T), kThreads, 0, as_cuda(s)>>>(logits.ptr<E>(), targets.ptr<int32_t>(), grad_scale,
                                                                losses.ptr<float>(), V);
    CUDA_CHECK_LAUNCH();
  };
  if (logits.dtype == DType::bf16)
    launch(bf16{});
  else
    launch(float{});
}

}  // namespace detail
}  // namespace nb::ops
