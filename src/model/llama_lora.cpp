// LlamaModel's LoRA parts: the adapter modules' views into the adapter store, the frozen base streamed
// into place one parameter at a time (a 70B base never exists in FP32, on the host or the GPU; under
// Megatron-FSDP only this rank's rows of it reach the GPU), and the memory the frozen base and the adapters take.
#include <algorithm>
#include <thread>
#include "model/llama_model.h"
#include "ops/elementwise.h"

namespace nb {

namespace {
// Linear index (qkv 0, o 1, gate_up 2, down 3) of a LoRA target.
int linear_index(LoraTarget t) {
  switch (t) {
    case LoraTarget::linear_qkv: return 0;
    case LoraTarget::linear_proj: return 1;
    case LoraTarget::linear_fc1: return 2;
    default: return 3;
  }
}
bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}
// What a frozen Linear keeps per weight element (recipe/linear.h, frozen mode): a 2D NVFP4 weight one
// copy (E2M1 + an E4M3 scale per 16), a per-tensor FP8 weight one byte (its transpose is transient); any
// other format both copies (1-byte data, or E2M1, plus at most one scale byte per 16 elements).
double frozen_weight_bytes_per_element(const recipe::RoleSpec& w) {
  const double nvfp4 = 0.5 + 1.0 / 16;
  if (w.fmt == recipe::Fmt::nvfp4) return w.two_d ? nvfp4 : 2 * nvfp4;
  if (w.fmt == recipe::Fmt::fp8_e4m3 || w.fmt == recipe::Fmt::fp8_e5m2) return 1.0;
  return 2 * (1.0 + 1.0 / 16);
}
}  // namespace

void LlamaModel::set_lora(const LoraSpec& spec, const HfCheckpointReader* base) {
  lora_enabled_ = true;
  lora_spec_ = spec;
  lora_base_ = base;
}

void LlamaModel::build_lora_modules() {
  lora_modules_.assign(size_t(cfg_.layers * 4), LoraModule{});
  for (int64_t l = 0; l < cfg_.layers; ++l)
    for (LoraTarget t : lora_spec_.targets) {
      if (!holds_layer(l)) break;  // another pipeline stage's
      LoraModule& m = lora_modules_[size_t(l * 4 + linear_index(t))];
      const std::string a = lora_param_name(l, t, true), b = lora_param_name(l, t, false);
      m.a = params_.compute(a);
      m.b = params_.compute(b);
      m.ga = params_.grad(a);
      m.gb = params_.grad(b);
      m.scale = float(lora_spec_.scale());
      m.dropout = float(lora_spec_.dropout);
      m.id = uint32_t(l * 4 + linear_index(t));
      if (tp_size() > 1 && tp::split_of(a) == tp::Split::cols) {  // row-parallel: this rank's input columns
        m.in_first = int64_t(tp_shard().rank) * m.a.shape[1];
        m.in_whole = m.a.shape[1] * tp_size();
      }
    }
}

// Parameter p of the base (number `index` of the full model's list): its HF tensors from the reader (the
// slices model/hf_layout.h gives it: gate_up is gate_proj then up_proj), or the seeded initial values of a
// fresh model.
Status LlamaModel::base_values(const std::vector<HfTensor>& hf, const ParamInfo& p, uint32_t index, uint64_t seed,
                               float* dst) const {
  if (!lora_base_) {
    initial_values(p, index, seed, dst, std::max(1u, std::min(16u, std::thread::hardware_concurrency())));
    return Status::ok();
  }
  for (const HfTensor& t : hf)
    if (t.flat_offset >= p.offset && t.flat_offset < p.offset + p.numel)
      NB_TRY(lora_base_->read_f32(t.name, dst + (t.flat_offset - p.offset)));
  return Status::ok();
}

// Quantizes the fused weight w ([out, in], FP32) of the linear whose last HF part is `weight_name` into
// its frozen Linear (BF16 on CUDA through the staging buffer, as the trained path quantizes from BF16).
Status LlamaModel::freeze_linear(const std::string& weight_name, const Tensor& w) {
  const size_t dot = weight_name.find('.', 13);  // "model.layers." is 13 characters
  const int64_t layer = std::stoll(weight_name.substr(13, dot - 13));
  const int i = ends_with(weight_name, "v_proj.weight")         ? 0
                : ends_with(weight_name, "o_proj.weight")       ? 1
                : ends_with(weight_name, "gate_up_proj.weight") ? 2
                                                                : 3;
  Tensor src = w;
  if (dev_ == Device::cuda) {
    src = Tensor::make(weight_stage_.data(), DType::bf16, dev_, {w.shape[0], w.shape[1]});
    ops::cast(w, src, nullptr);
  }
  recipe::Linear& lin = linears_[size_t(layer)][size_t(i)];
  return (lin.sharded_weight() ? freeze_sharded(lin, src) : lin.freeze_weight(src, nullptr))
      .context("loading the frozen base");
}

// Every rank reads the whole weight (one at a time), so each takes the whole weight's amax itself: the max
// of every chunk's, as the training-format gathers reduce it over the ranks. Its own chunk, quantized with
// it, holds the bytes of that row range of the whole weight's copies (recipe/linear_sharded.cpp).
Status LlamaModel::freeze_sharded(recipe::Linear& lin, const Tensor& w) {
  const int ranks = base_.shard_count();
  const int64_t rows = w.shape[0] / ranks, cols = w.shape[1];
  auto chunk = [&](int r) {
    return Tensor::make(static_cast<uint8_t*>(w.data) + dtype_bytes(w.dtype, r * rows * cols), w.dtype, dev_,
                        {rows, cols});
  };
  Buffer amax;
  NB_TRY(Buffer::allocate(&amax, DType::f32, dev_, {1}));
  float most = 0.f;
  for (int r = 0; r < ranks; ++r) {
    float a = 0.f;
    NB_TRY(lin.weight_chunk_amax(chunk(r), amax.ptr<float>(), nullptr));
    NB_TRY(copy_bytes(&a, Device::cpu, amax.data(), dev_, sizeof(float)));
    most = std::max(most, a);
  }
  NB_TRY(copy_bytes(amax.data(), dev_, &most, Device::cpu, sizeof(float)));
  if (tp_size() > 1 && tp_amax_group)  // the other ranks' slices of the weight too
    NB_TRY(tp_amax_group->max(amax.ptr<float>(), 1, nullptr));
  NB_TRY(lin.freeze_weight_chunk(chunk(base_.shard_rank()), amax.ptr<float>(), nullptr));
  if (dev_ == Device::cuda) device_synchronize();  // `amax` is freed on return
  return Status::ok();
}

// The rows of p that fall in this rank's chunk of its group (q, k and v share one), cast into the shard;
// the chunk's padding rows stay as allocate_frozen_fsdp zeroed them.
Status LlamaModel::shard_base_rows(const ParamInfo& p, const float* host, float* stage) {
  const ParamStore::Group& g = base_.groups()[size_t(base_.group_index(p.name))];
  const int64_t first = (p.offset - g.begin) / g.cols, count = p.numel / g.cols;  // p's rows in its group
  const int64_t mine = base_.shard_rank() * g.rows_per_rank;
  const int64_t b = std::max(first, mine), e = std::min(first + count, mine + g.rows_per_rank);
  if (e <= b) return Status::ok();
  const int64_t n = (e - b) * g.cols, at = g.local + (b - mine) * g.cols;
  NB_TRY(copy_bytes(stage, dev_, host + (b - first) * g.cols, Device::cpu, size_t(n) * 4));
  ops::cast(Tensor::make(stage, DType::f32, dev_, {n}), base_.range(base_.padded_compute(), at, at + n), nullptr);
  return Status::ok();
}

// One parameter at a time: host FP32 values -> device FP32 staging -> the compute copy (cast), or for a
// quantized layer's linear weight, gathered into its fused [out, in] weight (q, k, v are consecutive) and
// quantized into the Linear. A sharded base (optim_grads_params) takes only this rank's rows into the device:
// a weight kept in BF16 its rows of the shard; a quantized one is staged whole (zero rows padding it to the
// ranks' chunks) for its amax, and only this rank's chunk is kept, quantized.
// Under tensor parallelism every parameter's whole values are read (or drawn) and this rank's part kept; a
// quantized weight's amax is then the group's MAX (its Linear's weight amax group), as one GPU's.
Status LlamaModel::load_base(uint64_t seed) {
  if (lora_base_)
    NB_TRY(
        check_hf_tensors(*lora_base_, hf_expected_tensors(whole_cfg_), cfg_.tied_embeddings).context("the LoRA base"));
  const bool sharded = base_.fsdp(), split = tp_size() > 1;
  int64_t whole_total = 0;
  // Per parameter of the base: the whole model's (its HF tensors' offsets) and its number there (its Philox stream).
  std::vector<ParamInfo> whole = split ? ParamStore::flat_layout(whole_cfg_, &whole_total) : base_.params();
  std::vector<uint32_t> index(whole.size());
  for (size_t i = 0; i < index.size(); ++i) index[i] = uint32_t(i);
  std::vector<HfTensor> hf = hf_tensors(whole);
  if (pipeline) {  // this stage's parameters of the whole model's list
    const std::vector<ParamInfo> all = base_.whole_layout(&whole_total);
    hf = hf_tensors(all);
    whole.clear();
    index.clear();
    for (const ParamInfo& p : base_.params())
      for (size_t i = 0; i < all.size(); ++i)
        if (all[i].name == p.name) {
          whole.push_back(all[i]);
          index.push_back(uint32_t(i));
        }
  }
  int64_t whole_most = 0;
  for (const ParamInfo& p : whole) whole_most = std::max(whole_most, p.numel);
  std::vector<float> whole_host(split ? size_t(whole_most) : 0);
  int64_t most = 0, most_device = 0;
  for (const ParamInfo& p : base_.params()) most = std::max(most, p.numel);
  const int64_t fused_most = cfg_.hidden * (cfg_.q_dim() + 2 * cfg_.kv_dim());
  most = std::max(most, fused_most);
  if (sharded)
    for (const ParamStore::Group& g : base_.groups())
      most_device = std::max(most_device, g.chunk() * (g.stored ? 1 : base_.shard_count()));
  std::vector<float> host(static_cast<size_t>(most));
  Buffer stage;
  NB_TRY(Buffer::allocate(&stage, DType::f32, dev_, {sharded ? most_device : most}));
  int64_t fused_rows = 0;
  const auto& list = base_.params();
  NB_CHECK(whole.size() == list.size(), "internal: the base lists %zu of the model's %zu parameters", list.size(),
           whole.size());
  for (size_t i = 0; i < list.size(); ++i) {
    const ParamInfo& p = list[i];
    const bool stored = base_.has_compute(p.name);
    float* dst = stage.ptr<float>() + (stored ? 0 : fused_rows * p.shape[1]);
    NB_TRY(base_values(hf, whole[i], index[i], seed, split ? whole_host.data() : host.data()));
    if (split) tp::slice(whole[i], p, tp_shard(), whole_host.data(), host.data(), &whole_cfg_);
    if (stored && sharded) {
      NB_TRY(shard_base_rows(p, host.data(), stage.ptr<float>()));
      continue;
    }
    NB_TRY(copy_bytes(dst, dev_, host.data(), Device::cpu, size_t(p.numel) * 4));
    const Tensor flat = Tensor::make(dst, DType::f32, dev_, {p.numel});
    if (stored) {
      const Tensor c = base_.compute(p.name);
      ops::cast(flat, Tensor::make(c.data, c.dtype, c.device, {p.numel}), nullptr);
      continue;
    }
    fused_rows += p.shape[0];
    if (ends_with(p.name, "q_proj.weight") || ends_with(p.name, "k_proj.weight")) continue;
    int64_t rows = fused_rows;
    if (sharded) {  // the whole weight, padded with zero rows to the ranks' chunks
      const ParamStore::Group& g = base_.groups()[size_t(base_.group_index(p.name))];
      rows = g.rows_per_rank * base_.shard_count();
      ops::fill(base_.range(stage.tensor(), fused_rows * p.shape[1], rows * p.shape[1]), 0.0f, nullptr);
    }
    NB_TRY(freeze_linear(p.name, Tensor::make(stage.data(), DType::f32, dev_, {rows, p.shape[1]})));
    fused_rows = 0;
  }
  if (dev_ == Device::cuda) device_synchronize();  // the staging buffer is freed on return
  return Status::ok();
}

int64_t LlamaModel::lora_parameter_bytes(const LlamaConfig& cfg, Device dev, const recipe::Recipe& recipe,
                                         const LoraSpec& lora, int base_shards, bool embeddings_per_step,
                                         bool quantized_linears) {
  const int64_t compute_bytes = dev == Device::cuda ? 2 : 4;
  double linear = 0;  // bytes of the layers' linear weights
  const double quantized = quantized_linears || base_shards > 1 ? frozen_weight_bytes_per_element(recipe.weight) : 0;
  bool bf16_layer = false, quantized_layer = false;
  for (int64_t l = 0; l < cfg.layers; ++l) {
    const bool q = recipe.quantized() && !recipe.layer_in_bf16(l, cfg.layers);
    linear += double(cfg.linear_params_per_layer()) * (q ? quantized : double(compute_bytes));
    quantized_layer = quantized_layer || q;
    bf16_layer = bf16_layer || !q;
  }
  const int64_t rest = cfg.total_params() - cfg.layers * cfg.linear_params_per_layer();
  const int64_t adapters = lora_param_count(cfg, lora) * (16 + compute_bytes);
  const double base = linear + double(rest * compute_bytes);
  if (base_shards <= 1) return int64_t(base) + adapters;
  // Megatron-FSDP's windows of the base as its pools hold them (distributed/fsdp.h): BF16 one large window (the
  // embedding or an untied LM head) and two layer windows (a quantized layer's holds only its norms); the
  // quantized weights' gathered copies in four layer windows and one layer of staging.
  const int64_t layer = 2 * cfg.hidden + (bf16_layer ? cfg.linear_params_per_layer() : 0);
  const double gathered = quantized_layer ? 5.0 * quantized * double(cfg.linear_params_per_layer()) : 0.0;
  const int64_t windows = fsdp_window_elems(cfg, layer, embeddings_per_step);
  return int64_t(base / base_shards + double(windows * compute_bytes) + gathered) + adapters;
}

// The adapters' store as ParamStore::allocate lays it out (each parameter padded to kAlign elements, each
// buffer a 256-byte multiple: FP32 master, m, v and gradient, the compute copy) and the frozen norms'
// gradient sink.
int64_t LlamaModel::lora_store_bytes(const LlamaConfig& cfg, Device dev, const LoraSpec& lora) {
  int64_t total = 0;
  for (const ParamInfo& p : lora_param_list(cfg, lora)) {
    int64_t n = 1;
    for (int64_t d : p.shape) n *= d;
    total += (n + ParamStore::kAlign - 1) / ParamStore::kAlign * ParamStore::kAlign;
  }
  auto buffer = [](int64_t bytes) { return (std::max<int64_t>(bytes, 1) + 255) / 256 * 256; };
  const int64_t n = std::max<int64_t>(total, 1);
  return 4 * buffer(n * 4) + buffer(n * (dev == Device::cuda ? 2 : 4)) + buffer(cfg.hidden * 4);
}

}  // namespace nb
