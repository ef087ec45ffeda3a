// LlamaModel: its parameters, Linears and arena, staged micro-batches, quantization health and scaling
// state. The pass over one micro-batch is llama_pass.cpp; the activation plan, llama_plan.cpp.
#include "model/llama_model.h"
#include "optim/adamw_stream.h"
#include <algorithm>
#include <array>
#include <optional>
#include <vector>
#include "core/bf16.h"
#include "core/memory_ledger.h"
#include "model/llama_internal.h"
#include "ops/attention.h"
#include "ops/elementwise.h"
#include "ops/rope.h"
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

std::vector<std::string> LlamaModel::layer_param_names(int64_t l) {
  const std::string p = "model.layers." + std::to_string(l) + ".";
  return {p + "input_layernorm.weight",  p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight",
          p + "self_attn.v_proj.weight", p + "self_attn.o_proj.weight", p + "post_attention_layernorm.weight",
          p + "mlp.gate_up_proj.weight", p + "mlp.down_proj.weight"};
}
// With LoRA the hooks hear of the frozen base only when it is sharded (they gather it, before each unit's
// forward and backward); its gradients never exist, so grads_final is never reported.
Status LlamaModel::weights_needed(const std::vector<std::string>& names) {
  return base_hooks() ? hooks_->weights_needed(names) : Status::ok();
}
Status LlamaModel::grads_final(const std::vector<std::string>& names) {
  return hooks_ && report_grads_final_ && !lora_enabled_ ? hooks_->grads_final(names) : Status::ok();
}
Status LlamaModel::grads_needed(const std::vector<std::string>& names) {
  return base_hooks() ? hooks_->grads_needed(names) : Status::ok();
}

// The first parameter of linear i's weight in layer l (the fused qkv's q_proj).
std::string LlamaModel::fsdp_weight_name(int64_t l, int i) {
  static const char* const kWeights[4] = {"self_attn.q_proj.weight", "self_attn.o_proj.weight",
                                          "mlp.gate_up_proj.weight", "mlp.down_proj.weight"};
  return "model.layers." + std::to_string(l) + "." + kWeights[i];
}

std::vector<std::pair<std::string, recipe::Linear*>> LlamaModel::quantized_linears() {
  std::vector<std::pair<std::string, recipe::Linear*>> out;
  for (size_t l = 0; l < linears_.size(); ++l)
    for (size_t i = 0; i < linears_[l].size(); ++i)
      if (linears_[l][i].keeps_quantized_input())  // i.e. not a BF16 layer
        out.emplace_back(fsdp_weight_name(int64_t(l), int(i)), &linears_[l][i]);
  return out;
}

void LlamaModel::begin_step(uint32_t step, uint32_t first_micro, uint32_t micro_stride) {
  step_ = step;
  micro_ = micro_first_ = first_micro;
  micro_stride_ = micro_stride;
  for (auto& layer : linears_)
    for (auto& lin : layer) lin.new_step(step, first_micro, micro_stride);
  std::fill(weight_staged_.begin(), weight_staged_.end(), char(0));
}

void LlamaModel::weights_changed() {
  for (auto& layer : linears_)
    for (auto& lin : layer) lin.weight_changed();
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

std::string LlamaModel::linear_name(int64_t layer, int index) {
  return "model.layers." + std::to_string(layer) + "." + kLinearNames[index];
}

Status LlamaModel::scaling_states(std::vector<LinearScaling>* out) const {
  out->clear();
  for (int64_t l = 0; l < cfg_.layers; ++l)
    for (int i = 0; i < 4 && !linears_[size_t(l)].empty(); ++i) {
      LinearScaling ls{linear_name(l, i), {}, l, i};
      NB_TRY(linears_[size_t(l)][size_t(i)].scaling_state(&ls.roles));
      if (!ls.roles.empty()) out->push_back(std::move(ls));
    }
  return Status::ok();
}

// `all` is the whole model's list (a checkpoint's); a pipeline stage takes the entries of the layers it holds.
Status LlamaModel::set_scaling_states(const std::vector<LinearScaling>& all) {
  std::vector<LinearScaling> in;
  for (const LinearScaling& ls : all)
    if (holds_param(ls.linear)) in.push_back(ls);  // every entry without pipeline parallelism
  std::vector<LinearScaling> mine;
  NB_TRY(scaling_states(&mine));
  if (in.size() != mine.size())
    return errorf("the checkpoint has FP8 delayed-scaling state for %zu linear layers, this model and recipe %zu",
                  in.size(), mine.size());
  size_t k = 0;
  for (int64_t l = 0; l < cfg_.layers; ++l)
    for (int i = 0; i < 4; ++i) {
      if (k >= in.size() || in[k].linear != linear_name(l, i)) continue;
      NB_TRY(linears_[size_t(l)][size_t(i)].set_scaling_state(in[k].roles));
      ++k;
    }
  if (k != in.size())
    return errorf("the checkpoint's delayed-scaling state names linear '%s', which this model lacks",
                  in[k].linear.c_str());
  return Status::ok();
}

// The pools' steady state (distributed/fsdp.h): gradients one large window (the head's, then the
// embedding's) and two layer windows (one reduced while the next unit's backward writes the other); weights
// one large window and two layer windows (the unit in use and the prefetched one). With the embedding and an
// untied head held through the step, both large units keep a window of each kind.
int64_t LlamaModel::fsdp_window_bytes(const LlamaConfig& cfg, Device dev, bool weights_sharded,
                                      bool embeddings_per_step) {
  const int64_t windows = fsdp_window_elems(cfg, cfg.linear_params_per_layer() + 2 * cfg.hidden, embeddings_per_step);
  return windows * 4 + (weights_sharded ? windows * (dev == Device::cuda ? 2 : 4) : 0);
}

// With --optimizer-cpu-offload: the device part of a shard's master, m and v, and the streaming windows.
int64_t LlamaModel::offloaded_state_device_bytes(int64_t shard, const optim::Placement& placement) {
  const int64_t resident = shard - optim::OptimizerState::offloaded_elems(shard, placement);
  const int64_t chunk = optim::OptimizerState::chunk_for(shard, placement);
  return resident * 12 + int64_t(optim::AdamWStreamer::staging_bytes(chunk));
}

int64_t LlamaModel::parameter_bytes(const LlamaConfig& cfg, Device dev, const recipe::Recipe& recipe, int shards,
                                    const optim::Placement& placement, Fsdp fsdp, bool embeddings_per_step) {
  const int64_t compute_bytes = dev == Device::cuda ? 2 : 4;
  if (fsdp != Fsdp::off && shards > 1) {  // per rank: 12 + 4 (+ compute) bytes over d, and the windows
    const bool weights = fsdp == Fsdp::optim_grads_params;
    const int64_t n = cfg.total_params(), shard = optimizer_shard_elems(cfg, shards);
    const int64_t common =
        shard * 4 + (weights ? shard : n) * compute_bytes + fsdp_window_bytes(cfg, dev, weights, embeddings_per_step);
    if (!(placement.offload_fraction > 0)) return common + shard * 12;
    return common + offloaded_state_device_bytes(shard, placement);
  }
  if (shards > 1 || placement.offload_fraction > 0) {  // every weight has a compute copy
    const int64_t weights = cfg.total_params() * (4 + compute_bytes);
    if (!(placement.offload_fraction > 0)) return weights + cfg.total_params() * 12 / shards;
    return weights + offloaded_state_device_bytes(optimizer_shard_elems(cfg, shards), placement);
  }
  // Quantized layers' linear weights have no compute copy (params.h).
  int64_t master_only = 0;
  for (bool q : llama::quantized_layers(cfg, recipe)) master_only += q ? cfg.linear_params_per_layer() : 0;
  return cfg.total_params() * 16 + (cfg.total_params() - master_only) * (dev == Device::cuda ? 2 : 4);
}

// The transformer Linears as build_linears makes them and the memory estimate sizes them
// (llama_memory.cpp): one list, so the two cannot drift apart.
std::vector<LlamaModel::LinearSpec> LlamaModel::linear_specs(const LlamaConfig& cfg, const recipe::Recipe& recipe,
                                                             Recompute rc) {
  const int64_t dims[4][2] = {{cfg.hidden, cfg.q_dim() + 2 * cfg.kv_dim()},
                              {cfg.q_dim(), cfg.hidden},
                              {cfg.hidden, 2 * cfg.ffn},
                              {cfg.ffn, cfg.hidden}};
  std::vector<LinearSpec> out;
  for (int64_t l = 0; l < cfg.layers; ++l)
    for (int i = 0; i < 4; ++i)
      out.push_back(
          {l, i, recipe.layer_in_bf16(l, cfg.layers), dims[i][0], dims[i][1], rc == Recompute::full ? i : -1});
  return out;
}

Status LlamaModel::build_linears() {
  MemoryScope scope(MemPart::quantized_copies);
  linears_.clear();
  linears_.resize(size_t(cfg_.layers));
  // The linears run one at a time on one stream: their transient copies (the input's row-wise copy in
  // forward, both grad copies in backward; with full recompute the input's column-wise copy too, one slot per
  // linear of a layer, since each layer's forward runs again right before its backward) share one workspace.
  linear_workspace_ = std::make_shared<recipe::LinearWorkspace>(dev_);
  for (const LinearSpec& sp : linear_specs(cfg_, recipe_, recompute_)) {
    const int64_t l = sp.layer;
    const int i = sp.index;
    if (!holds_layer(l)) continue;  // another pipeline stage's
    linears_[size_t(l)].resize(4);
    std::string name = "model.layers." + std::to_string(l) + "." + kLinearNames[i];
    recipe::Linear& lin = linears_[size_t(l)][size_t(i)];
    NB_TRY(lin.init(recipe_, sp.bf16_layer, name, uint32_t(l * 8 + i), shape_.tokens(), sp.in, sp.out, dev_,
                    linear_workspace_, /*frozen=*/lora_enabled_, sp.input_col_slot));
    // Pipeline parallelism: the micro-batches between their forward and their backward each keep their own
    // quantized inputs (the passes pick theirs: use_input_slot).
    if (const int64_t n =
            pipeline ? pipeline_input_slots(recipe_, recompute_, lora_enabled_, stage_slots_for_layer(l)) : 1;
        n > 1)
      NB_TRY(lin.set_input_slots(int(n)));
    // Context and tensor parallelism: activations, gradients and weights scaled as one GPU's. Column-parallel
    // (qkv, gate_up): the input is whole on every tensor-parallel rank, the gradient sharded; row-parallel (o,
    // down) the other way round.
    // Sequence parallelism spreads the column-parallel inputs and the row-parallel output gradients by tokens:
    // quantized, they are gathered as bytes (recipe::Linear::set_input_gather, set_grad_gather), each rank's
    // tokens scaled by the group's amax.
    const bool column = i == 0 || i == 2;
    if (tp_size() > 1) {
      lin.set_amax_groups(column && !sequence_parallel ? cp_amax_group : tp_cp_amax_group, tp_amax_group,
                          column || sequence_parallel ? tp_cp_amax_group : cp_amax_group);
      if (column) {  // NVFP4's SR draws the gradient's bits at the whole layer's columns
        int64_t whole_cols = 0;
        const auto segments = tp::fused_output_columns(whole_cfg_, tp_shard(), i, &whole_cols);
        lin.set_grad_columns(whole_cols, segments);
      }
    } else
      lin.set_amax_group(cp_amax_group);
    // Context parallelism: the gradient's SR bits at each token's row of the whole sequences, where the chunks
    // are whole NVFP4 blocks (else the rank's own rows, as the trainer's warning about such chunks says). Packed
    // rows cut each sequence, not the row, into chunks: their bits are the map's, not yet one GPU's.
    const int64_t chunk = shape_.seq / 2;
    if (cp_size() > 1 && chunk % 16 == 0)
      lin.set_grad_cp_rows(chunk, shape_.seq * cp_size(), cp_link->rank(), 2 * cp_size() - 1 - cp_link->rank());
    // Training-format gathers (and a sharded frozen LoRA base's quantized weights): a quantized weight sharded
    // as its group's rows (distributed/fsdp.h) right after its Linear is made, so no two Linears' whole weight
    // copies ever coexist on a rank.
    const ParamStore& W = base();
    if ((fsdp_training_format_gathers || lora_enabled_) && W.compute_sharded() && lin.keeps_quantized_input())
      NB_TRY(lin.set_sharded_weight(W.groups()[size_t(W.group_index(fsdp_weight_name(l, i)))].rows_per_rank,
                                    W.shard_count()));
  }
  if (sequence_parallel && tp_size() > 1)
    for (auto& layer : linears_) {
      if (layer.empty()) continue;  // another pipeline stage's layer
      for (int i : {0, 2}) layer[size_t(i)].set_input_gather(tp_byte_group());
      for (int i : {1, 3}) layer[size_t(i)].set_grad_gather(tp_byte_group());
    }
  NB_TRY(init_mor_board());
  MemoryScope ws_scope(MemPart::linear_workspace);
  return linear_workspace_->allocate();
}

Status LlamaModel::init(const LlamaConfig& cfg, Device dev, MicroBatchShape shape, Recompute rc, uint64_t seed,
                        const recipe::Recipe& recipe) {
  NB_TRY(validate(cfg));
  whole_cfg_ = cfg;
  cfg_ = tp::local_config(cfg, tp_size());  // from here on, the shape this rank holds
  params_.set_tensor_parallel(whole_cfg_, tp_shard());
  if (pipeline) {  // the stage's parameters of the whole model's (with LoRA: the frozen base's and the adapters')
    const auto held = [this](const std::string& n) { return holds_param(n); };
    (lora_enabled_ ? base_ : params_).set_pipeline_stage(llama_param_list(whole_cfg_), held);
    if (lora_enabled_) params_.set_pipeline_stage(lora_param_list(whole_cfg_, lora_spec_), held);
  }
  dev_ = dev;
  shape_ = shape;
  recompute_ = rc;
  recipe_ = recipe;
  plan_recipe_ = planned_switch ? activation_plan_recipe(recipe, *planned_switch) : recipe;
  fprop_bf16_ = false;
  if (sequence_parallel && (tp_size() == 1 || shape.tokens() % tp_size() != 0))
    return errorf(
        "sequence parallelism splits a micro-batch's %lld tokens over the %d tensor-parallel ranks; it "
        "needs --tensor-model-parallel-size > 1 dividing them",
        (long long)shape.tokens(), tp_size());
  if (shape.seq * cp_size() > cfg.max_seq)
    return errorf("sequence length %lld exceeds the model's %lld", (long long)(shape.seq * cp_size()),
                  (long long)cfg.max_seq);
  return init_parts(seed);
}

// init after the shapes are set: the stores, Linears, weight stage, initial values, arena and step buffers.
Status LlamaModel::init_parts(uint64_t seed) {
  const LlamaConfig& cfg = cfg_;
  const Device dev = dev_;
  const MicroBatchShape shape = shape_;
  const Recompute rc = recompute_;
  const recipe::Recipe& recipe = recipe_;
  lm_chunk_tokens_ = llama::lm_chunk_tokens(cfg, shape);
  seed_ = seed;
  const LoraSpec* lora = lora_enabled_ ? &lora_spec_ : nullptr;
  activation_bytes_ = plan_activation_bytes(cfg, dev, shape, rc, plan_recipe_, lora, sp_size());
  // Quantized layers (one contiguous block: BF16 layers are counted from either end) keep no compute copy
  // of their linear weights; a staging buffer of the largest such weight feeds their quantizers.
  const std::vector<bool> quantized = llama::quantized_layers(cfg, recipe);
  int64_t qb = 0;
  while (qb < cfg.layers && !quantized[size_t(qb)]) ++qb;
  int64_t qe = qb;
  while (qe < cfg.layers && quantized[size_t(qe)]) ++qe;
  for (int64_t l = qe; l < cfg.layers; ++l)
    NB_CHECK(!quantized[size_t(l)], "internal: quantized layers not contiguous");
  if (pipeline) {  // the held quantized layers: their linear weights are contiguous in the stage's store too
    int64_t first = qe, last = qb - 1;
    for (int64_t l = qb; l < qe; ++l)
      if (holds_layer(l)) first = std::min(first, l), last = l;
    qb = first <= last ? first : qb;
    qe = first <= last ? last + 1 : qb;
  }
  // The stage's activation plan and each chunk's most passes in flight (its Linears' input slots, build_linears).
  if (pipeline) {
    stage_acts_ = stage_activations();
    chunk_in_flight_ = chunk_in_flight(int(pipeline->chunks.size()), pipeline->order);
  }
  // Every allocation below is recorded under its part of the memory estimate (core/memory_ledger.h).
  NB_TRY(allocate_stores(qb, &qe));
  NB_TRY(build_linears());  // after the store: sharded weights take its row chunks
  weight_staged_.assign(size_t(cfg.layers * 4), char(0));
  if (qe > qb) {
    int64_t most = largest_linear_weight(cfg);
    if (lora_enabled_ && base_.fsdp())  // a sharded frozen weight is quantized from its zero-padded rows
      for (const ParamStore::Group& g : base_.groups())
        if (!g.stored) most = std::max(most, g.chunk() * base_.shard_count());
    MemoryScope scope(MemPart::weight_stage);
    NB_TRY(Buffer::allocate(&weight_stage_, params_.compute_dtype(), dev, {most}));
  }
  std::optional<MemoryScope> scope(std::in_place, MemPart::params);  // initialization scratch
  NB_TRY(params_.initialize(seed));
  if (lora_enabled_) {
    build_lora_modules();
    NB_TRY(load_base(seed));
  }
  scope.emplace(MemPart::activations);
  if (pipeline)
    NB_TRY(init_pipeline());
  else
    NB_TRY(arena_.reserve(dev, size_t(activation_bytes_)));
  return init_step_buffers();
}

// The parameter stores: the whole model (sharded, offloaded or with a master-only range [qb, *qe)), or with
// LoRA the frozen base and the adapters. *qe becomes qb where the range is empty (every compute copy kept).
Status LlamaModel::allocate_stores(int64_t qb, int64_t* qe_io) {
  const LlamaConfig& cfg = cfg_;
  const Device dev = dev_;
  const recipe::Recipe& recipe = recipe_;
  int64_t& qe = *qe_io;
  std::optional<MemoryScope> scope(std::in_place, MemPart::params);
  if (lora_enabled_) {  // quantized layers' frozen weights live in their Linears only
    // optim_grads_params: each rank keeps 1/d of the frozen base.
    if (fsdp == Fsdp::optim_grads_params)
      NB_TRY(base_.allocate_frozen_fsdp(cfg, dev, optimizer_shard_rank, optimizer_shard_count,
                                        recipe::weight_block_rows(recipe.weight.fmt), qb, qe));
    else
      NB_TRY(base_.allocate_frozen(cfg, dev, qb, qe));
    scope.emplace(MemPart::lora);
    // Tensor parallelism: each adapter is this rank's part of the whole model's (tp::split_of), initialized as
    // one GPU's slice.
    params_.set_tensor_parallel(whole_cfg_, tp_shard(), lora_param_list(whole_cfg_, lora_spec_));
    NB_TRY(params_.allocate(lora_param_list(cfg, lora_spec_), dev));
    NB_TRY(Buffer::allocate(&norm_dw_sink_, DType::f32, dev, {cfg.hidden}));
  } else {
    // An empty master-only range: asked for, sharded, or a planned recipe switch (its BF16 GEMMs read weights).
    const bool offload = optimizer_placement.offload_fraction > 0;
    if (!master_only_quantized_weights || optimizer_shard_count > 1 || planned_switch || offload) qe = qb;
    if (fsdp != Fsdp::off)
      NB_TRY(params_.allocate_fsdp(cfg, dev, optimizer_shard_rank, optimizer_shard_count,
                                   fsdp == Fsdp::optim_grads_params, recipe::weight_block_rows(recipe.weight.fmt),
                                   optimizer_placement));
    else
      NB_TRY(params_.allocate(cfg, dev, qb, qe, optimizer_shard_rank, optimizer_shard_count, optimizer_bucket_elems,
                              optimizer_placement));
  }
  return Status::ok();
}

// RoPE tables [S, hd/2] (FP32) and the per-token loss sums.
Status LlamaModel::init_step_buffers() {
  MemoryScope scope(MemPart::step_inputs);
  const int64_t rows = shape_.seq * cp_size();  // context parallelism: every position of the whole row
  std::vector<float> cos_h(size_t(rows * cfg_.head_dim / 2)), sin_h(cos_h.size());
  ops::rope_table(rope_config(cfg_), rows, cfg_.head_dim, cos_h.data(), sin_h.data());
  NB_TRY(Buffer::allocate(&rope_cos_, DType::f32, dev_, {rows, cfg_.head_dim / 2}));
  NB_TRY(Buffer::allocate(&rope_sin_, DType::f32, dev_, {rows, cfg_.head_dim / 2}));
  NB_TRY(copy_bytes(rope_cos_.data(), dev_, cos_h.data(), Device::cpu, cos_h.size() * 4));
  NB_TRY(copy_bytes(rope_sin_.data(), dev_, sin_h.data(), Device::cpu, sin_h.size() * 4));
  NB_TRY(Buffer::allocate(&loss_acc_, DType::f32, dev_, {shape_.tokens()}));
  ops::fill(loss_acc_.tensor(), 0.0f, nullptr);
  NB_TRY(init_tensor_parallel());
  return init_context_parallel();
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
  seg_host_.clear();
  if (cp_size() > 1) {  // whole rows in, this rank's tokens staged (packed rows choose theirs in stage_segments)
    const size_t whole = size_t(n * shape_.tokens() * cp_size());
    cp_whole_ids_.assign(tokens, tokens + whole);
    cp_whole_labels_.assign(labels, labels + whole);
    keep_local_tokens(tokens, n, &cp_ids_);
    keep_local_tokens(labels, n, &cp_labels_);
    tokens = cp_ids_.data();
    labels = cp_labels_.data();
  }
  return upload_staged(tokens, labels, n);
}

Status LlamaModel::upload_staged(const int32_t* tokens, const int32_t* labels, int64_t n) {
  const int64_t T = shape_.tokens();
  // The kernels guard their reads, but an id past the vocabulary must stop the run, never become a zero
  // embedding row or a dropped target (on the host: one pass over n*T ids, microseconds).
  NB_TRY(check_ids(tokens, n * T, whole_cfg_.vocab, "token"));
  NB_TRY(check_ids(labels, n * T, whole_cfg_.vocab, "label", -1));
  tokens = local_vocab_ids(tokens, n * T);  // tensor parallelism: this rank's embedding rows
  MemoryScope scope(MemPart::step_inputs);
  if (n > staged_capacity_) {
    NB_TRY(Buffer::allocate(&ids_, DType::i32, dev_, {n, T}));
    NB_TRY(Buffer::allocate(&targets_, DType::i32, dev_, {n, T}));
    staged_capacity_ = n;
  }
  NB_TRY(upload_ids_.upload(ids_.data(), dev_, tokens, size_t(n * T) * 4, nullptr));
  NB_TRY(upload_targets_.upload(targets_.data(), dev_, labels, size_t(n * T) * 4, nullptr));
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
  if (cp_size() > 1) {  // this rank's share of every packed sequence, or whole rows
    bool rows = false;
    NB_TRY(segments_under_cp(n, &rows));
    if (rows) return Status::ok();
  }
  std::vector<int32_t> all;
  MemoryScope scope(MemPart::step_inputs);
  seg_offset_.assign(size_t(n), 0);
  for (int64_t i = 0; i < n; ++i) {
    auto& st = seg_host_[size_t(i)];
    if (st.empty())  // an unpacked micro-batch among packed ones: one segment per row
      for (int64_t r = 0; r <= shape_.batch; ++r) st.push_back(int32_t(r * S));
    seg_offset_[size_t(i)] = int64_t(all.size());
    all.insert(all.end(), st.begin(), st.end());
  }
  // Grown, never shrunk: freeing device memory would wait for the whole device (a streamed update too).
  if (seg_starts_.tensor().numel() < int64_t(all.size()))
    NB_TRY(Buffer::allocate(&seg_starts_, DType::i32, dev_, {int64_t(all.size())}));
  NB_TRY(upload_seg_starts_.upload(seg_starts_.data(), dev_, all.data(), all.size() * 4, nullptr));
  // The attention's own rules, checked once here: the positions below index by the starts.
  const ops::AttentionShape ash{shape_.batch, S, cfg_.heads, cfg_.kv_heads, cfg_.head_dim, 1.0f};
  std::vector<int32_t> pos(size_t(n * T));
  for (int64_t i = 0; i < n; ++i) {
    const auto& st = seg_host_[size_t(i)];
    ops::AttentionSegments segs{int64_t(st.size()) - 1, st.data(), seg_starts_.ptr<int32_t>() + seg_offset_[size_t(i)]};
    NB_TRY(ops::attention_check_segments(ash, segs, dev_).context(strprintf("micro-batch %lld", (long long)i)));
    for (size_t k = 0; k + 1 < st.size(); ++k)
      for (int32_t t = st[k]; t < st[k + 1]; ++t)
        pos[size_t(i * T + t)] = segment_position(t - st[k], st[k + 1] - st[k]);
  }
  if (positions_.tensor().numel() < n * T) NB_TRY(Buffer::allocate(&positions_, DType::i32, dev_, {n * T}));
  return upload_positions_.upload(positions_.data(), dev_, pos.data(), pos.size() * 4, nullptr);
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
  if (tp_size() > 1) return errorf("forward_logits: a tensor-parallel rank holds only its vocabulary's logits");
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

}  // namespace nb
