// One micro-batch through LlamaModel: forward, chunked LM head + loss, and backward, in ops and GEMMs.
// Shapes (T = batch*seq tokens, H hidden, F ffn, qd = heads*head_dim, kvd = kv_heads*head_dim):
//   residual stream [T,H]; qkv [T,qd+2kvd] (one fused projection, split by rope_split_qkv);
//   q [T,qd] = [B,S,heads,hd]; k, v [T,kvd]; gate_up [T,2F]; logits chunk [C,V].
// Activations use the compute dtype (BF16 on CUDA, FP32 on CPU); norm statistics, attention
// softmax statistics, losses and all weight gradients are FP32.
#include <array>
#include <algorithm>
#include <cmath>
#include <string>
#include "core/gpu_profile.h"
#include "gemm/gemm.h"
#include "model/llama_internal.h"
#include "model/llama_pass.h"
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

using llama_pass::copy_tensor;
using llama_pass::nt;
using llama_pass::tn_acc;

// The activations in the arena, the staged tokens and targets, RoPE tables and packed-row segments.
Status MicroBatchPass::plan(bool plan_acts) {
  T_ = m_.shape_.tokens();
  B_ = m_.shape_.batch;
  S_ = m_.shape_.seq;
  sp_ = m_.sp_size();
  sp_rank_ = sp_ > 1 ? m_.tp_group->rank() : 0;
  Ts_ = T_ / sp_;
  dt_ = m_.params_.compute_dtype();
  if (plan_acts) NB_TRY(m_.plan_pass_acts(&A_, r_, arena_, scratch_));
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
  // A quantized Linear reads its staged weight once per step (its quantization); one whose weight MoR keeps in BF16
  // reads it at every GEMM, by which time another Linear may have staged its own: cast it again.
  const recipe::Linear& lin = m_.linears_[size_t(l)][size_t(i)];
  if (!staged || (lin.mor() && lin.mor_rung(1) == recipe::MorRung::bf16)) {
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
Status MicroBatchPass::adapt_backward(int64_t l, int i, const Tensor& dy, const Tensor& x, const Tensor& dx,
                                      const std::function<Status()>& after_dx) {
  LoraModule mod;
  if (!adapter(l, i, &mod)) return after_dx ? after_dx() : Status::ok();
  return lora_backward(mod, dy, x, A_.lora, dx, lora_dropout_key(m_.seed_, m_.step_, m_.micro_, mod), st_, after_dx);
}

// Forward of layer l from resid[l]; writes resid[l+1] unless only recomputing the saved activations.
Status MicroBatchPass::forward_layer(int64_t l, bool write_output) {
  const Layer w = layer_weights(l, false);
  auto& a = acts(l);
  auto& lin = m_.linears_[size_t(l)];
  NB_PROFILE_BEGIN("fwd: norm + qkv GEMM");
  NB_PROFILE_WORK("fwd: norm + qkv GEMM", work::rmsnorm_forward(T_, c_.hidden));  // + the GEMM's own
  ops::rmsnorm_forward(resid(l), w.w_in, c_.norm_eps, mine(a.n1), a.rstd1, st_);
  const Tensor qkv = A_.qkv.data ? A_.qkv : borrow(a.gu, T_, qkv_dim_);  // gu is written later in this layer
  NB_TRY(column_parallel_forward(l, 0, a.n1, weight(l, 0, w.wqkv, w.mqkv), qkv));
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
    NB_TRY(m_.cp_ring_.forward(q4(a.q), kv4(a.k), kv4(a.v), q4(a.o), a.lse, st_, segs_));
  else
    NB_TRY(ops::attention_forward(ash_, q4(a.q), kv4(a.k), kv4(a.v), q4(a.o), a.lse, st_, segs_));
  NB_PROFILE_END("fwd: attention");
  NB_PROFILE_BEGIN("fwd: o + norm + gate_up");
  NB_PROFILE_WORK("fwd: o + norm + gate_up", work::copy(T_, c_.hidden) + work::rmsnorm_forward(T_, c_.hidden));
  NB_TRY(row_parallel_forward(l, 1, a.o, weight(l, 1, w.wo, w.mo), resid(l), a.mid));  // mid = resid + o Wo^T
  ops::rmsnorm_forward(a.mid, w.w_post, c_.norm_eps, mine(a.n2), a.rstd2, st_);
  NB_TRY(column_parallel_forward(l, 2, a.n2, weight(l, 2, w.wgu, w.mgu), a.gu));
  NB_PROFILE_END("fwd: o + norm + gate_up");
  NB_PROFILE_BEGIN("fwd: swiglu + down");
  NB_PROFILE_WORK("fwd: swiglu + down",
                  work::swiglu_forward(T_, c_.ffn) + (write_output ? work::copy(T_, c_.hidden) : work::Work{}));
  ops::swiglu_forward(a.gu, a.a, st_);
  if (write_output) {
    NB_TRY(row_parallel_forward(l, 3, a.a, weight(l, 3, w.wdown, w.mdown), a.mid, resid(l + 1)));
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
  ops::rmsnorm_forward(resid(r_.end), W_.compute("model.norm.weight"), c_.norm_eps, mine(A_.nf), A_.rstdf, st_);
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

// A quantized layer keeps its Linears' inputs only as their quantized copies (its norms' and SwiGLU's outputs live in
// scratch that later forwards overwrite); an input that MoR keeps in BF16 is read by its Wgrad, so the layer's
// backward brings those outputs back first, as selective recompute does.
bool MicroBatchPass::reads_bf16_input(int64_t l) const {
  for (const recipe::Linear& lin : m_.linears_[size_t(l)])
    if (lin.mor() && lin.mor_rung(0) == recipe::MorRung::bf16) return true;
  return false;
}

// Full recompute: layer l's forward again. Its quantizations repeat the first forward's on the same values, which
// MoR's statistics and block counts already took, so they are paused for it: each operand is counted once per pass.
Status MicroBatchPass::recompute_forward(int64_t l) {
  auto& lins = m_.linears_[size_t(l)];
  std::array<bool, 4> paused{};  // a layer's four Linears (qkv, o, gate_up, down); no allocation per pass
  NB_CHECK(lins.size() == paused.size(), "internal: layer %lld has %zu Linears", (long long)l, lins.size());
  for (size_t i = 0; i < lins.size(); ++i) {
    paused[i] = lins[i].mor_stats_paused();
    lins[i].pause_mor_stats(true);
  }
  const Status s = forward_layer(l, false);
  for (size_t i = 0; i < lins.size(); ++i) lins[i].pause_mor_stats(paused[i]);
  return s;
}

// Brings back what the recompute mode did not keep for layer l's backward.
Status MicroBatchPass::recompute_layer(int64_t l, const Layer& w) {
  auto& a = acts(l);
  ops::rmsnorm_forward(resid(l), w.w_in, c_.norm_eps, mine(a.n1), a.rstd1, st_);
  ops::rmsnorm_forward(a.mid, w.w_post, c_.norm_eps, mine(a.n2), a.rstd2, st_);
  ops::swiglu_forward(a.gu, a.a, st_);
  // A Linear that gathers its input quantized kept its Wgrad copy; only a BF16 GEMM reads the whole input again.
  if (!gathers_quantized(l, 0)) NB_TRY(sp_gather(a.n1));
  return gathers_quantized(l, 2) ? Status::ok() : sp_gather(a.n2);
}

// MLP backward, resid' = mid + swiglu(n2 Wgu^T) Wdown^T: from d resid' (dx) to d mid (A_.dmid).
Status MicroBatchPass::mlp_backward(int64_t l, const Layer& w, const Tensor& dx) {
  auto& a = acts(l);
  NB_PROFILE_BEGIN("bwd: down GEMMs");
  NB_TRY(row_parallel_backward(l, 3, dx, a.a, weight(l, 3, w.wdown, w.mdown), w.gdown, A_.da));
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
  auto& a = acts(l);
  NB_PROFILE_BEGIN("bwd: o GEMMs");
  NB_TRY(row_parallel_backward(l, 1, A_.dmid, a.o, weight(l, 1, w.wo, w.mo), w.go, A_.dout));
  NB_PROFILE_END("bwd: o GEMMs");
  NB_PROFILE_BEGIN("bwd: attention");
  NB_PROFILE_WORK(
      "bwd: attention",
      work::ring_attention(work::attention_backward(B_, S_, c_.heads, c_.kv_heads, c_.head_dim), m_.cp_size()));
  if (m_.cp_size() > 1)
    NB_TRY(m_.cp_ring_.backward(q4(a.q), kv4(a.k), kv4(a.v), q4(a.o), q4(A_.dout), a.lse, q4(A_.dq), kv4(A_.dk),
                                kv4(A_.dv), st_, segs_));
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
  ops::rmsnorm_backward(resid(l), w.w_in, a.rstd1, input_grad(A_.dn), dx_next, w.g_in, st_);
  ops::add_inplace(dx_next, A_.dmid, st_);
  NB_PROFILE_END("bwd: norms + adds");
  return Status::ok();
}

// The final norm's backward from d nf (written by head_and_loss) into A_.dx.
Status MicroBatchPass::head_backward() {
  ops::rmsnorm_backward(resid(r_.end), W_.compute("model.norm.weight"), A_.rstdf, input_grad(A_.dnf), A_.dx,
                        grad_of("model.norm.weight"), st_);
  if (m_.hooks_ && c_.tied_embeddings)  // the embedding's gradient is complete after its own backward, below
    return m_.grads_final({"model.norm.weight"});
  if (m_.hooks_) return m_.grads_final({"model.norm.weight", "lm_head.weight"});
  return Status::ok();
}

// The range's layers in reverse (recomputing what the mode dropped), from the residual gradient in *dx; each
// finished gradient is reported to the data-parallel hooks as soon as it is complete.
Status MicroBatchPass::backward_layers(Tensor* dx_io) {
  Tensor dx = *dx_io, dx_next = dx.data == A_.dx.data ? A_.dx2 : A_.dx;
  for (int64_t l = r_.end - 1; l >= r_.begin; --l) {
    if (m_.hooks_) {
      const std::vector<std::string> names = LlamaModel::layer_param_names(l);
      NB_TRY(m_.weights_needed(names));
      NB_TRY(m_.grads_needed(names));
    }
    const Layer w = layer_weights(l, true);
    if (m_.recompute_ == Recompute::full)
      NB_TRY(recompute_forward(l));
    else if (m_.recompute_ == Recompute::selective || reads_bf16_input(l))
      NB_TRY(recompute_layer(l, w));
    NB_TRY(mlp_backward(l, w, dx));
    NB_TRY(attention_backward(l, w, dx_next));
    std::swap(dx, dx_next);
    if (m_.hooks_) NB_TRY(m_.grads_final(LlamaModel::layer_param_names(l)));
  }
  *dx_io = dx;
  return Status::ok();
}

// Final norm, the layers in reverse, the embedding.
Status MicroBatchPass::backward() {
  NB_TRY(head_backward());
  Tensor dx = A_.dx;
  NB_TRY(backward_layers(&dx));
  return embedding_backward(dx);
}

// dx: the first layer's input gradient (this rank's tokens under sequence parallelism).
Status MicroBatchPass::embedding_backward(const Tensor& dx) {
  if (m_.hooks_) NB_TRY(m_.grads_needed({"model.embed_tokens.weight"}));
  Tensor demb;
  NB_TRY(whole_grad(dx, &demb));
  if (!m_.lora_enabled_) ops::embedding_backward(ids_, demb, m_.params_.grad("model.embed_tokens.weight"), st_);
  if (m_.hooks_) NB_TRY(m_.grads_final({"model.embed_tokens.weight"}));
  return Status::ok();
}

// Vocabulary-parallel: the rank that holds a token's row gives it (summed, or with sequence parallelism
// reduce-scattered into this rank's block of tokens).
Status MicroBatchPass::embedding_forward() {
  if (m_.hooks_) NB_TRY(m_.weights_needed({"model.embed_tokens.weight"}));
  ops::embedding_forward(W_.compute("model.embed_tokens.weight"), ids_, sp_ > 1 ? A_.sp_full : resid(r_.begin), st_);
  if (sp_ > 1) return m_.tp_group->reduce_scatter(A_.sp_full, resid(r_.begin), st_);
  return tp_sum(resid(r_.begin));
}

Status MicroBatchPass::forward_layers() {
  for (int64_t l = r_.begin; l < r_.end; ++l) {
    if (m_.hooks_) NB_TRY(m_.weights_needed(LlamaModel::layer_param_names(l)));
    NB_TRY(forward_layer(l, true));
  }
  return Status::ok();
}

Status MicroBatchPass::run(float grad_scale) {
  NB_TRY(plan());
  NB_TRY(embedding_forward());
  NB_TRY(forward_layers());
  NB_TRY(head_and_loss(grad_scale));
  if (!backward_) return Status::ok();
  NB_TRY(backward());
  m_.micro_ += m_.micro_stride_;
  return Status::ok();
}

// Pipeline passes. Under sequence parallelism the stages pass this rank's block of tokens.
Status MicroBatchPass::run_forward(float grad_scale, const Tensor& input, bool plan_acts) {
  NB_TRY(plan(plan_acts));
  if (r_.embed)
    NB_TRY(embedding_forward());
  else
    NB_TRY(copy_tensor(resid(r_.begin), input));
  NB_TRY(forward_layers());
  return r_.head ? head_and_loss(grad_scale) : Status::ok();
}

Status MicroBatchPass::run_backward(const Tensor& output_grad, Tensor* input_grad) {
  NB_TRY(plan(false));
  if (r_.head)
    NB_TRY(head_backward());
  else
    NB_TRY(copy_tensor(A_.dx, output_grad));
  Tensor dx = A_.dx;
  NB_TRY(backward_layers(&dx));
  if (!r_.embed) {
    *input_grad = dx;
    return Status::ok();
  }
  return embedding_backward(dx);
}

// The activations live in the arena for this micro-batch only; released on every path out.
Status LlamaModel::run(int64_t staged_index, float grad_scale, bool backward) {
  const size_t mark = arena_.mark();
  const Status st = MicroBatchPass(*this, staged_index, backward, {0, cfg_.layers, true, true}).run(grad_scale);
  arena_.release(mark);
  return st;
}

}  // namespace nb
