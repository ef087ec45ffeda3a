// CPU reference and device dispatch for RMSNorm (see rmsnorm.h).
// Backward: with g = w * dy, dx_j = rstd * (g_j - x_j * rstd^2 * mean(g * x)); dw_j += sum_rows dy_j x_j rstd.
#include "ops/rmsnorm.h"
#include <cmath>
#include <vector>
#include "ops/ops_common.h"

namespace nb::ops {
using namespace detail;

static void check_rmsnorm(const char* op, const Tensor& x, const Tensor& w, const Tensor& rstd) {
  check_contiguous(op, "x", x);
  check_contiguous(op, "w", w);
  check_contiguous(op, "rstd", rstd);
  check_float(op, "x", x);
  check_float(op, "w", w);
  check_dtype(op, "rstd", rstd, DType::f32);
  check_same_device(op, x, w);
  check_same_device(op, x, rstd);
  check_numel(op, "w", w, cols_of(x));
  check_numel(op, "rstd", rstd, rows_of(x));
}

void rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, const Tensor& y, const Tensor& rstd,
                     [[maybe_unused]] Stream stream) {
  check_rmsnorm("rmsnorm_forward", x, w, rstd);
  check_contiguous("rmsnorm_forward", "y", y);
  check_float("rmsnorm_forward", "y", y);
  check_same_device("rmsnorm_forward", x, y);
  check_numel("rmsnorm_forward", "y", y, x.numel());
  if (x.device == Device::cuda) NB_OPS_CUDA("rmsnorm_forward", rmsnorm_forward_cuda(x, w, eps, y, rstd, stream));
  const int64_t rows = rows_of(x), H = cols_of(x);
  const float* px = x.ptr<float>();
  const float* pw = w.ptr<float>();
  float* py = y.ptr<float>();
  for (int64_t t = 0; t < rows; ++t) {
    const float* xr = px + t * H;
    double ss = 0;
    for (int64_t j = 0; j < H; ++j) ss += double(xr[j]) * double(xr[j]);
    float r = float(1.0 / std::sqrt(ss / double(H) + double(eps)));
    rstd.ptr<float>()[t] = r;
    for (int64_t j = 0; j < H; ++j) py[t * H + j] = xr[j] * r * pw[j];
  }
}

void rmsnorm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy, const Tensor& dx,
                      const Tensor& dw_f32, [[maybe_unused]] Stream stream) {
  const char* op = "rmsnorm_backward";
  check_rmsnorm(op, x, w, rstd);
  for (const Tensor* t : {&dy, &dx}) {
    check_contiguous(op, "dy/dx", *t);
    check_float(op, "dy/dx", *t);
    check_same_device(op, x, *t);
    check_numel(op, "dy/dx", *t, x.numel());
  }
  NB_CHECK(dx.data != dy.data, "%s: dx must not alias dy (dw is computed from dy after dx is written)", op);
  check_contiguous(op, "dw_f32", dw_f32);
  check_dtype(op, "dw_f32", dw_f32, DType::f32);
  check_same_device(op, x, dw_f32);
  check_numel(op, "dw_f32", dw_f32, cols_of(x));
  if (x.device == Device::cuda) NB_OPS_CUDA(op, rmsnorm_backward_cuda(x, w, rstd, dy, dx, dw_f32, stream));
  const int64_t rows = rows_of(x), H = cols_of(x);
  const float* px = x.ptr<float>();
  const float* pw = w.ptr<float>();
  const float* pdy = dy.ptr<float>();
  float* pdx = dx.ptr<float>();
  std::vector<double> dw(size_t(H), 0.0);
  for (int64_t t = 0; t < rows; ++t) {
    const float* xr = px + t * H;
    const float* dyr = pdy + t * H;
    double r = rstd.ptr<float>()[t];
    double dot = 0;
    for (int64_t j = 0; j < H; ++j) dot += double(pw[j]) * dyr[j] * xr[j];
    double c = r * r * r * dot / double(H);
    for (int64_t j = 0; j < H; ++j) {
      pdx[t * H + j] = float(r * pw[j] * dyr[j] - c * xr[j]);
      dw[size_t(j)] += double(dyr[j]) * xr[j] * r;
    }
  }
  for (int64_t j = 0; j < H; ++j) dw_f32.ptr<float>()[j] += float(dw[size_t(j)]);
}

}  // namespace nb::ops
