// Activation plans of LlamaModel: which tensors one micro-batch keeps for its backward, under each recompute
// mode and precision recipe, laid out in the arena (or only counted, for the memory estimate).
#include <algorithm>
#include <vector>
#include "model/llama_internal.h"

namespace nb {
namespace llama {

std::vector<bool> quantized_layers(const LlamaConfig& c, const recipe::Recipe& r) {
  std::vector<bool> q(size_t(c.layers));
  for (int64_t l = 0; l < c.layers; ++l) q[size_t(l)] = r.quantized() && !r.layer_in_bf16(l, c.layers);
  return q;
}
std::vector<bool> scratch_input_layers(const LlamaConfig& c, const recipe::Recipe& r, const LoraSpec* lora) {
  return lora ? std::vector<bool>(size_t(c.layers), false) : quantized_layers(c, r);
}

namespace {
void plan_lora(LoraScratch* s, Planner& P, const LlamaConfig& c, int64_t T, DType dt, const LoraSpec& lora) {
  s->h = P(dt, {T, lora.rank});
  s->dh = P(dt, {T, lora.rank});
  if (lora.dropout > 0) {
    const int64_t in = std::max({c.hidden, c.q_dim(), c.ffn});
    s->xd = P(dt, {T, in});
    s->dxd = P(dt, {T, in});
  }
}
}  // namespace

void plan_acts(LlamaModel::Acts* a, Planner& P, const LlamaConfig& c, MicroBatchShape s, Recompute rc, DType dt,
               int64_t chunk, const std::vector<bool>& quantized, const LoraSpec* lora, int sp, bool head,
               Planner* scratch) {
  Planner& S = scratch ? *scratch : P;
  const int64_t T = s.tokens(), H = c.hidden, F = c.ffn, qd = c.q_dim(), kvd = c.kv_dim(), Ts = T / sp;
  a->resid.clear();
  for (int64_t l = 0; l <= c.layers; ++l) a->resid.push_back(P(dt, {Ts, H}));
  auto make_layer = [&](LlamaModel::Acts::PerLayer& p, bool keep_cheap, bool keep_rest, Planner& from) {
    // keep_cheap: norms' outputs and the SwiGLU product (recomputed by selective recompute)
    if (keep_cheap) {
      p.n1 = from(dt, {T, H});
      p.n2 = from(dt, {T, H});
      p.a = from(dt, {T, F});
    }
    if (keep_rest) {
      p.rstd1 = from(DType::f32, {Ts});
      p.rstd2 = from(DType::f32, {Ts});
      p.q = from(dt, {T, qd});
      p.k = from(dt, {T, kvd});
      p.v = from(dt, {T, kvd});
      p.o = from(dt, {T, qd});
      p.lse = from(DType::f32, {s.batch, c.heads, s.seq});
      p.mid = from(dt, {Ts, H});
      p.gu = from(dt, {T, 2 * F});
    }
  };
  a->layer.assign(size_t(c.layers), {});
  LlamaModel::Acts::PerLayer shared;  // written by each forward (or recompute), read by no later pass
  if (rc == Recompute::full) {
    make_layer(shared, true, true, S);
    for (auto& p : a->layer) p = shared;
  } else {
    bool any_shared = rc == Recompute::selective;
    for (bool q : quantized) any_shared = any_shared || q;
    if (any_shared) make_layer(shared, true, false, S);
    for (size_t l = 0; l < a->layer.size(); ++l) {
      auto& p = a->layer[l];
      const bool is_shared = rc == Recompute::selective || quantized[l];
      make_layer(p, !is_shared, true, P);
      if (is_shared) {
        p.n1 = shared.n1;
        p.n2 = shared.n2;
        p.a = shared.a;
      }
    }
  }
  if (head) {  // the head's backward runs inside its forward: only rstdf and d nf wait for the layers' backward
    a->nf = S(dt, {T, H});
    a->rstdf = P(DType::f32, {Ts});
    a->logits = S(dt, {chunk, c.vocab});
    a->losses = S(DType::f32, {T});
    a->dnf = P(dt, {T, H});
  }
  a->dx = S(dt, {Ts, H});
  a->dx2 = S(dt, {Ts, H});
  a->dmid = S(dt, {Ts, H});
  if (sp > 1) {
    a->sp_full = S(dt, {T, H});
    a->sp_local = S(dt, {Ts, H});
  }
  a->dn = S(dt, {T, H});
  a->da = S(dt, {T, F});
  a->dgu = S(dt, {T, 2 * F});
  a->dout = S(dt, {T, qd});
  a->dq = S(dt, {T, qd});
  a->dk = S(dt, {T, kvd});
  a->dv = S(dt, {T, kvd});
  if (lora) plan_lora(&a->lora, S, c, T, dt, *lora);
  // The fused QKV output lives only until rope_split_qkv, before the layer writes gu; its gradient only
  // after gate_up's backward has consumed dgu. Both borrow those buffers when they are large enough.
  if (2 * F < qd + 2 * kvd) {
    a->qkv = S(dt, {T, qd + 2 * kvd});
    a->dqkv = S(dt, {T, qd + 2 * kvd});
  }
}

// Rounded down to a multiple of 128 tokens so the LM-head GEMMs get whole tiles (4096 for V = 128256).
int64_t lm_chunk_tokens(const LlamaConfig& cfg, MicroBatchShape shape) {
  int64_t c = std::max<int64_t>(1, (int64_t(1) << 29) / cfg.vocab);
  if (c >= 128) c = c / 128 * 128;
  return std::min<int64_t>(shape.tokens(), c);
}

}  // namespace llama

int64_t LlamaModel::plan_activation_bytes(const LlamaConfig& cfg, Device dev, MicroBatchShape shape, Recompute rc,
                                          const recipe::Recipe& recipe, const LoraSpec* lora, int sequence_parallel) {
  llama::Planner plan;
  plan.dev = dev;
  Acts probe;
  llama::plan_acts(&probe, plan, cfg, shape, rc, dev == Device::cuda ? DType::bf16 : DType::f32,
                   llama::lm_chunk_tokens(cfg, shape), llama::scratch_input_layers(cfg, recipe, lora), lora,
                   sequence_parallel);
  return plan.bytes;
}

}  // namespace nb
