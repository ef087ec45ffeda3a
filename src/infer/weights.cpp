// Weight views for inference, the compute-only loader and the unmerged LoRA adapters (see weights.h).
#include "infer/weights.h"
#include <algorithm>
#include "ops/elementwise.h"

namespace nb::infer {
namespace {

// q, k and v (gate and up) are consecutive in every flat buffer (params.cpp): one view of the three.
Tensor fused(const Tensor& first, const Tensor& last, int64_t rows) {
  if (!first.data) return Tensor{};
  const uint8_t* end = static_cast<const uint8_t*>(last.data) + last.bytes();
  NB_CHECK(end == static_cast<const uint8_t*>(first.data) + dtype_bytes(first.dtype, rows * first.shape[1]),
           "internal: fused projection weights are not adjacent in the parameter store");
  return Tensor::make(first.data, first.dtype, first.device, {rows, first.shape[1]});
}

// The LayerWeights::lora slot of a target: the linear it adapts (qkv 0, o 1, gate_up 2, down 3).
int lora_slot(LoraTarget t) {
  switch (t) {
    case LoraTarget::linear_qkv: return 0;
    case LoraTarget::linear_proj: return 1;
    case LoraTarget::linear_fc1: return 2;
    default: return 3;
  }
}

// Module (layer, target) with views a and b, as LlamaModel builds its own (model/llama_lora.cpp).
void attach(ModelWeights* out, int64_t layer, LoraTarget t, const Tensor& a, const Tensor& b, double scale) {
  LoraModule& m = out->layers[size_t(layer)].lora[lora_slot(t)];
  m = LoraModule{};
  m.a = a;
  m.b = b;
  m.scale = float(scale);
  m.id = uint32_t(layer * 4 + lora_slot(t));
  out->lora_rank = std::max(out->lora_rank, a.shape[0]);
}

}  // namespace

Status weights_from_store(const ParamStore& P, const LlamaConfig& c, ModelWeights* out) {
  auto compute = [&](const std::string& n) { return P.has_compute(n) ? P.compute(n) : Tensor{}; };
  auto master = [&](const std::string& n) { return P.has_compute(n) || P.frozen() ? Tensor{} : P.master(n); };
  const int64_t qkv_rows = c.q_dim() + 2 * c.kv_dim();
  out->embed = P.compute("model.embed_tokens.weight");
  out->norm = P.compute("model.norm.weight");
  out->lm_head = c.tied_embeddings ? out->embed : P.compute("lm_head.weight");
  out->layers.assign(size_t(c.layers), LayerWeights{});
  for (int64_t l = 0; l < c.layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    const std::string q = p + "self_attn.q_proj.weight", v = p + "self_attn.v_proj.weight";
    const std::string o = p + "self_attn.o_proj.weight", gu = p + "mlp.gate_up_proj.weight",
                      down = p + "mlp.down_proj.weight";
    if (!P.has_compute(q) && P.frozen())
      return errorf("layer %lld's linear weights live only in quantized form here; sampling needs BF16 weights",
                    (long long)l);
    LayerWeights& w = out->layers[size_t(l)];
    w.w_in = P.compute(p + "input_layernorm.weight");
    w.w_post = P.compute(p + "post_attention_layernorm.weight");
    w.wqkv = fused(compute(q), compute(v), qkv_rows);
    w.mqkv = fused(master(q), master(v), qkv_rows);
    w.wo = compute(o);
    w.mo = master(o);
    w.wgu = compute(gu);
    w.mgu = master(gu);
    w.wdown = compute(down);
    w.mdown = master(down);
  }
  return Status::ok();
}

Status load_inference_store(const HfTensorSource& source, const LlamaConfig& c, Device dev, ParamStore* out) {
  NB_TRY(out->allocate_frozen(c, dev, 0, 0));
  const std::vector<HfTensor> tensors = hf_tensors(*out);
  int64_t most = 0;
  for (const HfTensor& t : tensors) most = std::max(most, t.numel);
  std::vector<float> host(static_cast<size_t>(most));
  Buffer stage;  // FP32 on the device, cast into the compute copy there (one RNE rounding, as training)
  if (dev == Device::cuda) NB_TRY(Buffer::allocate(&stage, DType::f32, dev, {most}));
  for (const HfTensor& t : tensors) {
    NB_TRY(source(t, host.data()));
    // The tensor's place in its parameter's compute copy (no master-only range: offsets are flat offsets).
    const ParamInfo* p = nullptr;
    for (const ParamInfo& q : out->params())
      if (t.flat_offset >= q.offset && t.flat_offset < q.offset + q.numel) p = &q;
    NB_CHECK(p != nullptr, "internal: %s has no parameter", t.name.c_str());
    const Tensor whole = out->compute(p->name);
    const Tensor dst =
        Tensor::make(static_cast<uint8_t*>(whole.data) + dtype_bytes(whole.dtype, t.flat_offset - p->offset),
                     whole.dtype, dev, {t.numel});
    if (dev == Device::cpu) {
      std::copy(host.begin(), host.begin() + t.numel, dst.ptr<float>());
      continue;
    }
    NB_TRY(copy_bytes(stage.data(), dev, host.data(), Device::cpu, size_t(t.numel) * 4));
    ops::cast(Tensor::make(stage.data(), DType::f32, dev, {t.numel}), dst, nullptr);
  }
  if (dev == Device::cuda) device_synchronize();  // the staging buffer is freed on return
  return Status::ok();
}

Status lora_weights_from_store(const ParamStore& adapters, const LlamaConfig& c, const LoraSpec& s, ModelWeights* out) {
  NB_CHECK(int64_t(out->layers.size()) == c.layers, "internal: attach the base weights before the adapters");
  for (int64_t l = 0; l < c.layers; ++l)
    for (LoraTarget t : s.targets) {
      const std::string a = lora_param_name(l, t, true), b = lora_param_name(l, t, false);
      if (!adapters.has_compute(a) || !adapters.has_compute(b))
        return errorf("the adapter store has no compute copy of %s", a.c_str());
      attach(out, l, t, adapters.compute(a), adapters.compute(b), s.scale());
    }
  return Status::ok();
}

Status load_inference_adapter(const LoraAdapter& ad, const LlamaConfig& c, Device dev, Buffer* storage,
                              ModelWeights* out) {
  NB_TRY(check_lora_adapter(ad, c));
  NB_CHECK(int64_t(out->layers.size()) == c.layers, "internal: attach the base weights before the adapters");
  std::vector<float> host;  // every linear's A then B, in the adapter's order
  for (const LoraLinear& L : ad.linears) {
    host.insert(host.end(), L.a.begin(), L.a.end());
    host.insert(host.end(), L.b.begin(), L.b.end());
  }
  const int64_t n = int64_t(host.size());
  const DType dt = dev == Device::cuda ? DType::bf16 : DType::f32;
  NB_TRY(Buffer::allocate(storage, dt, dev, {n}));
  if (dev == Device::cpu) {
    std::copy(host.begin(), host.end(), storage->ptr<float>());
  } else {
    Buffer stage;  // FP32 on the device, rounded there by the same cast as a training store's compute copies
    NB_TRY(Buffer::allocate(&stage, DType::f32, dev, {n}));
    NB_TRY(copy_bytes(stage.data(), dev, host.data(), Device::cpu, size_t(n) * 4));
    ops::cast(stage.tensor(), storage->tensor(), nullptr);
    device_synchronize();  // the staging buffer is freed on return
  }
  const int64_t r = ad.spec.rank;
  int64_t at = 0;
  auto next = [&](int64_t rows, int64_t cols) {
    const Tensor t = Tensor::make(static_cast<uint8_t*>(storage->data()) + dtype_bytes(dt, at), dt, dev, {rows, cols});
    at += rows * cols;
    return t;
  };
  for (const LoraLinear& L : ad.linears) {
    const Tensor a = next(r, L.in), b = next(L.out, r);
    attach(out, L.layer, L.target, a, b, ad.spec.scale());
  }
  return Status::ok();
}

}  // namespace nb::infer
