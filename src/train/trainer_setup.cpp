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
#include "formats/mor/mor.h"
#include "io/hf_llama.h"
#include "tokenizer/bpe_tokenizer.h"
#include "train/trainer.h"

namespace nb {

// Mixture of Representations decides each operand from the whole tensor. Tensor, sequence and context parallelism keep
// that for the tensor rule: every shard is scaled by the group's amax and the shards' statistics are summed
// (trainer_mor.cpp). What they cannot keep yet is refused in one sentence.
Status Trainer::refuse_mor_splits() const {
  if (!recipe_.mor.on) return Status::ok();
  const char* scale =
      "scale it with data or pipeline parallelism (--nproc-per-node, --use-distributed-optimizer or "
      "--use-megatron-fsdp, --pipeline-model-parallel-size)";
  const char* split = cfg_.tensor_model_parallel_size > 1 ? "tensor parallelism"
                      : cfg_.context_parallel_size > 1    ? "context parallelism"
                                                          : nullptr;
  if (!split) return Status::ok();
  const bool tp = cfg_.tensor_model_parallel_size > 1;
  // The ladder keeps the whole tensor's statistics beside context and tensor parallelism (its scales come from the
  // group's amax, its NVFP4 blocks stay whole in every shard); sequence parallelism's gathers of an E4M3-rung operand
  // are not built.
  if (recipe_.mor.blocks && !tp) return refuse_mor_blocks_cp();
  const char* rule = recipe_.mor.ladder && tp && cfg_.sequence_parallel ? "the NVFP4 ladder"
                     : recipe_.mor.blocks ? "the block rule (its 128x128 blocks would span the shards' columns)"
                                          : nullptr;
  const char* why = rule                        ? rule
                    : tp && cfg_.peft == "lora" ? "a LoRA base (a frozen weight is decided from all of it when frozen)"
                                                : nullptr;
  if (!why) return Status::ok();
  return errorf("--recipe %s with %s does not support %s yet; drop it, or %s", recipe_.name.c_str(), split, why, scale);
}

// The block rule beside context parallelism: a rank's rows are two chunks of every sequence, so its 128-row blocks are
// whole blocks of the whole sequences when a chunk is a multiple of 128 tokens (and rows are not packed SFT samples,
// whose chunks cut each sample); the quantizations then take the group's amaxes (recipe::Linear's amax group), and the
// blocks' counts and statistics sum over the ranks to one GPU's. The ladder's SR draws by each rank's own rows.
Status Trainer::refuse_mor_blocks_cp() const {
  const int64_t cp = cfg_.context_parallel_size, chunk = cfg_.seq_length / (2 * cp);
  if (cfg_.sft && cfg_.packed_sequence)
    return errorf(
        "--mor-granularity block with context parallelism needs whole 128-token blocks of each sequence, but packed "
        "SFT rows cut each sample into chunks; drop --context-parallel-size or pass --packed-sequence false");
  if (chunk % mor::kBlock != 0)
    return errorf(
        "--mor-granularity block with --context-parallel-size %lld cuts each sequence into chunks of %lld tokens, "
        "which are not whole 128-token blocks; use a --seq-length that is a multiple of %lld",
        (long long)cp, (long long)chunk, (long long)(2 * cp * mor::kBlock));
  if (recipe_.mor.ladder && recipe_.grad.sr)
    return errorf(
        "--recipe %s with --mor-granularity block and context parallelism draws the gradients' stochastic rounding "
        "by each rank's own rows (the whole sequences' row map is not built for its kernel); add --fp4-disable-sr or "
        "drop --context-parallel-size",
        recipe_.name.c_str());
  return Status::ok();
}

// --mor-channel-statistic scales each whole row on its own: a token's row is whole on every rank of data and context
// parallelism, but a row-parallel weight's shard holds part of each of its rows; a frozen LoRA base's weight is
// measured once, when frozen, not each step.
Status Trainer::refuse_mor_channel_stat() const {
  if (!recipe_.mor.channel_stat) return Status::ok();
  if (cfg_.tensor_model_parallel_size > 1)
    return errorf(
        "--mor-channel-statistic scales each row of an operand on its own, but with tensor parallelism a row-parallel "
        "weight's shard holds only part of each row; drop it or --tensor-model-parallel-size");
  if (cfg_.peft == "lora")
    return errorf(
        "--mor-channel-statistic measures every trained operand each measured step, but a LoRA base's frozen weight "
        "is measured once when frozen; drop it or --peft lora");
  return Status::ok();
}

Status Trainer::setup(TrainConfig cfg) {
  cfg_ = std::move(cfg);
  NB_TRY(detect_ranks());
  NB_TRY(resolve_config());
  NB_TRY(check_tokenizer());
  NB_TRY(setup_sampling());
  NB_TRY(pick_device());
  print_plan();
  NB_TRY(connect_ranks());
  NB_TRY(plan_pipeline());  // this stage's layers and activation slots, before the estimate sizes them
  print_pipeline_plan();
  NB_TRY(estimate_memory());
  return explain_out_of_memory(allocate_and_load());  // from here on an out-of-memory means the estimate was wrong
}

Status Trainer::allocate_and_load() {
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
  knobs.mor_threshold = cfg_.mor_threshold;
  knobs.mor_nvfp4_threshold = cfg_.mor_nvfp4_threshold;
  knobs.mor_interval = cfg_.mor_interval;
  knobs.mor_granularity = cfg_.mor_granularity;
  knobs.mor_decide_now = cfg_.mor_decide_now;
  knobs.mor_three_way = cfg_.mor_three_way;
  knobs.mor_scaling = cfg_.mor_scaling;
  knobs.mor_channel_stat = cfg_.mor_channel_stat;
  knobs.mor_nvfp4_rows = cfg_.mor_nvfp4_rows;
  NB_TRY(recipe::apply_knobs(knobs, &recipe_));
  if (recipe_.mor.blocks && cfg_.quant_stats)
    return errorf(
        "--quant-stats measures quantized copies that MoR's block rule does not make (its operands are BF16 with FP8 "
        "blocks); its blocks per format and errors are in metrics.jsonl's mor_linear records: drop --quant-stats");
  NB_TRY(refuse_mor_splits());
  NB_TRY(refuse_mor_channel_stat());
  if (recipe_.mor.on && recipe_.mor.decide_now && cfg_.pipeline_model_parallel_size > 1)
    return errorf(
        "--mor-decide-now lets each quantization decide itself on one process, for the study of the decisions' lag; "
        "run it without --pipeline-model-parallel-size");
  if (recipe_.mor.on && cfg_.fsdp_param_gather == "training")
    return errorf(
        "--fsdp-param-gather training gathers weights already quantized, but Mixture of Representations decides "
        "each weight's format from its BF16 values; pass --fsdp-param-gather bf16 or auto");
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
  int64_t quantized = 0;
  for (int64_t l = 0; l < m.layers; ++l) quantized += recipe_.quantized() && !recipe_.layer_in_bf16(l, m.layers);
  recipe_as_run_ = recipe_.name;
  if (recipe_.quantized() && quantized == 0) {
    recipe_as_run_ = "bf16 (" + recipe_.name + " keeps every layer of this model in BF16)";
    NB_LOG_WARN(
        "recipe %s quantizes no Linear of this %lld-layer model (its BF16 layers cover them all): the run is "
        "a BF16 run, and its summary says so; use a model with more layers or fewer BF16 layers "
        "(--num-layers-at-start-in-bf16, --num-layers-at-end-in-bf16)",
        recipe_.name.c_str(), (long long)m.layers);
  }
  if (cfg_.deterministic_mode && dev_ == Device::cuda)
    std::printf("deterministic mode: attention backward without the atomic dQ accumulator, GEMMs without split-K%s\n",
                world_.distributed() ? ", NCCL Ring/Simple unless NCCL_ALGO/NCCL_PROTO are set" : "");
  print_lora_plan();
  print_anneal_plan();
  if (!cfg_.save.empty()) {
    if (logging_rank() && !dry_run_) std::ofstream(cfg_.save + "/config.toml") << format_config(cfg_);
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
  return model_.fsdp == LlamaModel::Fsdp::optim_grads_params && world_.size / tp_size() > 1 && recipe_.quantized() &&
         !lora() && cfg_.fsdp_param_gather != "bf16" && !cfg_.quant_stats && !(cfg_.anneal_start_fraction > 0) &&
         !recipe_.mor.on;
}

Status Trainer::build_model() {
  if (lora()) model_.set_lora(lora_spec_, lora_base_.get());
  plan_anneal();
  model_.fsdp_training_format_gathers = training_format_gather();
  Status st = model_.init(model_cfg_, dev_, {cfg_.micro_batch_size, cfg_.seq_length / cp_size()}, recompute_,
                          uint64_t(cfg_.seed), recipe_);
  if (!st) return st;
  NB_TRY(start_pipeline());
  if (model_.sequence_parallel) {
    int of = 0;
    const int n = model_.quantized_input_gathers(&of);
    std::printf(
        "sequence parallel: %d of %d column-parallel inputs and %d of %d row-parallel output gradients all-gathered "
        "in their quantized format%s\n",
        n, of, model_.quantized_grad_gathers(), of,
        lora()   ? " (a LoRA run's frozen base gathers BF16: its adapters read the whole inputs and gradients)"
        : n < of ? ", the rest in BF16 (BF16 layers, 1x128 FP8 blocks, tokens per rank not whole blocks)"
                 : "");
  }
  NB_TRY(Buffer::allocate(&norm_sq_, DType::f32, dev_, {2}));  // sharded and whole parameters' squares
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
                                  Split::train, train_samples, consumed, &train_src_, data_rank(), data_ranks()));
    if (cfg_.eval_interval > 0)
      NB_TRY(make_mock_source_split(model_cfg_.vocab, cfg_.seq_length, cfg_.micro_batch_size, uint64_t(cfg_.seed),
                                    Split::valid, valid_samples, consumed_valid_, &valid_src_, data_rank(),
                                    data_ranks()));
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
  const int rank = data_rank(), ranks = data_ranks();
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
  sc.pad_to_multiple = cfg_.sft_pad_multiple();  // under context parallelism every sample splits into 2C chunks
  const int64_t consumed = iteration_ * cfg_.global_batch_size;
  const int rank = data_rank(), ranks = data_ranks();
  NB_TRY(make_sft_source(sc, Split::train, cfg_.micro_batch_size, rank, ranks, consumed, &train_src_, &train_packing_));
  const SftPacking& p = train_packing_;
  const std::string padded =
      p.multiple > 1 ? strprintf("; each sample padded to a multiple of %lld tokens", (long long)p.multiple) : "";
  std::printf(
      "SFT data: %lld training samples in %lld rows of %lld (%s): packing efficiency %.1f%% (real tokens / row "
      "tokens), an epoch is %.1f iterations%s%s\n",
      (long long)p.samples.size(), (long long)p.rows(), (long long)p.seq_length,
      cfg_.packed_sequence ? "packed" : "one sample per row", 100.0 * p.efficiency(),
      double(p.rows()) / double(cfg_.global_batch_size), padded.c_str(),
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
