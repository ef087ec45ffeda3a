// Tensor and sequence parallelism inside one micro-batch (MicroBatchPass, llama_pass.h): the vocabulary-parallel
// loss, the group's all-reduces, reduce-scatters and all-gathers around the column- and row-parallel GEMMs, and
// --tp-comm-overlap's side stream. Without tensor parallelism each is the one-GPU step.
#include "core/gpu_profile.h"
#include "model/llama_pass.h"
#include "model/step_work.h"
#include "ops/elementwise.h"
#include "ops/vocab_parallel_ce.h"
#include "ops/cross_entropy.h"

namespace nb {

using llama::rows;
using llama_pass::copy_tensor;

// The chunk's loss and (in place) its logits' gradient: over the whole vocabulary, or this rank's part of it.
Status MicroBatchPass::cross_entropy(const Tensor& logits, int64_t t0, int64_t t1, float grad_scale) {
  NB_PROFILE_BEGIN("lm: cross-entropy");
  NB_PROFILE_WORK("lm: cross-entropy", work::cross_entropy(t1 - t0, c_.vocab));
  const Tensor targets = rows(targets_, t0, t1), losses = rows(A_.losses, t0, t1);
  Status st = Status::ok();
  if (m_.tp_size() > 1) {
    const Tensor scratch =
        Tensor::make(m_.tp_ce_scratch_.data(), DType::f32, m_.dev_, {3, t1 - t0});  // rows of the chunk's length
    st = ops::tp::vocab_parallel_cross_entropy(logits, targets, tp::vocab_begin(m_.whole_cfg_, m_.tp_shard()),
                                               m_.whole_cfg_.vocab, grad_scale, losses, scratch, m_.tp_group, st_);
  } else {
    ops::cross_entropy_fwd_bwd(logits, targets, grad_scale, losses, st_);
  }
  NB_PROFILE_END("lm: cross-entropy");
  return st;
}

Status MicroBatchPass::tp_sum(const Tensor& t) const {
  if (m_.tp_size() == 1) return Status::ok();
  NB_PROFILE_BEGIN("tp: all-reduce");
  const Status st = m_.tp_group->sum(t, st_);
  NB_PROFILE_END("tp: all-reduce");
  return st;
}

// dx is each rank's heads' (or FFN columns') share of the input gradient until summed.
Status MicroBatchPass::column_parallel_backward(int64_t l, int i, const Tensor& dy, const Tensor& x, const Tensor& w,
                                                const Tensor& dw, const Tensor& dx) {
  recipe::Linear& lin = m_.linears_[size_t(l)][size_t(i)];
  if (m_.tp_size() == 1 || !m_.tp_comm_overlap) {
    NB_TRY(lin.backward(dy, x, w, dx, 0.f, dw, st_));
    NB_TRY(adapt_backward(l, i, dy, x, dx));
    return sum_input_grad(dx, st_);
  }
  const Stream side = m_.tp_stream_.get();
  auto launch = [&]() {  // dx is final once its GEMM (and a LoRA adapter's, which adds to it) is queued
    m_.tp_ready_.record(st_);
    m_.tp_ready_.wait_in(side);
    NB_TRY(sum_input_grad(dx, side));
    m_.tp_done_.record(side);
    return Status::ok();
  };
  if (m_.lora_enabled_) {  // a frozen base runs no Wgrad: the sum runs beside the adapter's weight gradients
    NB_TRY(lin.backward(dy, x, w, dx, 0.f, dw, st_));
    NB_TRY(adapt_backward(l, i, dy, x, dx, launch));
  } else {
    NB_TRY(lin.backward(dy, x, w, dx, 0.f, dw, st_, launch));
  }
  m_.tp_done_.wait_in(st_);  // the norm's backward reads the sum
  return Status::ok();
}

// out = resid + x W^T. Under tensor parallelism x and W hold this rank's columns: its partial product is
// summed over the group first, then the residual added (the one-GPU sum's order, up to rounding).
Status MicroBatchPass::row_parallel_forward(int64_t l, int i, const Tensor& x, const Tensor& w, const Tensor& resid,
                                            const Tensor& out) {
  recipe::Linear& lin = m_.linears_[size_t(l)][size_t(i)];
  if (m_.tp_size() == 1) {
    NB_TRY(copy_tensor(out, resid));
    NB_TRY(lin.forward(x, w, out, 1.f, st_));
    return adapt_forward(l, i, x, out);
  }
  // A LoRA adapter adds s (x A_r^T) B^T, its rank's part of the whole adapter's output, before the sum.
  if (sp_ > 1) {  // this rank's block of the summed output
    NB_TRY(lin.forward(x, w, A_.sp_full, 0.f, st_));
    NB_TRY(adapt_forward(l, i, x, A_.sp_full));
    NB_PROFILE_BEGIN("tp: reduce-scatter");
    NB_TRY(m_.tp_group->reduce_scatter(A_.sp_full, out, st_));
    NB_PROFILE_END("tp: reduce-scatter");
  } else {
    NB_TRY(lin.forward(x, w, out, 0.f, st_));
    NB_TRY(adapt_forward(l, i, x, out));
    NB_TRY(tp_sum(out));
  }
  ops::add_inplace(out, resid, st_);
  return Status::ok();
}

bool MicroBatchPass::gathers_quantized(int64_t l, int i) const {
  return sp_ > 1 && m_.linears_[size_t(l)][size_t(i)].gathers_quantized_input();
}

Status MicroBatchPass::column_parallel_forward(int64_t l, int i, const Tensor& x, const Tensor& w, const Tensor& y) {
  recipe::Linear& lin = m_.linears_[size_t(l)][size_t(i)];
  if (gathers_quantized(l, i)) {
    NB_PROFILE_BEGIN("tp: quantize + all-gather + GEMM");
    const Status st = lin.forward_gathered(mine(x), w, y, 0.f, st_);  // (never a frozen LoRA base: BF16 gathers)
    NB_PROFILE_END("tp: quantize + all-gather + GEMM");
    return st;
  }
  NB_TRY(sp_gather(x));
  NB_TRY(lin.forward(x, w, y, 0.f, st_));
  return adapt_forward(l, i, x, y);
}

Status MicroBatchPass::row_parallel_backward(int64_t l, int i, const Tensor& d, const Tensor& x, const Tensor& w,
                                             const Tensor& dw, const Tensor& dx) {
  recipe::Linear& lin = m_.linears_[size_t(l)][size_t(i)];
  // (A frozen LoRA base gathers BF16: its adapters read the whole dY.)
  if (sp_ > 1 && lin.gathers_quantized_grad()) return lin.backward_gathered(d, dx, 0.f, dw, st_);
  Tensor dy;
  NB_TRY(whole_grad(d, &dy));
  NB_TRY(lin.backward(dy, x, w, dx, 0.f, dw, st_));
  return adapt_backward(l, i, dy, x, dx);
}

Status MicroBatchPass::sp_gather(const Tensor& full) const {
  if (sp_ == 1) return Status::ok();
  NB_PROFILE_BEGIN("tp: all-gather");
  const Status st = m_.tp_group->all_gather(mine(full), full, st_);
  NB_PROFILE_END("tp: all-gather");
  return st;
}

Status MicroBatchPass::sum_input_grad(const Tensor& dx_full, Stream stream) const {
  if (sp_ == 1) return stream == st_ ? tp_sum(dx_full) : m_.tp_group->sum(dx_full, stream);
  NB_PROFILE_BEGIN("tp: reduce-scatter");
  const Status st = m_.tp_group->reduce_scatter(dx_full, A_.sp_local, stream);
  NB_PROFILE_END("tp: reduce-scatter");
  return st;
}

Status MicroBatchPass::whole_grad(const Tensor& local, Tensor* whole) {
  *whole = local;
  if (sp_ == 1) return Status::ok();
  *whole = A_.sp_full;
  NB_PROFILE_BEGIN("tp: all-gather");
  const Status st = m_.tp_group->all_gather(local, A_.sp_full, st_);
  NB_PROFILE_END("tp: all-gather");
  return st;
}

}  // namespace nb
