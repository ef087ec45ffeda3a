// Vocabulary-parallel cross-entropy (vocab_parallel_ce.h): argument checks, the CPU reference (three passes
// over the local logits around the group's two reductions, FP64 within a rank as ops/cross_entropy.cpp) and
// the CUDA dispatch (the same passes as kernels in vocab_parallel_ce.cu, the same reductions between them).
#include "ops/vocab_parallel_ce.h"
#include <algorithm>
#include <cmath>
#include <string>
#include "ops/ops_common.h"

namespace nb::ops::tp {
namespace {

constexpr const char* kOp = "vocab_parallel_cross_entropy";

// One sentence naming the first bad argument; Status rather than NB_CHECK, since the shapes come from the
// parallel layout the caller configured.
Status check_arguments(const Tensor& logits, const Tensor& targets, int64_t vocab_begin, int64_t vocab,
                       const Tensor& losses, const Tensor& scratch, const ReduceGroup* group) {
  if (group == nullptr) return errorf("%s: no reduce group", kOp);
  if (logits.ndim != 2) return errorf("%s: logits must be [T, V/T], got %s", kOp, logits.shape_str().c_str());
  const bool cuda = logits.device == Device::cuda;
  if (logits.dtype != DType::f32 && !(cuda && logits.dtype == DType::bf16))
    return errorf("%s: logits must be f32 (or bf16 on cuda), got %s on %s", kOp,
                  std::string(dtype_name(logits.dtype)).c_str(), device_name(logits.device));
  const int64_t T = logits.shape[0];
  struct Want {
    const char* name;
    const Tensor& t;
    DType dtype;
    int64_t numel;
  };
  for (const Want& w : {Want{"logits", logits, logits.dtype, logits.numel()}, Want{"targets", targets, DType::i32, T},
                        Want{"losses", losses, DType::f32, T}, Want{"scratch", scratch, DType::f32, 3 * T}}) {
    if (w.t.device != logits.device)
      return errorf("%s: '%s' is on %s but logits are on %s", kOp, w.name, device_name(w.t.device),
                    device_name(logits.device));
    if (w.t.dtype != w.dtype)
      return errorf("%s: '%s' must be %s, got %s", kOp, w.name, std::string(dtype_name(w.dtype)).c_str(),
                    std::string(dtype_name(w.t.dtype)).c_str());
    if (w.t.numel() != w.numel || !w.t.is_contiguous() || (w.t.data == nullptr && w.numel > 0))
      return errorf("%s: '%s' %s must be contiguous with %lld elements", kOp, w.name, w.t.shape_str().c_str(),
                    (long long)w.numel);
  }
  if (scratch.ndim != 2 || scratch.shape[0] != 3)
    return errorf("%s: scratch must be [3, T], got %s", kOp, scratch.shape_str().c_str());
  if (vocab <= 0 || vocab_begin < 0)
    return errorf("%s: the slice must start at an id >= 0 of a vocabulary > 0, got %lld of %lld", kOp,
                  (long long)vocab_begin, (long long)vocab);
  return Status::ok();
}

#if defined(NIBBLE_HAVE_CUDA)
Status vocab_parallel_cuda(const Tensor& logits, const Tensor& targets, int64_t vocab_begin, int64_t vocab,
                           float grad_scale, const Tensor& losses, const Tensor& row_max, const Tensor& sums,
                           ReduceGroup* group, Stream stream) {
  detail::vp_ce_row_max_cuda(logits, vocab_begin, vocab, row_max, stream);
  NB_TRY(group->max(row_max, stream));
  detail::vp_ce_sums_cuda(logits, targets, vocab_begin, vocab, row_max, sums, stream);
  NB_TRY(group->sum(sums, stream));
  detail::vp_ce_finish_cuda(logits, targets, vocab_begin, vocab, grad_scale, row_max, sums, losses, stream);
  return Status::ok();
}
#endif

}  // namespace

Status vocab_parallel_cross_entropy(const Tensor& logits, const Tensor& targets, int64_t vocab_begin, int64_t vocab,
                                    float grad_scale, const Tensor& losses, const Tensor& scratch, ReduceGroup* group,
                                    Stream stream) {
  NB_TRY(check_arguments(logits, targets, vocab_begin, vocab, losses, scratch, group));
  const int64_t T = logits.shape[0], Vl = logits.shape[1];
  if (T == 0) return Status::ok();  // T is the same on every rank, so no rank waits in a collective
  float* stats = scratch.ptr<float>();
  // Rows 1 and 2 are adjacent: the sums and the target logits travel in one all-reduce of 2T values.
  const Tensor row_max = Tensor::make(stats, DType::f32, scratch.device, {T});
  const Tensor sums = Tensor::make(stats + T, DType::f32, scratch.device, {2 * T});
  if (logits.device == Device::cuda)
    NB_OPS_CUDA(kOp, vocab_parallel_cuda(logits, targets, vocab_begin, vocab, grad_scale, losses, row_max, sums, group,
                                         stream));

  // Local columns [0, real) hold ids below vocab; the rest are padding (a whole slice may be).
  const int64_t real = std::clamp<int64_t>(vocab - vocab_begin, 0, Vl);
  float* x = logits.ptr<float>();
  const int32_t* tgt = targets.ptr<int32_t>();
  for (int64_t t = 0; t < T; ++t) {
    NB_CHECK(tgt[t] < vocab, "%s: target %d of token %lld is outside the vocabulary of %lld", kOp, tgt[t], (long long)t,
             (long long)vocab);
    double m = -INFINITY;  // stays -inf on a slice of padding only, neutral in the MAX
    for (int64_t j = 0; j < real; ++j) m = std::fmax(m, double(x[t * Vl + j]));
    stats[t] = float(m);  // exact: the max of FP32 values
  }
  NB_TRY(group->max(row_max, stream));
  for (int64_t t = 0; t < T; ++t) {
    double s = 0, target_logit = 0;
    const int64_t local = int64_t(tgt[t]) - vocab_begin;
    if (tgt[t] >= 0) {  // ignored rows send zeros: every rank still reduces all T rows
      for (int64_t j = 0; j < real; ++j) s += std::exp(double(x[t * Vl + j]) - double(stats[t]));
      if (local >= 0 && local < real) target_logit = x[t * Vl + local];
    }
    stats[T + t] = float(s);
    stats[2 * T + t] = float(target_logit);
  }
  NB_TRY(group->sum(sums, stream));
  for (int64_t t = 0; t < T; ++t) {
    float* row = x + t * Vl;
    if (tgt[t] < 0) {
      losses.ptr<float>()[t] = 0.f;
      std::fill(row, row + Vl, 0.f);
      continue;
    }
    const double m = stats[t], s = stats[T + t];
    losses.ptr<float>()[t] = float(std::log(s) + m - double(stats[2 * T + t]));
    for (int64_t j = 0; j < real; ++j) {
      const double p = std::exp(double(row[j]) - m) / s;
      row[j] = float((p - (vocab_begin + j == tgt[t] ? 1.0 : 0.0)) * double(grad_scale));
    }
    std::fill(row + real, row + Vl, 0.f);
  }
  return Status::ok();
}

}  // namespace nb::ops::tp
