// The memory estimate (memory_estimate.h): each row from the function that sizes that allocation.
#include "train/memory_estimate.h"
#include <algorithm>
#include <cmath>
#include "core/log.h"
#include "distributed/fsdp.h"
#include "gemm/gemm.h"
#include "infer/generator.h"
#include "model/llama_internal.h"
#include "optim/adamw_stream.h"
#include "ops/attention_workspace.h"
#include "ops/cp_ring.h"
#include "optim/optimizer_state.h"
#include "train/pipeline_schedule.h"

namespace nb {

namespace {

double gib(double b) { return b / 1073741824.0; }
int64_t align256(int64_t b) { return (b + 255) / 256 * 256; }

}  // namespace

int MemoryJob::shards() const {
  // LoRA: only optim_grads_params changes anything (it shards the frozen base); see detect_ranks.
  const int n = dp_cp_ranks();
  const bool sharding = strategy != "no_shard" && n > 1 && (!lora || strategy == "optim_grads_params");
  return sharding ? n : 1;
}

LlamaModel::Fsdp MemoryJob::fsdp() const {
  if (shards() <= 1) return LlamaModel::Fsdp::off;
  if (strategy == "optim_grads") return LlamaModel::Fsdp::optim_grads;
  if (strategy == "optim_grads_params") return LlamaModel::Fsdp::optim_grads_params;
  return LlamaModel::Fsdp::off;
}

// Megatron's default bucket: one without an overlap, else max(40M, 1M x data x context ranks) elements.
int64_t MemoryJob::bucket_elems() const {
  const int n = dp_cp_ranks();
  if (n <= 1) return 0;
  if (ddp_bucket_size > 0) return ddp_bucket_size;
  return overlap ? std::max<int64_t>(40'000'000, int64_t(1'000'000) * n) : 0;
}

bool MemoryJob::master_only() const { return !lora && shards() <= 1 && !(placement.offload_fraction > 0) && !anneal; }

double MemoryEstimate::nibble() const {
  double n = 0;
  for (const Row& r : rows) n += r.bytes;
  return n;
}

double MemoryEstimate::part(MemPart p) const {
  double n = 0;
  for (const Row& r : rows) n += r.part == p ? r.bytes : 0;
  return n;
}

namespace {

// The streaming windows of an offloaded state (optim/optimizer_state.cpp's chunk rule, adamw_stream.h).
int64_t offload_staging_bytes(int64_t shard, const optim::Placement& pl) {
  return int64_t(optim::AdamWStreamer::staging_bytes(optim::OptimizerState::chunk_for(shard, pl)));
}

// A pipeline stage's parameters that local_model() counts but the stage does not hold: the embedding off the first
// stage, the final norm and the LM head off the last (tied embeddings are refused under pipeline parallelism).
int64_t params_off_stage(const MemoryJob& j, const LlamaConfig& m) {
  if (j.pipeline <= 1) return 0;
  int64_t n = 0;
  if (j.pipeline_rank != 0) n += m.vocab * m.hidden;
  if (j.pipeline_rank != j.pipeline - 1) n += m.vocab * m.hidden + m.hidden;
  return n;
}

// Weights, gradients and optimizer state (and Megatron-FSDP's windows of them), with the offload windows
// as a row of their own.
void add_parameter_rows(const MemoryJob& j, MemoryEstimate* e) {
  const LlamaConfig m = j.local_model();
  const int shards = j.shards();
  const bool offload = j.placement.offload_fraction > 0;
  // What each of the stage's missing parameters would have cost: a frozen base keeps its compute copy only, a
  // trained one FP32 master, gradient and compute copy and its share of m and v (neither is ever master-only), of
  // which --optimizer-cpu-offload keeps the offloaded fraction on the host.
  const double compute_bytes = j.dev == Device::cuda ? 2 : 4;
  const double state = 12.0 / std::max(1, shards) * (offload ? 1.0 - j.placement.offload_fraction : 1.0);
  // Megatron-FSDP shards the master and the gradient too, and optim_grads_params the compute copy (a LoRA base's
  // included).
  const bool fsdp = j.fsdp() != LlamaModel::Fsdp::off && shards > 1;
  const double compute_share =
      compute_bytes / (fsdp && j.fsdp() == LlamaModel::Fsdp::optim_grads_params ? double(shards) : 1.0);
  const double per_off_stage = j.lora ? compute_share
                               : fsdp ? 4.0 / shards + state + compute_share
                                      : 4.0 + compute_bytes + state;
  const double off_stage = double(params_off_stage(j, m)) * per_off_stage;
  if (j.lora) {
    const bool sharded_base = j.fsdp() == LlamaModel::Fsdp::optim_grads_params;
    const double all = double(LlamaModel::lora_parameter_bytes(m, j.dev, j.recipe, j.lora_spec,
                                                               sharded_base ? shards : 1, j.embeddings_per_step,
                                                               /*quantized_linears=*/false));
    // The adapters' store (FP32 master, grad, m, v + compute copy) and the frozen norms' gradient sink.
    const double adapters = double(LlamaModel::lora_store_bytes(m, j.dev, j.lora_spec));
    const double formula_adapters = double(lora_param_count(m, j.lora_spec) * (16 + (j.dev == Device::cuda ? 2 : 4)));
    e->rows.push_back({MemPart::params, all - formula_adapters - off_stage, "the frozen base's BF16 parts"});
    e->rows.push_back({MemPart::lora, adapters, "adapters with AdamW state"});
    return;
  }
  double bytes = double(LlamaModel::parameter_bytes(m, j.dev, j.params_plan, shards, j.placement, j.fsdp(),
                                                    j.embeddings_per_step)) -
                 off_stage;  // Megatron-FSDP's windows: a stage holds at most one of the two large units (over)
  if (offload) {
    const double staging = double(offload_staging_bytes(LlamaModel::optimizer_shard_elems(m, shards), j.placement));
    bytes -= staging;
    e->rows.push_back({MemPart::params, bytes,
                       strprintf("weights + grads, the device share of the state (%.1f bytes/param)",
                                 bytes / double(m.total_params()))});
    e->rows.push_back({MemPart::optimizer_staging, staging, "AdamWStreamer windows"});
    return;
  }
  const double per_param = bytes / double(m.total_params() - params_off_stage(j, m));
  std::string how = shards > 1 ? strprintf("sharded over %d ranks (%.1f bytes/param)", shards, per_param)
                               : strprintf("FP32 master, grad, m, v + compute copy (%.1f bytes/param)", per_param);
  if (j.tensor_parallel > 1) how += strprintf(" of this rank's 1/%d", j.tensor_parallel);
  e->rows.push_back({MemPart::params, bytes, how});
}

// A pipeline stage's activation plan, as LlamaModel::stage_activations makes it for this rank's chunks.
LlamaModel::StageActivations stage_activations(const MemoryJob& j, const LlamaConfig& m, MicroBatchShape shape,
                                               const std::vector<pp::LayerRange>& chunks) {
  const LoraSpec* lora = j.lora ? &j.lora_spec : nullptr;
  const int sp = j.sequence_parallel ? j.tensor_parallel : 1;
  return LlamaModel::plan_stage_activations(m, j.dev, shape, j.recompute,
                                            llama::scratch_input_layers(j.model, j.acts_plan, lora), lora, sp, chunks,
                                            j.pipeline_rank == j.pipeline - 1);
}

// The step's passes on this rank, in the schedule's order.
std::vector<LlamaModel::PipelinePass> stage_order(const MemoryJob& j) {
  return PipelineSchedule::pass_order(j.pipeline, j.virtual_stages, std::max(0, j.pipeline_rank), j.accumulation());
}

// The Linears' copies, their workspace, the weight stage and the emulated GEMMs' scratch. An annealed run
// releases the first recipe's Linears before the second's are made: the larger set counts.
Status add_linear_rows(const MemoryJob& j, MemoryEstimate* e) {
  const MicroBatchShape shape{j.micro_batch, j.local_seq()};
  const LlamaConfig m = j.local_model();
  const bool master_only = j.master_only();
  const bool sharded = j.training_format_gather || (j.lora && j.fsdp() == LlamaModel::Fsdp::optim_grads_params);
  LlamaModel::LinearMemory lm;
  const int sp_ranks = j.sequence_parallel ? j.tensor_parallel : 1;
  // A pipeline stage's own layers, by their indices in the whole model (which of them stay BF16 is counted from
  // the whole model's ends, as build_linears does), each quantized Linear with an input slot per pass in flight.
  std::vector<pp::LayerRange> chunks;
  if (j.pipeline > 1 && !j.pipeline_stages.empty())
    chunks = pp::rank_chunks(j.pipeline_stages, std::max(0, j.pipeline_rank), j.pipeline);
  const std::vector<pp::LayerRange>* stage = chunks.empty() ? nullptr : &chunks;
  const LlamaConfig linears_of = stage ? tp::local_config(j.model, j.tensor_parallel) : m;
  // Each chunk's quantized Linears keep an input slot per pass of it in flight (LlamaModel::stage_slots_for_layer).
  const std::vector<int64_t> in_flight =
      stage ? LlamaModel::chunk_in_flight(int(chunks.size()), stage_order(j)) : std::vector<int64_t>{};
  const auto slots = [&](const recipe::Recipe& r) {
    std::vector<int64_t> n;
    for (const int64_t f : in_flight) n.push_back(LlamaModel::pipeline_input_slots(r, j.recompute, j.lora, f));
    return n;
  };
  NB_TRY(LlamaModel::plan_linear_memory(linears_of, j.dev, shape, j.recompute, j.recipe, j.lora, master_only, sharded,
                                        &lm, sp_ranks, stage, slots(j.recipe)));
  if (j.anneal) {
    LlamaModel::LinearMemory next;
    NB_TRY(LlamaModel::plan_linear_memory(linears_of, j.dev, shape, j.recompute, j.anneal_recipe, j.lora, false,
                                          sharded, &next, sp_ranks, stage, slots(j.anneal_recipe)));
    if (next.owned + next.workspace > lm.owned + lm.workspace) lm = next;
  }
  double owned = double(lm.owned);
  if (j.training_format_gather) {
    // Megatron-FSDP's quantized windows: four layer windows and one layer of staging (distributed/fsdp.h).
    const double per_weight = j.recipe.weight.fmt == recipe::Fmt::nvfp4   ? (j.recipe.weight.two_d ? 0.5625 : 1.125)
                              : j.recipe.weight.fmt == recipe::Fmt::mxfp8 ? 2.0625
                              : j.recipe.weight.fmt == recipe::Fmt::fp8_block128x128 ? 2.0
                                                                                     : 1.0;
    owned += 5.0 * per_weight * double(m.linear_params_per_layer());
  }
  if (owned > 0) e->rows.push_back({MemPart::quantized_copies, owned, "recipe::Linear's placement, run dry"});
  if (lm.workspace > 0)
    e->rows.push_back({MemPart::linear_workspace, double(lm.workspace), "the largest need per slot"});
  if (lm.weight_stage > 0)
    e->rows.push_back({MemPart::weight_stage, double(lm.weight_stage), "the largest linear weight in BF16"});
  if (lm.emulated_scratch > 0)
    e->rows.push_back({MemPart::emulated_scratch, double(lm.emulated_scratch), "gemm's plan_emulation + 1/8"});
  return Status::ok();
}

// Staged tokens and labels of a step's micro-batches, packed rows' positions and segment starts, the RoPE
// tables and the per-token loss sums (LlamaModel::init and stage_batches); under tensor parallelism the
// vocabulary-parallel cross-entropy's statistics, f32 [3, LM-head chunk] (llama_tp.cpp).
double step_input_bytes(const MemoryJob& j) {
  const int64_t tokens = j.micro_batch * j.local_seq(), staged = std::max<int64_t>(1, j.accumulation());
  double b = 2.0 * double(align256(staged * tokens * 4));  // ids, targets
  if (j.packed) b += double(align256(staged * tokens * 4)) + double(align256((staged * (tokens + 1)) * 4));
  b += 2.0 * double(align256(j.seq * j.model.head_dim / 2 * 4));  // RoPE cos, sin
  b += double(align256(tokens * 4));                              // loss sums
  if (j.context_parallel > 1) b += double(align256(tokens * 4));  // the local tokens' row positions
  if (j.tensor_parallel > 1)
    b += double(align256(3 * llama::lm_chunk_tokens(j.local_model(), {j.micro_batch, j.local_seq()}) * 4));
  return b;
}

// The attention backward's workspace: nibble's own scratch (dQ accumulator, softmax sums, packed GQA's dK
// and dV, segment tables) by the layout attention_cudnn.cu uses, and cuDNN's part by its measured rule.
double attention_workspace_bytes(const MemoryJob& j) {
  const LlamaConfig m = j.local_model();
  const ops::AttentionShape sh{j.micro_batch, j.local_seq(), m.heads, m.kv_heads, m.head_dim, 1.0f};
  double b = double(ops::attention_workspace::backward_bytes(sh, j.packed, j.deterministic));
  if (j.context_parallel > 1) b += double(ops::cp::Ring::scratch_bytes(sh, DType::bf16));  // the ring's buffers
  return b;
}

// Data-parallel buffers: the BF16 bucket of a BF16 reduction (grad_sync.h), Megatron-FSDP's reduced chunk
// and BF16 scratch (distributed/fsdp.h), the delayed-scaling amax scratch.
double comm_bytes(const MemoryJob& j) {
  if (j.dp_cp_ranks() <= 1) return 0;
  double b = 0;
  const LlamaConfig m = j.local_model();
  const int64_t all = m.total_params();
  if (j.fsdp() != LlamaModel::Fsdp::off && !j.lora) {
    const int64_t large = m.vocab * m.hidden;
    const int64_t layer = m.linear_params_per_layer();
    b += double(align256((std::max(large, layer) + j.shards() - 1) / j.shards() * 4));  // the largest chunk, FP32
    if (j.grad_reduce_in_bf16) b += double(FsdpSync::bf16_scratch_bytes());
  } else if (j.grad_reduce_in_bf16 && !j.lora) {
    const int64_t bucket = j.bucket_elems();
    b += 2.0 * double(bucket > 0 ? std::min(bucket, all) : all);
  }
  return b;
}

// Host memory of one machine: every local rank's offloaded state, and rank 0's checkpoint copies. Under tensor
// parallelism the T ranks of rank 0's group each copy their part, and rank 0 gathers the group's parts and
// assembles the whole master, m and v (Trainer::save, trainer_tp.cpp).
double host_bytes(const MemoryJob& j) {
  const LlamaConfig m = j.local_model();
  const int shards = j.shards(), tp = j.tensor_parallel;
  const int64_t shard = LlamaModel::optimizer_shard_elems(m, shards);
  double b = 0;
  if (j.placement.offload_fraction > 0)
    b += 12.0 * double(optim::OptimizerState::offloaded_elems(shard, j.placement)) * double(j.local_ranks);
  if (!j.saves) return b;
  const bool from_state = j.placement.offload_fraction > 0 && shards <= 1;
  const int64_t trained = j.lora ? lora_param_count(m, j.lora_spec) : m.total_params();
  const int64_t whole = j.lora ? lora_param_count(j.model, j.lora_spec) : j.model.total_params();
  if (!from_state) b += 12.0 * double(trained) * double(std::min(tp, std::max(1, j.local_ranks)));
  if (tp > 1) b += 12.0 * double(whole) + 4.0 * double(tp) * double(trained);
  return b;
}

// A save under tensor parallelism: the device chunks rank 0's group gathers through (Trainer::
// gather_tensor_parallel: one chunk sent, T received), allocated outside any part of the ledger.
double tensor_parallel_save_bytes(const MemoryJob& j) {
  if (!j.saves || j.tensor_parallel <= 1) return 0;
  int64_t total = 0;  // the store's elements, as it lays them out (LoRA: the adapters')
  if (j.lora) {
    for (const ParamInfo& p : lora_param_list(j.local_model(), j.lora_spec)) {
      int64_t n = 1;
      for (int64_t d : p.shape) n *= d;
      total += (n + ParamStore::kAlign - 1) / ParamStore::kAlign * ParamStore::kAlign;
    }
  } else {
    ParamStore::flat_layout(j.local_model(), &total);
  }
  const int64_t chunk = std::min<int64_t>(total, int64_t(1) << 24);
  return double(align256(chunk * 4)) + double(align256(j.tensor_parallel * chunk * 4));
}

}  // namespace

namespace {

// The arena's plan; a pipeline stage's as LlamaModel::init_pipeline sizes it (plan_stage_activations) for its
// schedule's most passes in flight.
int64_t activation_bytes(const MemoryJob& j, const LlamaConfig& m, MicroBatchShape shape, const LoraSpec* lora) {
  const int sp = j.sequence_parallel ? j.tensor_parallel : 1;
  if (j.pipeline == 1) return LlamaModel::plan_activation_bytes(m, j.dev, shape, j.recompute, j.acts_plan, lora, sp);
  std::vector<pp::LayerRange> chunks = pp::rank_chunks(j.pipeline_stages, j.pipeline_rank, j.pipeline);
  if (chunks.empty()) chunks = {{0, m.layers}};  // no split given: an even share of the first layers
  const LlamaModel::StageActivations acts = stage_activations(j, m, shape, chunks);
  return acts.bytes(LlamaModel::plan_slot_bytes(acts.chunk_kept, stage_order(j)));
}

}  // namespace

int64_t MemoryJob::pipeline_layers() const {
  if (pipeline <= 1) return model.layers;
  const std::vector<pp::LayerRange> chunks = pp::rank_chunks(pipeline_stages, std::max(0, pipeline_rank), pipeline);
  if (chunks.empty()) return (model.layers + pipeline - 1) / pipeline;
  int64_t n = 0;
  for (const pp::LayerRange& c : chunks) n += c.end - c.begin;
  return n;
}

namespace {

Status estimate_stage(const MemoryJob& j, MemoryEstimate* e) {
  *e = MemoryEstimate{};
  add_parameter_rows(j, e);
  const MicroBatchShape shape{j.micro_batch, j.local_seq()};
  const LoraSpec* lora = j.lora ? &j.lora_spec : nullptr;
  const LlamaConfig m = j.local_model();
  e->rows.push_back({MemPart::activations, double(align256(activation_bytes(j, m, shape, lora))),
                     "the arena's plan (" +
                         std::string(j.recompute == Recompute::none        ? "no"
                                     : j.recompute == Recompute::selective ? "selective"
                                                                           : "full") +
                         " recompute)"});
  NB_TRY(add_linear_rows(j, e));
  if (j.dev == Device::cuda) {
    const bool two = j.recipe.quantized() || (j.anneal && j.anneal_recipe.quantized());
    e->rows.push_back({MemPart::gemm_workspace, (two ? 2.0 : 1.0) * double(gemm::kCublasLtWorkspaceBytes),
                       two ? "the BF16 and the FP8 backend's" : "one per GPU"});
    e->rows.push_back({MemPart::attention_workspace, attention_workspace_bytes(j),
                       j.deterministic ? "deterministic: cuDNN's dQ partials (measured rule)"
                                       : "dQ accumulator + cuDNN's part (measured rule)"});
  }
  e->rows.push_back({MemPart::step_inputs, step_input_bytes(j), "a step's micro-batches staged at once"});
  if (const double c = comm_bytes(j); c > 0) e->rows.push_back({MemPart::comm_buffers, c, "reduction scratch"});
  if (j.quant_stats && j.recipe.quantized() && !j.lora) {
    // recipe/linear_stats.h: every quantized Linear keeps a BF16 copy of its input for the Wgrad error, and
    // one shared FP32 scratch holds the reference dW of the largest weight (and the alternative's codes).
    double inputs = 0;
    for (const LlamaModel::LinearSpec& sp : LlamaModel::linear_specs(m, j.recipe, j.recompute))
      inputs += sp.bf16_layer ? 0.0 : double(align256(j.micro_batch * j.local_seq() * sp.in * 2));
    const double w = double(LlamaModel::largest_linear_weight(m));
    e->rows.push_back({MemPart::quant_stats, inputs + 5.0 * w, "BF16 inputs of the Linears + FP32 Wgrad scratch"});
  }
  if (const double g = tensor_parallel_save_bytes(j); g > 0)
    e->rows.push_back({MemPart::other, g, "a save's tensor-parallel gather chunks"});
  if (j.sample_len > 0) {  // rank 0 (and its tensor-parallel group) only; the other ranks hold less
    const bool cast = j.master_only() && j.recipe.quantized();
    e->rows.push_back({MemPart::samples,
                       double(infer::Generator::planned_bytes(j.model, j.dev, 1, j.sample_len, j.sample_prompt_tokens,
                                                              cast, 0, j.tensor_parallel)),
                       "the generator's KV cache and buffers while it samples"});
  }
  if (j.dev == Device::cuda) e->libraries = kLibraryBytes + (j.ranks > 1 ? kNcclBytes : 0.0);
  e->host = host_bytes(j);
  return Status::ok();
}

}  // namespace

// Under pipeline parallelism (unless one rank is asked for) every rank's stage; the largest is the job's need.
Status estimate_memory(const MemoryJob& j, MemoryEstimate* e) {
  if (j.pipeline <= 1 || j.pipeline_rank >= 0) {
    NB_TRY(estimate_stage(j, e));
    e->pipeline_rank = j.pipeline > 1 ? j.pipeline_rank : -1;
    return Status::ok();
  }
  std::vector<double> totals;
  for (int r = 0; r < j.pipeline; ++r) {
    MemoryJob stage = j;
    stage.pipeline_rank = r;
    MemoryEstimate mine;
    NB_TRY(estimate_stage(stage, &mine));
    totals.push_back(mine.device());
    if (r == 0 || mine.device() > e->device()) {
      *e = std::move(mine);
      e->pipeline_rank = r;
    }
  }
  e->stage_totals = std::move(totals);
  return Status::ok();
}

std::string format_memory_table(const MemoryEstimate& e, double free_bytes) {
  std::string s = "memory estimate per GPU, by part (each from the code that sizes it):\n";
  if (e.pipeline_rank >= 0)
    s = strprintf(
        "memory estimate per GPU, by part (each from the code that sizes it), for pipeline rank %d's "
        "stage, the largest:\n",
        e.pipeline_rank);
  for (const MemoryEstimate::Row& r : e.rows)
    s += strprintf("  %-42s %9.2f GiB   %s\n", mem_part_name(r.part), gib(r.bytes), r.how.c_str());
  s += strprintf("  %-42s %9.2f GiB   measured constant (handles, NCCL, stream-ordered pool)\n",
                 "CUDA libraries (outside nibble's allocator)", gib(e.libraries));
  s += strprintf("  %-42s %9.2f GiB", "total", gib(e.device()));
  if (free_bytes > 0)
    s += strprintf(" of %.2f GiB free: %s", gib(free_bytes), e.device() <= free_bytes ? "fits" : "does NOT fit");
  s += "\n";
  if (e.stage_totals.size() > 1) {  // the first stage holds the most passes in flight, the last the LM head
    s += "  total by pipeline stage:";
    for (size_t r = 0; r < e.stage_totals.size(); ++r)
      s += strprintf("%s rank %zu %.2f GiB", r ? "," : "", r, gib(e.stage_totals[r]));
    s += "\n";
  }
  if (e.host > 0)
    s += strprintf("  host memory on one machine: %.2f GiB (offloaded state, checkpoint copies)\n", gib(e.host));
  return s;
}

int64_t largest_fitting_micro_batch(const MemoryJob& job, double free_bytes) {
  int64_t best = 0;
  const int64_t per_rank = std::max<int64_t>(1, job.global_batch / job.data_ranks());
  for (int64_t mbs = 1; mbs <= std::min<int64_t>(1024, per_rank); mbs *= 2) {
    if (per_rank % mbs != 0) break;
    MemoryJob j = job;
    j.micro_batch = mbs;
    MemoryEstimate e;
    if (!estimate_memory(j, &e) || e.device() > free_bytes) break;
    best = mbs;
  }
  return best;
}

}  // namespace nb
