// Vocabulary-parallel cross-entropy, the CPU reference (vocab_parallel_ce.h): three passes over the local
// logits around the group's two reductions, FP64 as ops/cross_entropy.cpp's reference.
#include "ops/vocab_parallel_ce.h"
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace nb::ops::tp {

Status vocab_parallel_cross_entropy(const Tensor& logits, const Tensor& targets, int64_t vocab_begin, float grad_scale,
                                    const Tensor& losses, VocabReducer* group) {
  if (logits.device != Device::cpu || logits.dtype != DType::f32 || logits.ndim != 2)
    return errorf("vocab_parallel_cross_entropy: the reference takes f32 host logits [T, V/T], not %s %s",
                  std::string(dtype_name(logits.dtype)).c_str(), logits.shape_str().c_str());
  const int64_t T = logits.shape[0], Vl = logits.shape[1];
  if (targets.numel() != T || losses.numel() != T)
    return errorf("vocab_parallel_cross_entropy: %lld rows of logits but %lld targets and %lld losses", (long long)T,
                  (long long)targets.numel(), (long long)losses.numel());
  float* x = logits.ptr<float>();
  const int32_t* tgt = targets.ptr<int32_t>();
  std::vector<double> m(size_t(T), -std::numeric_limits<double>::infinity()), st(size_t(2 * T), 0.0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < Vl; ++j) m[size_t(t)] = std::max(m[size_t(t)], double(x[t * Vl + j]));
  NB_TRY(group->max(m.data(), T));
  for (int64_t t = 0; t < T; ++t) {  // st = [sum exp (T) | target logit (T)]
    for (int64_t j = 0; j < Vl; ++j) st[size_t(t)] += std::exp(double(x[t * Vl + j]) - m[size_t(t)]);
    const int64_t local = int64_t(tgt[t]) - vocab_begin;
    if (tgt[t] >= 0 && local >= 0 && local < Vl) st[size_t(T + t)] = double(x[t * Vl + local]);
  }
  NB_TRY(group->sum(st.data(), 2 * T));
  for (int64_t t = 0; t < T; ++t) {
    const bool trained = tgt[t] >= 0;
    const double s = st[size_t(t)];
    losses.ptr<float>()[t] = trained ? float(std::log(s) + m[size_t(t)] - st[size_t(T + t)]) : 0.f;
    for (int64_t j = 0; j < Vl; ++j) {
      const double p = std::exp(double(x[t * Vl + j]) - m[size_t(t)]) / s;
      const double onehot = vocab_begin + j == tgt[t] ? 1.0 : 0.0;
      x[t * Vl + j] = trained ? float((p - onehot) * double(grad_scale)) : 0.f;
    }
  }
  return Status::ok();
}

}  // namespace nb::ops::tp
