// CUDA kernels for RoPE and the fused-QKV split (see rope.h). One thread rotates V consecutive pairs of one head
// (16-byte accesses on both halves when hd/2 is a multiple of V); FP32 math, the same formula as the CPU.
// Packed sequences pass a positions array (table row per token); the kernels take it as a template flag, so
// without positions they compute exactly what they did before and read no extra memory.
#include <type_traits>

#include "ops/cuda_common.cuh"
#include "ops/ops_common.h"
#include "ops/rope.h"

namespace nb::ops {
namespace {
using namespace cuda;

// Rotates V pairs (src[i + k], src[half + i + k]) of one head by position row `cs` of the tables into
// dst (may equal src): the one rotation formula of both kernels, FP32 math, as the CPU reference.
template <typename T, int V>
__device__ __forceinline__ void rotate_pairs(const T* src, T* dst, const float* cs, const float* sn_row, int64_t i,
                                             int64_t half, float sign) {
  float x1[V], x2[V], c[V], sn[V];
  load_vec<T, V>(src + i, x1);
  load_vec<T, V>(src + half + i, x2);
  load_vec<float, V>(cs + i, c);
  load_vec<float, V>(sn_row + i, sn);
  float o1[V], o2[V];
  NB_UNROLL for (int k = 0; k < V; ++k) {
    float sk = sign * sn[k];
    o1[k] = x1[k] * c[k] - x2[k] * sk;
    o2[k] = x2[k] * c[k] + x1[k] * sk;
  }
  store_vec<T, V>(dst + i, o1);
  store_vec<T, V>(dst + half + i, o2);
}

// Table row of token t: positions[t] with kPos, else t % S.
template <bool kPos>
__device__ __forceinline__ int64_t position_of(int64_t t, int64_t S, const int32_t* positions) {
  if constexpr (kPos)
    return positions[t];
  else
    return t % S;
}

// x [rows = B*S*nh, hd]; item = (row, pair group). Token t = row / nh.
template <typename T, int V, bool kPos>
__global__ void rope_kernel(T* x, const float* cosv, const float* sinv, int64_t rows, int64_t S, int64_t nh,
                            int64_t half, float sign, const int32_t* positions) {
  int64_t groups = half / V;
  int64_t items = rows * groups;
  int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t it = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; it < items; it += stride) {
    int64_t row = it / groups, i = (it % groups) * V;
    int64_t s = position_of<kPos>(row / nh, S, positions);
    T* head = x + row * 2 * half;
    rotate_pairs<T, V>(head, head, cosv + s * half, sinv + s * half, i, half, sign);
  }
}

// Fused QKV split (merge = false) or its backward (merge = true). Item = (token, head, pair group) over
// the Hq + 2*Hkv heads of qkv; q and k heads rotate (sign -1 when merging: the inverse), v heads copy.
template <typename T, int V, bool kPos>
__global__ void rope_qkv_kernel(T* qkv, T* q, T* k, T* v, const float* cosv, const float* sinv, int64_t tokens,
                                int64_t S, int64_t hq, int64_t hkv, int64_t half, bool merge,
                                const int32_t* positions) {
  const int64_t groups = half / V, heads = hq + 2 * hkv;
  const int64_t items = tokens * heads * groups;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const float sign = merge ? -1.f : 1.f;
  for (int64_t it = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; it < items; it += stride) {
    const int64_t row = it / groups, i = (it % groups) * V;  // row = token * heads + head
    const int64_t t = row / heads, h = row % heads, s = position_of<kPos>(t, S, positions);
    T* fused = qkv + row * 2 * half;
    T* sep = h < hq ? q + (t * hq + h) * 2 * half
                    : (h < hq + hkv ? k + (t * hkv + h - hq) * 2 * half : v + (t * hkv + h - hq - hkv) * 2 * half);
    const T* src = merge ? sep : fused;
    T* dst = merge ? fused : sep;
    if (h < hq + hkv) {
      rotate_pairs<T, V>(src, dst, cosv + s * half, sinv + s * half, i, half, sign);
    } else {
      float x1[V], x2[V];  // v heads: a BF16 -> FP32 -> BF16 round trip is exact
      load_vec<T, V>(src + i, x1);
      load_vec<T, V>(src + half + i, x2);
      store_vec<T, V>(dst + i, x1);
      store_vec<T, V>(dst + half + i, x2);
    }
  }
}

// Calls launch(T{}, bool_constant<has_positions>) for the storage type (bf16 or f32).
template <typename Launch>
void dispatch(DType dt, bool has_positions, Launch&& launch) {
  if (dt == DType::bf16) {
    if (has_positions)
      launch(bf16{}, std::true_type{});
    else
      launch(bf16{}, std::false_type{});
  } else {
    if (has_positions)
      launch(float{}, std::true_type{});
    else
      launch(float{}, std::false_type{});
  }
}

}  // namespace

namespace detail {

void rope_qkv_cuda(const Tensor& qkv, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cos,
                   const Tensor& sin, bool merge, const int32_t* positions, Stream s) {
  const int64_t S = q.shape[1], hq = q.shape[2], hkv = k.shape[2], half = q.shape[3] / 2;
  const int64_t tokens = q.shape[0] * S;
  const int64_t items = tokens * (hq + 2 * hkv) * half;
  if (items == 0) return;
  auto launch = [&](auto tt, auto has_pos) {
    using T = decltype(tt);
    constexpr bool kPos = decltype(has_pos)::value;
    bool vec = half % 8 == 0 && vec_ok<float>(cos.data, half) && vec_ok<float>(sin.data, half);
    for (const Tensor* t : {&qkv, &q, &k, &v}) vec = vec && vec_ok<T>(t->data, half);
    if (vec) {
      rope_qkv_kernel<T, 8, kPos><<<grid_for(items / 8, 256, 8192), 256, 0, as_cuda(s)>>>(
          qkv.ptr<T>(), q.ptr<T>(), k.ptr<T>(), v.ptr<T>(), cos.ptr<float>(), sin.ptr<float>(), tokens, S, hq, hkv,
          half, merge, positions);
    } else {
      rope_qkv_kernel<T, 1, kPos><<<grid_for(items, 256, 8192), 256, 0, as_cuda(s)>>>(
          qkv.ptr<T>(), q.ptr<T>(), k.ptr<T>(), v.ptr<T>(), cos.ptr<float>(), sin.ptr<float>(), tokens, S, hq, hkv,
          half, merge, positions);
    }
    CUDA_CHECK_LAUNCH();
  };
  dispatch(qkv.dtype, positions != nullptr, launch);
}

void rope_apply_cuda(const Tensor& x, const Tensor& cos, const Tensor& sin, bool inverse, const int32_t* positions,
                     Stream s) {
  const int64_t B = x.shape[0], S = x.shape[1], nh = x.shape[2], half = x.shape[3] / 2;
  const int64_t rows = B * S * nh;
  if (rows == 0 || half == 0) return;
  const float sign = inverse ? -1.f : 1.f;
  auto launch = [&](auto tt, auto has_pos) {
    using T = decltype(tt);
    constexpr bool kPos = decltype(has_pos)::value;
    bool vec =
        half % 8 == 0 && vec_ok<T>(x.data, half) && vec_ok<float>(cos.data, half) && vec_ok<float>(sin.data, half);
    if (vec) {
      rope_kernel<T, 8, kPos><<<grid_for(rows * half / 8, 256, 8192), 256, 0, as_cuda(s)>>>(
          x.ptr<T>(), cos.ptr<float>(), sin.ptr<float>(), rows, S, nh, half, sign, positions);
    } else {
      rope_kernel<T, 1, kPos><<<grid_for(rows * half, 256, 8192), 256, 0, as_cuda(s)>>>(
          x.ptr<T>(), cos.ptr<float>(), sin.ptr<float>(), rows, S, nh, half, sign, positions);
    }
    CUDA_CHECK_LAUNCH();
  };
  dispatch(x.dtype, positions != nullptr, launch);
}

}  // namespace detail
}  // namespace nb::ops
