// TrainConfig's checks after parsing: the model it resolves to, and the values and combinations a run refuses
// (one sentence each, naming the flag to change).
#include "train/train_config.h"
#include "distributed/parallel_layout.h"

namespace nb {

Status resolve_model(TrainConfig& c, LlamaConfig* model) {
  NB_TRY(llama_preset(c.model, model));
  if (c.num_layers > 0) model->layers = c.num_layers;
  if (c.vocab_size > 0) model->vocab = (c.vocab_size + 127) / 128 * 128;
  if (c.seq_length == 0) c.seq_length = c.model == "tiny" ? 64 : (c.model == "llama-125m" ? 1024 : 4096);
  if (c.global_batch_size == 0) c.global_batch_size = c.micro_batch_size * c.data_parallel;
  if (c.lr_decay_iters == 0) c.lr_decay_iters = c.train_iters;
  return validate(*model);
}

namespace {
// Data parallelism (DDP, the distributed optimizer, Megatron-FSDP) and optimizer offload: the ranges and
// the combinations that are refused.
Status validate_parallel_and_offload(const TrainConfig& c) {
  if (!(c.distributed_timeout_minutes > 0))
    return errorf("--distributed-timeout-minutes must be positive; got %g", c.distributed_timeout_minutes);
  if (!(c.optimizer_offload_fraction >= 0 && c.optimizer_offload_fraction <= 1))
    return errorf("--optimizer-offload-fraction is the share of the optimizer state in host memory, 0..1; got %g",
                  c.optimizer_offload_fraction);
  if (!(c.optimizer_state_offload_chunk_size_mb > 0 && c.optimizer_state_offload_chunk_size_mb <= 4096))
    return errorf("--optimizer-state-offload-chunk-size-mb must lie in (0, 4096]; got %g",
                  c.optimizer_state_offload_chunk_size_mb);
  if (c.optimizer_cpu_offload && c.peft == "lora")
    return errorf(
        "--optimizer-cpu-offload moves the full model's optimizer state to host memory; a LoRA run keeps only its "
        "small adapters' state: leave it out");
  if (c.tensor_model_parallel_size < 1)
    return errorf("--tensor-model-parallel-size must be at least 1; got %lld", (long long)c.tensor_model_parallel_size);
  if (c.sequence_parallel && c.tensor_model_parallel_size == 1)
    return errorf("--sequence-parallel splits tokens over the tensor-parallel ranks: add --tensor-model-parallel-size");
  if (c.sequence_parallel && c.micro_batch_size * c.seq_length / c.context_parallel_size % c.tensor_model_parallel_size)
    return errorf(
        "--sequence-parallel splits each micro-batch's %lld tokens per rank over %lld tensor-parallel "
        "ranks, which does not divide them; choose --seq-length or --micro-batch-size to fit",
        (long long)(c.micro_batch_size * c.seq_length / c.context_parallel_size),
        (long long)c.tensor_model_parallel_size);
  if (c.context_parallel_size < 1)
    return errorf("--context-parallel-size must be at least 1; got %lld", (long long)c.context_parallel_size);
  if (c.pad_seq_to_mult < 0)
    return errorf("--pad-seq-to-mult must be 0 (automatic) or a number of tokens; got %lld",
                  (long long)c.pad_seq_to_mult);
  if (c.sft && c.seq_length % c.sft_pad_multiple() != 0)
    return errorf(
        "--seq-length %lld is not a multiple of --pad-seq-to-mult %lld, so padded samples would not fill rows",
        (long long)c.seq_length, (long long)c.sft_pad_multiple());
  if (c.context_parallel_size > 1 && c.sft && c.packed_sequence && c.sft_pad_multiple() % (2 * c.context_parallel_size))
    return errorf(
        "packed SFT rows under --context-parallel-size %lld cut every sample into %lld chunks, so --pad-seq-to-mult "
        "%lld must be a multiple of %lld (0 chooses it)",
        (long long)c.context_parallel_size, (long long)(2 * c.context_parallel_size), (long long)c.sft_pad_multiple(),
        (long long)(2 * c.context_parallel_size));
  if (c.ddp_bucket_size < 0)
    return errorf("--ddp-bucket-size must be 0 (automatic) or a number of elements; got %lld",
                  (long long)c.ddp_bucket_size);
  if (c.data_parallel_sharding_strategy != "no_shard" && !c.use_megatron_fsdp)
    return errorf("--data-parallel-sharding-strategy %s applies to Megatron-FSDP: add --use-megatron-fsdp",
                  c.data_parallel_sharding_strategy.c_str());
  if (c.sharding_strategy().rfind("optim_grads", 0) == 0) {
    if (c.peft == "lora" && c.lora_base_precision != "bf16" && c.fsdp_param_gather == "bf16")
      return errorf(
          "--fsdp-param-gather bf16 gathers BF16 weights, but a LoRA base at --lora-base-precision %s keeps no "
          "BF16 copy: its weights are gathered in their stored format; leave the flag out",
          c.lora_base_precision.c_str());
    if (c.fsdp_param_gather == "training" && (c.quant_stats || c.anneal_start_fraction > 0))
      return errorf(
          "--fsdp-param-gather training gathers only quantized weights, but %s reads the BF16 weight: use "
          "--fsdp-param-gather bf16 (or auto)",
          c.quant_stats ? "--quant-stats" : "annealing's BF16 step");
  }
  if (c.fsdp_embeddings_per_step && c.sharding_strategy().rfind("optim_grads", 0) != 0)
    return errorf(
        "--fsdp-embeddings-per-step changes when Megatron-FSDP gathers and reduces the embedding and output "
        "layer: add --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads or optim_grads_params");
  if (c.fsdp_embeddings_per_step && c.peft == "lora" && c.sharding_strategy() != "optim_grads_params")
    return errorf(
        "--fsdp-embeddings-per-step with --peft lora needs --data-parallel-sharding-strategy optim_grads_params "
        "(the only strategy that shards a frozen base; %s runs as LoRA DDP)",
        c.sharding_strategy().c_str());
  if (c.overlap_param_gather && c.sharding_strategy() == "no_shard")
    return errorf(
        "--overlap-param-gather overlaps the distributed optimizer's weight gather; add --use-distributed-optimizer "
        "(plain DDP gathers nothing)");
  return Status::ok();
}

// What pipeline parallelism does not run with yet (P > 1): each refused in one sentence.
Status refuse_unsupported_with_pipeline(const TrainConfig& c, const LlamaConfig& m) {
  std::string unsupported;
  if (m.tied_embeddings)
    unsupported = "model " + m.name + "'s tied embeddings (the embedding and LM head share a weight on two stages)";
  else if (c.sample_interval > 0)
    unsupported = "--sample-interval";
  else if (c.quant_stats)
    unsupported = "--quant-stats";
  if (unsupported.empty()) return Status::ok();
  return errorf("%s is not supported yet with --pipeline-model-parallel-size > 1 (here %lld)", unsupported.c_str(),
                (long long)c.pipeline_model_parallel_size);
}

}  // namespace

Status TrainConfig::pipeline_virtual_stages(int64_t decoder_layers, int* virtual_stages) const {
  const bool uneven = decoder_first_pipeline_num_layers > 0 || decoder_last_pipeline_num_layers > 0;
  if (!pipeline_model_parallel_layout.empty()) {
    if (num_layers_per_virtual_pipeline_stage > 0 || num_virtual_stages_per_pipeline_rank > 0)
      return errorf(
          "--pipeline-model-parallel-layout sets the virtual stages (its stages over --pipeline-model-parallel-size); "
          "leave out --num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank");
    return pp::layout_virtual_stages(pipeline_model_parallel_layout, int(pipeline_model_parallel_size), virtual_stages);
  }
  if (num_layers_per_virtual_pipeline_stage > 0 && uneven)
    return errorf(
        "with --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers give the virtual stages as "
        "--num-virtual-stages-per-pipeline-rank instead of --num-layers-per-virtual-pipeline-stage");
  const int64_t counted =
      decoder_layers + int64_t(account_for_embedding_in_pipeline_split) + int64_t(account_for_loss_in_pipeline_split);
  return pp::resolve_virtual_stages(counted, int(pipeline_model_parallel_size), num_layers_per_virtual_pipeline_stage,
                                    num_virtual_stages_per_pipeline_rank, virtual_stages);
}

namespace {

// Pipeline parallelism: the sizes, the virtual stages (Megatron's two flags or a layout), the layer split and the
// interleaved schedule's demands (model/pipeline_split.h has the split's own refusals).
Status validate_pipeline(const TrainConfig& c, const LlamaConfig& m) {
  const int64_t P = c.pipeline_model_parallel_size;
  if (P < 1) return errorf("--pipeline-model-parallel-size must be at least 1; got %lld", (long long)P);
  const int64_t counted =
      m.layers + int64_t(c.account_for_embedding_in_pipeline_split) + int64_t(c.account_for_loss_in_pipeline_split);
  // No split fills more stages (an accounted embedding or loss fills one) but a layout, which may leave stages
  // empty (and holds at most 2^20 of them); the bound keeps P an int.
  if (P > counted && (c.pipeline_model_parallel_layout.empty() || P > (int64_t(1) << 20)))
    return errorf("--pipeline-model-parallel-size %lld is more stages than the model's %lld decoder layers can fill",
                  (long long)P, (long long)m.layers);
  if (P > 1) NB_TRY(refuse_unsupported_with_pipeline(c, m));
  int V = 1;
  NB_TRY(c.pipeline_virtual_stages(m.layers, &V));
  std::vector<pp::LayerRange> stages;
  NB_TRY(pp::split_layers(m.layers, c.pipeline_split_options(V), &stages));
  const int64_t micro_batches = c.global_batch_size / (c.micro_batch_size * c.data_parallel);
  if (V > 1 && micro_batches % P != 0)
    return errorf(
        "the interleaved schedule (%d virtual stages per pipeline rank) runs micro-batches in groups of "
        "--pipeline-model-parallel-size %lld, but each rank has %lld per step (global batch / (micro-batch x "
        "data-parallel %lld)); choose a --global-batch-size that is a multiple of %lld",
        V, (long long)P, (long long)micro_batches, (long long)c.data_parallel,
        (long long)(P * c.micro_batch_size * c.data_parallel));
  return Status::ok();
}

}  // namespace

Status validate_train_config(const TrainConfig& c, const LlamaConfig& m) {
  if (c.micro_batch_size <= 0)
    return errorf("--micro-batch-size must be positive; got %lld", (long long)c.micro_batch_size);
  if (c.seq_length <= 0) return errorf("--seq-length must be positive; got %lld", (long long)c.seq_length);
  if (c.seq_length > m.max_seq)
    return errorf("--seq-length %lld exceeds the model's maximum context %lld", (long long)c.seq_length,
                  (long long)m.max_seq);
  int64_t per_step = c.micro_batch_size * c.data_parallel;
  if (c.global_batch_size <= 0 || c.global_batch_size % per_step != 0)
    return errorf("--global-batch-size %lld must be a positive multiple of micro-batch-size x data-parallel = %lld",
                  (long long)c.global_batch_size, (long long)per_step);
  if (c.train_iters <= 0) return errorf("--train-iters must be positive; got %lld", (long long)c.train_iters);
  if (c.lr < 0 || c.min_lr < 0 || c.min_lr > c.lr)
    return errorf("learning rates must satisfy 0 <= min-lr <= lr; got lr %g, min-lr %g", c.lr, c.min_lr);
  if (c.lr_warmup_iters < 0 || c.lr_warmup_iters > c.train_iters)
    return errorf("--lr-warmup-iters %lld must lie in [0, train-iters %lld]", (long long)c.lr_warmup_iters,
                  (long long)c.train_iters);
  if (c.lr_decay_style == "wsd" &&
      (c.lr_wsd_decay_iters <= 0 || c.lr_wsd_decay_iters + c.lr_warmup_iters > c.lr_decay_iters))
    return errorf(
        "--lr-decay-style wsd needs 0 < lr-wsd-decay-iters (%lld) and warmup + decay <= lr-decay-iters (%lld)",
        (long long)c.lr_wsd_decay_iters, (long long)c.lr_decay_iters);
  if (c.adam_beta1 < 0 || c.adam_beta1 >= 1 || c.adam_beta2 < 0 || c.adam_beta2 >= 1)
    return errorf("AdamW betas must lie in [0, 1); got %g, %g", c.adam_beta1, c.adam_beta2);
  if (c.log_interval <= 0) return errorf("--log-interval must be positive");
  if (c.sample_interval < 0 || c.sample_tokens < 1)
    return errorf("--sample-interval (%lld) must be >= 0 and --sample-tokens (%lld) >= 1", (long long)c.sample_interval,
                  (long long)c.sample_tokens);
  if (c.tensorboard_log_interval <= 0)
    return errorf("--tensorboard-log-interval must be positive; got %lld", (long long)c.tensorboard_log_interval);
  if (c.quant_stats_interval < 0)
    return errorf("--quant-stats-interval must not be negative (0 = log-interval); got %lld",
                  (long long)c.quant_stats_interval);
  if (!c.mock_data && c.data_path.empty()) return errorf("no data: pass --data-path PREFIX (or --mock-data true)");
  if (c.sft && c.mock_data)
    return errorf("--sft trains on SFT data: pass --data-path PREFIX as given to nibble preprocess --sft");
  if (c.peft == "lora") {
    if (c.lora_rank < 1) return errorf("--lora-rank must be at least 1; got %lld", (long long)c.lora_rank);
    if (!(c.lora_alpha > 0)) return errorf("--lora-alpha must be positive; got %g", c.lora_alpha);
    if (!(c.lora_dropout >= 0 && c.lora_dropout < 1))
      return errorf("--lora-dropout must lie in [0, 1); got %g", c.lora_dropout);
    if (c.use_distributed_optimizer)
      return errorf(
          "--use-distributed-optimizer shards the full model's optimizer state; a LoRA run's adapters are small and "
          "kept whole on every rank: leave it out");
    if (c.recipe != "bf16_mixed")
      return errorf(
          "with --peft lora the base precision chooses the recipe: pass --lora-base-precision bf16, fp8 or nvfp4 "
          "instead of --recipe %s",
          c.recipe.c_str());
  }
  NB_TRY(validate_parallel_and_offload(c));
  NB_TRY(validate_pipeline(c, m));
  NB_TRY(dist::check_model_fits_layout(
      m, c.seq_length,
      {int(c.tensor_model_parallel_size), int(c.context_parallel_size), int(c.pipeline_model_parallel_size)}));
  if (c.save_interval < 0 || c.save_keep < 0 || c.exit_interval < 0)
    return errorf("--save-interval, --save-keep and --exit-interval must not be negative");
  if ((c.save_interval > 0 || c.exit_interval > 0) && c.save.empty())
    return errorf("--save-interval / --exit-interval write checkpoints: pass --save DIR to say where");
  if ((c.finetune || c.no_load_optim || c.no_load_rng || c.ckpt_step >= 0) && c.load.empty())
    return errorf("--finetune, --no-load-optim, --no-load-rng and --ckpt-step apply to a checkpoint: pass --load DIR");
  return Status::ok();
}

}  // namespace nb
