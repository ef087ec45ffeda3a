// A Llama decoder (RMSNorm, GQA attention with RoPE, SwiGLU MLP, untied or tied LM head) written
// only in terms of ops and Linear GEMMs, so the same code runs on the CPU and CUDA backends and a
// precision recipe can replace the linears' GEMMs without touching this file.
//
// One call of forward_backward() runs one micro-batch: forward, the LM head and loss in token
// chunks (never the full [T, V] logits), and the backward, accumulating FP32 gradients into the
// ParamStore. Activations come from an Arena sized by plan_activation_bytes() and are released
// after the backward.
#pragma once
#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>
#include "core/arena.h"
#include "core/host_upload.h"
#include "core/stream_event.h"
#include "io/hf_llama.h"
#include "io/peft_adapter.h"
#include "model/llama_config.h"
#include "model/lora.h"
#include "model/params.h"
#include "model/pipeline_split.h"
#include "model/tensor_parallel.h"
#include "ops/attention.h"
#include "ops/cp_ring.h"
#include "ops/vocab_parallel_ce.h"
#include "recipe/linear.h"

namespace nb {

enum class Recompute { none, selective, full };
struct PassRange;  // llama_pass.h
Status parse_recompute(const std::string& s, Recompute* out);

struct MicroBatchShape {
  int64_t batch = 1, seq = 64;
  int64_t tokens() const { return batch * seq; }
};

class LlamaModel {
 public:
  // Megatron-FSDP's strategies beyond the distributed optimizer (the `fsdp` member below).
  enum class Fsdp { off, optim_grads, optim_grads_params };
  // `recipe` chooses the format of every linear layer's three GEMMs (bf16_mixed by default).
  Status init(const LlamaConfig& cfg, Device dev, MicroBatchShape shape, Recompute rc, uint64_t seed,
              const recipe::Recipe& recipe = recipe::Recipe{});
  // Bytes of activations and temporaries one micro-batch needs (exact: the same plan allocates them).
  // Quantized layers keep their linears' inputs as quantized copies (owned by the Linear), not in BF16.
  // With LoRA (lora != nullptr) every layer keeps its linears' BF16 inputs (the adapters' Wgrad reads them).
  // sequence_parallel: the tensor-parallel size when --sequence-parallel splits the residual stream's tokens.
  static int64_t plan_activation_bytes(const LlamaConfig& cfg, Device dev, MicroBatchShape shape, Recompute rc,
                                       const recipe::Recipe& recipe = recipe::Recipe{}, const LoraSpec* lora = nullptr,
                                       int sequence_parallel = 1);
  // One pass of a pipeline stage's schedule, in the order the schedule runs them (PipelineSchedule::pass_order).
  struct PipelinePass {
    int64_t micro = 0;
    int chunk = 0;
    bool forward = true;
  };
  // Each pass in flight keeps its chunk's kept bytes in a slot of its own; the slots are sized by replaying the
  // schedule's passes with take_slot's rule (the smallest free slot that holds the chunk, else a new one of the
  // chunk's size: plan_slot_bytes), so a chunk larger than the others (a layout's, or the LM head's) costs only
  // where its passes are in flight. scratch: the one scratch every pass shares, the largest chunk's.
  struct StageActivations {
    int64_t scratch = 0;
    std::vector<int64_t> chunk_kept;                              // each chunk's kept bytes per pass
    int64_t bytes(const std::vector<int64_t>& slot_bytes) const;  // the slots (plan_slot_bytes) and the scratch
  };
  static std::vector<int64_t> plan_slot_bytes(const std::vector<int64_t>& chunk_kept,
                                              const std::vector<PipelinePass>& order);
  // Each chunk's most passes in flight under `order`: the input slots its quantized Linears keep.
  static std::vector<int64_t> chunk_in_flight(int chunks, const std::vector<PipelinePass>& order);
  // A pipeline stage's activations (llama_pipeline.cpp), as init_pipeline allocates them and the memory estimate
  // counts them: each chunk's residual stream and kept layer tensors per pass (chunk_kept); one scratch they all
  // share, the largest chunk's (scratch). cfg: the rank's model (layer count unused); quantized: the whole model's
  // per-layer rule (llama::scratch_input_layers); the last stage's last chunk ends with the LM head.
  static StageActivations plan_stage_activations(const LlamaConfig& cfg, Device dev, MicroBatchShape shape,
                                                 Recompute rc, const std::vector<bool>& quantized, const LoraSpec* lora,
                                                 int sp, const std::vector<pp::LayerRange>& chunks, bool last_stage);
  // One transformer Linear as build_linears makes it (the fused qkv 0, o 1, gate_up 2, down 3).
  struct LinearSpec {
    int64_t layer = 0;
    int index = 0;
    bool bf16_layer = false;
    int64_t in = 0, out = 0;
    int input_col_slot = -1;  // full recompute: the shared input-column slot (recipe::Linear::init)
  };
  static std::vector<LinearSpec> linear_specs(const LlamaConfig& cfg, const recipe::Recipe& recipe, Recompute rc);
  // Elements of the largest transformer linear weight (the fused qkv or gate_up).
  static int64_t largest_linear_weight(const LlamaConfig& cfg) {
    return cfg.hidden * std::max(cfg.q_dim() + 2 * cfg.kv_dim(), 2 * cfg.ffn);
  }
  // The memory estimate's figures for what init allocates besides parameters and activations, each from
  // the code that sizes the allocation, run without allocating (llama_memory.cpp). Bytes on `dev`
  // (host memory on the cpu backend, which allocates the same layout). `master_only`: quantized layers' weights have no
  // compute copy (a weight stage feeds their quantizers); `frozen`: LoRA's frozen base; `sharded_weights`: the
  // quantized weights are Megatron-FSDP's (training-format gathers, a sharded LoRA base).
  struct LinearMemory {
    int64_t owned = 0;             // the Linears' kept copies (MemPart::quantized_copies)
    int64_t workspace = 0;         // their shared transient slots (MemPart::linear_workspace)
    int64_t weight_stage = 0;      // MemPart::weight_stage
    int64_t emulated_scratch = 0;  // the emulated MXFP8/NVFP4 GEMMs' BF16 scratch at its largest
  };
  // sp_ranks: the tensor-parallel size under sequence parallelism (the quantized input gathers' workspace).
  // stage_chunks: a pipeline stage's layers (nullptr: every layer); chunk_input_slots: the input slots of each
  // chunk's Linears (pipeline_input_slots; empty: one).
  static Status plan_linear_memory(const LlamaConfig& cfg, Device dev, MicroBatchShape shape, Recompute rc,
                                   const recipe::Recipe& recipe, bool frozen, bool master_only, bool sharded_weights,
                                   LinearMemory* out, int sp_ranks = 1,
                                   const std::vector<pp::LayerRange>* stage_chunks = nullptr,
                                   const std::vector<int64_t>& chunk_input_slots = {});
  // How many micro-batches' quantized inputs each Linear of a pipeline stage keeps (recipe::Linear::
  // set_input_slots): the stage's passes in flight, unless full recompute remakes them right before each
  // backward or the Linears are frozen (LoRA: no Wgrad, nothing kept); 1 otherwise.
  static int64_t pipeline_input_slots(const recipe::Recipe& recipe, Recompute rc, bool frozen, int64_t slots);
  // Starts optimizer step `step`: the weights changed, so quantized weight copies are rebuilt once.
  // Data parallelism: local micro-batch j of this step is global micro-batch first_micro + j * micro_stride
  // (rank r of d: first r, stride d), so stochastic-rounding keys match a one-rank run of the same batch.
  void begin_step(uint32_t step, uint32_t first_micro = 0, uint32_t micro_stride = 1);
  // The weights changed since the last step's forwards (the optimizer's update): forwards outside a step (an
  // evaluation) quantize them again instead of reading the last step's copies.
  void weights_changed();
  // One quantized Linear's statistics since the last take_health (collection on; recipe/linear_stats.h).
  struct LinearStats {
    std::string linear;  // "model.layers.3.mlp.down_proj"
    int64_t layer = 0;
    recipe::LinearHealth health;
  };
  // Non-finite quantizer inputs since the last call ("layer 3 mlp.down_proj grad", or empty) and the
  // worst per-linear quantization statistics when collection is on; per_linear (optional) gets each
  // quantized Linear's statistics, in layer order.
  Status take_health(std::string* nonfinite_where, recipe::LinearHealth* worst,
                     std::vector<LinearStats>* per_linear = nullptr);
  // --quant-stats: every Linear's statistics, and the Wgrad error of the next micro-batch (re-armed by
  // begin_step). The Linears share one Wgrad scratch; see linear_stats.h for the memory it costs.
  void set_collect_stats(bool on);
  double quant_stats_ms() const { return quant_stats_ms_; }  // wall time of all statistics passes so far
  // FP8 delayed-scaling state of every Linear (empty for other recipes), for checkpoints. A pipeline stage reports its
  // own Linears and, given the whole model's, takes its own.
  struct LinearScaling {
    std::string linear;  // "model.layers.3.mlp.down_proj" (linear_name)
    std::vector<recipe::ScalingState> roles;
    int64_t layer = -1;  // of the whole model
    int index = -1;      // 0 qkv, 1 o, 2 gate_up, 3 down
  };
  static std::string linear_name(int64_t layer, int index);
  Status scaling_states(std::vector<LinearScaling>* out) const;
  Status set_scaling_states(const std::vector<LinearScaling>& in);
  void step_amax_views(std::vector<Tensor>* out) const;  // delayed scaling: every step amax (llama_amax.cpp)
  // ---- Mixture of Representations (recipe.mor; llama_mor.cpp) ----
  // Every MoR Linear's three statistic cells (input, weight, grad) live in one board, in the order of mor_slots(),
  // so a decision reads them in one copy. mor_board / set_mor_board copy the board (synchronize); clear_mor_board
  // zeroes it. mor_choices: each role's recipe::MorRung (0 BF16, 1 E4M3, 2 NVFP4), 3 per Linear; set_mor_choices
  // sets them. The NVFP4 ladder's Linears have six cells (mor_cells_per_linear): E4M3's three, then NVFP4's.
  // pause_mor_stats(true): quantizations add nothing (evaluation forwards). All empty without MoR.
  std::vector<int64_t> mor_slots()
      const;  // each MoR Linear as layer * 4 + index in the whole model (the board's order)
  static int64_t mor_board_bytes(int64_t mor_linears, int cells_per_linear);  // the allocation; the estimate's too
  int mor_cells_per_linear() const;                                           // 0 without MoR
  Status mor_board(std::vector<mor::StatCell>* cells) const;
  Status set_mor_board(const std::vector<mor::StatCell>& cells);
  Status clear_mor_board();
  std::vector<uint8_t> mor_choices() const;
  Status set_mor_choices(const std::vector<uint8_t>& choices);
  void pause_mor_stats(bool paused);
  const recipe::Recipe& recipe() const { return recipe_; }
  // Parameter storage: FP32 master, gradient, m, v plus the compute copy.
  // (The linear weights of quantized layers keep no compute copy: they are quantized from the master.)
  // With the distributed optimizer over `shards` ranks: 4 (gradient) + 12 / shards + the compute copy.
  // The elements of master, m and v one of `shards` optimizer ranks keeps (before bucket padding).
  static int64_t optimizer_shard_elems(const LlamaConfig& cfg, int shards) {
    return (cfg.total_params() + shards - 1) / shards;
  }
  // With an offload placement, the device part of the state and the streaming windows only.
  // With Megatron-FSDP (fsdp != off) the sharded arrays and the windows (fsdp_window_bytes).
  static int64_t parameter_bytes(const LlamaConfig& cfg, Device dev, const recipe::Recipe& recipe = recipe::Recipe{},
                                 int shards = 1, const optim::Placement& placement = {}, Fsdp fsdp = Fsdp::off,
                                 bool embeddings_per_step = false);
  // Megatron-FSDP's windows at their most (distributed/fsdp.h): a large window (the embedding or an untied
  // LM head) and two layer windows, for the weights (optim_grads_params) and for the FP32 gradients.
  // embeddings_per_step (--fsdp-embeddings-per-step): the embedding's and an untied head's windows are both
  // held through the step, one more large window of each kind.
  static int64_t fsdp_window_bytes(const LlamaConfig& cfg, Device dev, bool weights_sharded,
                                   bool embeddings_per_step = false);
  // --optimizer-cpu-offload: the device part of one rank's master, m and v and the streaming windows.
  static int64_t offloaded_state_device_bytes(int64_t shard, const optim::Placement& placement);
  // LoRA fine-tuning: the bytes of the frozen base at its storage precision (BF16 embeddings, norms and
  // LM head; linear weights in the recipe's weight format: 2D NVFP4 0.5 + 1/16 byte, FP8 1 byte, BF16
  // layers 2) plus the adapters' 16 bytes of FP32 state and their compute copy. base_shards > 1
  // (optim_grads_params): 1/base_shards of the base plus Megatron-FSDP's windows of it (a large window and two
  // layer windows in BF16, and a quantized base's gathered copies: four layer windows and the staging);
  // embeddings_per_step: one more large BF16 window (the base has no gradient windows).
  // quantized_linears = false leaves out an unsharded base's quantized linear weights (the memory estimate
  // counts them from the Linears' own layout, plan_linear_memory).
  static int64_t lora_parameter_bytes(const LlamaConfig& cfg, Device dev, const recipe::Recipe& recipe,
                                      const LoraSpec& lora, int base_shards = 1, bool embeddings_per_step = false,
                                      bool quantized_linears = true);
  // LoRA: the adapters' store (master, gradient, m, v, compute copy) and the frozen norms' gradient sink, in
  // the bytes ParamStore allocates (MemPart::lora).
  static int64_t lora_store_bytes(const LlamaConfig& cfg, Device dev, const LoraSpec& lora);
  // The trainable parameters: the whole model, or with LoRA the adapters only.
  ParamStore& params() { return params_; }
  const ParamStore& params() const { return params_; }
  // LoRA: set before init. The base is frozen (no FP32 master, gradient or AdamW state) and stored in
  // the recipe's formats, quantized once at init from `base` (HF names: an HF folder or a nibble
  // checkpoint's model file) or, when base is nullptr, from the seeded values a fresh model of this seed
  // would start with. The reader is used during init only.
  void set_lora(const LoraSpec& spec, const HfCheckpointReader* base);
  bool lora_enabled() const { return lora_enabled_; }
  const LoraSpec& lora_spec() const { return lora_spec_; }
  const ParamStore& base() const { return lora_enabled_ ? base_ : params_; }
  ParamStore& base() { return lora_enabled_ ? base_ : params_; }
  // Linear i (qkv 0, o 1, gate_up 2, down 3) of a layer, for tests and diagnostics.
  const recipe::Linear& linear(int64_t layer, int i) const { return linears_[size_t(layer)][size_t(i)]; }
  // The quantized Linears of the transformer layers, each with the name of its weight's first parameter (the
  // fused qkv's q_proj): what Megatron-FSDP gathers in their training format (distributed/fsdp.h).
  std::vector<std::pair<std::string, recipe::Linear*>> quantized_linears();
  static std::string fsdp_weight_name(int64_t layer, int i);
  const LlamaConfig& config() const { return cfg_; }
  // Set before init: false keeps compute copies of quantized layers' weights too (tests compare both paths).
  bool master_only_quantized_weights = true;
  // Set before init: the distributed optimizer's shard of master, m and v (params.h). Sharding keeps a
  // compute copy of every weight, so quantized layers quantize from the BF16 copy, as Megatron with
  // TransformerEngine does; the FP32 master of a weight lives on one rank only.
  int optimizer_shard_rank = 0, optimizer_shard_count = 1;
  // Set before init: Megatron-FSDP over the optimizer's shard ranks (params.h, distributed/fsdp.h): the
  // gradients are sharded too (optim_grads), and the compute copy (optim_grads_params). Its hooks must be
  // set (set_step_hooks) and report every micro-batch's final gradients.
  // With LoRA only optim_grads_params applies: the frozen base is sharded over those ranks (each keeps 1/d of
  // every group's rows; its quantized weights as their frozen Linears' chunks) and the hooks gather it
  // before each unit's forward and backward; the adapters stay whole on every rank.
  Fsdp fsdp = Fsdp::off;
  // optim_grads_params: the quantized Linears' weights are sharded (recipe::Linear::set_sharded_weight) as
  // the Linears are built, for Megatron-FSDP's training-format gathers (set before init).
  bool fsdp_training_format_gathers = false;
  // Set before init: the gradient-bucket length in elements (--ddp-bucket-size; 0 = one bucket).
  int64_t optimizer_bucket_elems = 0;
  // Set before init: the share of master, m and v kept in host memory (--optimizer-cpu-offload). An
  // offloaded state keeps a compute copy of every weight: the FP32 master is not on the GPU to quantize
  // from (the copy holds the same RNE values, so results are bit-identical).
  optim::Placement optimizer_placement;
  // Data-parallel overlap (docs/DISTRIBUTED.md): weights_needed(names) runs before a forward first reads
  // those parameters' compute copies (the embedding, each layer, the final norm and LM head); grads_final
  // (names) runs when those parameters' gradients are complete, which only the backward of the step's
  // last micro-batch reports (set_grads_final_reporting). The trainer launches collectives from them.
  struct StepHooks {
    virtual ~StepHooks() = default;
    virtual Status weights_needed(const std::vector<std::string>& names) = 0;
    virtual Status grads_final(const std::vector<std::string>& names) = 0;
    // Before a backward first writes those parameters' gradients (Megatron-FSDP binds their windows).
    virtual Status grads_needed(const std::vector<std::string>& /*names*/) { return Status::ok(); }
  };
  void set_step_hooks(StepHooks* hooks) { hooks_ = hooks; }
  void set_grads_final_reporting(bool on) { report_grads_final_ = on; }
  // The parameters of transformer layer l (its six linear weights and two norms), as the hooks name them.
  static std::vector<std::string> layer_param_names(int64_t l);
  // Precision annealing (llama_recipe_switch.cpp). Set before init: the recipe a later set_recipe() switches
  // to. init then keeps a compute copy of every weight (no master-only range: a BF16 GEMM reads the weight)
  // and plans the activations for both recipes (activation_plan_recipe).
  struct RecipeSwitch {
    recipe::Recipe next;
    bool fprop_only = false;  // only Fprop switches (next is bf16_mixed); Dgrad and Wgrad keep the recipe
  };
  std::optional<RecipeSwitch> planned_switch;
  // Set before init: context parallelism over link->size() ranks (ops/cp_ring.h, llama_cp.cpp). init's
  // shape is then this rank's share of each row: seq / C tokens, the row's chunks r and 2C-1-r of 2C.
  // stage_batches takes whole rows ([n, batch * seq * C] ids) and keeps this rank's tokens, RoPE rotates
  // each at its position in the whole row, and attention runs the ring. Packed rows (stage_segments) need every
  // sequence to be a multiple of 2C tokens: each is cut like a row, this rank keeps its chunks r and 2C-1-r, and
  // RoPE rotates each token at its position in its sequence.
  ops::cp::RingLink* cp_link = nullptr;
  // ... and the group the quantized Linears reduce their inputs' and gradients' per-tensor amaxes over, so that
  // every rank scales its tokens with the whole row's amax (recipe::Linear::set_amax_group).
  recipe::AmaxGroup* cp_amax_group = nullptr;
  int cp_size() const { return cp_link ? cp_link->size() : 1; }
  // Set before init: tensor parallelism over tp_group->size() ranks (model/tensor_parallel.h, llama_tp.cpp).
  // init takes the whole model's config; this rank holds its part (config() is the local shape, whole_config()
  // the model's): column-parallel q/k/v and gate/up, row-parallel o and down (their outputs all-reduced over the
  // group in the forward, the column-parallel inputs' gradients in the backward), a vocabulary-parallel
  // embedding (all-reduced) and head (ops/vocab_parallel_ce.h). Every rank runs the same tokens.
  ops::tp::ReduceGroup* tp_group = nullptr;
  // ... and the quantized Linears' amax groups (recipe::Linear::set_amax_groups): the tensor-parallel ranks (a
  // sharded weight) and the tensor x context-parallel ranks (a sharded input or gradient; the TP group itself
  // without context parallelism). A replicated input or gradient uses cp_amax_group.
  recipe::AmaxGroup* tp_amax_group = nullptr;
  recipe::AmaxGroup* tp_cp_amax_group = nullptr;
  // Set before init (--tp-comm-overlap): the column-parallel input gradients' all-reduces run on a side stream
  // beside their Linears' Wgrad GEMMs (the forward's and the head's still wait on the default stream).
  bool tp_comm_overlap = false;
  // Set before init (--sequence-parallel): norms, residual adds and their gradients on this rank's T/tp block of
  // the micro-batch's tokens; the norms' outputs all-gathered before the column-parallel GEMMs, the row-parallel
  // outputs (and the embedding) reduce-scattered, the residual gradients all-gathered before the row-parallel
  // backward, the column-parallel input gradients reduce-scattered. The norms' weight gradients are then each
  // rank's share: the trainer sums them over the group once per step.
  bool sequence_parallel = false;
  int sp_size() const { return sequence_parallel ? tp_size() : 1; }
  int tp_size() const { return tp_group ? tp_group->size() : 1; }
  tp::Shard tp_shard() const { return tp_group ? tp::Shard{tp_group->rank(), tp_group->size()} : tp::Shard{}; }
  const LlamaConfig& whole_config() const { return whole_cfg_; }
  // Sequence parallelism: how many column-parallel Linears all-gather their inputs, and how many row-parallel ones
  // their output gradients, in their quantized format (recipe::Linear::set_input_gather, set_grad_gather; the
  // others gather BF16), each of how many (*of).
  int quantized_input_gathers(int* of = nullptr) const;
  int quantized_grad_gathers() const;
  // The recipe whose activation plan holds before and after the switch: layers quantized under both keep
  // quantized inputs only; fprop_only keeps the current plan (its backward still reads the kept copies).
  static recipe::Recipe activation_plan_recipe(const recipe::Recipe& now, const RecipeSwitch& next);
  // At a step boundary (before begin_step): every Linear runs `r` from now on. The old Linears and their
  // workspace are released before the new ones allocate, so the two sets of copies never coexist.
  // fprop_only: the Linears stay (and keep their copies) but compute Fprop in BF16 (r must be bf16_mixed).
  // Refused when the activation plan or the weights' compute copies do not cover `r` (see planned_switch).
  Status set_recipe(const recipe::Recipe& r, bool fprop_only);
  bool fprop_bf16() const { return fprop_bf16_; }

  // Set before init: pipeline parallelism (llama_pipeline.cpp). This rank holds the decoder layers of its chunks
  // (virtual stages, model/pipeline_split.h), the embedding when it holds the first stage, the final norm and LM
  // head when it holds the last; names, seeds and stochastic-rounding keys stay the whole model's. `slots`
  // activation sets, one per (micro-batch, chunk) between its forward and its backward (the schedule's most in
  // flight), each sized for the largest chunk.
  struct PipelineStage {
    std::vector<pp::LayerRange> chunks;  // in model order
    bool first = true, last = true;
    std::vector<PipelinePass> order;  // the step's passes in order (PipelineSchedule::pass_order)
  };
  std::optional<PipelineStage> pipeline;
  bool holds_layer(int64_t l) const;
  bool holds_param(const std::string& name) const;  // an HF name of the whole model (or of its LoRA adapters)
  // Whether stage `s` holds layer l / parameter `name` (the trainer asks of other stages when it gathers a save).
  static bool stage_holds_layer(const PipelineStage& s, int64_t l);
  static bool stage_holds(const PipelineStage& s, const std::string& name);
  bool holds_embedding() const { return !pipeline || pipeline->first; }
  bool holds_head() const { return !pipeline || pipeline->last; }
  // A pipeline message's shape: one micro-batch's residual stream [tokens, hidden] in the compute dtype.
  Status make_boundary(Buffer* out) const;
  // Staged micro-batch i through chunk c: the forward from `input` (ignored on the first stage), then, on the last
  // stage, the loss and the head's backward. *output (not on the last stage) is a view of the chunk's activations,
  // valid until its backward. The activations stay in a slot until backward_chunk(i, c).
  Status forward_chunk(int64_t i, int c, const Tensor& input, float grad_scale, Tensor* output);
  // ... and its backward from `output_grad` (ignored on the last stage); *input_grad (not on the first stage) is a
  // view valid until the next forward_chunk.
  Status backward_chunk(int64_t i, int c, const Tensor& output_grad, Tensor* input_grad);
  // Evaluation: the forward of chunk c alone (the loss added on the last stage); *output is valid until the next
  // forward.
  Status forward_chunk_only(int64_t i, int c, const Tensor& input, Tensor* output);

  // The training loop's path, with one host synchronization per optimizer step: stage_batches()
  // copies n micro-batches of host int32 tokens/labels ([n, batch*seq] each) to the device in one
  // transfer; forward_backward_staged(i) runs micro-batch i, accumulating FP32 gradients (+=) and the
  // per-token losses on the device; take_loss_sum() returns the summed token loss since the last
  // call (this synchronizes). grad_scale multiplies the summed loss's gradient (1 / tokens per step
  // gives the mean).
  // Labels < 0 are not trained (SFT prompts, padding).
  Status stage_batches(const int32_t* tokens, const int32_t* labels, int64_t n);
  // Packed rows (SFT), after stage_batches: starts[i] is staged micro-batch i's segment starts
  // (Batch::segment_starts). Attention stays inside each segment and RoPE positions restart at its start.
  // Without this call (or with every starts[i] empty) rows are single sequences.
  Status stage_segments(const std::vector<int32_t>* starts, int64_t n);
  Status forward_backward_staged(int64_t i, float grad_scale);
  Status forward_loss_staged(int64_t i);
  Status take_loss_sum(double* loss_sum);
  // One micro-batch from host arrays, adding its summed token loss into *loss_sum (synchronizes).
  Status forward_backward(const int32_t* tokens, const int32_t* labels, float grad_scale, double* loss_sum);
  Status forward_loss(const int32_t* tokens, const int32_t* labels, double* loss_sum);
  // forward_loss that also copies the logits [batch*seq, vocab] to the host as FP32 (parity checks
  // against other implementations; BF16 logits on CUDA are widened).
  Status forward_logits(const int32_t* tokens, const int32_t* labels, float* logits, double* loss_sum);

  // Internal: one layer's weight views and one micro-batch's activations (model/llama_internal.h).
  struct Layer;
  struct Acts;

 private:
  // Elements of the windows one FSDP pool kind holds at its most, given a layer window of `layer` elements:
  // two layer windows and a large one (the embedding's or an untied head's, at least a layer), or both large
  // ones when they are held through the step (--fsdp-embeddings-per-step) and the head is not the embedding.
  static int64_t fsdp_window_elems(const LlamaConfig& cfg, int64_t layer, bool embeddings_per_step) {
    const int64_t large = std::max(cfg.vocab * cfg.hidden, layer);
    return (embeddings_per_step && !cfg.tied_embeddings ? 2 : 1) * large + 2 * layer;
  }
  friend class MicroBatchPass;  // one micro-batch's forward and backward (llama_pass.cpp)
  Status run(int64_t staged_index, float grad_scale, bool backward);
  // The activations of a pass over `r`, laid out in `arena` (llama_pipeline.cpp); with a `scratch` arena the tensors
  // no later pass reads go there (see llama::plan_acts). plan_stage_activations sizes both.
  Status plan_pass_acts(Acts* a, const PassRange& r, Arena* arena, Arena* scratch = nullptr) const;
  Status init_pipeline();  // the slots' arenas (init_parts)
  PassRange chunk_range(int c) const;
  struct PipelineSlot {
    std::unique_ptr<Arena> arena;
    std::shared_ptr<Acts> acts;
    int64_t micro = -1;  // in flight: staged micro-batch and chunk (-1: free)
    int chunk = -1;
    int64_t bytes = 0;       // its arena's size
    int64_t input_slot = 0;  // in flight: the input slot its chunk's Linears use (chunk_inputs_)
  };
  std::vector<PipelineSlot> slots_;
  Status take_slot(int chunk, PipelineSlot** out);
  // The input slots each Linear of layer l keeps: its chunk's most passes in flight.
  int64_t stage_slots_for_layer(int64_t l) const;
  StageActivations stage_activations() const;    // this stage's, as plan_stage_activations sizes them
  StageActivations stage_acts_;                  // set before the Linears are built (init_parts)
  std::vector<int64_t> chunk_in_flight_;         // chunk_in_flight of the stage's order
  std::vector<std::vector<bool>> chunk_inputs_;  // per chunk, which of its Linears' input slots a pass holds
  // The Linears of pass range r read and write input slot `slot` (a no-op with one slot per Linear).
  Status use_input_slot(const PassRange& r, int64_t slot);
  Arena pipeline_scratch_;  // the slots' shared scratch (llama::plan_acts)
  // Staged micro-batch i's segments and RoPE positions; false when its rows are single sequences.
  bool packed_view(int64_t i, ops::AttentionSegments* segs, Tensor* positions) const;
  Status weights_needed(const std::vector<std::string>& names);  // forward to hooks_ (if any)
  Status grads_final(const std::vector<std::string>& names);
  Status grads_needed(const std::vector<std::string>& names);
  Status copy_logits_to_host(const Tensor& logits, float* out) const;
  // recipe_'s Linears (qkv, o, gate_up, down per layer) and their shared workspace, allocated.
  Status build_linears();
  Status allocate_stores(int64_t qb, int64_t* qe);  // init's parameter stores (llama_model.cpp)
  Status init_parts(uint64_t seed);                 // init once the shapes are set
  Status init_step_buffers();                       // init's RoPE tables and loss sums
  Status init_context_parallel();                   // the ring and the tokens' row positions (llama_cp.cpp)
  // Context parallelism: this rank's tokens of n micro-batches of whole rows (llama_cp.cpp).
  void keep_local_tokens(const int32_t* whole, int64_t n, std::vector<int32_t>* local) const;
  // The checks and upload of stage_batches, for this rank's n micro-batches of tokens and labels.
  Status upload_staged(const int32_t* tokens, const int32_t* labels, int64_t n);
  // Context parallelism (llama_cp.cpp): staged segments that are one sample per row (SFT without packing: the
  // sample from the row's start, then padding) are whole rows to causal attention (*rows = true, segments
  // dropped); otherwise this rank's share of every sequence is staged again and seg_host_ becomes its local
  // segment table.
  bool one_sample_per_row(int64_t n) const;
  Status segments_under_cp(int64_t n, bool* rows);
  // Local token i of a staged segment of len tokens: its position in its whole sequence (i without CP).
  int32_t segment_position(int64_t i, int64_t len) const;
  // set_recipe's checks: `r` keeps quantized inputs wherever the activation plan does, and every layer that
  // would run a BF16 GEMM has its weights' compute copies.
  Status check_switch_covered(const recipe::Recipe& r, bool fprop_only) const;
  // LoRA (llama_lora.cpp): the adapter modules' views, and the frozen base streamed into place.
  void build_lora_modules();
  Status load_base(uint64_t seed);
  Status base_values(const std::vector<HfTensor>& hf, const ParamInfo& p, uint32_t index, uint64_t seed,
                     float* dst) const;
  Status freeze_linear(const std::string& weight_name, const Tensor& w);
  // A sharded base (optim_grads_params): this rank's rows of parameter p (host FP32 values of all of it) into
  // the compute shard, through the device scratch `stage`; and a frozen Linear's chunk of its weight `w`
  // (zero rows padding it to the ranks' chunks), quantized with the whole weight's amax.
  Status shard_base_rows(const ParamInfo& p, const float* host, float* stage);
  Status freeze_sharded(recipe::Linear& lin, const Tensor& w);
  bool base_hooks() const { return hooks_ && (!lora_enabled_ || base_.fsdp()); }  // the hooks see the weights

  LlamaConfig cfg_;        // this rank's shape (the whole model's without tensor parallelism)
  LlamaConfig whole_cfg_;  // the model's
  Device dev_ = Device::cpu;
  MicroBatchShape shape_;
  Recompute recompute_ = Recompute::none;
  ParamStore params_;
  Arena arena_;
  int64_t activation_bytes_ = 0;
  int64_t lm_chunk_tokens_ = 0;
  Buffer rope_cos_, rope_sin_;
  recipe::Recipe recipe_;
  recipe::Recipe plan_recipe_;  // the activation plan's recipe: recipe_, or activation_plan_recipe()
  bool fprop_bf16_ = false;     // set_recipe(..., fprop_only = true) happened
  StepHooks* hooks_ = nullptr;  // data-parallel overlap (set_step_hooks); null: no calls
  bool report_grads_final_ = false;
  std::shared_ptr<recipe::LinearWorkspace> linear_workspace_;
  std::shared_ptr<recipe::StatsScratch> stats_scratch_;  // --quant-stats' Wgrad scratch (first use allocates)
  double quant_stats_ms_ = 0;
  Buffer weight_stage_;  // a quantized layer's weight cast from its FP32 master (see params.h)
  std::vector<char>
      weight_staged_;  // per (layer, linear): staged since the last begin_step  // shared transient quantized copies
  std::vector<std::vector<recipe::Linear>> linears_;  // per layer: qkv (fused), o, gate_up, down
  Buffer mor_board_;                                  // MoR statistic cells, 3 per MoR Linear (llama_mor.cpp)
  Status init_mor_board();
  std::vector<recipe::Linear*> mor_linears();
  Buffer ids_, targets_, loss_acc_;  // staged tokens [n, T] i32; per-token loss sums [T] f32
  // Packed rows: per staged micro-batch its segment starts (host; empty = not packed), their offset into
  // the device copy seg_starts_; positions_ [n, T] i32 restart at every segment.
  std::vector<std::vector<int32_t>> seg_host_;
  std::vector<int64_t> seg_offset_;
  Buffer seg_starts_, positions_;
  int64_t staged_capacity_ = 0;
  // The staged inputs go up through these (core/host_upload.h): never behind a streamed update's copies.
  HostUpload upload_ids_, upload_targets_, upload_seg_starts_, upload_positions_;
  // LoRA: the frozen base (params_ then holds the adapters), per (layer, linear) its adapter (a.data ==
  // nullptr: not adapted), a scratch for the frozen norms' unused weight gradient, the dropout key state.
  bool lora_enabled_ = false;
  LoraSpec lora_spec_;
  const HfCheckpointReader* lora_base_ = nullptr;
  ParamStore base_;
  std::vector<LoraModule> lora_modules_;
  Buffer norm_dw_sink_;
  uint32_t step_ = 0, micro_ = 0, micro_stride_ = 1, micro_first_ = 0;
  uint64_t seed_ = 0;
  float* logits_sink_ = nullptr;  // forward_logits: host destination of the LM head's logits
  // Context parallelism: the ring, each local token's position in its row [B * S] and the staged local ids.
  ops::cp::Ring cp_ring_;
  Buffer cp_positions_;
  std::vector<int32_t> cp_ids_, cp_labels_;
  std::vector<int32_t> cp_whole_ids_, cp_whole_labels_;  // the staged whole rows, for packed sequences' shares
  // Tensor parallelism: the staged tokens as this rank's vocabulary rows (-1: another rank's), the
  // vocabulary-parallel cross-entropy's statistics [3, LM-head chunk].
  std::vector<int32_t> tp_ids_;
  Buffer tp_ce_scratch_;
  SideStream tp_stream_;            // --tp-comm-overlap's all-reduces
  StreamEvent tp_ready_, tp_done_;  // the input gradient written; its sum done
  Status init_tensor_parallel();    // llama_tp.cpp
  // Sequence parallelism's quantized input gathers (recipe::Linear::set_input_gather): tp_group's all-gather of
  // bytes, made on first use (llama_tp.cpp).
  std::unique_ptr<recipe::ByteGroup> tp_bytes_;
  recipe::ByteGroup* tp_byte_group();
  const int32_t* local_vocab_ids(const int32_t* ids, int64_t n);
};

}  // namespace nb
