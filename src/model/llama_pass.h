// MicroBatchPass: one micro-batch through LlamaModel (llama_pass.cpp: layers, head, backward;
// llama_pass_tp.cpp: tensor and sequence parallelism's collectives around them). Internal to src/model.
#pragma once
#include <functional>
#include "gemm/gemm.h"
#include "model/llama_internal.h"
#include "ops/attention.h"

namespace nb {
namespace llama_pass {
inline Status copy_tensor(const Tensor& dst, const Tensor& src) {
  return copy_bytes(dst.data, dst.device, src.data, src.device, size_t(src.bytes()));
}
inline gemm::GemmArgs nt() {
  gemm::GemmArgs a;
  a.trans_b = true;
  return a;
}
inline gemm::GemmArgs tn_acc() {
  gemm::GemmArgs a;
  a.trans_a = true;
  a.beta = 1.f;
  return a;
}
}  // namespace llama_pass

// What one pass runs: decoder layers [begin, end), and whether it starts at the embedding and ends with the head
// and loss. The whole model by default; a pipeline stage's chunk otherwise (llama_pipeline.cpp).
struct PassRange {
  int64_t begin = 0, end = 0;
  bool embed = true, head = true;
};

// The pass's state: the model, the micro-batch's views and its activations (in the arena, or a pipeline slot's).
class MicroBatchPass {
 public:
  // `acts` (optional): activations planned for `range` in a pipeline slot, kept from the forward to the backward.
  MicroBatchPass(LlamaModel& m, int64_t staged_index, bool backward, PassRange range, LlamaModel::Acts* acts = nullptr,
                 Arena* arena = nullptr, Arena* scratch = nullptr)
      : m_(m),
        c_(m.cfg_),
        W_(m.base()),
        index_(staged_index),
        backward_(backward),
        r_(range),
        arena_(arena ? arena : &m.arena_),
        scratch_(scratch),
        A_(acts ? *acts : own_) {}
  Status run(float grad_scale);
  // Pipeline parallelism: the forward of the range from `input` (its first layer's residual stream; ignored when it
  // starts at the embedding), through the loss and the head's backward when it ends there (grad_scale as run's).
  // plan_acts lays the activations out in the slot first.
  Status run_forward(float grad_scale, const Tensor& input, bool plan_acts);
  // ... and its backward from `output_grad` (the next stage's input gradient; ignored when the range ends at the
  // head), leaving the gradient of its input in *input_grad (a view of the slot's activations) unless it starts at
  // the embedding.
  Status run_backward(const Tensor& output_grad, Tensor* input_grad);

 private:
  using Layer = LlamaModel::Layer;
  enum class Buf { compute, grad, master };
  Status plan(bool plan_acts = true);
  // The residual stream entering layer l (l = range end: leaving the last one) and layer l's activations.
  Tensor& resid(int64_t l) { return A_.resid[size_t(l - r_.begin)]; }
  LlamaModel::Acts::PerLayer& acts(int64_t l) { return A_.layer[size_t(l - r_.begin)]; }
  Status embedding_forward();  // into the range's first residual stream
  Status embedding_backward(const Tensor& dx);
  Status forward_layers();
  // The backward of the layers from the residual gradient in *dx (A_.dx), through the range's layers in reverse;
  // *dx ends as the gradient of the range's input.
  Status backward_layers(Tensor* dx);
  Status head_backward();  // the final norm's backward into A_.dx
  Tensor grad_of(const std::string& n) const;
  Tensor fused_qkv(const std::string& p, Buf b) const;
  Layer layer_weights(int64_t l, bool with_grads) const;
  Tensor weight(int64_t l, int i, const Tensor& compute, const Tensor& master);
  bool adapter(int64_t l, int i, LoraModule* mod) const;
  Status adapt_forward(int64_t l, int i, const Tensor& x, const Tensor& y);
  // after_dx (optional) runs once dx is final: after the adapter's dx, or at once without an adapter.
  Status adapt_backward(int64_t l, int i, const Tensor& dy, const Tensor& x, const Tensor& dx,
                        const std::function<Status()>& after_dx = {});
  Status forward_layer(int64_t l, bool write_output);
  Status head_and_loss(float grad_scale);
  Status recompute_layer(int64_t l, const Layer& w);
  Status recompute_forward(int64_t l);     // full recompute: the layer's forward again, MoR's statistics paused
  bool reads_bf16_input(int64_t l) const;  // a Linear of layer l whose input MoR keeps in BF16
  Status mlp_backward(int64_t l, const Layer& w, const Tensor& dx);
  Status attention_backward(int64_t l, const Layer& w, const Tensor& dx_next);
  Status backward();
  // Tensor parallelism: t summed over the group (nothing without it), a profile phase of its own.
  Status tp_sum(const Tensor& t) const;
  // Sequence parallelism (sp_ > 1): this rank's block of a [T, ...] tensor; the gather of every rank's block of
  // `full` in place; the input gradient's sum, reduce-scattered into A_.sp_local (else all-reduced in place).
  Tensor mine(const Tensor& full) const {
    return sp_ > 1 ? llama::rows(full, sp_rank_ * Ts_, (sp_rank_ + 1) * Ts_) : full;
  }
  Status sp_gather(const Tensor& full) const;
  Status sum_input_grad(const Tensor& dx_full, Stream stream) const;
  const Tensor& input_grad(const Tensor& dx_full) const { return sp_ > 1 ? A_.sp_local : dx_full; }
  // The residual stream's gradient as the row-parallel backward reads it: all of the micro-batch's tokens.
  Status whole_grad(const Tensor& local, Tensor* whole);
  // Column-parallel Linear i's backward into dx (d n1 or d n2), summed over the group: after the Wgrad on the
  // default stream, or (--tp-comm-overlap) on the side stream beside it.
  Status column_parallel_backward(int64_t l, int i, const Tensor& dy, const Tensor& x, const Tensor& w,
                                  const Tensor& dw, const Tensor& dx);
  // Column-parallel Linear i's GEMM y = x W^T: under sequence parallelism x (n1 or n2) is gathered first, in BF16
  // here or quantized by the Linear (recipe::Linear::forward_gathered; the BF16 x is then not gathered).
  Status column_parallel_forward(int64_t l, int i, const Tensor& x, const Tensor& w, const Tensor& y);
  // Under sequence parallelism, whether Linear i of layer l gathers its own input (quantized).
  bool gathers_quantized(int64_t l, int i) const;
  // Row-parallel Linear i's backward from the residual stream's gradient d (this rank's tokens under sequence
  // parallelism, gathered first: in BF16 here, or quantized by the Linear, recipe::Linear::backward_gathered).
  Status row_parallel_backward(int64_t l, int i, const Tensor& d, const Tensor& x, const Tensor& w, const Tensor& dw,
                               const Tensor& dx);
  // Row-parallel Linear i's output partial sums (x W_r^T) into out, summed over the group, plus the residual.
  Status row_parallel_forward(int64_t l, int i, const Tensor& x, const Tensor& w, const Tensor& resid,
                              const Tensor& out);
  Status cross_entropy(const Tensor& logits, int64_t t0, int64_t t1, float grad_scale);

  Tensor q4(const Tensor& t) const { return llama::reshape4(t, B_, S_, c_.heads, c_.head_dim); }
  Tensor kv4(const Tensor& t) const { return llama::reshape4(t, B_, S_, c_.kv_heads, c_.head_dim); }

  LlamaModel& m_;
  const LlamaConfig& c_;
  const ParamStore& W_;  // the weights: the model's own, or with LoRA the frozen base
  const int64_t index_;
  const bool backward_;
  const PassRange r_;
  Arena* const arena_;    // where plan() lays the activations out
  Arena* const scratch_;  // ... and the tensors no later pass reads (null: arena_)
  const Stream st_ = nullptr;
  int64_t T_ = 0, B_ = 0, S_ = 0, qkv_heads_ = 0, qkv_dim_ = 0;
  int64_t Ts_ = 0;            // tokens of the residual stream on this rank (T_ / sp_)
  int sp_ = 1, sp_rank_ = 0;  // sequence parallelism's ranks and this one's block
  DType dt_ = DType::f32;
  LlamaModel::Acts own_;  // a whole pass's activations (planned in the model's arena)
  LlamaModel::Acts& A_;
  Tensor ids_, targets_, cos_, sin_, positions_;
  ops::AttentionShape ash_{};
  ops::AttentionSegments segments_;
  const ops::AttentionSegments* segs_ = nullptr;  // packed rows only
  const Tensor* pos_ = nullptr;
};

}  // namespace nb
