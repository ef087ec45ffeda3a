// CUDA passes of the vocabulary-parallel cross-entropy (vocab_parallel_ce.h), one block per row of the local
// slice, FP32 math as ops/cross_entropy.cu: the row max, then (after the group's MAX) the sum of exponentials
// and the target's logit, then (after the group's SUM) the losses and the gradient written over the logits.
// Split in three because the group's reductions sit between them. Block reductions run in a fixed order and
// nothing uses float atomics, so every run gives the same bits. Columns past `real` (ids >= vocab) are
// padding: masked out of the max and the sum, their gradient 0.
#include <cfloat>
#include <type_traits>
#include "ops/cuda_common.cuh"
#include "ops/vocab_parallel_ce.h"

namespace nb::ops::tp {
namespace {
using namespace nb::ops::cuda;
constexpr int kThreads = 512;

// Block-wide max, the counterpart of cuda_common's block_sum (fixed butterfly order, ends with a barrier).
NB_DEVICE float block_max(float v, float* shared) {
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  v = warp_max(v);
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  float r = lane < nwarps ? shared[lane] : -INFINITY;
  r = warp_max(r);
  __syncthreads();
  return r;
}

// A row is ignored for target < 0, and for target >= vocab (a bug that the CPU path reports, treated as
// ignored like ops/cross_entropy's kernel). Every rank sees the same targets,
// so all agree on which rows are ignored.
NB_DEVICE bool row_ignored(int32_t target, int64_t vocab) { return target < 0 || target >= vocab; }

template <typename T, int V>
__global__ void row_max_kernel(const T* logits, int64_t cols, int64_t real, float* row_max) {
  __shared__ float sh[32];
  const T* row = logits + int64_t(blockIdx.x) * cols;
  float m = -INFINITY;  // stays -inf on a slice of padding only, neutral in the group's MAX
  for (int64_t c = int64_t(threadIdx.x) * V; c < real; c += int64_t(blockDim.x) * V) {
    float v[V];
    load_vec<T, V>(row + c, v);
    NB_UNROLL for (int k = 0; k < V; ++k) if (c + k < real) m = fmaxf(m, v[k]);
  }
  m = block_max(m, sh);
  if (threadIdx.x == 0) row_max[blockIdx.x] = m;
}

// sums_and_target: [sum of exp (T) | target logit (T)]. Ignored rows send zeros.
template <typename T, int V>
__global__ void sums_kernel(const T* logits, const int32_t* targets, int64_t cols, int64_t real, int64_t vocab_begin,
                            int64_t vocab, const float* row_max, float* sums_and_target) {
  __shared__ float sh[32];
  const int64_t t = blockIdx.x, rows = gridDim.x;
  const T* row = logits + t * cols;
  const int32_t target = targets[t];
  if (row_ignored(target, vocab)) {
    if (threadIdx.x == 0) sums_and_target[t] = sums_and_target[rows + t] = 0.f;
    return;
  }
  const float m = row_max[t];
  float s = 0.f;
  for (int64_t c = int64_t(threadIdx.x) * V; c < real; c += int64_t(blockDim.x) * V) {
    float v[V];
    load_vec<T, V>(row + c, v);
    NB_UNROLL for (int k = 0; k < V; ++k) if (c + k < real) s += expf(v[k] - m);
  }
  s = block_sum(s, sh);
  if (threadIdx.x == 0) {
    const int64_t local = int64_t(target) - vocab_begin;
    sums_and_target[t] = s;
    sums_and_target[rows + t] = local >= 0 && local < real ? to_f32(row[local]) : 0.f;
  }
}

// Each element is read and rewritten by the same thread, and the target's logit was taken in the previous
// pass, so the in-place overwrite needs no barrier.
template <typename T, int V>
__global__ void finish_kernel(T* logits, const int32_t* targets, int64_t cols, int64_t real, int64_t vocab_begin,
                              int64_t vocab, float grad_scale, const float* row_max, const float* sums_and_target,
                              float* losses) {
  const int64_t t = blockIdx.x, rows = gridDim.x;
  T* row = logits + t * cols;
  const int32_t target = targets[t];
  const bool ignored = row_ignored(target, vocab);
  const float m = row_max[t], s = sums_and_target[t];
  if (threadIdx.x == 0) losses[t] = ignored ? 0.f : logf(s) + m - sums_and_target[rows + t];
  const float inv_s = 1.f / s;
  const int64_t local_target = int64_t(target) - vocab_begin;
  for (int64_t c = int64_t(threadIdx.x) * V; c < cols; c += int64_t(blockDim.x) * V) {
    float v[V];
    load_vec<T, V>(row + c, v);
    NB_UNROLL for (int k = 0; k < V; ++k) {
      // Select rather than scale by 0: padding may hold inf or NaN.
      if (ignored || c + k >= real) {
        v[k] = 0.f;
        continue;
      }
      float p = expf(v[k] - m) * inv_s;
      if (c + k == local_target) p -= 1.f;
      v[k] = p * grad_scale;
    }
    store_vec<T, V>(row + c, v);
  }
}

// Local columns [0, real) hold ids below vocab; a slice may be padding only (real = 0).
int64_t real_columns(int64_t cols, int64_t vocab_begin, int64_t vocab) {
  const int64_t r = vocab - vocab_begin;
  return r < 0 ? 0 : (r > cols ? cols : r);
}

// Calls launch(element, width) for the logits' dtype: 8-wide accesses when every row allows them, else
// scalar ones.
template <typename F>
void dispatch(const Tensor& logits, const char* pass, F&& launch) {
  const int64_t T = logits.shape[0], cols = logits.shape[1];
  if (T == 0) return;
  NB_CHECK(T <= 0x7fffffff, "vocab_parallel_cross_entropy (%s): too many rows (%lld)", pass, (long long)T);
  if (logits.dtype == DType::bf16) {
    if (cols % 8 == 0 && vec_ok<bf16>(logits.data, cols))
      launch(bf16{}, std::integral_constant<int, 8>{});
    else
      launch(bf16{}, std::integral_constant<int, 1>{});
  } else {
    if (cols % 8 == 0 && vec_ok<float>(logits.data, cols))
      launch(float{}, std::integral_constant<int, 8>{});
    else
      launch(float{}, std::integral_constant<int, 1>{});
  }
  CUDA_CHECK_LAUNCH();
}

}  // namespace

namespace detail {

void vp_ce_row_max_cuda(const Tensor& logits, int64_t vocab_begin, int64_t vocab, const Tensor& row_max, Stream s) {
  const int64_t cols = logits.shape[1], real = real_columns(cols, vocab_begin, vocab);
  dispatch(logits, "row max", [&](auto e, auto v) {
    using E = decltype(e);
    row_max_kernel<E, decltype(v)::value>
        <<<unsigned(logits.shape[0]), kThreads, 0, as_cuda(s)>>>(logits.ptr<E>(), cols, real, row_max.ptr<float>());
  });
}

void vp_ce_sums_cuda(const Tensor& logits, const Tensor& targets, int64_t vocab_begin, int64_t vocab,
                     const Tensor& row_max, const Tensor& sums_and_target, Stream s) {
  const int64_t cols = logits.shape[1], real = real_columns(cols, vocab_begin, vocab);
  dispatch(logits, "sums", [&](auto e, auto v) {
    using E = decltype(e);
    sums_kernel<E, decltype(v)::value><<<unsigned(logits.shape[0]), kThreads, 0, as_cuda(s)>>>(
        logits.ptr<E>(), targets.ptr<int32_t>(), cols, real, vocab_begin, vocab, row_max.ptr<float>(),
        sums_and_target.ptr<float>());
  });
}

void vp_ce_finish_cuda(const Tensor& logits, const Tensor& targets, int64_t vocab_begin, int64_t vocab,
                       float grad_scale, const Tensor& row_max, const Tensor& sums_and_target, const Tensor& losses,
                       Stream s) {
  const int64_t cols = logits.shape[1], real = real_columns(cols, vocab_begin, vocab);
  dispatch(logits, "finish", [&](auto e, auto v) {
    using E = decltype(e);
    finish_kernel<E, decltype(v)::value><<<unsigned(logits.shape[0]), kThreads, 0, as_cuda(s)>>>(
        logits.ptr<E>(), targets.ptr<int32_t>(), cols, real, vocab_begin, vocab, grad_scale, row_max.ptr<float>(),
        sums_and_target.ptr<float>(), losses.ptr<float>());
  });
}

}  // namespace detail
}  // namespace nb::ops::tp
