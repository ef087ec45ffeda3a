// LoRA adapters as model parameters and their GEMMs (model/lora.h).
#include "model/lora.h"
#include <cmath>
#include "gemm/gemm.h"
#include "ops/dropout.h"
#include "ops/elementwise.h"

namespace nb {

namespace {
const char* module_path(LoraTarget t) {
  switch (t) {
    case LoraTarget::linear_qkv: return "self_attn.linear_qkv";
    case LoraTarget::linear_proj: return "self_attn.linear_proj";
    case LoraTarget::linear_fc1: return "mlp.linear_fc1";
    default: return "mlp.linear_fc2";
  }
}
}  // namespace

std::string lora_param_name(int64_t layer, LoraTarget t, bool a) {
  return "model.layers." + std::to_string(layer) + "." + module_path(t) + (a ? ".lora_A.weight" : ".lora_B.weight");
}

std::vector<ParamInfo> lora_param_list(const LlamaConfig& c, const LoraSpec& s) {
  std::vector<ParamInfo> out;
  for (int64_t l = 0; l < c.layers; ++l)
    for (LoraTarget t : s.targets) {
      int64_t in = 0, o = 0;
      lora_target_shape(c, t, &in, &o);
      ParamInfo a{lora_param_name(l, t, true), {s.rank, in}, 0, 0, true, float(1.0 / std::sqrt(3.0 * double(in)))};
      ParamInfo b{lora_param_name(l, t, false), {o, s.rank}, 0, 0, true, 0.f};
      b.init_value = 0.f;
      out.push_back(a);
      out.push_back(b);
    }
  return out;
}

int64_t lora_param_count(const LlamaConfig& c, const LoraSpec& s) {
  int64_t n = 0;
  for (LoraTarget t : s.targets) {
    int64_t in = 0, o = 0;
    lora_target_shape(c, t, &in, &o);
    n += s.rank * (in + o);
  }
  return n * c.layers;
}

RngKey lora_dropout_key(uint64_t seed, uint32_t step, uint32_t micro, const LoraModule& m) {
  // Stream bit 31 set: apart from the quantizers' stochastic-rounding streams (tensor_id << 8 < 2^31).
  return RngKey{seed, step, 0x80000000u | (m.id << 8) | (micro % 256u)};
}

namespace {
Tensor first_rows(const Tensor& t, int64_t rows, int64_t cols) {
  return Tensor::make(t.data, t.dtype, t.device, {rows, cols});
}
ops::DropoutColumns input_columns(const LoraModule& m) { return {m.in_whole, m.in_first}; }
// d(x): x itself, or the dropped copy in scratch.
Tensor dropped_input(const LoraModule& m, const Tensor& x, const LoraScratch& s, RngKey key, Stream stream) {
  if (m.dropout <= 0.f) return x;
  const Tensor xd = first_rows(s.xd, x.shape[0], x.shape[1]);
  ops::dropout_forward(x, xd, m.dropout, key, stream, input_columns(m));
  return xd;
}
}  // namespace

Status lora_forward(const LoraModule& m, const Tensor& x, const LoraScratch& s, const Tensor& y, RngKey key,
                    Stream stream) {
  const int64_t T = x.shape[0], r = m.a.shape[0];
  const Tensor h = first_rows(s.h, T, r);
  NB_TRY(gemm::matmul(dropped_input(m, x, s, key, stream), m.a, h, {.trans_b = true}, stream));
  return gemm::matmul(h, m.b, y, {.trans_b = true, .alpha = m.scale, .beta = 1.f}, stream);
}

// dx first, so that a tensor-parallel sum of it can run beside the weight gradients' GEMMs.
Status lora_backward(const LoraModule& m, const Tensor& dy, const Tensor& x, const LoraScratch& s, const Tensor& dx,
                     RngKey key, Stream stream, const std::function<Status()>& after_dx) {
  const int64_t T = x.shape[0], r = m.a.shape[0];
  const Tensor h = first_rows(s.h, T, r), dh = first_rows(s.dh, T, r);
  const Tensor xd = dropped_input(m, x, s, key, stream);
  NB_TRY(gemm::matmul(xd, m.a, h, {.trans_b = true}, stream));    // h = d(x) A^T
  NB_TRY(gemm::matmul(dy, m.b, dh, {.alpha = m.scale}, stream));  // dh = s dy B
  if (m.dropout <= 0.f) {
    NB_TRY(gemm::matmul(dh, m.a, dx, {.beta = 1.f}, stream));  // dx += dh A
  } else {
    const Tensor dxd = first_rows(s.dxd, T, x.shape[1]);
    NB_TRY(gemm::matmul(dh, m.a, dxd, {}, stream));
    ops::dropout_backward(dxd, dxd, m.dropout, key, stream, input_columns(m));
    ops::add_inplace(dx, dxd, stream);
  }
  if (after_dx) NB_TRY(after_dx());
  NB_TRY(gemm::matmul(dy, h, m.gb, {.trans_a = true, .alpha = m.scale, .beta = 1.f}, stream));  // gB += s dy^T h
  return gemm::matmul(dh, xd, m.ga, {.trans_a = true, .beta = 1.f}, stream);                    // gA += dh^T d(x)
}

Status lora_adapter_from_store(const ParamStore& P, const LlamaConfig& c, const LoraSpec& s, LoraAdapter* out) {
  std::vector<float> host(size_t(P.total()));
  NB_TRY(P.get_state(optim::StateArray::master, host.data()));
  lora_adapter_from_values(host.data(), P.params(), c, s, out);
  return Status::ok();
}

void lora_adapter_from_values(const float* values, const std::vector<ParamInfo>& params, const LlamaConfig& c,
                              const LoraSpec& s, LoraAdapter* out) {
  lora_allocate(c, s, out);
  auto find = [&](const std::string& name) -> const ParamInfo& {
    for (const ParamInfo& p : params)
      if (p.name == name) return p;
    NB_CHECK(false, "internal: no LoRA parameter %s", name.c_str());
    return params.front();
  };
  for (LoraLinear& L : out->linears) {
    const ParamInfo& a = find(lora_param_name(L.layer, L.target, true));
    const ParamInfo& b = find(lora_param_name(L.layer, L.target, false));
    L.a.assign(values + a.offset, values + a.offset + a.numel);
    L.b.assign(values + b.offset, values + b.offset + b.numel);
  }
}

Status lora_store_from_adapter(const LoraAdapter& ad, const LlamaConfig& c, ParamStore& P) {
  NB_TRY(check_lora_adapter(ad, c));
  std::vector<float> host(size_t(P.total()), 0.f);
  NB_TRY(P.get_state(optim::StateArray::master, host.data()));
  int64_t found = 0;
  for (const LoraLinear& L : ad.linears) {
    const std::string an = lora_param_name(L.layer, L.target, true), bn = lora_param_name(L.layer, L.target, false);
    bool has = false;
    for (const ParamInfo& p : P.params()) has = has || p.name == an;
    if (!has)
      return errorf("the adapter adapts %s of layer %lld, which this run does not train (check --lora-target)",
                    lora_target_name(L.target), (long long)L.layer);
    const ParamInfo &a = P.info(an), &b = P.info(bn);
    if (a.numel != int64_t(L.a.size()) || b.numel != int64_t(L.b.size()))
      return errorf("the adapter's rank differs from --lora-rank (%s of layer %lld)", lora_target_name(L.target),
                    (long long)L.layer);
    std::copy(L.a.begin(), L.a.end(), host.begin() + a.offset);
    std::copy(L.b.begin(), L.b.end(), host.begin() + b.offset);
    found += 2;
  }
  if (found != int64_t(P.params().size()))
    return errorf("the adapter covers %lld of this run's %zu LoRA matrices (check --lora-target)", (long long)found,
                  P.params().size());
  return P.set_master(host.data());
}

}  // namespace nb
