// The Trainer's memory phases: the job as the estimate sees it (memory_job), the estimate before the first
// allocation with the largest micro-batch and, when the job does not fit, the changes that would (each one
// checked by the estimate), the host-memory check of an offloaded state, what an out-of-memory at run time
// says, the measured high-water marks beside the estimate at the end, and `--dry-run`.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include "core/device_info.h"
#include "core/log.h"
#include "optim/optimizer_state.h"
#include "train/trainer.h"

namespace nb {

namespace {
double gib(double bytes) { return bytes / 1073741824.0; }
}  // namespace

MemoryJob Trainer::memory_job() const {
  MemoryJob j;
  j.model = model_cfg_;
  j.dev = dev_;
  j.recipe = recipe_;
  j.params_plan = param_plan_recipe();
  j.acts_plan = activation_plan_recipe();
  j.anneal = anneal_configured();
  j.anneal_recipe = anneal_recipe_;
  j.micro_batch = cfg_.micro_batch_size;
  j.seq = cfg_.seq_length;
  j.global_batch = cfg_.global_batch_size;
  j.recompute = recompute_;
  j.ranks = world_.size;
  j.context_parallel = cp_size();
  j.tensor_parallel = tp_size();
  j.pipeline = pp_size();
  j.virtual_stages = virtual_stages_;
  j.pipeline_stages = pp_stages_;
  j.sequence_parallel = cfg_.sequence_parallel;
  j.local_ranks = std::max(1, world_.local_size);
  j.strategy = cfg_.sharding_strategy();
  j.placement = model_.optimizer_placement;
  j.offload_chunk_elems = int64_t(cfg_.optimizer_state_offload_chunk_size_mb * 1048576.0 / 4.0);
  j.lora = lora();
  j.lora_spec = lora_spec_;
  j.embeddings_per_step = cfg_.fsdp_embeddings_per_step;
  j.grad_reduce_in_bf16 = cfg_.grad_reduce_in_bf16;
  j.overlap = cfg_.overlap_grad_reduce || cfg_.overlap_param_gather;
  j.ddp_bucket_size = cfg_.ddp_bucket_size;
  j.training_format_gather = training_format_gather();
  j.quant_stats = cfg_.quant_stats;
  j.packed = cfg_.sft && cfg_.packed_sequence;
  j.deterministic = cfg_.deterministic_mode;
  if (cfg_.sample_interval > 0) {  // the prompt's tokens once the tokenizer has read it, else its bytes at most
    j.sample_prompt_tokens = sample_ids_.empty() ? int64_t(cfg_.sample_prompt.size()) + 1 : int64_t(sample_ids_.size());
    j.sample_len = std::min<int64_t>(model_cfg_.max_seq, j.sample_prompt_tokens + cfg_.sample_tokens);
  }
  j.saves = !cfg_.save.empty();
  return j;
}

// The estimate before anything is allocated: the table, the largest micro-batch, and a refusal that names
// the changes that would fit when this job does not.
Status Trainer::estimate_memory() {
  const MemoryJob job = memory_job();
  NB_TRY(nb::estimate_memory(job, &estimate_));
  own_estimate_ = estimate_;
  if (pp_size() > 1 && estimate_.pipeline_rank != layout_.pp) {
    MemoryJob own = job;
    own.pipeline_rank = layout_.pp;
    NB_TRY(nb::estimate_memory(own, &own_estimate_));
  }
  device_memory_info(&free_bytes_, &total_bytes_);
  base_used_ = total_bytes_ - free_bytes_;
  const double free = dev_ == Device::cuda ? double(free_bytes_) : 0.0;
  std::printf("%s", format_memory_table(estimate_, free).c_str());
  if (dev_ != Device::cuda) return check_host_memory();
  std::printf("largest micro-batch that fits: %lld%s\n", (long long)largest_fitting_micro_batch(job, free),
              offload_fraction_advice().c_str());
  NB_TRY(check_host_memory());
  if (estimate_.device() <= free) return Status::ok();
  std::string why;
  const int gpus = int(query_gpus(&why).size());
  return Status::error(does_not_fit_message(job, free, optim::host_memory_available_bytes(), gpus));
}

// "this job needs X GiB but Y is free; ..." with the changes the estimate says would fit, cheapest first.
std::string Trainer::does_not_fit_message(const MemoryJob& job, double free, double host, int gpus) const {
  std::string s = strprintf(
      "out of GPU memory before step 1: this job needs about %.2f GiB per GPU (%.2f GiB of it activations) but "
      "%.2f GiB is free",
      gib(estimate_.device()), gib(estimate_.part(MemPart::activations)), gib(free));
  const std::vector<MemoryAdvice> advice = advise_memory(job, free, host, std::max(gpus, 8));
  const std::string split = "; " + parallel_split_line(job, free, host, std::max(gpus, 8));
  if (advice.empty())
    return s +
           strprintf(
               "; no change of --micro-batch-size, --recompute, --optimizer-cpu-offload, sharding, tensor or "
               "context parallelism over up to %d GPUs fits it, alone or in pairs: shorten --seq-length (now "
               "%lld) or plan a larger machine with nibble train --dry-run",
               std::max(gpus, 8), (long long)cfg_.seq_length) +
           split;
  s += "; what would fit, cheapest first: ";
  for (size_t i = 0; i < advice.size(); ++i)
    s += strprintf("%s%s (%s, %.2f GiB)", i ? "; or " : "", advice[i].flags.c_str(), advice[i].what.c_str(),
                   gib(advice[i].device_bytes));
  return s + split;
}

// With offload, the least share of the state in host memory with which the estimate still fits the GPU at
// this micro-batch (less streaming per step).
std::string Trainer::offload_fraction_advice() const {
  if (!(model_.optimizer_placement.offload_fraction > 0)) return "";
  const double least = least_offload_fraction(memory_job(), double(free_bytes_), 0.0);
  return least > 0 ? strprintf("; least --optimizer-offload-fraction that fits: %.2f", least) : "";
}

// --optimizer-cpu-offload: the share of master, m and v this rank keeps in page-locked host memory must fit
// the host beside the other ranks of this machine, or the job stops before anything is allocated.
Status Trainer::check_host_memory() {
  const optim::Placement& pl = model_.optimizer_placement;
  if (!(pl.offload_fraction > 0)) return Status::ok();
  const int64_t shard =
      LlamaModel::optimizer_shard_elems(tp::local_config(model_cfg_, tp_size()), model_.optimizer_shard_count);
  const double mine = 12.0 * double(optim::OptimizerState::offloaded_elems(shard, pl));
  const double node = mine * double(world_.local_size), avail = optim::host_memory_available_bytes();
  std::printf(
      "host memory: optimizer state offloaded %.0f%% (%.2f GiB page-locked per rank, %d rank%s here), "
      "%.2f GiB available\n",
      100.0 * pl.offload_fraction, gib(mine), world_.local_size, world_.local_size > 1 ? "s" : "", gib(avail));
  if (avail <= 0 || node <= avail * 0.95) return Status::ok();
  const double fits = std::floor(100.0 * pl.offload_fraction * avail * 0.95 / node) / 100.0;
  return errorf(
      "the offloaded optimizer state needs %.2f GiB of page-locked host memory on this machine (%.0f%% of 12 "
      "bytes x %lld parameters%s) but %.2f GiB is available; pass --optimizer-offload-fraction %.2f or less (the "
      "rest stays on the GPU), use more machines, or free host memory",
      gib(node), 100.0 * pl.offload_fraction, (long long)shard,
      world_.local_size > 1 ? strprintf(" on each of %d ranks", world_.local_size).c_str() : "", gib(avail), fits);
}

// An allocation that failed although the estimate said the job fits: name the part, its estimate and what
// nibble held, and call the estimate wrong (a bug to report). Other errors pass through unchanged.
Status Trainer::explain_out_of_memory(const Status& st) const {
  if (st.is_ok() || st.message().find("out of GPU memory allocating") == std::string::npos) return st;
  const LedgerSnapshot held = ledger_snapshot(Device::cuda);
  std::string parts;
  for (int p = 0; p < kMemParts; ++p) {
    const double est = own_estimate_.part(MemPart(p)), now = double(held.parts[size_t(p)].current);
    if (est > 0 || now > 0)
      parts += strprintf("%s%s %.2f GiB held / %.2f estimated", parts.empty() ? "" : ", ", mem_part_name(MemPart(p)),
                         gib(now), gib(est));
  }
  return errorf(
      "%s. The memory estimate (%.2f GiB in all) said this job fits the %.2f GiB that was free, so the estimate "
      "is wrong: please report this line as a bug. By part: %s. Nothing was saved over: checkpoints already "
      "written are intact",
      st.message().c_str(), gib(own_estimate_.device()), gib(double(free_bytes_)), parts.c_str());
}

// After the run: each part's measured high-water mark beside its estimate (the ledger, core/memory_ledger.h).
void Trainer::report_memory() const {
  const LedgerSnapshot s = ledger_snapshot(dev_);
  double device_peak = peak_mem_;  // sampled after each step's micro-batches; and now, after evaluation and saves
  if (dev_ == Device::cuda) {
    size_t f = 0, t = 0;
    device_memory_info(&f, &t);
    device_peak = std::max(device_peak, double(t - f - base_used_));
  }
  const MemoryEstimate& e = own_estimate_;  // this rank's stage, under pipeline parallelism
  if (e.pipeline_rank >= 0)
    std::printf(
        "memory by part: estimate of pipeline rank %d's stage (this rank's) vs allocator high-water mark (GiB)\n",
        e.pipeline_rank);
  else
    std::printf("memory by part: estimate vs allocator high-water mark (GiB)\n");
  for (int p = 0; p < kMemParts; ++p) {
    const double est = e.part(MemPart(p)), peak = double(s.parts[size_t(p)].peak);
    if (est > 0 || peak > 0) std::printf("  %-42s %9.2f %9.2f\n", mem_part_name(MemPart(p)), gib(est), gib(peak));
  }
  std::printf(
      "memory check: estimate %.3f GiB (nibble %.3f + libraries %.3f), allocator peak %.3f GiB, device peak "
      "%.3f GiB\n",
      gib(e.device()), gib(e.nibble()), gib(e.libraries), gib(double(s.total.peak)), gib(device_peak));
}

// --dry-run: the phases of setup that need no GPU and read no weights or data, then the estimate for the
// planned machine, the largest micro-batch, and (when it does not fit) the changes that would.
Status Trainer::dry_run(TrainConfig cfg, const DryRun& plan, bool* fits) {
  dry_run_ = true;
  cfg_ = std::move(cfg);
  world_ = dist::World{};
  world_.size = plan.ranks;
  world_.local_size = plan.ranks_per_node;
  NB_TRY(apply_world());
  NB_TRY(resolve_config());
  dev_ = Device::cuda;  // the planned GPU: Hopper, as the recipes' support rules need a capability
  cc_major_ = 9;
  cc_minor_ = 0;
  device_name_ = strprintf("planned: %.0f GiB GPU x %d (%d per machine), %.0f GiB host memory (--dry-run)",
                           gib(plan.gpu_bytes), plan.ranks, plan.ranks_per_node, gib(plan.host_bytes));
  NB_TRY(recipe::check_supported(recipe_, cc_major_, cc_minor_));
  NB_TRY(plan_pipeline());  // the split and the virtual stages the estimate sizes each stage by
  print_plan();
  print_pipeline_plan();
  const MemoryJob job = memory_job();
  NB_TRY(nb::estimate_memory(job, &estimate_));
  const double free = plan.gpu_bytes - kCudaContextBytes;
  std::printf("%s", format_memory_table(estimate_, free).c_str());
  if (estimate_.host > 0 && plan.host_bytes > 0)
    std::printf("host memory: %.2f GiB needed of %.2f GiB (%s)\n", gib(estimate_.host), gib(plan.host_bytes),
                estimate_.host <= 0.95 * plan.host_bytes ? "fits" : "does NOT fit");
  std::printf("largest micro-batch that fits: %lld\n", (long long)largest_fitting_micro_batch(job, free));
  *fits = estimate_.device() <= free && (plan.host_bytes <= 0 || estimate_.host <= 0.95 * plan.host_bytes);
  if (*fits) {
    std::printf("dry run: this job fits (%.2f of %.2f GiB per GPU)\n", gib(estimate_.device()), gib(free));
    return Status::ok();
  }
  const std::vector<MemoryAdvice> advice = advise_memory(job, free, plan.host_bytes, std::max(8, plan.ranks_per_node));
  std::printf("dry run: this job does NOT fit (%.2f GiB per GPU, %.2f GiB usable)\n", gib(estimate_.device()),
              gib(free));
  if (advice.empty()) std::printf("no single change or pair of changes fits it\n");
  for (const MemoryAdvice& a : advice)
    std::printf("  would fit: %s  (%.2f GiB per GPU; %s)\n", a.flags.c_str(), gib(a.device_bytes), a.what.c_str());
  const int gpus = std::max(8, std::max(plan.ranks_per_node, plan.ranks));
  std::printf("%s\n", parallel_split_line(job, free, plan.host_bytes, gpus).c_str());
  return Status::ok();
}

}  // namespace nb
