// CUDA kernel for AdamW (see adamw.h): one fused pass per tensor, 8 elements per thread step with
// 16-byte accesses when every pointer is aligned; the same FP32 operation order as the CPU reference
// (the build disables FMA contraction and uses IEEE division and sqrt, so results match bit for bit).
#include "ops/adamw.h"
#include "ops/cuda_common.cuh"
#include "ops/ops_common.h"

namespace nb::ops {
namespace {
using namespace cuda;
using detail::AdamWScalars;
constexpr int kElems = 8;

NB_DEVICE void adamw_one(const AdamWScalars& k, float& p, float g, float& m, float& v) {
  g = g * k.grad_scale;
  m = k.beta1 * m + k.one_minus_beta1 * g;
  v = k.beta2 * v + k.one_minus_beta2 * (g * g);
  p = p * k.decay_factor;
  p = p - k.step_size * (m / (sqrtf(v) * k.inv_sqrt_bc2 + k.eps));
}

// C = compute-copy element type; copy == nullptr skips it.
template <typename C>
__global__ void adamw_kernel(float* master, const float* grad, float* m, float* v, C* copy, int64_t n, bool vec,
                             AdamWScalars k) {
  int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, stride = int64_t(gridDim.x) * blockDim.x;
  int64_t nvec = vec ? n / kElems : 0;
  for (int64_t i = tid; i < nvec; i += stride) {
    int64_t o = i * kElems;
    float p[kElems], g[kElems], mm[kElems], vv[kElems];
    load_vec<float, kElems>(master + o, p);
    load_vec<float, kElems>(grad + o, g);
    load_vec<float, kElems>(m + o, mm);
    load_vec<float, kElems>(v + o, vv);
    NB_UNROLL for (int e = 0; e < kElems; ++e) adamw_one(k, p[e], g[e], mm[e], vv[e]);
    store_vec<float, kElems>(master + o, p);
    store_vec<float, kElems>(m + o, mm);
    store_vec<float, kElems>(v + o, vv);
    if (copy) store_vec<C, kElems>(copy + o, p);
  }
  for (int64_t i = nvec * kElems + tid; i < n; i += stride) {
    float p = master[i], mm = m[i], vv = v[i];
    adamw_one(k, p, grad[i], mm, vv);
    master[i] = p;
    m[i] = mm;
    v[i] = vv;
    if (copy) copy[i] = from_f32<C>(p);
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

namespace detail {

void adamw_update_cuda(const Tensor& master, const Tensor& grad, const Tensor& m, const Tensor& v,
                       const Tensor& compute_copy, const AdamWScalars& k, Stream s) {
  const int64_t n = master.numel();
  if (n == 0) return;
  bool vec = aligned16(master.data) && aligned16(grad.data) && aligned16(m.data) && aligned16(v.data) &&
             (compute_copy.data == nullptr || aligned16(compute_copy.data));
  int grid = grid_for((n + kElems - 1) / kElems, 256, 8192);
  if (compute_copy.data != nullptr && compute_copy.dtype == DType::bf16)
    adamw_kernel<bf16><<<grid, 256, 0, as_cuda(s)>>>(master.ptr<float>(), grad.ptr<float>(), m.ptr<float>(),
                                                     v.ptr<float>(), compute_copy.ptr<bf16>(), n, vec, k);
  else
    adamw_kernel<float><<<grid, 256, 0, as_cuda(s)>>>(master.ptr<float>(), grad.ptr<float>(), m.ptr<float>(),
                                                      v.ptr<float>(), compute_copy.ptr<float>(), n, vec, k);
  CUDA_CHECK_LAUNCH();
}

}  // namespace detail
}  // namespace nb::ops
