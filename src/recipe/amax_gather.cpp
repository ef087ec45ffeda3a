// amax_gather.h on the CPU (and the checks both backends share), and Linear::step_amax_views, which
// hands out the views gather_amaxes reads.
#include "recipe/amax_gather.h"
#include <cmath>
#include "recipe/linear_device.h"
#include "recipe/linear_internal.h"

namespace nb::recipe {

using namespace detail;

void Linear::step_amax_views(std::vector<Tensor>* out) const {
  if (!impl_ || impl_->all_bf16 || impl_->recipe.fp8_scaling != Fp8Scaling::delayed) return;
  // All three roles, used in the step or not: every rank then lists the same views in the same order
  // (an unused role's step amax is 0 on every rank, and the weight's is the same on every rank anyway).
  for (const QCopies& c : impl_->q)
    out->push_back(Tensor::make(c.state_f.ptr<float>() + kStepAmax, DType::f32, impl_->dev, {1}));
}

// The views' pointers, or one sentence about the first view or buffer that does not fit.
static Status amax_pointers(const std::vector<Tensor>& amaxes, const Tensor& buf, std::vector<float*>* ptrs) {
  if (buf.dtype != DType::f32 || !buf.is_contiguous() || buf.numel() != int64_t(amaxes.size()))
    return errorf("amax gather: the buffer is %s %s; need a contiguous f32 tensor of %zu elements",
                  std::string(dtype_name(buf.dtype)).c_str(), buf.shape_str().c_str(), amaxes.size());
  ptrs->clear();
  for (const Tensor& a : amaxes) {
    if (a.dtype != DType::f32 || a.numel() != 1 || a.device != buf.device)
      return errorf("amax gather: an amax is %s %s on %s; need one f32 element on %s",
                    std::string(dtype_name(a.dtype)).c_str(), a.shape_str().c_str(), device_name(a.device),
                    device_name(buf.device));
    ptrs->push_back(a.ptr<float>());
  }
  return Status::ok();
}

Status gather_amaxes(const std::vector<Tensor>& amaxes, const Tensor& dst, Stream stream) {
  std::vector<float*> ptrs;
  NB_TRY(amax_pointers(amaxes, dst, &ptrs));
  if (ptrs.empty()) return Status::ok();
  if (dst.device == Device::cuda) return gather_amaxes_cuda(ptrs, dst.ptr<float>(), stream);
  float* d = dst.ptr<float>();
  for (size_t i = 0; i < ptrs.size(); ++i) d[i] = std::isnan(*ptrs[i]) ? INFINITY : *ptrs[i];
  return Status::ok();
}

Status scatter_amaxes(const Tensor& src, const std::vector<Tensor>& amaxes, Stream stream) {
  std::vector<float*> ptrs;
  NB_TRY(amax_pointers(amaxes, src, &ptrs));
  if (ptrs.empty()) return Status::ok();
  if (src.device == Device::cuda) return scatter_amaxes_cuda(src.ptr<float>(), ptrs, stream);
  const float* s = src.ptr<float>();
  for (size_t i = 0; i < ptrs.size(); ++i) *ptrs[i] = std::isinf(s[i]) ? NAN : s[i];
  return Status::ok();
}

}  // namespace nb::recipe
