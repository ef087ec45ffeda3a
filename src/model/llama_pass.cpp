// One micro-batch through LlamaModel: forward, chunked LM head + loss, and backward, in ops and GEMMs.
// Shapes (T = batch*seq tokens, H hidden, F ffn, qd = heads*head_dim, kvd = kv_heads*head_dim):
//   residual stream [T,H]; qkv [T,qd+2kvd] (one fused projection, split by rope_split_qkv);
//   q [T,qd] = [B,S,heads,hd]; k, v [T,kvd]; gate_up [T,2F]; logits chunk [C,V].
// Activations use the compute dtype (BF16 on CUDA, FP32 on CPU); norm statistics, attention
// softmax statistics, losses and all weight gradients are FP32.
#include <algorithm>
#include <cmath>
#include <string>
#include "core/gpu_profile.h"
#include "gemm/gemm.h"
#include "model/llama_internal.h"
#include "model/step_work.h"
#include "ops/attention.h"
#include "ops/cross_entropy.h"
#include "ops/elementwise.h"
#include "ops/embedding.h"
#include "ops/rmsnorm.h"
#include "ops/rope.h"
#include "ops/swiglu.h"

namespace nb {

using llama::borrow;
using llama::reshape4;
using llama::rows;

namespace {
Status copy_tensor(const Tensor& dst, const Tensor& src) {
  return copy_bytes(dst.data, dst.device, src.data, src.device, size_t(src.bytes()));
}
gemm::GemmArgs nt() {
  gemm::GemmArgs a;
  a.trans_b = true;
  return a;
}
gemm::GemmArgs tn_acc() {
  gemm::GemmArgs a;
  a.trans_a = true;
  a.beta = 1.f;
  return a;
}
}  // namespace

// The pass's state: the model, the micro-batch's views and its activations in the arena.
class MicroBatchPass {
 public:
  MicroBatchPass(LlamaModel& m, int64_t staged_index, bool backward)
      : m_(m), c_(m.cfg_), W_(m.base()), index_(staged_index), backward_(backward) {}
  Status run(float grad_scale);

 private:
  using Layer = LlamaModel::Layer;
  enum class Buf { compute, grad, master };
  Status plan();
  Tensor grad_of(const std::string& n) const;
  Tensor fused_qkv(const std::string& p, Buf b) const;
  Layer layer_weights(int64_t l, bool with_grads) const;
  Tensor weight(int64_t l, int i, const Tensor& compute, const Tensor& master);
  bool adapter(int64_t l, int i, LoraModule* mod) const;
  Status adapt_forward(int64_t l, int i, const Tensor& x, const Tensor& y);
  Status adapt_backward(int64_t l, int i, const Tensor& dy, const Tensor& x, const Tensor& dx);
  Status forward_layer(int64_t l, bool write_output);
  Status head_and_loss(float grad_scale);
  Status recompute_layer(int64_t l, const Layer& w);
  Status mlp_backward(int64_t l, const Layer& w, const Tensor& dx);
  Status attention_backward(int64_t l, const Layer& w, const Tensor& dx_next);
  Status backward();
  // Tensor parallelism: t summed over the group (nothing without it), a profile phase of its own.
  Status tp_sum(const Tensor& t) const;
  // Sequence parallelism (sp_ > 1): this rank's block of a [T, ...] tensor; the gather of every rank's block of
  // `full` in place; the input gradient's sum, reduce-scattered into A_.sp_local (else all-reduced in place).
  Tensor mine(const Tensor& full) const { return sp_ > 1 ? rows(full, sp_rank_ * Ts_, (sp_rank_ + 1) * Ts_) : full; }
  Status sp_gather(const Tensor& full) const;
  Status sum_input_grad(const Tensor& dx_full, Stream stream) const;
  const Tensor& input_grad(const Tensor& dx_full) const { return sp_ > 1 ? A_.sp_local : dx_full; }
  // The residual stream's gradient as the row-parallel backward reads it: all of the micro-batch's tokens.
  Status whole_grad(const Tensor& local, Tensor* whole);
  // Column-parallel Linear i's backward into dx (d n1 or d n2), summed over the group: after the Wgrad on the
  // default stream, or (--tp-comm-overlap) on the side stream beside it.
  Status column_parallel_backward(int64_t l, int i, const Tensor& dy, const Tensor& x, const Tensor& w,
                                  const Tensor& dw, const Tensor& dx);
  // Row-parallel Linear i's output partial sums (x W_r^T) into out, summed over the group, plus the residual.
  Status row_parallel_forward(int64_t l, int i, const Tensor& x, const Tensor& w, const Tensor& resid,
                              const Tensor& out);
  Status cross_entropy(const Tensor& logits, int64_t t0, int64_t t1, float grad_scale);

  Tensor q4(const Tensor& t) const { return reshape4(t, B_, S_, c_.heads, c_.head_dim); }
  Tensor kv4(const Tensor& t) const { return reshape4(t, B_, S_, c_.kv_heads, c_.head_dim); }

  LlamaModel& m_;
  const LlamaConfig& c_;
  const ParamStore& W_;  // the weights: the model's own, or with LoRA the frozen base
  const int64_t index_;
  const bool backward_;
  const Stream st_ = nullptr;
  int64_t T_ = 0, B_ = 0, S_ = 0, qkv_heads_ = 0, qkv_dim_ = 0;
  int64_t Ts_ = 0;            // tokens of the residual stream on this rank (T_ / sp_)
  int sp_ = 1, sp_rank_ = 0;  // sequence parallelism's ranks and this one's block
  DType dt_ = DType::f32;
  LlamaModel::Acts A_;
  Tensor ids_, targets_, cos_, sin_, positions_;
  ops::AttentionShape ash_{};
  ops::AttentionSegments segments_;
  const ops::AttentionSegments* segs_ = nullptr;  // packed rows only
  const Tensor* pos_ = nullptr;
};

// The activations in the arena, the staged tokens and targets, RoPE tables and packed-row segments.
Status MicroBatchPass::plan() {
  T_ = m_.shape_.tokens();
  B_ = m_.shape_.batch;
  S_ = m_.shape_.seq;
  sp_ = m_.sp_size();
  sp_rank_ = sp_ > 1 ? m_.tp_group->rank() : 0;
  Ts_ = T_ / sp_;
  dt_ = m_.params_.compute_dtype();
  llama::Planner P;
  P.arena = &m_.arena_;
  P.dev = m_.dev_;
  const LoraSpec* lora = m_.lora_enabled_ ? &m_.lora_spec_ : nullptr;
  llama::plan_acts(&A_, P, c_, m_.shape_, m_.recompute_, dt_, m_.lm_chunk_tokens_,
                   llama::scratch_input_layers(c_, m_.plan_recipe_, lora), lora, sp_);
  NB_TRY(P.st);
  NB_CHECK(index_ < m_.staged_capacity_, "micro-batch %lld was not staged", (long long)index_);
  const int64_t n = m_.staged_capacity_ * T_;
  ids_ = rows(Tensor::make(m_.ids_.data(), DType::i32, m_.dev_, {n}), index_ * T_, (index_ + 1) * T_);
  targets_ = rows(Tensor::make(m_.targets_.data(), DType::i32, m_.dev_, {n}), index_ * T_, (index_ + 1) * T_);
  cos_ = m_.rope_cos_.tensor();
  sin_ = m_.rope_sin_.tensor();
  ash_ = {B_, S_, c_.heads, c_.kv_heads, c_.head_dim, float(1.0 / std::sqrt(double(c_.head_dim)))};
  if (m_.packed_view(index_, &segments_, &positions_)) {
    segs_ = &segments_;
    pos_ = &positions_;
  } else if (m_.cp_size() > 1) {  // context parallelism: each token at its position in the whole row
    positions_ = m_.cp_positions_.tensor();
    pos_ = &positions_;
  }
  qkv_heads_ = c_.heads + 2 * c_.kv_heads;
  qkv_dim_ = qkv_heads_ * c_.head_dim;
  return Status::ok();
}

// With LoRA the frozen base has no gradients: its norms' weight gradients go to a sink (the norm
// backward always writes one), its linears' to nothing.
Tensor MicroBatchPass::grad_of(const std::string& n) const {
  if (!m_.lora_enabled_) return m_.params_.grad(n);
  return n.find("norm.weight") != std::string::npos ? m_.norm_dw_sink_.tensor() : Tensor{};
}

// q_proj, k_proj, v_proj are consecutive in every flat buffer (params.cpp): one [qd + 2 kvd, H] view.
Tensor MicroBatchPass::fused_qkv(const std::string& p, Buf b) const {
  if (b == Buf::compute && !W_.has_compute(p + "self_attn.q_proj.weight")) return Tensor{};
  // FP32 masters are read only by weights without a compute copy (a sharded store keeps no whole master).
  if (b == Buf::master && (m_.lora_enabled_ || W_.has_compute(p + "self_attn.q_proj.weight"))) return Tensor{};
  if (b == Buf::grad && m_.lora_enabled_) return Tensor{};
  auto view = [&](const char* n) {
    return b == Buf::grad ? m_.params_.grad(p + n) : b == Buf::master ? m_.params_.master(p + n) : W_.compute(p + n);
  };
  const Tensor q = view("self_attn.q_proj.weight"), k = view("self_attn.k_proj.weight"),
               v = view("self_attn.v_proj.weight");
  NB_CHECK(static_cast<uint8_t*>(k.data) == static_cast<uint8_t*>(q.data) + q.bytes() &&
               static_cast<uint8_t*>(v.data) == static_cast<uint8_t*>(k.data) + k.bytes(),
           "internal: q, k and v projections of %s are not adjacent in the parameter store", p.c_str());
  return Tensor::make(q.data, q.dtype, q.device, {q.shape[0] + k.shape[0] + v.shape[0], q.shape[1]});
}

// Gradient views only for a backward: with Megatron-FSDP they exist only while the unit's window is bound.
LlamaModel::Layer MicroBatchPass::layer_weights(int64_t l, bool with_grads) const {
  const std::string p = "model.layers." + std::to_string(l) + ".";
  auto compute = [&](const std::string& n) { return W_.has_compute(n) ? W_.compute(n) : Tensor{}; };
  auto master = [&](const std::string& n) {
    return W_.has_compute(n) || m_.lora_enabled_ ? Tensor{} : m_.params_.master(n);
  };
  auto grad = [&](const std::string& n) { return with_grads ? grad_of(n) : Tensor{}; };
  Layer w;
  w.w_in = W_.compute(p + "input_layernorm.weight");
  w.g_in = grad(p + "input_layernorm.weight");
  w.wqkv = fused_qkv(p, Buf::compute);
  w.gqkv = with_grads ? fused_qkv(p, Buf::grad) : Tensor{};
  w.mqkv = fused_qkv(p, Buf::master);
  w.mo = master(p + "self_attn.o_proj.weight");
  w.mgu = master(p + "mlp.gate_up_proj.weight");
  w.mdown = master(p + "mlp.down_proj.weight");
  w.wo = compute(p + "self_attn.o_proj.weight");
  w.go = grad(p + "self_attn.o_proj.weight");
  w.w_post = W_.compute(p + "post_attention_layernorm.weight");
  w.g_post = grad(p + "post_attention_layernorm.weight");
  w.wgu = compute(p + "mlp.gate_up_proj.weight");
  w.ggu = grad(p + "mlp.gate_up_proj.weight");
  w.wdown = compute(p + "mlp.down_proj.weight");
  w.gdown = grad(p + "mlp.down_proj.weight");
  return w;
}

// The weight Linear i of layer l is given: its compute copy, or for a master-only weight the staging
// buffer, filled from the FP32 master (RNE, as the optimizer writes compute copies) only when the
// Linear quantizes it -- its first forward after begin_step. Later calls get the (stale) buffer,
// which a quantized Linear does not read.
Tensor MicroBatchPass::weight(int64_t l, int i, const Tensor& compute, const Tensor& master) {
  if (compute.data || m_.lora_enabled_) return compute;  // a frozen quantized base weight lives in its Linear
  const Tensor stage = Tensor::make(m_.weight_stage_.data(), dt_, m_.dev_, {master.shape[0], master.shape[1]});
  char& staged = m_.weight_staged_[size_t(l * 4 + i)];
  if (!staged) {
    ops::cast(master, stage, st_);
    staged = 1;
  }
  return stage;
}

// LoRA: the adapter of linear i of layer l beside its base GEMM (evaluation runs without dropout).
bool MicroBatchPass::adapter(int64_t l, int i, LoraModule* mod) const {
  if (!m_.lora_enabled_ || !m_.lora_modules_[size_t(l * 4 + i)].a.data) return false;
  *mod = m_.lora_modules_[size_t(l * 4 + i)];
  if (!backward_) mod->dropout = 0.f;
  return true;
}
Status MicroBatchPass::adapt_forward(int64_t l, int i, const Tensor& x, const Tensor& y) {
  LoraModule mod;
  if (!adapter(l, i, &mod)) return Status::ok();
  return lora_forward(mod, x, A_.lora, y, lora_dropout_key(m_.seed_, m_.step_, m_.micro_, mod), st_);
}
Status MicroBatchPass::adapt_backward(int64_t l, int i, const Tensor& dy, const Tensor& x, const Tensor& dx) {
  LoraModule mod;
  if (!adapter(l, i, &mod)) return Status::ok();
  return lora_backward(mod, dy, x, A_.lora, dx, lora_dropout_key(m_.seed_, m_.step_, m_.micro_, mod), st_);
}

// Forward of layer l from resid[l]; writes resid[l+1] unless only recomputing the saved activations.
Status MicroBatchPass::forward_layer(int64_t l, bool write_output) {
  const Layer w = layer_weights(l, false);
  auto& a = A_.layer[size_t(l)];
  auto& lin = m_.linears_[size_t(l)];
  NB_PROFILE_BEGIN("fwd: norm + qkv GEMM");
  NB_PROFILE_WORK("fwd: norm + qkv GEMM", work::rmsnorm_forward(T_, c_.hidden));  // + the GEMM's own
  ops::rmsnorm_forward(A_.resid[l], w.w_in, c_.norm_eps, mine(a.n1), a.rstd1, st_);
  NB_TRY(sp_gather(a.n1));
  const Tensor qkv = A_.qkv.data ? A_.qkv : borrow(a.gu, T_, qkv_dim_);  // gu is written later in this layer
  NB_TRY(lin[0].forward(a.n1, weight(l, 0, w.wqkv, w.mqkv), qkv, 0.f, st_));
  NB_TRY(adapt_forward(l, 0, a.n1, qkv));
  NB_PROFILE_END("fwd: norm + qkv GEMM");
  NB_PROFILE_BEGIN("fwd: rope + split");
  NB_PROFILE_WORK("fwd: rope + split", work::rope(T_, c_.q_dim(), c_.kv_dim()));
  ops::rope_split_qkv(reshape4(qkv, B_, S_, qkv_heads_, c_.head_dim), cos_, sin_, q4(a.q), kv4(a.k), kv4(a.v), st_,
                      pos_);
  NB_PROFILE_END("fwd: rope + split");
  NB_PROFILE_BEGIN("fwd: attention");
  NB_PROFILE_WORK(
      "fwd: attention",
      work::ring_attention(work::attention_forward(B_, S_, c_.heads, c_.kv_heads, c_.head_dim), m_.cp_size()));
  if (m_.cp_size() > 1)
    NB_TRY(m_.cp_ring_.forward(q4(a.q), kv4(a.k), kv4(a.v), q4(a.o), a.lse, st_));
  else
    NB_TRY(ops::attention_forward(ash_, q4(a.q), kv4(a.k), kv4(a.v), q4(a.o), a.lse, st_, segs_));
  NB_PROFILE_END("fwd: attention");
  NB_PROFILE_BEGIN("fwd: o + norm + gate_up");
  NB_PROFILE_WORK("fwd: o + norm + gate_up", work::copy(T_, c_.hidden) + work::rmsnorm_forward(T_, c_.hidden));
  NB_TRY(row_parallel_forward(l, 1, a.o, weight(l, 1, w.wo, w.mo), A_.resid[l], a.mid));  // mid = resid + o Wo^T
  ops::rmsnorm_forward(a.mid, w.w_post, c_.norm_eps, mine(a.n2), a.rstd2, st_);
  NB_TRY(sp_gather(a.n2));
  NB_TRY(lin[2].forward(a.n2, weight(l, 2, w.wgu, w.mgu), a.gu, 0.f, st_));
  NB_TRY(adapt_forward(l, 2, a.n2, a.gu));
  NB_PROFILE_END("fwd: o + norm + gate_up");
  NB_PROFILE_BEGIN("fwd: swiglu + down");
  NB_PROFILE_WORK("fwd: swiglu + down",
                  work::swiglu_forward(T_, c_.ffn) + (write_output ? work::copy(T_, c_.hidden) : work::Work{}));
  ops::swiglu_forward(a.gu, a.a, st_);
  if (write_output) {
    NB_TRY(row_parallel_forward(l, 3, a.a, weight(l, 3, w.wdown, w.mdown), a.mid, A_.resid[l + 1]));
  } else if (lin[3].input_copy_shared()) {
    NB_TRY(lin[3].quantize_input(a.a, st_));  // its Wgrad's copy lives in a slot the other layers overwrote
  }
  NB_PROFILE_END("fwd: swiglu + down");
  return Status::ok();
}

// LM head and loss, chunked over tokens; the backward of the head runs chunk by chunk too.
Status MicroBatchPass::head_and_loss(float grad_scale) {
  const std::string lm_name = c_.tied_embeddings ? "model.embed_tokens.weight" : "lm_head.weight";
  if (m_.hooks_) NB_TRY(m_.weights_needed({"model.norm.weight", lm_name}));
  if (m_.hooks_ && backward_) NB_TRY(m_.grads_needed({"model.norm.weight", lm_name}));
  const Tensor w_lm = W_.compute(lm_name), g_lm = backward_ ? grad_of(lm_name) : Tensor{};
  ops::rmsnorm_forward(A_.resid[c_.layers], W_.compute("model.norm.weight"), c_.norm_eps, mine(A_.nf), A_.rstdf, st_);
  NB_TRY(sp_gather(A_.nf));
  for (int64_t t0 = 0; t0 < T_; t0 += m_.lm_chunk_tokens_) {
    const int64_t t1 = std::min(T_, t0 + m_.lm_chunk_tokens_);
    const Tensor nf_c = rows(A_.nf, t0, t1), logits = rows(A_.logits, 0, t1 - t0);
    NB_PROFILE_BEGIN("lm: fprop GEMM");
    NB_TRY(gemm::matmul(nf_c, w_lm, logits, nt(), st_));
    NB_PROFILE_END("lm: fprop GEMM");
    if (m_.logits_sink_)  // before CE overwrites them
      NB_TRY(m_.copy_logits_to_host(logits, m_.logits_sink_ + t0 * c_.vocab));
    NB_TRY(cross_entropy(logits, t0, t1, backward_ ? grad_scale : 0.f));
    if (backward_) {  // (a frozen LM head has no gradient: g_lm is empty)
      NB_PROFILE_BEGIN("lm: dgrad GEMM");
      NB_TRY(gemm::matmul(logits, w_lm, rows(A_.dnf, t0, t1), gemm::GemmArgs{}, st_));  // d nf = dlogits W
      NB_PROFILE_END("lm: dgrad GEMM");
      NB_PROFILE_BEGIN("lm: wgrad GEMM (f32 +=)");
      if (g_lm.data) NB_TRY(gemm::matmul(logits, nf_c, g_lm, tn_acc(), st_));  // dW += dlogits^T nf
      NB_PROFILE_END("lm: wgrad GEMM (f32 +=)");
    }
  }
  if (backward_) NB_TRY(sum_input_grad(A_.dnf, st_));  // each rank's vocabulary rows' share of d nf
  ops::add_inplace(m_.loss_acc_.tensor(), A_.losses, st_);
  return Status::ok();
}

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
  auto launch = [&]() {  // dx is final once its GEMM is done (LoRA, which adds to it, is refused under TP)
    m_.tp_ready_.record(st_);
    m_.tp_ready_.wait_in(side);
    NB_TRY(sum_input_grad(dx, side));
    m_.tp_done_.record(side);
    return Status::ok();
  };
  NB_TRY(lin.backward(dy, x, w, dx, 0.f, dw, st_, launch));
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
  if (sp_ > 1) {  // this rank's block of the summed output
    NB_TRY(lin.forward(x, w, A_.sp_full, 0.f, st_));
    NB_PROFILE_BEGIN("tp: reduce-scatter");
    NB_TRY(m_.tp_group->reduce_scatter(A_.sp_full, out, st_));
    NB_PROFILE_END("tp: reduce-scatter");
  } else {
    NB_TRY(lin.forward(x, w, out, 0.f, st_));
    NB_TRY(tp_sum(out));
  }
  ops::add_inplace(out, resid, st_);
  return Status::ok();
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

// Brings back what the recompute mode did not keep for layer l's backward.
Status MicroBatchPass::recompute_layer(int64_t l, const Layer& w) {
  auto& a = A_.layer[size_t(l)];
  ops::rmsnorm_forward(A_.resid[l], w.w_in, c_.norm_eps, mine(a.n1), a.rstd1, st_);
  ops::rmsnorm_forward(a.mid, w.w_post, c_.norm_eps, mine(a.n2), a.rstd2, st_);
  ops::swiglu_forward(a.gu, a.a, st_);
  NB_TRY(sp_gather(a.n1));
  return sp_gather(a.n2);
}

// MLP backward, resid' = mid + swiglu(n2 Wgu^T) Wdown^T: from d resid' (dx) to d mid (A_.dmid).
Status MicroBatchPass::mlp_backward(int64_t l, const Layer& w, const Tensor& dx) {
  auto& a = A_.layer[size_t(l)];
  auto& lin = m_.linears_[size_t(l)];
  Tensor dy;
  NB_TRY(whole_grad(dx, &dy));
  NB_PROFILE_BEGIN("bwd: down GEMMs");
  NB_TRY(lin[3].backward(dy, a.a, weight(l, 3, w.wdown, w.mdown), A_.da, 0.f, w.gdown, st_));
  NB_TRY(adapt_backward(l, 3, dy, a.a, A_.da));
  NB_PROFILE_END("bwd: down GEMMs");
  NB_PROFILE_BEGIN("bwd: swiglu");
  NB_PROFILE_WORK("bwd: swiglu", work::swiglu_backward(T_, c_.ffn));
  ops::swiglu_backward(a.gu, A_.da, A_.dgu, st_);
  NB_PROFILE_END("bwd: swiglu");
  NB_PROFILE_BEGIN("bwd: gate_up GEMMs");
  NB_TRY(column_parallel_backward(l, 2, A_.dgu, a.n2, weight(l, 2, w.wgu, w.mgu), w.ggu, A_.dn));
  NB_PROFILE_END("bwd: gate_up GEMMs");
  NB_PROFILE_BEGIN("bwd: norms + adds");
  NB_PROFILE_WORK("bwd: norms + adds", work::rmsnorm_backward(T_, c_.hidden) + work::add(T_, c_.hidden));
  ops::rmsnorm_backward(a.mid, w.w_post, a.rstd2, input_grad(A_.dn), A_.dmid, w.g_post, st_);
  ops::add_inplace(A_.dmid, dx, st_);
  NB_PROFILE_END("bwd: norms + adds");
  return Status::ok();
}

// Attention backward, mid = resid + attn(rope(n1 Wq^T), rope(n1 Wk^T), n1 Wv^T) Wo^T: from d mid (A_.dmid) to
// d resid (dx_next).
Status MicroBatchPass::attention_backward(int64_t l, const Layer& w, const Tensor& dx_next) {
  auto& a = A_.layer[size_t(l)];
  auto& lin = m_.linears_[size_t(l)];
  Tensor dy;
  NB_TRY(whole_grad(A_.dmid, &dy));
  NB_PROFILE_BEGIN("bwd: o GEMMs");
  NB_TRY(lin[1].backward(dy, a.o, weight(l, 1, w.wo, w.mo), A_.dout, 0.f, w.go, st_));
  NB_TRY(adapt_backward(l, 1, dy, a.o, A_.dout));
  NB_PROFILE_END("bwd: o GEMMs");
  NB_PROFILE_BEGIN("bwd: attention");
  NB_PROFILE_WORK(
      "bwd: attention",
      work::ring_attention(work::attention_backward(B_, S_, c_.heads, c_.kv_heads, c_.head_dim), m_.cp_size()));
  if (m_.cp_size() > 1)
    NB_TRY(m_.cp_ring_.backward(q4(a.q), kv4(a.k), kv4(a.v), q4(a.o), q4(A_.dout), a.lse, q4(A_.dq), kv4(A_.dk),
                                kv4(A_.dv), st_));
  else
    NB_TRY(ops::attention_backward(ash_, q4(a.q), kv4(a.k), kv4(a.v), q4(a.o), q4(A_.dout), a.lse, q4(A_.dq),
                                   kv4(A_.dk), kv4(A_.dv), st_, segs_));
  NB_PROFILE_END("bwd: attention");
  NB_PROFILE_BEGIN("bwd: rope + merge");
  NB_PROFILE_WORK("bwd: rope + merge", work::rope(T_, c_.q_dim(), c_.kv_dim()));
  const Tensor dqkv = A_.dqkv.data ? A_.dqkv : borrow(A_.dgu, T_, qkv_dim_);  // dgu is dead after gate_up's backward
  ops::rope_merge_qkv_grad(q4(A_.dq), kv4(A_.dk), kv4(A_.dv), cos_, sin_,
                           reshape4(dqkv, B_, S_, qkv_heads_, c_.head_dim), st_, pos_);
  NB_PROFILE_END("bwd: rope + merge");
  NB_PROFILE_BEGIN("bwd: qkv GEMMs");
  NB_TRY(column_parallel_backward(l, 0, dqkv, a.n1, weight(l, 0, w.wqkv, w.mqkv), w.gqkv, A_.dn));
  NB_PROFILE_END("bwd: qkv GEMMs");
  NB_PROFILE_BEGIN("bwd: norms + adds");
  NB_PROFILE_WORK("bwd: norms + adds", work::rmsnorm_backward(T_, c_.hidden) + work::add(T_, c_.hidden));
  ops::rmsnorm_backward(A_.resid[l], w.w_in, a.rstd1, input_grad(A_.dn), dx_next, w.g_in, st_);
  ops::add_inplace(dx_next, A_.dmid, st_);
  NB_PROFILE_END("bwd: norms + adds");
  return Status::ok();
}

// Final norm, the layers in reverse (recomputing what the mode dropped), the embedding; each finished
// gradient is reported to the data-parallel hooks as soon as it is complete.
Status MicroBatchPass::backward() {
  ops::rmsnorm_backward(A_.resid[c_.layers], W_.compute("model.norm.weight"), A_.rstdf, input_grad(A_.dnf), A_.dx,
                        grad_of("model.norm.weight"), st_);
  if (m_.hooks_ && c_.tied_embeddings)  // the embedding's gradient is complete after its own backward, below
    NB_TRY(m_.grads_final({"model.norm.weight"}));
  else if (m_.hooks_)
    NB_TRY(m_.grads_final({"model.norm.weight", "lm_head.weight"}));
  Tensor dx = A_.dx, dx_next = A_.dx2;
  for (int64_t l = c_.layers - 1; l >= 0; --l) {
    if (m_.hooks_) {
      const std::vector<std::string> names = LlamaModel::layer_param_names(l);
      NB_TRY(m_.weights_needed(names));
      NB_TRY(m_.grads_needed(names));
    }
    const Layer w = layer_weights(l, true);
    if (m_.recompute_ == Recompute::full)
      NB_TRY(forward_layer(l, false));
    else if (m_.recompute_ == Recompute::selective)
      NB_TRY(recompute_layer(l, w));
    NB_TRY(mlp_backward(l, w, dx));
    NB_TRY(attention_backward(l, w, dx_next));
    std::swap(dx, dx_next);
    if (m_.hooks_) NB_TRY(m_.grads_final(LlamaModel::layer_param_names(l)));
  }
  if (m_.hooks_) NB_TRY(m_.grads_needed({"model.embed_tokens.weight"}));
  Tensor demb;
  NB_TRY(whole_grad(dx, &demb));
  if (!m_.lora_enabled_) ops::embedding_backward(ids_, demb, m_.params_.grad("model.embed_tokens.weight"), st_);
  if (m_.hooks_) NB_TRY(m_.grads_final({"model.embed_tokens.weight"}));
  return Status::ok();
}

Status MicroBatchPass::run(float grad_scale) {
  NB_TRY(plan());
  if (m_.hooks_) NB_TRY(m_.weights_needed({"model.embed_tokens.weight"}));
  // Vocabulary-parallel: the rank that holds a token's row gives it (summed, or with sequence parallelism
  // reduce-scattered into this rank's block of tokens).
  ops::embedding_forward(W_.compute("model.embed_tokens.weight"), ids_, sp_ > 1 ? A_.sp_full : A_.resid[0], st_);
  if (sp_ > 1)
    NB_TRY(m_.tp_group->reduce_scatter(A_.sp_full, A_.resid[0], st_));
  else
    NB_TRY(tp_sum(A_.resid[0]));
  for (int64_t l = 0; l < c_.layers; ++l) {
    if (m_.hooks_) NB_TRY(m_.weights_needed(LlamaModel::layer_param_names(l)));
    NB_TRY(forward_layer(l, true));
  }
  NB_TRY(head_and_loss(grad_scale));
  if (!backward_) return Status::ok();
  NB_TRY(backward());
  m_.micro_ += m_.micro_stride_;
  return Status::ok();
}

// The activations live in the arena for this micro-batch only; released on every path out.
Status LlamaModel::run(int64_t staged_index, float grad_scale, bool backward) {
  const size_t mark = arena_.mark();
  const Status st = MicroBatchPass(*this, staged_index, backward).run(grad_scale);
  arena_.release(mark);
  return st;
}

}  // namespace nb
