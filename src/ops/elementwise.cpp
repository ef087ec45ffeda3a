// CPU reference and device dispatch for the elementwise helpers (see elementwise.h).
#include "ops/elementwise.h"
#include <cmath>
#include "ops/ops_common.h"

namespace nb::ops {
using namespace detail;

void cast(const Tensor& src, const Tensor& dst, [[maybe_unused]] Stream stream) {
  check_same_device("cast", src, dst);
  check_contiguous("cast", "src", src);
  check_contiguous("cast", "dst", dst);
  check_numel("cast", "dst", dst, src.numel());
  for (const Tensor* t : {&src, &dst})
    NB_CHECK(t->dtype == DType::f32 || t->dtype == DType::bf16, "cast: only f32 and bf16 are supported, got %s",
             std::string(dtype_name(t->dtype)).c_str());
  if (src.device == Device::cuda) NB_OPS_CUDA("cast", cast_cuda(src, dst, stream));
  for (int64_t i = 0, n = src.numel(); i < n; ++i) store_host(dst, i, load_host(src, i));
}

void add_inplace(const Tensor& y, const Tensor& x, [[maybe_unused]] Stream stream) {
  check_same_device("add_inplace", y, x);
  check_contiguous("add_inplace", "y", y);
  check_contiguous("add_inplace", "x", x);
  check_numel("add_inplace", "x", x, y.numel());
  check_float("add_inplace", "y", y);
  check_float("add_inplace", "x", x);
  if (y.device == Device::cuda) NB_OPS_CUDA("add_inplace", add_inplace_cuda(y, x, stream));
  float* py = y.ptr<float>();
  const float* px = x.ptr<float>();
  for (int64_t i = 0, n = y.numel(); i < n; ++i) py[i] += px[i];
}

void fill(const Tensor& t, float value, [[maybe_unused]] Stream stream) {
  check_contiguous("fill", "t", t);
  check_float("fill", "t", t);
  if (t.device == Device::cuda) NB_OPS_CUDA("fill", fill_cuda(t, value, stream));
  float* p = t.ptr<float>();
  for (int64_t i = 0, n = t.numel(); i < n; ++i) p[i] = value;
}

void scale_inplace(const Tensor& t, float s, [[maybe_unused]] Stream stream) {
  check_contiguous("scale_inplace", "t", t);
  check_float("scale_inplace", "t", t);
  if (t.device == Device::cuda) NB_OPS_CUDA("scale_inplace", scale_inplace_cuda(t, s, stream));
  float* p = t.ptr<float>();
  for (int64_t i = 0, n = t.numel(); i < n; ++i) p[i] *= s;
}

bool all_finite(const Tensor& t, [[maybe_unused]] Stream stream) {
  check_contiguous("all_finite", "t", t);
  check_float("all_finite", "t", t);
  if (t.device == Device::cuda) NB_OPS_CUDA("all_finite", all_finite_cuda(t, stream));
  const float* p = t.ptr<float>();
  for (int64_t i = 0, n = t.numel(); i < n; ++i)
    if (!std::isfinite(p[i])) return false;
  return true;
}

void sum_squares_accumulate(const Tensor& x, float* out, [[maybe_unused]] Stream stream) {
  check_contiguous("sum_squares_accumulate", "x", x);
  check_float("sum_squares_accumulate", "x", x);
  NB_CHECK(out != nullptr, "sum_squares_accumulate: out is null");
  if (x.device == Device::cuda) NB_OPS_CUDA("sum_squares_accumulate", sum_squares_accumulate_cuda(x, out, stream));
  const float* p = x.ptr<float>();
  double acc = 0;
  for (int64_t i = 0, n = x.numel(); i < n; ++i) acc += double(p[i]) * double(p[i]);
  *out = float(double(*out) + acc);
}

}  // namespace nb::ops
