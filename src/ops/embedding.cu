// CUDA kernels for the embedding (see embedding.h). Forward: one block per token copies its row with
// 16-byte accesses. Backward: cub's stable radix sort orders (id, token) pairs by id; one block per
// sorted position that starts a run of equal ids sums that run's dout rows in token order (FP32) and
// adds the sum into dtable once. Scratch comes from the stream-ordered allocator.
#include <cub/device/device_radix_sort.cuh>
#include "ops/cuda_common.cuh"
#include "ops/embedding.h"
#include "ops/ops_common.h"

namespace nb::ops {
namespace {
using namespace cuda;

int row_threads(int64_t per_row) {
  int t = 32;
  while (t < 256 && t < per_row) t *= 2;
  return t;
}

template <typename T, int V>
__global__ void embedding_fwd_kernel(const T* table, const int32_t* ids, T* out, int64_t vocab, int64_t H) {
  int32_t id = ids[blockIdx.x];
  T* orow = out + int64_t(blockIdx.x) * H;
  bool valid = id >= 0 && id < vocab;
  const T* trow = table + int64_t(valid ? id : 0) * H;
  for (int64_t c = int64_t(threadIdx.x) * V; c < H; c += int64_t(blockDim.x) * V) {
    float v[V];
    load_vec<T, V>(trow + c, v);
    if (!valid) NB_UNROLL for (int k = 0; k < V; ++k) v[k] = 0.f;
    store_vec<T, V>(orow + c, v);
  }
}

// keys[t] = id (or `vocab` for an invalid id, sorted last and skipped), vals[t] = t.
__global__ void embedding_keys_kernel(const int32_t* ids, int64_t T, int32_t vocab, uint32_t* keys, int32_t* vals) {
  int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= T) return;
  int32_t id = ids[t];
  keys[t] = (id >= 0 && id < vocab) ? uint32_t(id) : uint32_t(vocab);
  vals[t] = int32_t(t);
}

template <typename T, int V>
__global__ void embedding_bwd_kernel(const uint32_t* sorted_ids, const int32_t* sorted_tokens, const T* dout,
                                     float* dtable, int64_t T_tokens, uint32_t vocab, int64_t H) {
  int64_t start = blockIdx.x;
  uint32_t id = sorted_ids[start];
  if (id >= vocab || (start > 0 && sorted_ids[start - 1] == id)) return;
  int64_t end = start + 1;
  while (end < T_tokens && sorted_ids[end] == id) ++end;
  float* drow = dtable + int64_t(id) * H;
  for (int64_t c = int64_t(threadIdx.x) * V; c < H; c += int64_t(blockDim.x) * V) {
    float acc[V];
    NB_UNROLL for (int k = 0; k < V; ++k) acc[k] = 0.f;
    for (int64_t r = start; r < end; ++r) {
      float v[V];
      load_vec<T, V>(dout + int64_t(sorted_tokens[r]) * H + c, v);
      NB_UNROLL for (int k = 0; k < V; ++k) acc[k] += v[k];
    }
    float d[V];
    load_vec<float, V>(drow + c, d);
    NB_UNROLL for (int k = 0; k < V; ++k) d[k] += acc[k];
    store_vec<float, V>(drow + c, d);
  }
}

}  // namespace

namespace detail {

void embedding_forward_cuda(const Tensor& table, const Tensor& ids, const Tensor& out, Stream s) {
  const int64_t V = table.shape[0], H = table.shape[1], T = ids.numel();
  if (T == 0 || H == 0) return;
  NB_CHECK(T <= 0x7fffffff, "embedding_forward: too many tokens (%lld)", (long long)T);
  auto launch = [&](auto tt) {
    using E = decltype(tt);
    if (H % 8 == 0 && vec_ok<E>(table.data, H) && vec_ok<E>(out.data, H))
      embedding_fwd_kernel<E, 8>
          <<<unsigned(T), row_threads(H / 8), 0, as_cuda(s)>>>(table.ptr<E>(), ids.ptr<int32_t>(), out.ptr<E>(), V, H);
    else
      embedding_fwd_kernel<E, 1>
          <<<unsigned(T), row_threads(H), 0, as_cuda(s)>>>(table.ptr<E>(), ids.ptr<int32_t>(), out.ptr<E>(), V, H);
    CUDA_CHECK_LAUNCH();
  };
  if (table.dtype == DType::bf16)
    launch(bf16{});
  else
    launch(float{});
}

void embedding_backward_cuda(const Tensor& ids, const Tensor& dout, const Tensor& dtable_f32, Stream s) {
  const int64_t V = dtable_f32.shape[0], H = dtable_f32.shape[1], T = ids.numel();
  if (T == 0 || H == 0) return;
  NB_CHECK(T <= 0x7fffffff && V < 0x7fffffff, "embedding_backward: too many tokens or ids");
  cudaStream_t cs = as_cuda(s);
  int end_bit = 1;
  while ((uint64_t(1) << end_bit) <= uint64_t(V)) ++end_bit;  // keys are in [0, V]
  uint32_t* keys = scratch_alloc<uint32_t>(size_t(2 * T), cs);
  int32_t* vals = scratch_alloc<int32_t>(size_t(2 * T), cs);
  embedding_keys_kernel<<<grid_for(T, 256), 256, 0, cs>>>(ids.ptr<int32_t>(), T, int32_t(V), keys, vals);
  CUDA_CHECK_LAUNCH();
  size_t temp_bytes = 0;
  CUDA_CHECK(
      cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, keys, keys + T, vals, vals + T, int(T), 0, end_bit, cs));
  void* temp = scratch_alloc<char>(temp_bytes, cs);
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys, keys + T, vals, vals + T, int(T), 0, end_bit, cs));
  auto launch = [&](auto tt) {
    using E = decltype(tt);
    if (H % 8 == 0 && vec_ok<E>(dout.data, H) && vec_ok<float>(dtable_f32.data, H))
      embedding_bwd_kernel<E, 8><<<unsigned(T), row_threads(H / 8), 0, cs>>>(
          keys + T, vals + T, dout.ptr<E>(), dtable_f32.ptr<float>(), T, uint32_t(V), H);
    else
      embedding_bwd_kernel<E, 1><<<unsigned(T), row_threads(H), 0, cs>>>(keys + T, vals + T, dout.ptr<E>(),
                                                                         dtable_f32.ptr<float>(), T, uint32_t(V), H);
    CUDA_CHECK_LAUNCH();
  };
  if (dout.dtype == DType::bf16)
    launch(bf16{});
  else
    launch(float{});
  scratch_free(temp, cs);
  scratch_free(vals, cs);
  scratch_free(keys, cs);
}

}  // namespace detail
}  // namespace nb::ops
