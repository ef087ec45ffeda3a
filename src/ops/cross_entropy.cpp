// CPU reference and device dispatch for softmax cross-entropy (see cross_entropy.h).
#include "ops/cross_entropy.h"
#include <cmath>
#include "ops/ops_common.h"

namespace nb::ops {
using namespace detail;

void cross_entropy_fwd_bwd(const Tensor& logits, const Tensor& targets, float grad_scale, const Tensor& losses,
                           [[maybe_unused]] Stream stream) {
  const char* op = "cross_entropy_fwd_bwd";
  NB_CHECK(logits.ndim == 2, "%s: logits must be [T, V], got %s", op, logits.shape_str().c_str());
  check_contiguous(op, "logits", logits);
  check_contiguous(op, "targets", targets);
  check_contiguous(op, "losses", losses);
  check_float(op, "logits", logits);
  check_dtype(op, "targets", targets, DType::i32);
  check_dtype(op, "losses", losses, DType::f32);
  check_same_device(op, logits, targets);
  check_same_device(op, logits, losses);
  const int64_t T = logits.shape[0], V = logits.shape[1];
  check_numel(op, "targets", targets, T);
  check_numel(op, "losses", losses, T);
  if (logits.device == Device::cuda)
    NB_OPS_CUDA(op, cross_entropy_fwd_bwd_cuda(logits, targets, grad_scale, losses, stream));
  for (int64_t t = 0; t < T; ++t) {
    float* row = logits.ptr<float>() + t * V;
    const int32_t target = targets.ptr<int32_t>()[t];
    NB_CHECK(target < V, "%s: target %d of token %lld is outside the vocabulary of %lld", op, target, (long long)t,
             (long long)V);
    if (target < 0) {
      losses.ptr<float>()[t] = 0.f;
      for (int64_t j = 0; j < V; ++j) row[j] = 0.f;
      continue;
    }
    double m = -INFINITY;
    for (int64_t j = 0; j < V; ++j) m = std::fmax(m, double(row[j]));
    double s = 0;
    for (int64_t j = 0; j < V; ++j) s += std::exp(double(row[j]) - m);
    losses.ptr<float>()[t] = float(std::log(s) + m - double(row[target]));
    for (int64_t j = 0; j < V; ++j) {
      double p = std::exp(double(row[j]) - m) / s;
      row[j] = float((p - (j == target ? 1.0 : 0.0)) * double(grad_scale));
    }
  }
}

}  // namespace nb::ops
