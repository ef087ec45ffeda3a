// LlamaModel: forward, chunked LM head + loss, and backward for one micro-batch, in ops and GEMMs.
// Shapes (T = batch*seq tokens, H hidden, F ffn, qd = heads*head_dim, kvd = kv_heads*head_dim):
//   residual stream [T,H]; qkv [T,qd+2kvd] (one fused projection, split by rope_split_qkv);
//   q [T,qd] = [B,S,heads,hd]; k, v [T,kvd]; gate_up [T,2F]; logits chunk [C,V].
// Activations use the compute dtype (BF16 on CUDA, FP32 on CPU); norm statistics, attention
// softmax statistics, losses and all weight gradients are FP32.
#include "model/llama_model.h"
#include <algorithm>
#include <array>
#include <cmath>
#include <vector>
#include "core/bf16.h"
#include "core/gpu_profile.h"
#include "gemm/gemm.h"
#include "ops/attention.h"
#include "ops/cross_entropy.h"
#include "ops/elementwise.h"
#include "ops/embedding.h"
#include "ops/rmsnorm.h"
#include "ops/rope.h"
#include "ops/swiglu.h"
#include "recipe/linear_stats.h"

namespace nb {

Status parse_recompute(const std::string& s, Recompute* out) {
  if (s == "none")
    *out = Recompute::none;
  else if (s == "selective")
    *out = Recompute::selective;
  else if (s == "full")
    *out = Recompute::full;
  else
    return errorf("recompute must be none, selective or full; got '%s'", s.c_str());
  return Status::ok();
}

namespace {

// Allocates from the arena, or only counts bytes when planning (arena == nullptr).
struct Planner {
  Arena* arena = nullptr;
  Device dev = Device::cpu;
  int64_t bytes = 0;
  Status st;
  Tensor operator()(DType dt, std::initializer_list<int64_t> dims) {
    Tensor t = Tensor::make(nullptr, dt, dev, dims);
    bytes += (t.bytes() + 255) / 256 * 256;
    if (arena && st) t.data = arena->alloc(size_t(t.bytes()), &st);
    return t;
  }
};

Tensor rows(const Tensor& t, int64_t begin, int64_t end) {
  Tensor r = t;
  r.data = static_cast<uint8_t*>(t.data) + dtype_bytes(t.dtype, begin * t.stride[0]);
  r.shape[0] = end - begin;
  return r;
}
Tensor reshape4(const Tensor& t, int64_t b, int64_t s, int64_t h, int64_t d) {
  return Tensor::make(t.data, t.dtype, t.device, {b, s, h, d});
}
Status copy_tensor(const Tensor& dst, const Tensor& src) {
  return copy_bytes(dst.data, dst.device, src.data, src.device, size_t(src.bytes()));
}
gemm::GemmArgs nt(float beta = 0.f) {
  gemm::GemmArgs a;
  a.trans_b = true;
  a.beta = beta;
  return a;
}
gemm::GemmArgs nn(float beta = 0.f) {
  gemm::GemmArgs a;
  a.beta = beta;
  return a;
}
gemm::GemmArgs tn_acc() {
  gemm::GemmArgs a;
  a.trans_a = true;
  a.beta = 1.f;
  return a;
}

}  // namespace

// The weights of one layer as views into the ParamStore.
// q, k and v are adjacent in the ParamStore, so wqkv / gqkv view them as one [qd + 2 kvd, H] weight.
// A quantized layer's linear weights have no compute copy (data == nullptr): m* are their FP32 masters.
struct LlamaModel::Layer {
  Tensor w_in, wqkv, wo, w_post, wgu, wdown;  // compute copies
  Tensor g_in, gqkv, go, g_post, ggu, gdown;  // FP32 gradients
  Tensor mqkv, mo, mgu, mdown;                // FP32 masters of the linear weights
};

// One micro-batch's activations. Per-layer tensors that recompute does not keep point into shared scratch.
struct LlamaModel::Acts {
  struct PerLayer {
    Tensor n1, rstd1, q, k, v, o, lse, mid, n2, rstd2, gu, a;
  };
  std::vector<Tensor> resid;    // L+1 residual-stream tensors [T,H]
  std::vector<PerLayer> layer;  // L
  Tensor nf, rstdf, logits, losses, dnf;
  Tensor dx, dx2, dmid, dn, da, dgu, dout, dq, dk, dv;
  Tensor qkv, dqkv;  // the fused projection's output and gradient; only when they cannot borrow gu / dgu
  LoraScratch lora;  // LoRA: the adapters' scratch (model/lora.h)
};

namespace {
// Layers whose linears keep quantized copies of their inputs need no BF16 n1, n2 and SwiGLU output:
// those then live in shared scratch (written by the forward, read by no backward).
std::vector<bool> quantized_layers(const LlamaConfig& c, const recipe::Recipe& r) {
  std::vector<bool> q(size_t(c.layers));
  for (int64_t l = 0; l < c.layers; ++l) q[size_t(l)] = r.quantized() && !r.layer_in_bf16(l, c.layers);
  return q;
}
// Layers whose BF16 linear inputs live in shared scratch: none with LoRA, whose adapters read them.
std::vector<bool> scratch_input_layers(const LlamaConfig& c, const recipe::Recipe& r, const LoraSpec* lora) {
  return lora ? std::vector<bool>(size_t(c.layers), false) : quantized_layers(c, r);
}

void plan_lora(LoraScratch* s, Planner& P, const LlamaConfig& c, int64_t T, DType dt, const LoraSpec& lora) {
  s->h = P(dt, {T, lora.rank});
  s->dh = P(dt, {T, lora.rank});
  if (lora.dropout > 0) {
    const int64_t in = std::max({c.hidden, c.q_dim(), c.ffn});
    s->xd = P(dt, {T, in});
    s->dxd = P(dt, {T, in});
  }
}

void plan_acts(LlamaModel::Acts* a, Planner& P, const LlamaConfig& c, MicroBatchShape s, Recompute rc, DType dt,
               int64_t chunk, const std::vector<bool>& quantized, const LoraSpec* lora) {
  const int64_t T = s.tokens(), H = c.hidden, F = c.ffn, qd = c.q_dim(), kvd = c.kv_dim();
  a->resid.clear();
  for (int64_t l = 0; l <= c.layers; ++l) a->resid.push_back(P(dt, {T, H}));
  auto make_layer = [&](LlamaModel::Acts::PerLayer& p, bool keep_cheap, bool keep_rest) {
    // keep_cheap: norms' outputs and the SwiGLU product (recomputed by selective recompute)
    if (keep_cheap) {
      p.n1 = P(dt, {T, H});
      p.n2 = P(dt, {T, H});
      p.a = P(dt, {T, F});
    }
    if (keep_rest) {
      p.rstd1 = P(DType::f32, {T});
      p.rstd2 = P(DType::f32, {T});
      p.q = P(dt, {T, qd});
      p.k = P(dt, {T, kvd});
      p.v = P(dt, {T, kvd});
      p.o = P(dt, {T, qd});
      p.lse = P(DType::f32, {s.batch, c.heads, s.seq});
      p.mid = P(dt, {T, H});
      p.gu = P(dt, {T, 2 * F});
    }
  };
  a->layer.assign(size_t(c.layers), {});
  LlamaModel::Acts::PerLayer scratch;
  if (rc == Recompute::full) {
    make_layer(scratch, true, true);
    for (auto& p : a->layer) p = scratch;
  } else {
    bool any_shared = rc == Recompute::selective;
    for (bool q : quantized) any_shared = any_shared || q;
    if (any_shared) make_layer(scratch, true, false);
    for (size_t l = 0; l < a->layer.size(); ++l) {
      auto& p = a->layer[l];
      const bool shared = rc == Recompute::selective || quantized[l];
      make_layer(p, !shared, true);
      if (shared) {
        p.n1 = scratch.n1;
        p.n2 = scratch.n2;
        p.a = scratch.a;
      }
    }
  }
  a->nf = P(dt, {T, H});
  a->rstdf = P(DType::f32, {T});
  a->logits = P(dt, {chunk, c.vocab});
  a->losses = P(DType::f32, {T});
  a->dnf = P(dt, {T, H});
  a->dx = P(dt, {T, H});
  a->dx2 = P(dt, {T, H});
  a->dmid = P(dt, {T, H});
  a->dn = P(dt, {T, H});
  a->da = P(dt, {T, F});
  a->dgu = P(dt, {T, 2 * F});
  a->dout = P(dt, {T, qd});
  a->dq = P(dt, {T, qd});
  a->dk = P(dt, {T, kvd});
  a->dv = P(dt, {T, kvd});
  if (lora) plan_lora(&a->lora, P, c, T, dt, *lora);
  // The fused QKV output lives only until rope_split_qkv, before the layer writes gu; its gradient only
  // after gate_up's backward has consumed dgu. Both borrow those buffers when they are large enough.
  if (2 * F < qd + 2 * kvd) {
    a->qkv = P(dt, {T, qd + 2 * kvd});
    a->dqkv = P(dt, {T, qd + 2 * kvd});
  }
}

// A [rows, cols] view of the start of `t` (which must hold at least that many elements).
Tensor borrow(const Tensor& t, int64_t rows, int64_t cols) {
  NB_CHECK(t.numel() >= rows * cols, "internal: borrowing [%lld, %lld] from %s", (long long)rows, (long long)cols,
           t.shape_str().c_str());
  return Tensor::make(t.data, t.dtype, t.device, {rows, cols});
}
}  // namespace

namespace {
// LM-head chunk: at most 2^29 logits at a time (1 GiB of BF16), i.e. 4096 tokens for V = 128256.
// Rounded down to a multiple of 128 tokens so the LM-head GEMMs get whole tiles (4096 for V = 128256).
int64_t lm_chunk_tokens(const LlamaConfig& cfg, MicroBatchShape shape) {
  int64_t c = std::max<int64_t>(1, (int64_t(1) << 29) / cfg.vocab);
  if (c >= 128) c = c / 128 * 128;
  return std::min<int64_t>(shape.tokens(), c);
}
}  // namespace

int64_t LlamaModel::plan_activation_bytes(const LlamaConfig& cfg, Device dev, MicroBatchShape shape, Recompute rc,
                                          const recipe::Recipe& recipe, const LoraSpec* lora) {
  Planner plan;
  plan.dev = dev;
  Acts probe;
  plan_acts(&probe, plan, cfg, shape, rc, dev == Device::cuda ? DType::bf16 : DType::f32, lm_chunk_tokens(cfg, shape),
            scratch_input_layers(cfg, recipe, lora), lora);
  return plan.bytes;
}

size_t LlamaModel::quantized_copy_bytes() const {
  size_t n = linear_workspace_ ? linear_workspace_->bytes() : 0;
  for (const auto& layer : linears_)
    for (const auto& lin : layer) n += lin.bytes();
  return n;
}

std::vector<std::string> LlamaModel::layer_param_names(int64_t l) {
  const std::string p = "model.layers." + std::to_string(l) + ".";
  return {p + "input_layernorm.weight",  p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight",
          p + "self_attn.v_proj.weight", p + "self_attn.o_proj.weight", p + "post_attention_layernorm.weight",
          p + "mlp.gate_up_proj.weight", p + "mlp.down_proj.weight"};
}
Status LlamaModel::weights_needed(const std::vector<std::string>& names) {
  return hooks_ && !lora_enabled_ ? hooks_->weights_needed(names) : Status::ok();
}
Status LlamaModel::grads_final(const std::vector<std::string>& names) {
  return hooks_ && report_grads_final_ && !lora_enabled_ ? hooks_->grads_final(names) : Status::ok();
}

void LlamaModel::begin_step(uint32_t step, uint32_t first_micro, uint32_t micro_stride) {
  step_ = step;
  micro_ = first_micro;
  micro_stride_ = micro_stride;
  for (auto& layer : linears_)
    for (auto& lin : layer) lin.new_step(step, first_micro, micro_stride);
  std::fill(weight_staged_.begin(), weight_staged_.end(), char(0));
}

void LlamaModel::set_collect_stats(bool on) {
  if (on && !stats_scratch_) stats_scratch_ = std::make_shared<recipe::StatsScratch>(dev_);
  for (auto& layer : linears_)
    for (auto& lin : layer) lin.set_collect_stats(on, stats_scratch_);
}

namespace {
const char* const kLinearNames[4] = {"self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"};
}  // namespace

Status LlamaModel::take_health(std::string* nonfinite_where, recipe::LinearHealth* worst,
                               std::vector<LinearStats>* per_linear) {
  nonfinite_where->clear();
  *worst = recipe::LinearHealth{};
  for (size_t l = 0; l < linears_.size(); ++l) {
    for (size_t i = 0; i < linears_[l].size(); ++i) {
      recipe::LinearHealth h;
      NB_TRY(linears_[l][i].take_health(&h));
      if (h.nonfinite > 0 && nonfinite_where->empty())
        *nonfinite_where = "layer " + std::to_string(l) + " " + kLinearNames[i] + " " + h.first_nonfinite_role;
      worst->nonfinite += h.nonfinite;
      if (h.has_stats) {
        if (!worst->has_stats || h.sqnr_db < worst->sqnr_db) worst->sqnr_db = h.sqnr_db;
        worst->flushed = std::max(worst->flushed, h.flushed);
        worst->saturated = std::max(worst->saturated, h.saturated);
        worst->has_stats = true;
        quant_stats_ms_ += h.stats_ms;
        if (per_linear)
          per_linear->push_back({"model.layers." + std::to_string(l) + "." + kLinearNames[i], int64_t(l), h});
      }
    }
  }
  return Status::ok();
}

Status LlamaModel::scaling_states(std::vector<LinearScaling>* out) const {
  out->clear();
  for (int64_t l = 0; l < cfg_.layers; ++l)
    for (int i = 0; i < 4; ++i) {
      LinearScaling ls{"model.layers." + std::to_string(l) + "." + kLinearNames[i], {}};
      NB_TRY(linears_[size_t(l)][size_t(i)].scaling_state(&ls.roles));
      if (!ls.roles.empty()) out->push_back(std::move(ls));
    }
  return Status::ok();
}

Status LlamaModel::set_scaling_states(const std::vector<LinearScaling>& in) {
  std::vector<LinearScaling> mine;
  NB_TRY(scaling_states(&mine));
  if (in.size() != mine.size())
    return errorf("the checkpoint has FP8 delayed-scaling state for %zu linear layers, this model and recipe %zu",
                  in.size(), mine.size());
  size_t k = 0;
  for (int64_t l = 0; l < cfg_.layers; ++l)
    for (int i = 0; i < 4; ++i) {
      if (k >= in.size() || in[k].linear != "model.layers." + std::to_string(l) + "." + kLinearNames[i]) continue;
      NB_TRY(linears_[size_t(l)][size_t(i)].set_scaling_state(in[k].roles));
      ++k;
    }
  if (k != in.size())
    return errorf("the checkpoint's delayed-scaling state names linear '%s', which this model lacks",
                  in[k].linear.c_str());
  return Status::ok();
}

int64_t LlamaModel::parameter_bytes(const LlamaConfig& cfg, Device dev, const recipe::Recipe& recipe, int shards) {
  const int64_t compute_bytes = dev == Device::cuda ? 2 : 4;
  if (shards > 1) return cfg.total_params() * (4 + compute_bytes) + cfg.total_params() * 12 / shards;
  // Quantized layers' linear weights have no compute copy (params.h).
  int64_t master_only = 0;
  for (bool q : quantized_layers(cfg, recipe)) master_only += q ? cfg.linear_params_per_layer() : 0;
  return cfg.total_params() * 16 + (cfg.total_params() - master_only) * (dev == Device::cuda ? 2 : 4);
}

namespace {
// The linear layers of a transformer layer (qkv, o, gate_up, down): {in, out} features.
std::array<std::array<int64_t, 2>, 4> linear_dims(const LlamaConfig& cfg) {
  return {{{cfg.hidden, cfg.q_dim() + 2 * cfg.kv_dim()},
           {cfg.q_dim(), cfg.hidden},
           {cfg.hidden, 2 * cfg.ffn},
           {cfg.ffn, cfg.hidden}}};
}
}  // namespace

Status LlamaModel::build_linears() {
  const auto dims = linear_dims(cfg_);
  linears_.clear();
  linears_.resize(size_t(cfg_.layers));
  // The linears run one at a time on one stream: their transient copies (the input's row-wise copy in
  // forward, both grad copies in backward) share one workspace sized for the largest layer.
  linear_workspace_ = std::make_shared<recipe::LinearWorkspace>(dev_);
  for (int64_t l = 0; l < cfg_.layers; ++l) {
    linears_[size_t(l)].resize(4);
    for (int i = 0; i < 4; ++i) {
      std::string name = "model.layers." + std::to_string(l) + "." + kLinearNames[i];
      NB_TRY(linears_[size_t(l)][size_t(i)].init(recipe_, recipe_.layer_in_bf16(l, cfg_.layers), name,
                                                 uint32_t(l * 8 + i), shape_.tokens(), dims[size_t(i)][0],
                                                 dims[size_t(i)][1], dev_, linear_workspace_,
                                                 /*frozen=*/lora_enabled_));
    }
  }
  return linear_workspace_->allocate();
}

Status LlamaModel::init(const LlamaConfig& cfg, Device dev, MicroBatchShape shape, Recompute rc, uint64_t seed,
                        const recipe::Recipe& recipe) {
  cfg_ = cfg;
  dev_ = dev;
  shape_ = shape;
  recompute_ = rc;
  recipe_ = recipe;
  plan_recipe_ = planned_switch ? activation_plan_recipe(recipe, *planned_switch) : recipe;
  fprop_bf16_ = false;
  NB_TRY(validate(cfg));
  if (shape.seq > cfg.max_seq)
    return errorf("sequence length %lld exceeds the model's %lld", (long long)shape.seq, (long long)cfg.max_seq);
  lm_chunk_tokens_ = lm_chunk_tokens(cfg, shape);
  seed_ = seed;
  const LoraSpec* lora = lora_enabled_ ? &lora_spec_ : nullptr;
  activation_bytes_ = plan_activation_bytes(cfg, dev, shape, rc, plan_recipe_, lora);
  NB_TRY(build_linears());
  // Quantized layers (one contiguous block: BF16 layers are counted from either end) keep no compute copy
  // of their linear weights; a staging buffer of the largest such weight feeds their quantizers.
  const std::vector<bool> quantized = quantized_layers(cfg, recipe);
  int64_t qb = 0;
  while (qb < cfg.layers && !quantized[size_t(qb)]) ++qb;
  int64_t qe = qb;
  while (qe < cfg.layers && quantized[size_t(qe)]) ++qe;
  for (int64_t l = qe; l < cfg.layers; ++l)
    NB_CHECK(!quantized[size_t(l)], "internal: quantized layers not contiguous");
  if (lora_enabled_) {  // quantized layers' frozen weights live in their Linears only
    NB_TRY(base_.allocate_frozen(cfg, dev, qb, qe));
    NB_TRY(params_.allocate(lora_param_list(cfg, lora_spec_), dev));
    NB_TRY(Buffer::allocate(&norm_dw_sink_, DType::f32, dev, {cfg.hidden}));
  } else {
    // An empty master-only range: asked for, sharded, or a planned recipe switch (its BF16 GEMMs read weights).
    if (!master_only_quantized_weights || optimizer_shard_count > 1 || planned_switch) qe = qb;
    NB_TRY(params_.allocate(cfg, dev, qb, qe, optimizer_shard_rank, optimizer_shard_count, optimizer_bucket_elems));
  }
  weight_staged_.assign(size_t(cfg.layers * 4), char(0));
  if (qe > qb) {
    int64_t most = 0;
    for (const auto& d : linear_dims(cfg)) most = std::max(most, d[0] * d[1]);
    NB_TRY(Buffer::allocate(&weight_stage_, params_.compute_dtype(), dev, {most}));
  }
  NB_TRY(params_.initialize(seed));
  if (lora_enabled_) {
    build_lora_modules();
    NB_TRY(load_base(seed));
  }
  NB_TRY(arena_.reserve(dev, size_t(activation_bytes_)));
  // RoPE tables [S, hd/2], FP32.
  std::vector<float> cos_h(size_t(shape.seq * cfg.head_dim / 2)), sin_h(cos_h.size());
  ops::RopeConfig rcfg;
  rcfg.theta = cfg.rope_theta;
  rcfg.llama31_scaling = cfg.rope_factor != 1.0;
  rcfg.factor = cfg.rope_factor;
  rcfg.low_freq_factor = cfg.rope_low_freq_factor;
  rcfg.high_freq_factor = cfg.rope_high_freq_factor;
  rcfg.original_max_pos = cfg.rope_original_max_pos;
  ops::rope_table(rcfg, shape.seq, cfg.head_dim, cos_h.data(), sin_h.data());
  NB_TRY(Buffer::allocate(&rope_cos_, DType::f32, dev, {shape.seq, cfg.head_dim / 2}));
  NB_TRY(Buffer::allocate(&rope_sin_, DType::f32, dev, {shape.seq, cfg.head_dim / 2}));
  NB_TRY(copy_bytes(rope_cos_.data(), dev, cos_h.data(), Device::cpu, cos_h.size() * 4));
  NB_TRY(copy_bytes(rope_sin_.data(), dev, sin_h.data(), Device::cpu, sin_h.size() * 4));
  NB_TRY(Buffer::allocate(&loss_acc_, DType::f32, dev, {shape.tokens()}));
  ops::fill(loss_acc_.tensor(), 0.0f, nullptr);
  return Status::ok();
}

// Labels may be -1 (not trained); any other id outside the vocabulary stops the run.
static Status check_ids(const int32_t* ids, int64_t n, int64_t vocab, const char* what, int32_t lowest = 0) {
  for (int64_t i = 0; i < n; ++i)
    if (ids[i] < lowest || ids[i] >= vocab)
      return errorf(
          "a micro-batch holds the %s id %d at position %lld, outside the model's vocabulary [0, %lld); "
          "the data does not fit this model (check its tokenizer against --vocab-size)",
          what, ids[i], (long long)i, (long long)vocab);
  return Status::ok();
}

Status LlamaModel::stage_batches(const int32_t* tokens, const int32_t* labels, int64_t n) {
  const int64_t T = shape_.tokens();
  // The kernels guard their reads, but an id past the vocabulary must stop the run, never become a zero
  // embedding row or a dropped target (on the host: one pass over n*T ids, microseconds).
  NB_TRY(check_ids(tokens, n * T, cfg_.vocab, "token"));
  NB_TRY(check_ids(labels, n * T, cfg_.vocab, "label", -1));
  seg_host_.clear();
  if (n > staged_capacity_) {
    NB_TRY(Buffer::allocate(&ids_, DType::i32, dev_, {n, T}));
    NB_TRY(Buffer::allocate(&targets_, DType::i32, dev_, {n, T}));
    staged_capacity_ = n;
  }
  NB_TRY(copy_bytes(ids_.data(), dev_, tokens, Device::cpu, size_t(n * T) * 4));
  NB_TRY(copy_bytes(targets_.data(), dev_, labels, Device::cpu, size_t(n * T) * 4));
  return Status::ok();
}

Status LlamaModel::stage_segments(const std::vector<int32_t>* starts, int64_t n) {
  const int64_t T = shape_.tokens(), S = shape_.seq;
  NB_CHECK(n <= staged_capacity_, "stage_segments for %lld micro-batches, %lld staged", (long long)n,
           (long long)staged_capacity_);
  seg_host_.assign(starts, starts + n);
  if (std::all_of(seg_host_.begin(), seg_host_.end(), [](const auto& v) { return v.empty(); })) {
    seg_host_.clear();
    return Status::ok();
  }
  std::vector<int32_t> all;
  seg_offset_.assign(size_t(n), 0);
  for (int64_t i = 0; i < n; ++i) {
    auto& st = seg_host_[size_t(i)];
    if (st.empty())  // an unpacked micro-batch among packed ones: one segment per row
      for (int64_t r = 0; r <= shape_.batch; ++r) st.push_back(int32_t(r * S));
    seg_offset_[size_t(i)] = int64_t(all.size());
    all.insert(all.end(), st.begin(), st.end());
  }
  NB_TRY(Buffer::allocate(&seg_starts_, DType::i32, dev_, {int64_t(all.size())}));
  NB_TRY(copy_bytes(seg_starts_.data(), dev_, all.data(), Device::cpu, all.size() * 4));
  // The attention's own rules, checked once here: the positions below index by the starts.
  const ops::AttentionShape ash{shape_.batch, S, cfg_.heads, cfg_.kv_heads, cfg_.head_dim, 1.0f};
  std::vector<int32_t> pos(size_t(n * T));
  for (int64_t i = 0; i < n; ++i) {
    const auto& st = seg_host_[size_t(i)];
    ops::AttentionSegments segs{int64_t(st.size()) - 1, st.data(), seg_starts_.ptr<int32_t>() + seg_offset_[size_t(i)]};
    NB_TRY(ops::attention_check_segments(ash, segs, dev_).context(strprintf("micro-batch %lld", (long long)i)));
    for (size_t k = 0; k + 1 < st.size(); ++k)
      for (int32_t t = st[k]; t < st[k + 1]; ++t) pos[size_t(i * T + t)] = t - st[k];
  }
  if (positions_.tensor().numel() < n * T) NB_TRY(Buffer::allocate(&positions_, DType::i32, dev_, {n * T}));
  return copy_bytes(positions_.data(), dev_, pos.data(), Device::cpu, pos.size() * 4);
}

bool LlamaModel::packed_view(int64_t i, ops::AttentionSegments* segs, Tensor* positions) const {
  if (seg_host_.empty()) return false;
  const int64_t T = shape_.tokens();
  const auto& st = seg_host_[size_t(i)];
  segs->count = int64_t(st.size()) - 1;
  segs->starts = st.data();
  segs->starts_device = seg_starts_.ptr<int32_t>() + seg_offset_[size_t(i)];
  segs->max_len = 0;  // derived from the host starts by the ops
  *positions = Tensor::make(positions_.ptr<int32_t>() + i * T, DType::i32, dev_, {T});
  return true;
}

Status LlamaModel::take_loss_sum(double* loss_sum) {
  std::vector<float> losses(static_cast<size_t>(shape_.tokens()));
  NB_TRY(copy_bytes(losses.data(), Device::cpu, loss_acc_.data(), dev_, losses.size() * 4));
  double sum = 0;
  for (float x : losses) sum += x;
  *loss_sum += sum;
  ops::fill(loss_acc_.tensor(), 0.0f, nullptr);
  return Status::ok();
}

Status LlamaModel::forward_backward_staged(int64_t i, float grad_scale) { return run(i, grad_scale, true); }
Status LlamaModel::forward_loss_staged(int64_t i) { return run(i, 0.f, false); }

Status LlamaModel::forward_backward(const int32_t* tokens, const int32_t* labels, float grad_scale, double* loss_sum) {
  NB_TRY(stage_batches(tokens, labels, 1));
  NB_TRY(run(0, grad_scale, true));
  return take_loss_sum(loss_sum);
}
Status LlamaModel::forward_loss(const int32_t* tokens, const int32_t* labels, double* loss_sum) {
  NB_TRY(stage_batches(tokens, labels, 1));
  NB_TRY(run(0, 0.f, false));
  return take_loss_sum(loss_sum);
}

Status LlamaModel::forward_logits(const int32_t* tokens, const int32_t* labels, float* logits, double* loss_sum) {
  NB_TRY(stage_batches(tokens, labels, 1));
  logits_sink_ = logits;
  Status st = run(0, 0.f, false);
  logits_sink_ = nullptr;
  NB_TRY(st);
  return take_loss_sum(loss_sum);
}

Status LlamaModel::copy_logits_to_host(const Tensor& logits, float* out) const {
  const size_t n = size_t(logits.numel());
  if (logits.dtype == DType::f32) return copy_bytes(out, Device::cpu, logits.data, dev_, n * 4);
  std::vector<bf16> h(n);
  NB_TRY(copy_bytes(h.data(), Device::cpu, logits.data, dev_, n * 2));
  for (size_t i = 0; i < n; ++i) out[i] = bf16_to_f32(h[i]);
  return Status::ok();
}

// NOLINTNEXTLINE(readability-function-size): a listed offender (docs/HARDENING.md), to shrink when next changed
Status LlamaModel::run(int64_t staged_index, float grad_scale, bool backward) {
  const LlamaConfig& c = cfg_;
  const int64_t T = shape_.tokens(), B = shape_.batch, S = shape_.seq, hd = c.head_dim;
  const DType dt = params_.compute_dtype();
  const Stream st = nullptr;
  size_t mark = arena_.mark();
  Planner P;
  P.arena = &arena_;
  P.dev = dev_;
  Acts A;
  const LoraSpec* lora = lora_enabled_ ? &lora_spec_ : nullptr;
  plan_acts(&A, P, c, shape_, recompute_, dt, lm_chunk_tokens_, scratch_input_layers(c, plan_recipe_, lora), lora);
  NB_TRY(P.st);
  NB_CHECK(staged_index < staged_capacity_, "micro-batch %lld was not staged", (long long)staged_index);
  const Tensor ids = rows(Tensor::make(ids_.data(), DType::i32, dev_, {staged_capacity_ * T}), staged_index * T,
                          (staged_index + 1) * T);
  const Tensor targets = rows(Tensor::make(targets_.data(), DType::i32, dev_, {staged_capacity_ * T}), staged_index * T,
                              (staged_index + 1) * T);
  const Tensor cosT = rope_cos_.tensor(), sinT = rope_sin_.tensor();
  ops::AttentionShape ash{B, S, c.heads, c.kv_heads, hd, float(1.0 / std::sqrt(double(hd)))};
  ops::AttentionSegments segments;
  Tensor positions;
  const bool packed = packed_view(staged_index, &segments, &positions);
  const ops::AttentionSegments* segs = packed ? &segments : nullptr;
  const Tensor* pos = packed ? &positions : nullptr;
  const int64_t qkv_heads = c.heads + 2 * c.kv_heads, qkv_dim = qkv_heads * hd;

  // The weights: the model's own, or with LoRA the frozen base, which has no gradients (its norms'
  // weight gradients go to a sink: the norm backward always writes one) and no FP32 masters.
  const ParamStore& W = base();
  auto grad_of = [&](const std::string& n) {
    if (!lora_enabled_) return params_.grad(n);
    return n.find("norm.weight") != std::string::npos ? norm_dw_sink_.tensor() : Tensor{};
  };
  // q_proj, k_proj, v_proj are consecutive in every flat buffer (params.cpp): one [qd + 2 kvd, H] view.
  enum class Buf { compute, grad, master };
  auto fused_qkv = [&](const std::string& p, Buf b) {
    if (b == Buf::compute && !W.has_compute(p + "self_attn.q_proj.weight")) return Tensor{};
    // FP32 masters are read only by weights without a compute copy (a sharded store keeps no whole master).
    if (b == Buf::master && (lora_enabled_ || W.has_compute(p + "self_attn.q_proj.weight"))) return Tensor{};
    if (b == Buf::grad && lora_enabled_) return Tensor{};
    auto view = [&](const char* n) {
      return b == Buf::grad ? params_.grad(p + n) : b == Buf::master ? params_.master(p + n) : W.compute(p + n);
    };
    const Tensor q = view("self_attn.q_proj.weight"), k = view("self_attn.k_proj.weight"),
                 v = view("self_attn.v_proj.weight");
    NB_CHECK(static_cast<uint8_t*>(k.data) == static_cast<uint8_t*>(q.data) + q.bytes() &&
                 static_cast<uint8_t*>(v.data) == static_cast<uint8_t*>(k.data) + k.bytes(),
             "internal: q, k and v projections of %s are not adjacent in the parameter store", p.c_str());
    return Tensor::make(q.data, q.dtype, q.device, {q.shape[0] + k.shape[0] + v.shape[0], q.shape[1]});
  };
  auto layer_weights = [&](int64_t l) {
    std::string p = "model.layers." + std::to_string(l) + ".";
    Layer w;
    w.w_in = W.compute(p + "input_layernorm.weight");
    w.g_in = grad_of(p + "input_layernorm.weight");
    auto compute = [&](const std::string& n) { return W.has_compute(n) ? W.compute(n) : Tensor{}; };
    w.wqkv = fused_qkv(p, Buf::compute);
    w.gqkv = fused_qkv(p, Buf::grad);
    w.mqkv = fused_qkv(p, Buf::master);
    auto master = [&](const std::string& n) {
      return W.has_compute(n) || lora_enabled_ ? Tensor{} : params_.master(n);
    };
    w.mo = master(p + "self_attn.o_proj.weight");
    w.mgu = master(p + "mlp.gate_up_proj.weight");
    w.mdown = master(p + "mlp.down_proj.weight");
    w.wo = compute(p + "self_attn.o_proj.weight");
    w.go = grad_of(p + "self_attn.o_proj.weight");
    w.w_post = W.compute(p + "post_attention_layernorm.weight");
    w.g_post = grad_of(p + "post_attention_layernorm.weight");
    w.wgu = compute(p + "mlp.gate_up_proj.weight");
    w.ggu = grad_of(p + "mlp.gate_up_proj.weight");
    w.wdown = compute(p + "mlp.down_proj.weight");
    w.gdown = grad_of(p + "mlp.down_proj.weight");
    return w;
  };

  // The weight Linear i of layer l is given: its compute copy, or for a master-only weight the staging
  // buffer, filled from the FP32 master (RNE, as the optimizer writes compute copies) only when the
  // Linear quantizes it -- its first forward after begin_step. Later calls get the (stale) buffer,
  // which a quantized Linear does not read.
  auto weight = [&](int64_t l, int i, const Tensor& compute, const Tensor& master) -> Tensor {
    if (compute.data || lora_enabled_) return compute;  // a frozen quantized base weight lives in its Linear
    const Tensor stage = Tensor::make(weight_stage_.data(), dt, dev_, {master.shape[0], master.shape[1]});
    char& staged = weight_staged_[size_t(l * 4 + i)];
    if (!staged) {
      ops::cast(master, stage, st);
      staged = 1;
    }
    return stage;
  };

  // LoRA: the adapter of linear i of layer l beside its base GEMM (evaluation runs without dropout).
  auto adapter = [&](int64_t l, int i, LoraModule* m) {
    if (!lora_enabled_ || !lora_modules_[size_t(l * 4 + i)].a.data) return false;
    *m = lora_modules_[size_t(l * 4 + i)];
    if (!backward) m->dropout = 0.f;
    return true;
  };
  auto adapt_forward = [&](int64_t l, int i, const Tensor& x, const Tensor& y) -> Status {
    LoraModule m;
    if (!adapter(l, i, &m)) return Status::ok();
    return lora_forward(m, x, A.lora, y, lora_dropout_key(seed_, step_, micro_, m), st);
  };
  auto adapt_backward = [&](int64_t l, int i, const Tensor& dy, const Tensor& x, const Tensor& dx) -> Status {
    LoraModule m;
    if (!adapter(l, i, &m)) return Status::ok();
    return lora_backward(m, dy, x, A.lora, dx, lora_dropout_key(seed_, step_, micro_, m), st);
  };

  // Forward of layer l from resid[l]; writes resid[l+1] unless only recomputing the saved activations.
  auto forward_layer = [&](int64_t l, bool write_output) -> Status {
    Layer w = layer_weights(l);
    auto& a = A.layer[size_t(l)];
    NB_PROFILE_BEGIN("fwd: norm + qkv GEMM");
    ops::rmsnorm_forward(A.resid[l], w.w_in, c.norm_eps, a.n1, a.rstd1, st);
    auto& lin = linears_[size_t(l)];
    const Tensor qkv = A.qkv.data ? A.qkv : borrow(a.gu, T, qkv_dim);  // gu is written later in this layer
    NB_TRY(lin[0].forward(a.n1, weight(l, 0, w.wqkv, w.mqkv), qkv, 0.f, st));
    NB_TRY(adapt_forward(l, 0, a.n1, qkv));
    NB_PROFILE_END("fwd: norm + qkv GEMM");
    NB_PROFILE_BEGIN("fwd: rope + split");
    ops::rope_split_qkv(reshape4(qkv, B, S, qkv_heads, hd), cosT, sinT, reshape4(a.q, B, S, c.heads, hd),
                        reshape4(a.k, B, S, c.kv_heads, hd), reshape4(a.v, B, S, c.kv_heads, hd), st, pos);
    NB_PROFILE_END("fwd: rope + split");
    NB_PROFILE_BEGIN("fwd: attention");
    NB_TRY(ops::attention_forward(ash, reshape4(a.q, B, S, c.heads, hd), reshape4(a.k, B, S, c.kv_heads, hd),
                                  reshape4(a.v, B, S, c.kv_heads, hd), reshape4(a.o, B, S, c.heads, hd), a.lse, st,
                                  segs));
    NB_PROFILE_END("fwd: attention");
    NB_PROFILE_BEGIN("fwd: o + norm + gate_up");
    NB_TRY(copy_tensor(a.mid, A.resid[l]));
    NB_TRY(lin[1].forward(a.o, weight(l, 1, w.wo, w.mo), a.mid, 1.f, st));  // mid = resid + o Wo^T
    NB_TRY(adapt_forward(l, 1, a.o, a.mid));
    ops::rmsnorm_forward(a.mid, w.w_post, c.norm_eps, a.n2, a.rstd2, st);
    NB_TRY(lin[2].forward(a.n2, weight(l, 2, w.wgu, w.mgu), a.gu, 0.f, st));
    NB_TRY(adapt_forward(l, 2, a.n2, a.gu));
    NB_PROFILE_END("fwd: o + norm + gate_up");
    NB_PROFILE_BEGIN("fwd: swiglu + down");
    ops::swiglu_forward(a.gu, a.a, st);
    if (write_output) {
      NB_TRY(copy_tensor(A.resid[l + 1], a.mid));
      NB_TRY(lin[3].forward(a.a, weight(l, 3, w.wdown, w.mdown), A.resid[l + 1], 1.f, st));  // resid' = mid + a Wdown^T
      NB_TRY(adapt_forward(l, 3, a.a, A.resid[l + 1]));
    }
    NB_PROFILE_END("fwd: swiglu + down");
    return Status::ok();
  };

  // ---- forward
  const std::string lm_name = c.tied_embeddings ? "model.embed_tokens.weight" : "lm_head.weight";
  if (hooks_) NB_TRY(weights_needed({"model.embed_tokens.weight"}));
  ops::embedding_forward(W.compute("model.embed_tokens.weight"), ids, A.resid[0], st);
  for (int64_t l = 0; l < c.layers; ++l) {
    if (hooks_) NB_TRY(weights_needed(layer_param_names(l)));
    NB_TRY(forward_layer(l, true));
  }

  // ---- LM head and loss, chunked over tokens; the backward of the head runs chunk by chunk too.
  if (hooks_) NB_TRY(weights_needed({"model.norm.weight", lm_name}));
  const Tensor w_lm = W.compute(lm_name), g_lm = grad_of(lm_name);
  const Tensor w_final = W.compute("model.norm.weight");
  ops::rmsnorm_forward(A.resid[c.layers], w_final, c.norm_eps, A.nf, A.rstdf, st);
  for (int64_t t0 = 0; t0 < T; t0 += lm_chunk_tokens_) {
    int64_t t1 = std::min(T, t0 + lm_chunk_tokens_);
    Tensor nf_c = rows(A.nf, t0, t1), logits = rows(A.logits, 0, t1 - t0);
    NB_PROFILE_BEGIN("lm: fprop GEMM");
    NB_TRY(gemm::matmul(nf_c, w_lm, logits, nt(), st));
    NB_PROFILE_END("lm: fprop GEMM");
    if (logits_sink_) NB_TRY(copy_logits_to_host(logits, logits_sink_ + t0 * c.vocab));  // before CE overwrites them
    NB_PROFILE_BEGIN("lm: cross-entropy");
    ops::cross_entropy_fwd_bwd(logits, rows(targets, t0, t1), backward ? grad_scale : 0.f, rows(A.losses, t0, t1), st);
    NB_PROFILE_END("lm: cross-entropy");
    if (backward) {  // (a frozen LM head has no gradient: g_lm is empty)
      NB_PROFILE_BEGIN("lm: dgrad GEMM");
      NB_TRY(gemm::matmul(logits, w_lm, rows(A.dnf, t0, t1), nn(), st));  // d nf = dlogits W
      NB_PROFILE_END("lm: dgrad GEMM");
      NB_PROFILE_BEGIN("lm: wgrad GEMM (f32 +=)");
      if (g_lm.data) NB_TRY(gemm::matmul(logits, nf_c, g_lm, tn_acc(), st));  // dW += dlogits^T nf
      NB_PROFILE_END("lm: wgrad GEMM (f32 +=)");
    }
  }
  ops::add_inplace(loss_acc_.tensor(), A.losses, st);
  if (!backward) {
    arena_.release(mark);
    return Status::ok();
  }

  // ---- backward
  ops::rmsnorm_backward(A.resid[c.layers], w_final, A.rstdf, A.dnf, A.dx, grad_of("model.norm.weight"), st);
  if (hooks_ && c.tied_embeddings)  // the embedding's gradient is complete after its own backward, below
    NB_TRY(grads_final({"model.norm.weight"}));
  else if (hooks_)
    NB_TRY(grads_final({"model.norm.weight", "lm_head.weight"}));
  Tensor dx = A.dx, dx_next = A.dx2;
  for (int64_t l = c.layers - 1; l >= 0; --l) {
    const Layer w = layer_weights(l);
    auto& a = A.layer[size_t(l)];
    if (recompute_ == Recompute::full) {
      NB_TRY(forward_layer(l, false));
    } else if (recompute_ == Recompute::selective) {
      ops::rmsnorm_forward(A.resid[l], w.w_in, c.norm_eps, a.n1, a.rstd1, st);
      ops::rmsnorm_forward(a.mid, w.w_post, c.norm_eps, a.n2, a.rstd2, st);
      ops::swiglu_forward(a.gu, a.a, st);
    }
    // MLP: resid' = mid + swiglu(n2 Wgu^T) Wdown^T
    NB_PROFILE_BEGIN("bwd: down GEMMs");
    auto& lin = linears_[size_t(l)];
    NB_TRY(lin[3].backward(dx, a.a, weight(l, 3, w.wdown, w.mdown), A.da, 0.f, w.gdown, st));
    NB_TRY(adapt_backward(l, 3, dx, a.a, A.da));
    NB_PROFILE_END("bwd: down GEMMs");
    NB_PROFILE_BEGIN("bwd: swiglu");
    ops::swiglu_backward(a.gu, A.da, A.dgu, st);
    NB_PROFILE_END("bwd: swiglu");
    NB_PROFILE_BEGIN("bwd: gate_up GEMMs");
    NB_TRY(lin[2].backward(A.dgu, a.n2, weight(l, 2, w.wgu, w.mgu), A.dn, 0.f, w.ggu, st));
    NB_TRY(adapt_backward(l, 2, A.dgu, a.n2, A.dn));
    NB_PROFILE_END("bwd: gate_up GEMMs");
    NB_PROFILE_BEGIN("bwd: norms + adds");
    ops::rmsnorm_backward(a.mid, w.w_post, a.rstd2, A.dn, A.dmid, w.g_post, st);
    ops::add_inplace(A.dmid, dx, st);
    NB_PROFILE_END("bwd: norms + adds");
    // Attention: mid = resid + attn(rope(n1 Wq^T), rope(n1 Wk^T), n1 Wv^T) Wo^T
    NB_PROFILE_BEGIN("bwd: o GEMMs");
    NB_TRY(lin[1].backward(A.dmid, a.o, weight(l, 1, w.wo, w.mo), A.dout, 0.f, w.go, st));
    NB_TRY(adapt_backward(l, 1, A.dmid, a.o, A.dout));
    NB_PROFILE_END("bwd: o GEMMs");
    NB_PROFILE_BEGIN("bwd: attention");
    NB_TRY(ops::attention_backward(
        ash, reshape4(a.q, B, S, c.heads, hd), reshape4(a.k, B, S, c.kv_heads, hd), reshape4(a.v, B, S, c.kv_heads, hd),
        reshape4(a.o, B, S, c.heads, hd), reshape4(A.dout, B, S, c.heads, hd), a.lse, reshape4(A.dq, B, S, c.heads, hd),
        reshape4(A.dk, B, S, c.kv_heads, hd), reshape4(A.dv, B, S, c.kv_heads, hd), st, segs));
    NB_PROFILE_END("bwd: attention");
    NB_PROFILE_BEGIN("bwd: rope + merge");
    const Tensor dqkv = A.dqkv.data ? A.dqkv : borrow(A.dgu, T, qkv_dim);  // dgu is dead after gate_up's backward
    ops::rope_merge_qkv_grad(reshape4(A.dq, B, S, c.heads, hd), reshape4(A.dk, B, S, c.kv_heads, hd),
                             reshape4(A.dv, B, S, c.kv_heads, hd), cosT, sinT, reshape4(dqkv, B, S, qkv_heads, hd), st,
                             pos);
    NB_PROFILE_END("bwd: rope + merge");
    NB_PROFILE_BEGIN("bwd: qkv GEMMs");
    NB_TRY(lin[0].backward(dqkv, a.n1, weight(l, 0, w.wqkv, w.mqkv), A.dn, 0.f, w.gqkv, st));
    NB_TRY(adapt_backward(l, 0, dqkv, a.n1, A.dn));
    NB_PROFILE_END("bwd: qkv GEMMs");
    NB_PROFILE_BEGIN("bwd: norms + adds");
    ops::rmsnorm_backward(A.resid[l], w.w_in, a.rstd1, A.dn, dx_next, w.g_in, st);
    ops::add_inplace(dx_next, A.dmid, st);
    NB_PROFILE_END("bwd: norms + adds");
    std::swap(dx, dx_next);
    if (hooks_) NB_TRY(grads_final(layer_param_names(l)));
  }
  if (!lora_enabled_) ops::embedding_backward(ids, dx, params_.grad("model.embed_tokens.weight"), st);
  if (hooks_) NB_TRY(grads_final({"model.embed_tokens.weight"}));
  micro_ += micro_stride_;
  arena_.release(mark);
  return Status::ok();
}

}  // namespace nb
