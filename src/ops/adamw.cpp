// CPU reference and device dispatch for AdamW (see adamw.h).
#include "ops/adamw.h"
#include <cmath>
#include "ops/ops_common.h"

namespace nb::ops {
using namespace detail;

namespace detail {
AdamWScalars adamw_scalars(const AdamWParams& p) {
  NB_CHECK(p.step >= 1, "adamw_update: step %lld must start at 1", (long long)p.step);
  AdamWScalars k;
  k.lr = p.lr;
  k.beta1 = p.beta1;
  k.beta2 = p.beta2;
  k.one_minus_beta1 = float(1.0 - double(p.beta1));
  k.one_minus_beta2 = float(1.0 - double(p.beta2));
  k.eps = p.eps;
  k.decay_factor = float(1.0 - double(p.lr) * double(p.weight_decay));
  double bc1 = 1.0 - std::pow(double(p.beta1), double(p.step));
  double bc2 = 1.0 - std::pow(double(p.beta2), double(p.step));
  k.step_size = float(double(p.lr) / bc1);
  k.inv_sqrt_bc2 = float(1.0 / std::sqrt(bc2));
  k.grad_scale = p.grad_scale;
  return k;
}
}  // namespace detail

void adamw_update(const Tensor& master, const Tensor& grad, const Tensor& m, const Tensor& v,
                  const Tensor& compute_copy, const AdamWParams& params, [[maybe_unused]] Stream stream) {
  const char* op = "adamw_update";
  const int64_t n = master.numel();
  for (const Tensor* t : {&master, &grad, &m, &v}) {
    check_contiguous(op, "master/grad/m/v", *t);
    check_dtype(op, "master/grad/m/v", *t, DType::f32);
    check_same_device(op, master, *t);
    check_numel(op, "grad/m/v", *t, n);
  }
  const bool has_copy = compute_copy.data != nullptr;
  if (has_copy) {
    check_contiguous(op, "compute_copy", compute_copy);
    NB_CHECK(compute_copy.dtype == DType::bf16 || compute_copy.dtype == DType::f32,
             "%s: compute_copy must be bf16 or f32", op);
    check_same_device(op, master, compute_copy);
    check_numel(op, "compute_copy", compute_copy, n);
  }
  const AdamWScalars k = adamw_scalars(params);
  if (master.device == Device::cuda) NB_OPS_CUDA(op, adamw_update_cuda(master, grad, m, v, compute_copy, k, stream));
  float* pp = master.ptr<float>();
  const float* pg = grad.ptr<float>();
  float* pm = m.ptr<float>();
  float* pv = v.ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    float g = pg[i] * k.grad_scale;
    float mi = k.beta1 * pm[i] + k.one_minus_beta1 * g;
    float vi = k.beta2 * pv[i] + k.one_minus_beta2 * (g * g);
    float p = pp[i] * k.decay_factor;
    p = p - k.step_size * (mi / (std::sqrt(vi) * k.inv_sqrt_bc2 + k.eps));
    pm[i] = mi;
    pv[i] = vi;
    pp[i] = p;
    if (has_copy) store_host(compute_copy, i, p);
  }
}

}  // namespace nb::ops
