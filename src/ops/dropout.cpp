// CPU reference and device dispatch for dropout (see dropout.h).
#include "ops/dropout.h"
#include <cstring>
#include "ops/ops_common.h"

namespace nb::ops {
using namespace detail;

static void check_dropout(const char* op, const char* in_name, const Tensor& in, const char* out_name,
                          const Tensor& out, float p) {
  NB_CHECK(p >= 0.f && p < 1.f, "%s: dropout probability %g must be in [0, 1)", op, double(p));
  check_contiguous(op, in_name, in);
  check_contiguous(op, out_name, out);
  check_float(op, in_name, in);
  check_same_device(op, in, out);
  NB_CHECK(out.dtype == in.dtype, "%s: '%s' must have '%s''s dtype (%s vs %s)", op, out_name, in_name,
           std::string(dtype_name(out.dtype)).c_str(), std::string(dtype_name(in.dtype)).c_str());
  check_numel(op, out_name, out, in.numel());
  const auto a = reinterpret_cast<uintptr_t>(in.data), b = reinterpret_cast<uintptr_t>(out.data);
  NB_CHECK(a == b || a + uintptr_t(in.bytes()) <= b || b + uintptr_t(out.bytes()) <= a,
           "%s: '%s' must be '%s' itself or not overlap it", op, out_name, in_name);
}

// A column window's elements one by one, each with its whole-tensor index's bits.
static void dropout_window(const char* op, const Tensor& in, const Tensor& out, float p, RngKey key, DropoutColumns w,
                           [[maybe_unused]] Stream stream) {
  NB_CHECK(in.ndim == 2 && w.first >= 0 && w.first + in.shape[1] <= w.whole,
           "%s: a column window [%lld, +%s) of %lld columns needs a 2-D tensor inside it", op, (long long)w.first,
           in.shape_str().c_str(), (long long)w.whole);
  const uint32_t threshold = dropout_threshold(p);
  const float scale = dropout_scale(p);
  const int64_t cols = in.shape[1];
  if (in.device == Device::cuda) NB_OPS_CUDA(op, dropout_window_cuda(in, out, threshold, scale, key, cols, w, stream));
  const float* px = in.ptr<float>();
  float* po = out.ptr<float>();
  for (int64_t i = 0; i < in.numel(); ++i)
    po[i] = dropout_apply(px[i], dropout_bits(key, dropout_whole_index(i, cols, w)), threshold, scale);
}

static void dropout([[maybe_unused]] const char* op, const Tensor& in, const Tensor& out, float p, RngKey key,
                    [[maybe_unused]] Stream stream, DropoutColumns w) {
  if (w.whole > 0) return dropout_window(op, in, out, p, key, w, stream);
  const uint32_t threshold = dropout_threshold(p);
  const float scale = dropout_scale(p);
  if (in.device == Device::cuda) NB_OPS_CUDA(op, dropout_cuda(in, out, threshold, scale, key, stream));
  const int64_t n = in.numel();
  const float* px = in.ptr<float>();
  float* po = out.ptr<float>();
  if (threshold == 0 && scale == 1.f) {  // p == 0 (or too small to drop anything): an exact copy
    if (po != px && n > 0) std::memcpy(po, px, size_t(n) * sizeof(float));
    return;
  }
  for (int64_t b = 0; b * 4 < n; ++b) {
    const Philox4x32 r = philox_block(key, uint64_t(b));
    for (int64_t k = 0; k < 4 && b * 4 + k < n; ++k)
      po[b * 4 + k] = dropout_apply(px[b * 4 + k], r.v[k], threshold, scale);
  }
}

void dropout_forward(const Tensor& x, const Tensor& out, float p, RngKey key, Stream stream, DropoutColumns cols) {
  check_dropout("dropout_forward", "x", x, "out", out, p);
  dropout("dropout_forward", x, out, p, key, stream, cols);
}

void dropout_backward(const Tensor& dy, const Tensor& dx, float p, RngKey key, Stream stream, DropoutColumns cols) {
  check_dropout("dropout_backward", "dy", dy, "dx", dx, p);
  dropout("dropout_backward", dy, dx, p, key, stream, cols);
}

}  // namespace nb::ops
