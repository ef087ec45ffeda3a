// Trainer setup phases: everything that needs no GPU is checked first, the resolved configuration and
// the per-layer recipe are printed, the memory estimate comes before the first allocation, then the
// model and the data sources are built.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include "core/determinism.h"
#include "core/device_info.h"
#include "core/log.h"
#include "data/token_check.h"
#include "io/hf_llama.h"
#include "tokenizer/bpe_tokenizer.h"
#include "train/trainer.h"

namespace nb {

namespace {

double gib(double bytes) { return bytes / 1073741824.0; }

std::string oom_advice(const TrainConfig& c, double need_gib, double free_gib) {
  // Weights, gradients and AdamW state shrink with more ranks only when sharded; with LoRA only the frozen
  // base is worth sharding (the adapters are small).
  std::string more;
  if (c.peft == "lora")
    more = c.sharding_strategy() != "optim_grads_params" || c.data_parallel == 1
               ? "; or shard the frozen base over N GPUs: --nproc-per-node N --use-megatron-fsdp "
                 "--data-parallel-sharding-strategy optim_grads_params (1/N of the base per GPU), or a smaller "
                 "--lora-base-precision"
               : "; or add GPUs (the frozen base is sharded over " + std::to_string(c.data_parallel) +
                     "), or a smaller --lora-base-precision";
  else if (c.data_parallel == 1)
    more =
        "; or train on more GPUs with --use-distributed-optimizer (6 + 12/N bytes per parameter on N GPUs "
        "instead of 18) or --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params (18/N)";
  else if (c.sharding_strategy() != "optim_grads_params")
    more = "; or shard more over the " + std::to_string(c.data_parallel) +
           " GPUs: --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params (18/N bytes per parameter)";
  else
    more = "; or add GPUs (weights, gradients and optimizer state are sharded over " + std::to_string(c.data_parallel) +
           ")";
  return strprintf(
      "needs about %.2f GiB of GPU memory but %.2f GiB is free; lower --micro-batch-size (now %lld), "
      "use --recompute selective or full (now %s), or shorten --seq-length (now %lld)%s",
      need_gib, free_gib, (long long)c.micro_batch_size, c.recompute.c_str(), (long long)c.seq_length, more.c_str());
}

}  // namespace

Status Trainer::setup(TrainConfig cfg) {
  cfg_ = std::move(cfg);
  NB_TRY(detect_ranks());
  NB_TRY(resolve_config());
  NB_TRY(check_tokenizer());
  NB_TRY(setup_sampling());
  NB_TRY(pick_device());
  print_plan();
  NB_TRY(connect_ranks());
  NB_TRY(estimate_memory());
  NB_TRY(open_lora_base());
  NB_TRY(build_model());
  NB_TRY(prepare_grad_sync());
  NB_TRY(load());
  return build_data();
}

// The model comes from --load-hf's config.json when one is given (and no preset was asked for).
Status Trainer::resolve_config() {
  set_deterministic_mode(cfg_.deterministic_mode);  // process-wide, before any GEMM or attention plan exists
  // A given --data-path is the data: mock data (on by default) is for runs without one. Before this rule
  // a --data-path without --mock-data false trained on mock tokens without a word.
  if (!cfg_.data_path.empty()) cfg_.mock_data = false;
  NB_TRY(resolve_model(cfg_, &model_cfg_));
  if (!cfg_.load_hf.empty()) {  // the model is the folder's config.json
    NB_TRY(read_hf_config(cfg_.load_hf, &model_cfg_).context("--load-hf"));
    if (cfg_.vocab_size > 0 && (cfg_.vocab_size + 127) / 128 * 128 != model_cfg_.vocab)
      return errorf("--vocab-size %lld conflicts with the vocabulary %lld of --load-hf %s; leave --vocab-size out",
                    (long long)cfg_.vocab_size, (long long)model_cfg_.vocab, cfg_.load_hf.c_str());
  }
  NB_TRY(validate_train_config(cfg_, model_cfg_));
  NB_TRY(resolve_lora());
  NB_TRY(parse_recompute(cfg_.recompute, &recompute_));
  NB_TRY(recipe::recipe_preset(cfg_.recipe, &recipe_).context("--recipe"));
  recipe::RecipeKnobs knobs;
  knobs.disable_fp4 = cfg_.disable_fp4;
  knobs.fp4_disable_rht = cfg_.fp4_disable_rht;
  knobs.fp4_disable_sr = cfg_.fp4_disable_sr;
  knobs.fp4_disable_2d = cfg_.fp4_disable_2d;
  knobs.fp4_4over6 = cfg_.fp4_4over6;
  knobs.fp4_4over6_err_mode = cfg_.fp4_4over6_err_mode;
  knobs.first_last_layers_bf16 = cfg_.first_last_layers_bf16;
  knobs.layers_at_start_bf16 = cfg_.num_layers_at_start_in_bf16;
  knobs.layers_at_end_bf16 = cfg_.num_layers_at_end_in_bf16;
  NB_TRY(recipe::apply_knobs(knobs, &recipe_));
  recipe_.seed = uint64_t(cfg_.seed);
  if (cfg_.emulated_weight_cache) {
    if (recipe_.weight.fmt != recipe::Fmt::mxfp8 && recipe_.weight.fmt != recipe::Fmt::nvfp4)
      return errorf(
          "--emulated-weight-cache keeps MXFP8/NVFP4 weights dequantized for their emulated GEMMs, but recipe "
          "'%s' has %s weights; leave the flag out",
          recipe_.name.c_str(), recipe::fmt_name(recipe_.weight.fmt));
    recipe_.keep_dequantized_weights = true;
  }
  NB_TRY(resolve_anneal());
  accum_ = cfg_.global_batch_size / (cfg_.micro_batch_size * cfg_.data_parallel);
  tokens_per_step_ = cfg_.global_batch_size * cfg_.seq_length;
  flops_per_token_ = lora() ? lora_flops_per_token() : model_cfg_.flops_per_token(cfg_.seq_length);
  if (cfg_.optimizer_cpu_offload)  // where master, m and v live (optim/optimizer_state.h)
    model_.optimizer_placement = {cfg_.optimizer_offload_fraction,
                                  int64_t(cfg_.optimizer_state_offload_chunk_size_mb * 1048576.0 / 4.0)};
  return Status::ok();
}

// Real data: the tokenizer's and the data's ids must fit the model's vocabulary.
Status Trainer::check_tokenizer() {
  if (!cfg_.mock_data && !cfg_.tokenizer.empty()) {
    std::unique_ptr<BpeTokenizer> tok;
    NB_TRY(BpeTokenizer::load(cfg_.tokenizer, "auto", &tok).context("--tokenizer"));
    if (tok->vocab_size() > model_cfg_.vocab)
      return errorf(
          "the tokenizer %s has %lld tokens but model %s has a vocabulary of %lld; pass --vocab-size %lld "
          "or a preset with a larger vocabulary",
          cfg_.tokenizer.c_str(), (long long)tok->vocab_size(), model_cfg_.name.c_str(), (long long)model_cfg_.vocab,
          (long long)tok->vocab_size());
  }
  // The data itself, with or without a tokenizer: one scan per dataset (cached), before any allocation.
  const std::string tokens = cfg_.sft ? cfg_.data_path + "_tokens_document" : cfg_.data_path;
  if (!cfg_.mock_data && cfg_.sft)
    NB_TRY(check_dataset_vocab(tokens, "", model_cfg_.vocab, model_cfg_.name)
               .context("--sft --data-path " + cfg_.data_path + " (the prefix given to nibble preprocess --sft)"));
  else if (!cfg_.mock_data)
    NB_TRY(check_dataset_vocab(tokens, "", model_cfg_.vocab, model_cfg_.name));
  return Status::ok();
}

Status Trainer::pick_device() {
  dev_ = Device::cpu;
  device_name_ = "CPU (reference backend)";
  std::string why;
  if (cfg_.device != "cpu") {
    auto gpus = query_gpus(&why);
    if (!gpus.empty()) {
      const int gpu = world_.local_rank;  // each rank of a node takes the GPU of its local rank
      if (world_.distributed()) NB_TRY(set_current_gpu(gpu));
      dev_ = Device::cuda;
      device_name_ = gpus[size_t(gpu)].name;
      cc_major_ = gpus[size_t(gpu)].cc_major;
      cc_minor_ = gpus[size_t(gpu)].cc_minor;
    } else if (cfg_.device == "cuda") {
      return errorf("--device cuda was asked for but %s", why.c_str());
    } else {
      NB_LOG_WARN("no GPU (%s): training on the CPU backend, which is meant for tiny models", why.c_str());
    }
  }
  NB_TRY(recipe::check_supported(recipe_, cc_major_, cc_minor_));
  NB_TRY(recipe::check_supported(anneal_recipe_, cc_major_, cc_minor_).context("--anneal-recipe"));
  peak_tflops_ = cfg_.peak_tflops > 0 ? cfg_.peak_tflops : (dev_ == Device::cuda ? bf16_peak_tflops(device_name_) : 0);
  if (!cfg_.save.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(cfg_.save, ec);
    if (ec) return errorf("cannot create the --save folder %s: %s", cfg_.save.c_str(), ec.message().c_str());
  }
  return Status::ok();
}

// The resolved configuration (valid TOML), the model, the batch and which layer runs which format.
void Trainer::print_plan() {
  std::printf("---------------- nibble train: resolved configuration ----------------\n%s",
              format_config(cfg_).c_str());
  std::printf("device = \"%s\"\n", device_name_.c_str());
  const LlamaConfig& m = model_cfg_;
  std::printf("model: %s, %lld layers, hidden %lld, ffn %lld, heads %lld/%lld kv, vocab %lld, %.2f M parameters\n",
              m.name.c_str(), (long long)m.layers, (long long)m.hidden, (long long)m.ffn, (long long)m.heads,
              (long long)m.kv_heads, (long long)m.vocab, m.total_params() / 1e6);
  std::printf(
      "batch: %lld tokens/step = global batch %lld x seq %lld (micro-batch %lld, %lld accumulation steps); "
      "%.2f GFLOP/token\n",
      (long long)tokens_per_step_, (long long)cfg_.global_batch_size, (long long)cfg_.seq_length,
      (long long)cfg_.micro_batch_size, (long long)accum_, flops_per_token_ / 1e9);
  std::printf("recipe %s:\n", recipe_.name.c_str());
  for (int64_t l = 0; l < m.layers;) {
    const bool bf16 = recipe_.layer_in_bf16(l, m.layers);
    int64_t e = l;
    while (e + 1 < m.layers && recipe_.layer_in_bf16(e + 1, m.layers) == bf16) ++e;
    std::printf("  layers %lld-%lld: %s\n", (long long)l, (long long)e,
                recipe::describe_gemms(recipe_, bf16, cc_major_, cc_minor_).c_str());
    l = e + 1;
  }
  std::printf("  embedding, attention, norms, LM head and loss: bf16; master weights, gradients, AdamW: fp32\n");
  if (cfg_.deterministic_mode && dev_ == Device::cuda)
    std::printf("deterministic mode: attention backward without the atomic dQ accumulator, GEMMs without split-K%s\n",
                world_.distributed() ? ", NCCL Ring/Simple unless NCCL_ALGO/NCCL_PROTO are set" : "");
  print_lora_plan();
  print_anneal_plan();
  if (!cfg_.save.empty()) {
    if (logging_rank()) std::ofstream(cfg_.save + "/config.toml") << format_config(cfg_);
    if (cfg_.save_interval > 0 || cfg_.exit_interval > 0)
      std::printf("checkpoints: %s every %lld iterations%s%s, keep %s, %s writes\n", cfg_.save.c_str(),
                  (long long)cfg_.save_interval, cfg_.save_interval > 0 ? " and at the end" : " (none)",
                  cfg_.exit_interval > 0
                      ? strprintf("; exit after a multiple of %lld", (long long)cfg_.exit_interval).c_str()
                      : "",
                  cfg_.save_keep > 0 ? std::to_string(cfg_.save_keep).c_str() : "all",
                  cfg_.async_save ? "background" : "synchronous");
  }
}

// Megatron-FSDP gathers the quantized layers' weights as codes and scales (trainer_dist.cpp's choice).
bool Trainer::training_format_gather() const {
  return model_.fsdp == LlamaModel::Fsdp::optim_grads_params && world_.size > 1 && recipe_.quantized() && !lora() &&
         cfg_.fsdp_param_gather != "bf16" && !cfg_.quant_stats && !(cfg_.anneal_start_fraction > 0);
}

// Bytes per weight element of what a training-format gather moves (recipe/linear.h: the copies it gathers).
double Trainer::gathered_bytes_per_weight(const recipe::Recipe& r) {
  switch (r.weight.fmt) {
    case recipe::Fmt::nvfp4: return r.weight.two_d ? 0.5625 : 1.125;
    case recipe::Fmt::mxfp8: return 2.0625;
    case recipe::Fmt::fp8_block128x128: return 2.0;
    default: return 1.0;
  }
}

// The quantized inputs' column copies Wgrad reads: one per linear of every quantized layer, or with full
// recompute one per linear of a layer (shared workspace slots, recipe/linear_workspace.h).
double Trainer::input_column_copy_bytes() const {
  double per_element = 1.0;  // per-tensor FP8
  switch (recipe_.input.fmt) {
    case recipe::Fmt::nvfp4: per_element = 0.5625; break;
    case recipe::Fmt::mxfp8: per_element = 1.03125; break;
    case recipe::Fmt::fp8_block128: per_element = 1.03125; break;
    default: break;
  }
  const double in_per_layer = 3.0 * double(model_cfg_.hidden) + double(model_cfg_.ffn);  // qkv, o, gate_up, down
  int64_t quantized = 0;
  for (int64_t l = 0; l < model_cfg_.layers; ++l) quantized += recipe_.layer_in_bf16(l, model_cfg_.layers) ? 0 : 1;
  const double layers = recompute_ == Recompute::full ? 1.0 : double(quantized);
  return per_element * double(cfg_.micro_batch_size * cfg_.seq_length) * in_per_layer * layers;
}

Status Trainer::estimate_memory() {
  const MicroBatchShape shape{cfg_.micro_batch_size, cfg_.seq_length};
  const LoraSpec* lora_spec = lora() ? &lora_spec_ : nullptr;
  // Precision annealing plans for both recipes from the start (trainer_anneal.cpp).
  const recipe::Recipe params_plan = param_plan_recipe(), acts_plan = activation_plan_recipe();
  // LoRA under optim_grads_params: 1/N of the frozen base per rank plus its gathered windows.
  const int base_shards = model_.fsdp == LlamaModel::Fsdp::optim_grads_params ? model_.optimizer_shard_count : 1;
  // --fsdp-embeddings-per-step counts only where the windows do (sharded, more than one rank).
  const bool per_step = cfg_.fsdp_embeddings_per_step;
  param_bytes_ =
      lora() ? double(LlamaModel::lora_parameter_bytes(model_cfg_, dev_, recipe_, lora_spec_, base_shards, per_step))
             : double(LlamaModel::parameter_bytes(model_cfg_, dev_, params_plan, model_.optimizer_shard_count,
                                                  model_.optimizer_placement, model_.fsdp, per_step));
  act_bytes_ = double(LlamaModel::plan_activation_bytes(model_cfg_, dev_, shape, recompute_, acts_plan, lora_spec));
  // cuBLASLt/cuDNN workspaces and allocator slack; quantized recipes add their weight and input copies
  // and the BF16 scratch of emulated GEMMs (estimated: about 1 byte per linear weight element).
  workspace_bytes_ = dev_ == Device::cuda ? 512.0 * 1048576 : 0;
  const int64_t largest_linear =
      model_cfg_.hidden * std::max(2 * model_cfg_.ffn, model_cfg_.q_dim() + 2 * model_cfg_.kv_dim());
  if (recipe_.quantized() && lora())  // the transient copies and the BF16 scratch of one emulated GEMM at a time
    workspace_bytes_ += 3.0 * double(largest_linear) + 4.0 * double(cfg_.micro_batch_size * cfg_.seq_length) *
                                                           double(std::max(model_cfg_.ffn, model_cfg_.hidden) * 2);
  else if (training_format_gather())  // quantized windows, staging, inputs' column copies, a BF16 scratch
    workspace_bytes_ += gathered_bytes_per_weight(recipe_) * 5.0 *  // 4 windows, the staging (1 layer)
                            double(model_cfg_.linear_params_per_layer()) +
                        input_column_copy_bytes() + 4.0 * double(largest_linear);
  else if (recipe_.quantized() || anneal_recipe_.quantized())  // the two recipes' copies never coexist
    workspace_bytes_ += double(model_cfg_.matmul_params() - model_cfg_.hidden * model_cfg_.vocab);
  if (recipe_.keep_dequantized_weights && !training_format_gather()) {  // BF16 copies: one (2D NVFP4) or two
    const bool two = recipe_.weight.fmt == recipe::Fmt::mxfp8 || !recipe_.weight.two_d;
    workspace_bytes_ += (two ? 4.0 : 2.0) * double(model_cfg_.matmul_params() - model_cfg_.hidden * model_cfg_.vocab);
  }
  // NCCL's communicator buffers and the side stream's handles: what the 8B's BF16 Megatron-FSDP run on two
  // H100s measured beyond its planned bytes (docs/DISTRIBUTED.md).
  if (world_.size > 1 && dev_ == Device::cuda) workspace_bytes_ += 0.75 * 1073741824.0;
  if (world_.size > 1 && cfg_.grad_reduce_in_bf16 && !lora()) {
    const int64_t all = model_cfg_.total_params(), bucket = model_.optimizer_bucket_elems;
    if (model_.fsdp != LlamaModel::Fsdp::off)  // one piece of every rank's chunk (distributed/fsdp.h)
      workspace_bytes_ += double(FsdpSync::bf16_scratch_bytes());
    else  // one bucket in BF16 (train/grad_sync.h)
      workspace_bytes_ += 2.0 * double(bucket > 0 ? std::min(bucket, all) : all);
  }
  device_memory_info(&free_bytes_, &total_bytes_);
  const double need = param_bytes_ + act_bytes_ + workspace_bytes_;
  std::printf(
      "memory estimate: %s %.2f GiB (%.1f bytes/param), activations %.2f GiB per micro-batch "
      "of %lld, workspaces %.2f GiB, total %.2f GiB",
      lora() ? "frozen base + adapters with AdamW" : "weights+grads+AdamW", gib(param_bytes_),
      param_bytes_ / double(model_cfg_.total_params()), gib(act_bytes_), (long long)cfg_.micro_batch_size,
      gib(workspace_bytes_), gib(need));
  base_used_ = total_bytes_ - free_bytes_;
  if (dev_ != Device::cuda) {
    std::printf("\n");
    return check_host_memory();
  }
  int64_t best = 0;
  for (int64_t mbs = 1; mbs <= 1024; mbs *= 2) {
    const double n = param_bytes_ + workspace_bytes_ +
                     double(LlamaModel::plan_activation_bytes(model_cfg_, dev_, {mbs, cfg_.seq_length}, recompute_,
                                                              acts_plan, lora_spec));
    if (n <= double(free_bytes_))
      best = mbs;
    else
      break;
  }
  std::printf("; %.2f GiB free of %.2f GiB: largest micro-batch that fits %lld%s\n", gib(double(free_bytes_)),
              gib(double(total_bytes_)), (long long)best, offload_fraction_advice(need).c_str());
  NB_TRY(check_host_memory());
  if (need > double(free_bytes_))
    return Status::error("out of GPU memory before step 1: this job " +
                         oom_advice(cfg_, gib(need), gib(double(free_bytes_))));
  return Status::ok();
}

// With offload, the least share of the state in host memory that still fits the GPU at this micro-batch
// (less streaming per step), keeping 3% of the free memory as slack.
std::string Trainer::offload_fraction_advice(double need) const {
  const optim::Placement& pl = model_.optimizer_placement;
  if (!(pl.offload_fraction > 0)) return "";
  const int64_t shard_elems = LlamaModel::optimizer_shard_elems(model_cfg_, model_.optimizer_shard_count);
  const double shard = double(shard_elems);
  const double on_device = 12.0 * (shard - double(optim::OptimizerState::offloaded_elems(shard_elems, pl)));
  const double room = 0.97 * double(free_bytes_) - (need - on_device);  // for the resident state
  const double least = std::ceil(100.0 * std::clamp(1.0 - room / (12.0 * shard), 0.0, 1.0)) / 100.0;
  return strprintf("; least --optimizer-offload-fraction that fits: %.2f", least);
}

// --optimizer-cpu-offload: the share of master, m and v this rank keeps in page-locked host memory must fit
// the host beside the other ranks of this machine, or the job stops before anything is allocated.
Status Trainer::check_host_memory() {
  const optim::Placement& pl = model_.optimizer_placement;
  if (!(pl.offload_fraction > 0)) return Status::ok();
  const int64_t shard = LlamaModel::optimizer_shard_elems(model_cfg_, model_.optimizer_shard_count);
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

Status Trainer::build_model() {
  if (lora()) model_.set_lora(lora_spec_, lora_base_.get());
  plan_anneal();
  model_.fsdp_training_format_gathers = training_format_gather();
  Status st =
      model_.init(model_cfg_, dev_, {cfg_.micro_batch_size, cfg_.seq_length}, recompute_, uint64_t(cfg_.seed), recipe_);
  if (!st) {
    if (st.message().find("out of GPU memory") != std::string::npos)
      return Status::error(
          "out of GPU memory while allocating: this job " +
          oom_advice(cfg_, gib(param_bytes_ + act_bytes_ + workspace_bytes_), gib(double(free_bytes_))));
    return st;
  }
  if (recipe_.quantized())  // the estimate above guessed these; now they are allocated and known
    std::printf("quantized copies held by the linear layers: %.2f GiB\n", gib(double(model_.quantized_copy_bytes())));
  NB_TRY(Buffer::allocate(&norm_sq_, DType::f32, dev_, {1}));
  step_tokens_.resize(size_t(accum_ * cfg_.micro_batch_size * cfg_.seq_length));
  step_labels_.resize(step_tokens_.size());
  sched_.lr = cfg_.lr;
  sched_.min_lr = cfg_.min_lr;
  sched_.warmup = cfg_.lr_warmup_iters;
  sched_.decay_iters = cfg_.lr_decay_iters;
  sched_.wsd_decay_iters = cfg_.lr_wsd_decay_iters;
  sched_.style = cfg_.lr_decay_style;
  if (dev_ == Device::cuda)
    std::printf("MFU is reported against %.1f TFLOP/s (%s)\n", peak_tflops_,
                cfg_.peak_tflops > 0 ? "--peak-tflops" : "dense BF16 datasheet peak of this GPU");
  return Status::ok();
}

// Sources start where the loaded state says (consumed samples); build_data runs again after a load.
// Validation uses Megatron's sizes: (train_iters / eval_interval + 1) * eval_iters * global batch.
Status Trainer::build_data() {
  const int64_t train_samples = cfg_.train_iters * cfg_.global_batch_size;
  const int64_t evals = cfg_.eval_interval > 0 ? cfg_.train_iters / cfg_.eval_interval + 1 : 1;
  const int64_t valid_samples = evals * cfg_.eval_iters * cfg_.global_batch_size;
  const int64_t consumed = iteration_ * cfg_.global_batch_size;
  train_src_.reset();
  valid_src_.reset();
  if (cfg_.mock_data) {
    NB_TRY(make_mock_source_split(model_cfg_.vocab, cfg_.seq_length, cfg_.micro_batch_size, uint64_t(cfg_.seed),
                                  Split::train, train_samples, consumed, &train_src_, world_.rank, world_.size));
    if (cfg_.eval_interval > 0)
      NB_TRY(make_mock_source_split(model_cfg_.vocab, cfg_.seq_length, cfg_.micro_batch_size, uint64_t(cfg_.seed),
                                    Split::valid, valid_samples, consumed_valid_, &valid_src_, world_.rank,
                                    world_.size));
    return Status::ok();
  }
  if (cfg_.sft) return build_sft_data();
  DataConfig dc;
  dc.data_path = cfg_.data_path;
  dc.split = cfg_.split;
  dc.seq_length = cfg_.seq_length;
  dc.seed = uint64_t(cfg_.seed);
  dc.num_samples[0] = train_samples;
  dc.num_samples[1] = valid_samples;
  const int rank = world_.rank, ranks = world_.size;
  NB_TRY(make_gpt_source_dp(dc, Split::train, cfg_.micro_batch_size, rank, ranks, consumed, &train_src_));
  Status vs = make_gpt_source_dp(dc, Split::valid, cfg_.micro_batch_size, rank, ranks, consumed_valid_, &valid_src_);
  if (!vs) NB_LOG_WARN("no validation data: %s", vs.message().c_str());
  return Status::ok();
}

// SFT rows: the split's samples packed once (best-fit decreasing), then walked epoch by epoch.
Status Trainer::build_sft_data() {
  SftDataConfig sc;
  sc.prefix = cfg_.data_path;
  sc.split = cfg_.split;
  sc.seq_length = cfg_.seq_length;
  sc.seed = uint64_t(cfg_.seed);
  sc.pack = cfg_.packed_sequence;
  const int64_t consumed = iteration_ * cfg_.global_batch_size;
  const int rank = world_.rank, ranks = world_.size;
  NB_TRY(make_sft_source(sc, Split::train, cfg_.micro_batch_size, rank, ranks, consumed, &train_src_, &train_packing_));
  const SftPacking& p = train_packing_;
  std::printf(
      "SFT data: %lld training samples in %lld rows of %lld (%s): packing efficiency %.1f%% (real tokens / row "
      "tokens), an epoch is %.1f iterations%s\n",
      (long long)p.samples.size(), (long long)p.rows(), (long long)p.seq_length,
      cfg_.packed_sequence ? "packed" : "one sample per row", 100.0 * p.efficiency(),
      double(p.rows()) / double(cfg_.global_batch_size),
      p.cut ? strprintf("; %lld samples longer than a row were cut at their end", (long long)p.cut).c_str() : "");
  if (cfg_.eval_interval <= 0) return Status::ok();
  SftPacking vp;
  Status vs = make_sft_source(sc, Split::valid, cfg_.micro_batch_size, rank, ranks, consumed_valid_, &valid_src_, &vp);
  if (!vs) {
    NB_LOG_WARN("no validation loss: %s", vs.message().c_str());
    valid_src_.reset();
  } else {
    std::printf("SFT validation: %lld samples in %lld rows (packing efficiency %.1f%%)\n", (long long)vp.samples.size(),
                (long long)vp.rows(), 100.0 * vp.efficiency());
  }
  return Status::ok();
}

}  // namespace nb
