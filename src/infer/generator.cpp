// The KV-cache forward of a Llama (see generator.h): prefill and decode steps over ModelWeights, written in
// the model's ops (embedding, RMSNorm, fused-QKV RoPE, attention, SwiGLU) and BF16/FP32 GEMMs, with the
// decode kernels of infer/decode_ops.h for the cache. Activations of T tokens (T = B x S_max in prefill,
// B in decode): residual [T,H] (updated in place), norm output [T,H], qkv [T,qd+2kvd], q/o [T,qd],
// k/v [T,kvd], gate_up [T,2F], SwiGLU output [T,F]; logits [B,V] FP32; with LoRA adapters h [T, r].
//
// Decode steps on CUDA run on the generator's own stream (ordered after and before the default stream's work
// by events), their linears at up to kGemvMaxRows rows as decode_gemv (a pass over each weight), and each
// step's kernels are recorded once per batch size in a CUDA graph and replayed (infer/decode_graph.h).
// Prefill keeps the training forward's kernels (cuBLASLt GEMMs, cuDNN attention) on the default stream.
//
// Under tensor parallelism (generator.h) the embedding, the o and down outputs and the LM head's logits go
// through the group (embed, row_parallel, head); everything else is the rank's shard of the one-rank forward.
//
// LoRA adapters run unmerged, in the training forward's order (model/llama_pass.cpp, forward_layer): each
// adapted linear's base GEMM first, then lora_forward adds scale * (x A^T) B^T into the same output (for
// o and down that output is the residual, as in training). On the CPU every op here is the training
// path's op on the same rows, so decode logits equal LlamaModel::forward_logits bit for bit.
#include "infer/generator.h"
#include <algorithm>
#include <cmath>
#include "core/stream_event.h"
#include "gemm/gemm.h"
#include "infer/decode_graph.h"
#include "infer/decode_ops.h"
#include "model/lora.h"
#include "model/tensor_parallel.h"
#include "ops/attention.h"
#include "ops/elementwise.h"
#include "ops/embedding.h"
#include "ops/rmsnorm.h"
#include "ops/rope.h"
#include "ops/swiglu.h"

namespace nb::infer {
namespace {

gemm::GemmArgs nt(float beta) {
  gemm::GemmArgs a;
  a.trans_b = true;
  a.beta = beta;
  return a;
}
Tensor view(const Buffer& b, std::initializer_list<int64_t> dims) {
  const Tensor& t = b.tensor();
  return Tensor::make(t.data, t.dtype, t.device, dims);
}
Tensor at_row(const Tensor& t, int64_t row) {  // the view of row `row` of a 2-D tensor, as [1, cols]
  return Tensor::make(static_cast<uint8_t*>(t.data) + dtype_bytes(t.dtype, row * t.shape[1]), t.dtype, t.device,
                      {1, t.shape[1]});
}

}  // namespace

struct Generator::Impl {
  LlamaConfig c;
  ModelWeights w;
  Device dev = Device::cpu;
  DType dt = DType::f32;
  int64_t max_b = 0, L = 0, cap = 0, B = 0;
  Buffer x, n, rstd, qkv, q, k, v, o, gu, a, lse, last;  // activations for `cap` tokens (last: [max_b, H])
  Buffer logits, ids, pos, tok_pos, cos, sin, stage, all_logits, lora_h;
  std::vector<Buffer> ck, cv;
  std::vector<int32_t> len;  // host: each row's next position
  std::vector<char> done;    // rows whose positions no longer advance (generate() finished them)
  Stream st = nullptr;       // the stream the ops queue on: the default one, or `side` during a decode step
  SideStream side;           // decode steps' stream (CUDA; the default stream on the CPU backend)
  StreamEvent after_default, after_step;
  StepGraphs graphs;  // one decode step per (batch, argmax or not), replayed
  TensorParallelGroup tp;
  Buffer tp_ids, tp_y, tp_local, tp_gathered;  // local vocabulary ids, o/down partial sums, local and all logits

  Status allocate(int64_t tokens);
  Tensor weight(const Tensor& compute, const Tensor& master);
  Status adapt(const LayerWeights& lw, int i, const Tensor& x, const Tensor& y);
  Status linear(const Tensor& x, const Tensor& w, const Tensor& y, float beta, bool decode);
  Status layer(int64_t l, int64_t Bn, int64_t S, bool decode);
  Status embed(int64_t T);
  Status row_parallel(const Tensor& in, const Tensor& w, const Tensor& X, bool decode);
  Status gather_logits(const Tensor& local, const Tensor& out);
  int64_t vocab_out() const { return tp.group ? tp.whole_vocab : c.vocab; }
  Status forward(int64_t Bn, int64_t S, bool decode);
  Status head(const Tensor& rows, const Tensor& out, bool decode);
  Status decode_step(int64_t Bn, bool argmax);
  Status run_step(const int32_t* host_ids, std::vector<float>* out_logits, std::vector<int32_t>* next_ids);
  Status copy_to_host(void* dst, const Buffer& src, size_t bytes);
};

Generator::Generator() : impl_(new Impl) {}
Generator::~Generator() { delete impl_; }

// A decode step's y = x W^T (+ y when beta = 1): decode_gemv where it fits (a few rows on CUDA), else the
// training forward's GEMM (always on the CPU backend, so CPU logits stay bit-exact).
Status Generator::Impl::linear(const Tensor& x, const Tensor& w, const Tensor& y, float beta, bool decode) {
  if (decode && gemv_fits(x, w, y)) {
    decode_gemv(x, w, y, beta != 0.f, st);
    return Status::ok();
  }
  return gemm::matmul(x, w, y, nt(beta), st);
}

// Device-to-host copy on the ops' stream; the host waits for it (pageable memory: the copy is done then).
Status Generator::Impl::copy_to_host(void* dst, const Buffer& src, size_t bytes) {
  NB_TRY(copy_bytes_async(dst, Device::cpu, src.data(), dev, bytes, st));
  if (dev == Device::cuda) stream_synchronize(st);
  return Status::ok();
}

Status Generator::Impl::allocate(int64_t tokens) {
  if (tokens <= cap) return Status::ok();
  const int64_t H = c.hidden, qkvd = c.q_dim() + 2 * c.kv_dim();
  NB_TRY(Buffer::allocate(&x, dt, dev, {tokens, H}));
  NB_TRY(Buffer::allocate(&n, dt, dev, {tokens, H}));
  NB_TRY(Buffer::allocate(&rstd, DType::f32, dev, {tokens}));
  NB_TRY(Buffer::allocate(&qkv, dt, dev, {tokens, qkvd}));
  NB_TRY(Buffer::allocate(&q, dt, dev, {tokens, c.q_dim()}));
  NB_TRY(Buffer::allocate(&k, dt, dev, {tokens, c.kv_dim()}));
  NB_TRY(Buffer::allocate(&v, dt, dev, {tokens, c.kv_dim()}));
  NB_TRY(Buffer::allocate(&o, dt, dev, {tokens, c.q_dim()}));
  NB_TRY(Buffer::allocate(&gu, dt, dev, {tokens, 2 * c.ffn}));
  NB_TRY(Buffer::allocate(&a, dt, dev, {tokens, c.ffn}));
  NB_TRY(Buffer::allocate(&lse, DType::f32, dev, {tokens * c.heads}));
  NB_TRY(Buffer::allocate(&ids, DType::i32, dev, {tokens}));
  NB_TRY(Buffer::allocate(&tok_pos, DType::i32, dev, {tokens}));
  if (w.lora_rank > 0) NB_TRY(Buffer::allocate(&lora_h, dt, dev, {tokens, w.lora_rank}));
  if (tp.group) {
    NB_TRY(Buffer::allocate(&tp_ids, DType::i32, dev, {tokens}));
    NB_TRY(Buffer::allocate(&tp_y, dt, dev, {tokens, H}));
  }
  cap = tokens;
  graphs.clear();  // they point at the buffers just replaced
  return Status::ok();
}

// Mirrors Impl::allocate and init below (memory_estimate_test checks the two against the allocations).
int64_t Generator::planned_bytes(const LlamaConfig& whole, Device dev, int64_t max_batch, int64_t max_len,
                                 int64_t prompt_tokens, bool cast_weights, int64_t lora_rank, int tp_size) {
  const LlamaConfig c = tp::local_config(whole, tp_size);
  const int64_t e = dev == Device::cuda ? 2 : 4;  // the compute dtype's bytes
  auto buf = [](int64_t bytes) { return (std::max<int64_t>(bytes, 1) + 255) / 256 * 256; };
  const int64_t t = std::max(max_batch, prompt_tokens), qkvd = c.q_dim() + 2 * c.kv_dim();
  int64_t n = 2 * buf(t * c.hidden * e) + buf(t * 4) + buf(t * qkvd * e) + 2 * buf(t * c.q_dim() * e) +
              2 * buf(t * c.kv_dim() * e) + buf(t * 2 * c.ffn * e) + buf(t * c.ffn * e) + buf(t * c.heads * 4) +
              2 * buf(t * 4) + (lora_rank > 0 ? buf(t * lora_rank * e) : 0);
  n += buf(max_batch * c.hidden * e) + buf(max_batch * whole.vocab * 4) + buf(max_batch * 4);
  if (tp_size > 1)  // Impl::allocate's and init's tensor-parallel buffers
    n += buf(t * 4) + buf(t * c.hidden * e) + buf(max_batch * c.vocab * 4) + buf(tp_size * max_batch * c.vocab * 4);
  n += 2 * c.layers * buf(max_batch * max_len * c.kv_dim() * e);
  n += 2 * buf(max_len * c.head_dim / 2 * 4);
  if (cast_weights) n += buf(c.hidden * std::max(qkvd, 2 * c.ffn) * e);
  return n;
}

Status Generator::init(const LlamaConfig& cfg, const ModelWeights& w, Device dev, int64_t max_batch, int64_t max_len,
                       const TensorParallelGroup& tp) {
  Impl& m = *impl_;
  if (max_len < 1 || max_len > cfg.max_seq || max_batch < 1)
    return errorf("a generation context of %lld positions does not fit the model's %lld", (long long)max_len,
                  (long long)cfg.max_seq);
  m.c = cfg;
  m.w = w;
  m.dev = dev;
  m.dt = dev == Device::cuda ? DType::bf16 : DType::f32;
  m.max_b = max_batch;
  m.L = max_len;
  m.tp = tp.group && tp.group->size() > 1 ? tp : TensorParallelGroup{};
  m.graphs.clear();
  m.cap = 0;  // a second init: fresh buffers for the new weights and shapes
  NB_TRY(m.side.create(dev));
  NB_TRY(m.after_default.create(dev));
  NB_TRY(m.after_step.create(dev));
  B_ = 0;
  L_ = max_len;
  NB_TRY(m.allocate(max_batch));
  NB_TRY(Buffer::allocate(&m.last, m.dt, dev, {max_batch, cfg.hidden}));
  NB_TRY(Buffer::allocate(&m.logits, DType::f32, dev, {max_batch, m.vocab_out()}));
  if (m.tp.group) {
    NB_TRY(Buffer::allocate(&m.tp_local, DType::f32, dev, {max_batch, cfg.vocab}));
    NB_TRY(Buffer::allocate(&m.tp_gathered, DType::f32, dev, {m.tp.group->size() * max_batch * cfg.vocab}));
  }
  NB_TRY(Buffer::allocate(&m.pos, DType::i32, dev, {max_batch}));
  m.ck.resize(size_t(cfg.layers));
  m.cv.resize(size_t(cfg.layers));
  for (int64_t l = 0; l < cfg.layers; ++l) {
    NB_TRY(Buffer::allocate(&m.ck[size_t(l)], m.dt, dev, {max_batch, max_len, cfg.kv_heads, cfg.head_dim}));
    NB_TRY(Buffer::allocate(&m.cv[size_t(l)], m.dt, dev, {max_batch, max_len, cfg.kv_heads, cfg.head_dim}));
  }
  // RoPE table [L, hd/2] FP32, exactly the training forward's (model/llama_model.cpp).
  std::vector<float> cos_h(size_t(max_len * cfg.head_dim / 2)), sin_h(cos_h.size());
  ops::rope_table(rope_config(cfg), max_len, cfg.head_dim, cos_h.data(), sin_h.data());
  NB_TRY(Buffer::allocate(&m.cos, DType::f32, dev, {max_len, cfg.head_dim / 2}));
  NB_TRY(Buffer::allocate(&m.sin, DType::f32, dev, {max_len, cfg.head_dim / 2}));
  NB_TRY(copy_bytes(m.cos.data(), dev, cos_h.data(), Device::cpu, cos_h.size() * 4));
  NB_TRY(copy_bytes(m.sin.data(), dev, sin_h.data(), Device::cpu, sin_h.size() * 4));
  int64_t most = 0;  // master-only linear weights (a training store's quantized layers) are cast on use
  for (const LayerWeights& lw : w.layers) {
    const std::pair<const Tensor*, const Tensor*> pairs[] = {
        {&lw.wqkv, &lw.mqkv}, {&lw.wo, &lw.mo}, {&lw.wgu, &lw.mgu}, {&lw.wdown, &lw.mdown}};
    for (const auto& [compute, master] : pairs)
      if (!compute->data) most = std::max(most, master->numel());
  }
  if (most > 0) NB_TRY(Buffer::allocate(&m.stage, m.dt, dev, {most}));
  return Status::ok();
}

Tensor Generator::Impl::weight(const Tensor& compute, const Tensor& master) {
  if (compute.data) return compute;
  const Tensor s = Tensor::make(stage.data(), dt, dev, {master.shape[0], master.shape[1]});
  ops::cast(master, s, st);
  return s;
}

// y += scale * (x A^T) B^T for linear i's adapter, if it has one: the training path's lora_forward (dropout
// off, so its key is never read).
Status Generator::Impl::adapt(const LayerWeights& lw, int i, const Tensor& x, const Tensor& y) {
  const LoraModule& mod = lw.lora[i];
  if (!mod.a.data) return Status::ok();
  LoraScratch s;
  s.h = lora_h.tensor();
  return lora_forward(mod, x, s, y, RngKey{}, st);
}

// Layer l over Bn x S tokens: prefill (S = S_max, causal attention over the new keys) or decode (S = 1,
// attention over the cache). The residual x is updated in place: x += attn(...) Wo^T; x += mlp(...).
Status Generator::Impl::layer(int64_t l, int64_t Bn, int64_t S, bool decode) {
  const LayerWeights& lw = w.layers[size_t(l)];
  const int64_t T = Bn * S, H = c.hidden, hd = c.head_dim, Hq = c.heads, Hkv = c.kv_heads;
  const Tensor X = view(x, {T, H}), N = view(n, {T, H}), R = view(rstd, {T});
  const Tensor QKV = view(qkv, {T, c.q_dim() + 2 * c.kv_dim()});
  ops::rmsnorm_forward(X, lw.w_in, c.norm_eps, N, R, st);
  NB_TRY(linear(N, weight(lw.wqkv, lw.mqkv), QKV, 0.f, decode));
  NB_TRY(adapt(lw, 0, N, QKV));
  const Tensor q4 = view(q, {Bn, S, Hq, hd}), k4 = view(k, {Bn, S, Hkv, hd}), v4 = view(v, {Bn, S, Hkv, hd}),
               o4 = view(o, {Bn, S, Hq, hd});
  const Tensor P = decode ? view(pos, {Bn}) : view(tok_pos, {T});
  ops::rope_split_qkv(view(qkv, {Bn, S, Hq + 2 * Hkv, hd}), cos.tensor(), sin.tensor(), q4, k4, v4, st,
                      decode ? &P : nullptr);
  const Tensor& CK = ck[size_t(l)].tensor();
  const Tensor cache_k = Tensor::make(CK.data, dt, dev, {Bn, L, Hkv, hd});
  const Tensor cache_v = Tensor::make(cv[size_t(l)].data(), dt, dev, {Bn, L, Hkv, hd});
  kv_cache_write(view(k, {T, Hkv, hd}), view(v, {T, Hkv, hd}), cache_k, cache_v, P, S, st);
  const float scale = float(1.0 / std::sqrt(double(hd)));
  if (decode) {
    NB_TRY(cache_attention(view(q, {Bn, Hq, hd}), cache_k, cache_v, P, view(o, {Bn, Hq, hd}), scale, st));
  } else {
    const ops::AttentionShape ash{Bn, S, Hq, Hkv, hd, scale};
    NB_TRY(ops::attention_forward(ash, q4, k4, v4, o4, view(lse, {Bn, Hq, S}), st));
  }
  NB_TRY(row_parallel(view(o, {T, c.q_dim()}), weight(lw.wo, lw.mo), X, decode));
  NB_TRY(adapt(lw, 1, view(o, {T, c.q_dim()}), X));
  ops::rmsnorm_forward(X, lw.w_post, c.norm_eps, N, R, st);
  const Tensor GU = view(gu, {T, 2 * c.ffn}), A = view(a, {T, c.ffn});
  NB_TRY(linear(N, weight(lw.wgu, lw.mgu), GU, 0.f, decode));
  NB_TRY(adapt(lw, 2, N, GU));
  ops::swiglu_forward(GU, A, st);
  NB_TRY(row_parallel(A, weight(lw.wdown, lw.mdown), X, decode));
  return adapt(lw, 3, A, X);
}

// The residual X += in W^T; under tensor parallelism `in` holds this rank's columns, so the partial products
// are summed over the group first (LoRA is refused there: Trainer::setup_sampling).
Status Generator::Impl::row_parallel(const Tensor& in, const Tensor& W, const Tensor& X, bool decode) {
  if (!tp.group) return linear(in, W, X, 1.f, decode);
  const Tensor Y = view(tp_y, {X.shape[0], X.shape[1]});
  NB_TRY(linear(in, W, Y, 0.f, decode));
  NB_TRY(tp.group->sum(Y, st));
  ops::add_inplace(X, Y, st);
  return Status::ok();
}

// The embedding of the T tokens in ids; under tensor parallelism each rank's rows, summed over the group.
Status Generator::Impl::embed(int64_t T) {
  const Tensor X = view(x, {T, c.hidden});
  if (!tp.group) {
    ops::embedding_forward(w.embed, view(ids, {T}), X, st);
    return Status::ok();
  }
  vocab_shard_ids(view(ids, {T}), tp.vocab_begin, tp.vocab_begin + c.vocab, view(tp_ids, {T}), st);
  ops::embedding_forward(w.embed, view(tp_ids, {T}), X, st);
  return tp.group->sum(X, st);
}

// This rank's logits `local` [R, V/T] all-gathered ([T][R][V/T] in rank order) into the whole vocabulary's
// rows `out` [R, V] (the padding past V dropped).
Status Generator::Impl::gather_logits(const Tensor& local, const Tensor& out) {
  const int64_t R = local.shape[0], Vl = local.shape[1], V = out.shape[1], size = tp.group->size();
  if (tp_gathered.tensor().numel() < size * R * Vl)
    NB_TRY(Buffer::allocate(&tp_gathered, DType::f32, dev, {size * R * Vl}));
  NB_TRY(tp.group->all_gather(local, view(tp_gathered, {size * R * Vl}), st));
  const auto* g = static_cast<const float*>(tp_gathered.data());
  auto* o = static_cast<float*>(out.data);
  for (int64_t t = 0; t < size; ++t)
    for (int64_t r = 0; r < R; ++r)
      if (const int64_t n = std::min(Vl, V - t * Vl); n > 0)
        NB_TRY(copy_bytes_async(o + r * V + t * Vl, dev, g + (t * R + r) * Vl, dev, size_t(n) * 4, st));
  return Status::ok();
}

Status Generator::Impl::forward(int64_t Bn, int64_t S, bool decode) {
  NB_TRY(embed(Bn * S));
  for (int64_t l = 0; l < c.layers; ++l) NB_TRY(layer(l, Bn, S, decode));
  return Status::ok();
}

// Final norm and LM head of `rows` [R, H] into FP32 logits `out` [R, V] (the norm output borrows n).
Status Generator::Impl::head(const Tensor& rows, const Tensor& out, bool decode) {
  const int64_t R = rows.shape[0];
  const Tensor NF = view(n, {R, c.hidden});
  ops::rmsnorm_forward(rows, w.norm, c.norm_eps, NF, view(rstd, {R}), st);
  if (!tp.group) return linear(NF, w.lm_head, out, 0.f, decode);
  if (tp_local.tensor().numel() < R * c.vocab) NB_TRY(Buffer::allocate(&tp_local, DType::f32, dev, {R * c.vocab}));
  const Tensor local = view(tp_local, {R, c.vocab});
  NB_TRY(linear(NF, w.lm_head, local, 0.f, decode));
  return gather_logits(local, out);
}

// The work of one decode step on `st` (what a step graph records): the layers, the LM head and, for greedy
// decoding, the argmax into the next step's ids.
Status Generator::Impl::decode_step(int64_t Bn, bool argmax) {
  NB_TRY(forward(Bn, 1, true));
  NB_TRY(head(view(x, {Bn, c.hidden}), view(logits, {Bn, vocab_out()}), true));
  if (argmax) argmax_rows(view(logits, {Bn, vocab_out()}), view(ids, {Bn}), st);
  return Status::ok();
}

Status Generator::prefill(const std::vector<std::vector<int32_t>>& prompts, std::vector<float>* last_logits,
                          std::vector<float>* all_logits) {
  Impl& m = *impl_;
  const int64_t Bn = int64_t(prompts.size());
  int64_t S = 0;
  for (const auto& p : prompts) S = std::max(S, int64_t(p.size()));
  NB_CHECK(Bn >= 1 && Bn <= m.max_b && S >= 1 && S <= m.L, "prefill of %lld prompts of up to %lld tokens",
           (long long)Bn, (long long)S);
  NB_TRY(m.allocate(Bn * S));
  std::vector<int32_t> ids(size_t(Bn * S), 0), tpos(ids.size());
  m.len.assign(size_t(Bn), 0);
  m.done.assign(size_t(Bn), 0);
  for (int64_t b = 0; b < Bn; ++b) {
    std::copy(prompts[size_t(b)].begin(), prompts[size_t(b)].end(), ids.begin() + b * S);
    for (int64_t s = 0; s < S; ++s) tpos[size_t(b * S + s)] = int32_t(s);
    m.len[size_t(b)] = int32_t(prompts[size_t(b)].size());
  }
  NB_TRY(copy_bytes(m.ids.data(), m.dev, ids.data(), Device::cpu, ids.size() * 4));
  NB_TRY(copy_bytes(m.tok_pos.data(), m.dev, tpos.data(), Device::cpu, tpos.size() * 4));
  NB_TRY(copy_bytes(m.pos.data(), m.dev, m.len.data(), Device::cpu, size_t(Bn) * 4));
  m.B = B_ = Bn;
  NB_TRY(m.forward(Bn, S, false));
  const int64_t V = m.vocab_out();
  if (all_logits) {
    if (m.all_logits.tensor().numel() < Bn * S * V)
      NB_TRY(Buffer::allocate(&m.all_logits, DType::f32, m.dev, {Bn * S, V}));
    NB_TRY(m.head(view(m.x, {Bn * S, m.c.hidden}), view(m.all_logits, {Bn * S, V}), false));
    all_logits->resize(size_t(Bn * S * V));
    NB_TRY(copy_bytes(all_logits->data(), Device::cpu, m.all_logits.data(), m.dev, all_logits->size() * 4));
  }
  const Tensor X = view(m.x, {Bn * S, m.c.hidden}), G = view(m.last, {Bn, m.c.hidden});
  for (int64_t b = 0; b < Bn; ++b) {  // each row's last prompt position
    const Tensor src = at_row(X, b * S + m.len[size_t(b)] - 1), dst = at_row(G, b);
    NB_TRY(copy_bytes(dst.data, m.dev, src.data, m.dev, size_t(src.bytes())));
  }
  NB_TRY(m.head(G, view(m.logits, {Bn, V}), false));
  if (last_logits) {
    last_logits->resize(size_t(Bn * V));
    NB_TRY(copy_bytes(last_logits->data(), Device::cpu, m.logits.data(), m.dev, last_logits->size() * 4));
  }
  return Status::ok();
}

Status Generator::step(const int32_t* ids, std::vector<float>* logits, std::vector<int32_t>* next_ids) {
  Impl& m = *impl_;
  const int64_t Bn = m.B;
  NB_CHECK(Bn > 0, "step() before prefill()");
  for (int64_t b = 0; b < Bn; ++b)
    if (m.len[size_t(b)] >= m.L)
      return errorf("sequence %lld reached the end of its %lld-position cache", (long long)b, (long long)m.L);
  // The step queues on its own stream (capturable), after the default stream's work (prefill, host copies)
  // and before anything queued there later.
  m.st = m.side.get();
  m.after_default.record(nullptr);
  m.after_default.wait_in(m.st);
  const Status st = m.run_step(ids, logits, next_ids);
  m.after_step.record(m.st);
  m.after_step.wait_in(nullptr);
  m.st = nullptr;
  return st;
}

Status Generator::Impl::run_step(const int32_t* host_ids, std::vector<float>* out_logits,
                                 std::vector<int32_t>* next_ids) {
  const int64_t Bn = B, V = vocab_out();
  if (host_ids) NB_TRY(copy_bytes_async(ids.data(), dev, host_ids, Device::cpu, size_t(Bn) * 4, st));
  const bool argmax = next_ids != nullptr;
  if (tp.group)  // the group's collectives stay out of graph captures
    NB_TRY(decode_step(Bn, argmax));
  else
    NB_TRY(graphs.run(dev, Bn * 2 + (argmax ? 1 : 0), st, [&] { return decode_step(Bn, argmax); }));
  // Positions advance on the device while every row runs; once generate() froze a row, from the host.
  bool any_done = false;
  for (int64_t b = 0; b < Bn; ++b) {
    any_done = any_done || done[size_t(b)];
    if (!done[size_t(b)]) ++len[size_t(b)];
  }
  if (any_done)
    NB_TRY(copy_bytes_async(pos.data(), dev, len.data(), Device::cpu, size_t(Bn) * 4, st));
  else
    advance_positions(view(pos, {Bn}), st);
  if (out_logits) {
    out_logits->resize(size_t(Bn * V));
    NB_TRY(copy_to_host(out_logits->data(), logits, out_logits->size() * 4));
  }
  if (next_ids) {
    next_ids->resize(size_t(Bn));
    NB_TRY(copy_to_host(next_ids->data(), ids, size_t(Bn) * 4));
  }
  return Status::ok();
}

int64_t Generator::max_batch() const { return impl_->max_b; }
const LlamaConfig& Generator::config() const { return impl_->c; }
int64_t Generator::vocab() const { return impl_->vocab_out(); }
void Generator::freeze_row(int64_t b) { impl_->done[size_t(b)] = 1; }

Status Generator::first_argmax(std::vector<int32_t>* next) {
  Impl& m = *impl_;
  argmax_rows(view(m.logits, {m.B, m.vocab_out()}), view(m.ids, {m.B}), nullptr);
  next->resize(size_t(m.B));
  return copy_bytes(next->data(), Device::cpu, m.ids.data(), m.dev, size_t(m.B) * 4);
}

Status Generator::copy_ids(const std::vector<int32_t>& ids) {
  return copy_bytes(impl_->ids.data(), impl_->dev, ids.data(), Device::cpu, ids.size() * 4);
}

Status check_prompts(const std::vector<std::vector<int32_t>>& prompts, const LlamaConfig& cfg, int64_t context) {
  if (prompts.empty()) return errorf("no prompt was given; pass --prompt TEXT or --prompts FILE.jsonl");
  for (size_t i = 0; i < prompts.size(); ++i) {
    const auto& p = prompts[i];
    if (p.empty()) return errorf("prompt %zu encodes to no tokens; give it some text", i + 1);
    if (int64_t(p.size()) >= context)
      return errorf(
          "prompt %zu has %zu tokens, which leaves no room in the model's context of %lld tokens; shorten it to "
          "fewer than %lld tokens",
          i + 1, p.size(), (long long)context, (long long)context);
    for (int32_t id : p)
      if (id < 0 || id >= cfg.vocab)
        return errorf(
            "prompt %zu holds token id %d, outside the model's vocabulary of %lld (is the tokenizer the "
            "model's?)",
            i + 1, id, (long long)cfg.vocab);
  }
  return Status::ok();
}

}  // namespace nb::infer
