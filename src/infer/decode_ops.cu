// CUDA kernels of the decode path (see decode_ops.h): the cache write, the attention over the cache (one
// block per (sequence, query head); the BF16 kernel keeps many positions' 16-byte loads in flight, since at a
// few sequences the attention is bound by load latency, not bandwidth), the argmax and the position counter.
#include <cmath>
#include <climits>
#include <cstdint>
#include "infer/decode_ops.h"
#include "ops/cuda_common.cuh"
#include "ops/ops_common.h"

namespace nb::infer {
namespace {
using namespace ops::cuda;

constexpr int kWarps = 4;   // warps per attention block, each over every kWarps-th cache position
constexpr int kMaxPer = 8;  // accumulator values per lane: head_dim <= 32 * kMaxPer
constexpr int kArgmaxThreads = 256;

// new k, v [T, row] -> cache [B, L, row] at (t / per_row, pos[t]); row = Hkv * hd.
template <typename E>
__global__ void kv_write_kernel(const E* k, const E* v, E* ck, E* cv, const int32_t* pos, int64_t T, int64_t row,
                                int64_t L, int64_t per_row) {
  const int64_t n = T * row, stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const int64_t t = i / row, e = i % row, p = pos[t];
    if (p < 0 || p >= L) continue;  // the host checked the lengths; never write outside the cache
    const int64_t dst = ((t / per_row) * L + p) * row + e;
    ck[dst] = k[i];
    cv[dst] = v[i];
  }
}

// Block (b, h): out[b, h] = softmax(scale q[b, h] . K[b, 0..pos[b], h / group]) V[...], online softmax.
template <typename E>
__global__ void __launch_bounds__(kWarps * 32)
    cache_attn_kernel(const E* q, const E* ck, const E* cv, const int32_t* pos, E* out, int Hq, int Hkv, int D,
                      int64_t L, float scale) {
  __shared__ float s_max[kWarps], s_sum[kWarps];
  __shared__ float s_acc[kWarps][kMaxPer * 32];
  const int b = blockIdx.x / Hq, h = blockIdx.x % Hq, kvh = h / (Hq / Hkv);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t n = min(int64_t(pos[b]) + 1, L);
  const E* qh = q + (int64_t(b) * Hq + h) * D;
  float qr[kMaxPer], acc[kMaxPer];
  NB_UNROLL for (int i = 0; i < kMaxPer; ++i) {
    const int d = lane + 32 * i;
    qr[i] = d < D ? to_f32(qh[d]) * scale : 0.f;
    acc[i] = 0.f;
  }
  float m = -INFINITY, l = 0.f;
  for (int64_t j = warp; j < n; j += kWarps) {
    const int64_t off = ((int64_t(b) * L + j) * Hkv + kvh) * D;
    float dot = 0.f;
    NB_UNROLL for (int i = 0; i < kMaxPer; ++i) {
      const int d = lane + 32 * i;
      if (d < D) dot += qr[i] * to_f32(ck[off + d]);
    }
    dot = warp_sum(dot);
    const float mn = fmaxf(m, dot), corr = expf(m - mn), p = expf(dot - mn);
    l = l * corr + p;
    NB_UNROLL for (int i = 0; i < kMaxPer; ++i) {
      const int d = lane + 32 * i;
      if (d < D) acc[i] = acc[i] * corr + p * to_f32(cv[off + d]);
    }
    m = mn;
  }
  if (lane == 0) {
    s_max[warp] = m;
    s_sum[warp] = l;
  }
  NB_UNROLL for (int i = 0; i < kMaxPer; ++i) s_acc[warp][lane + 32 * i] = acc[i];
  __syncthreads();
  if (warp != 0) return;
  float M = -INFINITY;
  NB_UNROLL for (int w = 0; w < kWarps; ++w) M = fmaxf(M, s_max[w]);
  float total = 0.f, o[kMaxPer] = {};
  NB_UNROLL for (int w = 0; w < kWarps; ++w) {
    const float f = s_max[w] == -INFINITY ? 0.f : expf(s_max[w] - M);  // a warp that saw no position
    total += s_sum[w] * f;
    NB_UNROLL for (int i = 0; i < kMaxPer; ++i) o[i] += s_acc[w][lane + 32 * i] * f;
  }
  E* oh = out + (int64_t(b) * Hq + h) * D;
  NB_UNROLL for (int i = 0; i < kMaxPer; ++i) {
    const int d = lane + 32 * i;
    if (d < D) oh[d] = from_f32<E>(o[i] / total);
  }
}

constexpr int kVecThreads = 256;  // threads of the vectorized attention block
constexpr int kVecUnroll = 4;     // positions per lane group per iteration (their loads issued together)

// Block (b, h) as cache_attn_kernel, BF16 with head_dim D in {32, 64, 128, 256}: G = D / 8 consecutive lanes
// own one position (8 dims each: one 16-byte load of the key and one of the value), the block's groups walk
// positions j0 + group + k * groups (k < kVecUnroll), and positions past pos[b] are masked, so every lane of
// a warp takes the same number of steps (the group shuffles stay full).
template <int D>
__global__ void __launch_bounds__(kVecThreads)
    cache_attn_vec_kernel(const bf16* q, const bf16* ck, const bf16* cv, const int32_t* pos, bf16* out, int Hq, int Hkv,
                          int64_t L, float scale) {
  constexpr int G = D / 8, kGroups = kVecThreads / G;
  __shared__ float s_max[kGroups], s_sum[kGroups];
  __shared__ float s_acc[kGroups][D];
  const int b = blockIdx.x / Hq, h = blockIdx.x % Hq, kvh = h / (Hq / Hkv);
  const int grp = int(threadIdx.x) / G, sub = int(threadIdx.x) % G;
  const int64_t n = min(int64_t(pos[b]) + 1, L);
  float qr[8], acc[8] = {};
  load_vec<bf16, 8>(q + (int64_t(b) * Hq + h) * D + sub * 8, qr);
  NB_UNROLL for (int i = 0; i < 8; ++i) qr[i] *= scale;
  const int64_t row = int64_t(Hkv) * D, base = int64_t(b) * L * row + int64_t(kvh) * D + sub * 8;
  float m = -INFINITY, l = 0.f;
  for (int64_t j0 = 0; j0 < n; j0 += int64_t(kGroups) * kVecUnroll) {
    uint4 kr[kVecUnroll], vr[kVecUnroll];
    NB_UNROLL for (int u = 0; u < kVecUnroll; ++u) {
      const int64_t j = j0 + grp + int64_t(u) * kGroups;
      kr[u] = j < n ? *reinterpret_cast<const uint4*>(ck + base + j * row) : make_uint4(0, 0, 0, 0);
      vr[u] = j < n ? *reinterpret_cast<const uint4*>(cv + base + j * row) : make_uint4(0, 0, 0, 0);
    }
    NB_UNROLL for (int u = 0; u < kVecUnroll; ++u) {
      const bf16* ke = reinterpret_cast<const bf16*>(&kr[u]);
      float dot = 0.f;
      NB_UNROLL for (int i = 0; i < 8; ++i) dot += qr[i] * to_f32(ke[i]);
      NB_UNROLL for (int o = G / 2; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
      if (j0 + grp + int64_t(u) * kGroups >= n) continue;  // a masked position (after the full shuffle)
      const float mn = fmaxf(m, dot), corr = expf(m - mn), p = expf(dot - mn);
      const bf16* ve = reinterpret_cast<const bf16*>(&vr[u]);
      l = l * corr + p;
      NB_UNROLL for (int i = 0; i < 8; ++i) acc[i] = acc[i] * corr + p * to_f32(ve[i]);
      m = mn;
    }
  }
  if (sub == 0) {
    s_max[grp] = m;
    s_sum[grp] = l;
  }
  NB_UNROLL for (int i = 0; i < 8; ++i) s_acc[grp][sub * 8 + i] = acc[i];
  __syncthreads();
  const int d = int(threadIdx.x);
  if (d >= D) return;
  float M = -INFINITY;
  for (int g = 0; g < kGroups; ++g) M = fmaxf(M, s_max[g]);
  float total = 0.f, o = 0.f;
  for (int g = 0; g < kGroups; ++g) {  // fixed order: the result does not depend on timing
    const float f = s_max[g] == -INFINITY ? 0.f : expf(s_max[g] - M);  // a group that saw no position
    total += s_sum[g] * f;
    o += s_acc[g][d] * f;
  }
  out[(int64_t(b) * Hq + h) * D + d] = from_f32<bf16>(o / total);
}

// (value, index) order of the argmax: larger value first, then the smaller index.
NB_DEVICE bool better(float v, int i, float bv, int bi) { return v > bv || (v == bv && i < bi); }

__global__ void argmax_kernel(const float* logits, int32_t* ids, int64_t V) {
  __shared__ float s_v[kArgmaxThreads];
  __shared__ int s_i[kArgmaxThreads];
  const float* row = logits + int64_t(blockIdx.x) * V;
  float bv = -INFINITY;
  int bi = INT_MAX;
  for (int64_t i = threadIdx.x; i < V; i += kArgmaxThreads)
    if (better(row[i], int(i), bv, bi)) {
      bv = row[i];
      bi = int(i);
    }
  s_v[threadIdx.x] = bv;
  s_i[threadIdx.x] = bi;
  __syncthreads();
  for (int w = kArgmaxThreads / 2; w > 0; w >>= 1) {
    if (int(threadIdx.x) < w &&
        better(s_v[threadIdx.x + w], s_i[threadIdx.x + w], s_v[threadIdx.x], s_i[threadIdx.x])) {
      s_v[threadIdx.x] = s_v[threadIdx.x + w];
      s_i[threadIdx.x] = s_i[threadIdx.x + w];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) ids[blockIdx.x] = s_i[0] == INT_MAX ? 0 : s_i[0];  // an all-NaN row: token 0
}

__global__ void advance_kernel(int32_t* pos, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) ++pos[i];
}

__global__ void vocab_shard_kernel(const int32_t* ids, int64_t begin, int64_t end, int32_t* out, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = ids[i] >= begin && ids[i] < end ? int32_t(ids[i] - begin) : -1;
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

void kv_cache_write_cuda(const Tensor& k, const Tensor& v, const Tensor& cache_k, const Tensor& cache_v,
                         const Tensor& pos, int64_t per_row, Stream s) {
  const int64_t L = cache_k.shape[1], row = cache_k.shape[2] * cache_k.shape[3], T = k.numel() / row;
  if (T == 0) return;
  dispatch(k.dtype, [&](auto tt) {
    using E = decltype(tt);
    kv_write_kernel<E><<<grid_for(T * row, 256, 16384), 256, 0, as_cuda(s)>>>(
        k.ptr<E>(), v.ptr<E>(), cache_k.ptr<E>(), cache_v.ptr<E>(), pos.ptr<int32_t>(), T, row, L, per_row);
    CUDA_CHECK_LAUNCH();
  });
}

Status cache_attention_cuda(const Tensor& q, const Tensor& cache_k, const Tensor& cache_v, const Tensor& pos,
                            const Tensor& out, float scale, Stream s) {
  const int64_t B = cache_k.shape[0], L = cache_k.shape[1], Hkv = cache_k.shape[2], D = cache_k.shape[3];
  const int64_t Hq = q.shape[1];
  if (D > 32 * kMaxPer)
    return errorf("decode attention supports head_dim up to %d, the model has %lld", 32 * kMaxPer, (long long)D);
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  if (q.dtype == DType::bf16 && aligned(q.data) && aligned(cache_k.data) && aligned(cache_v.data)) {
    const auto vec = [&](auto kernel) {
      kernel<<<unsigned(B * Hq), kVecThreads, 0, as_cuda(s)>>>(q.ptr<bf16>(), cache_k.ptr<bf16>(), cache_v.ptr<bf16>(),
                                                               pos.ptr<int32_t>(), out.ptr<bf16>(), int(Hq), int(Hkv),
                                                               L, scale);
      CUDA_CHECK_LAUNCH();
      return Status::ok();
    };
    if (D == 32) return vec(cache_attn_vec_kernel<32>);
    if (D == 64) return vec(cache_attn_vec_kernel<64>);
    if (D == 128) return vec(cache_attn_vec_kernel<128>);
    if (D == 256) return vec(cache_attn_vec_kernel<256>);
  }
  dispatch(q.dtype, [&](auto tt) {
    using E = decltype(tt);
    cache_attn_kernel<E><<<unsigned(B * Hq), kWarps * 32, 0, as_cuda(s)>>>(
        q.ptr<E>(), cache_k.ptr<E>(), cache_v.ptr<E>(), pos.ptr<int32_t>(), out.ptr<E>(), int(Hq), int(Hkv), int(D), L,
        scale);
    CUDA_CHECK_LAUNCH();
  });
  return Status::ok();
}

void argmax_rows_cuda(const Tensor& logits, const Tensor& ids, Stream s) {
  const int64_t B = ops::detail::rows_of(logits), V = ops::detail::cols_of(logits);
  if (B == 0) return;
  argmax_kernel<<<unsigned(B), kArgmaxThreads, 0, as_cuda(s)>>>(logits.ptr<float>(), ids.ptr<int32_t>(), V);
  CUDA_CHECK_LAUNCH();
}

void advance_positions_cuda(const Tensor& pos, Stream s) {
  const int64_t n = pos.numel();
  if (n == 0) return;
  advance_kernel<<<unsigned((n + 255) / 256), 256, 0, as_cuda(s)>>>(pos.ptr<int32_t>(), n);
  CUDA_CHECK_LAUNCH();
}

void vocab_shard_ids_cuda(const Tensor& ids, int64_t begin, int64_t end, const Tensor& out, Stream s) {
  const int64_t n = ids.numel();
  if (n == 0) return;
  vocab_shard_kernel<<<unsigned((n + 255) / 256), 256, 0, as_cuda(s)>>>(ids.ptr<int32_t>(), begin, end,
                                                                        out.ptr<int32_t>(), n);
  CUDA_CHECK_LAUNCH();
}

}  // namespace detail
}  // namespace nb::infer
