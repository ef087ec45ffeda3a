// The training job's configuration: one registry of keys drives the command-line flags (Megatron
// spelling, e.g. --micro-batch-size), the TOML config file (same names, dashes or underscores),
// the resolved-config printout and the unknown-key check, so a key is declared exactly once.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>
#include "core/status.h"
#include "model/llama_config.h"
#include "model/pipeline_split.h"

namespace nb {

struct TrainConfig {
  // model
  std::string model = "tiny";
  int64_t num_layers = 0;  // 0 = preset's
  int64_t vocab_size = 0;  // 0 = preset's; else padded up to a multiple of 128 (Megatron's default)
  // batch and schedule
  int64_t seq_length = 0;  // 0 = preset default (tiny 64, proxies 4096, others 4096)
  int64_t micro_batch_size = 1;
  int64_t global_batch_size = 0;  // 0 = micro_batch_size * data_parallel (one accumulation step)
  int64_t train_iters = 20;
  double lr = 3e-4, min_lr = 3e-5;
  int64_t lr_warmup_iters = 0;
  std::string lr_decay_style = "cosine";  // cosine | wsd | constant | linear
  int64_t lr_wsd_decay_iters = 0;         // wsd: length of the final decay phase
  int64_t lr_decay_iters = 0;             // 0 = train_iters
  double weight_decay = 0.1, adam_beta1 = 0.9, adam_beta2 = 0.95, adam_eps = 1e-8, clip_grad = 1.0;
  int64_t seed = 1234;
  std::string recompute = "none";  // none | selective | full
  // precision recipe (Megatron-Bridge names and knobs)
  std::string recipe = "bf16_mixed";
  bool disable_fp4 = false, fp4_disable_rht = false, fp4_disable_sr = false, fp4_disable_2d = false;
  bool emulated_weight_cache = false;       // keep MXFP8/NVFP4 weights dequantized once per step (Recipe)
  std::string fp4_4over6 = "none";          // none | weights | activations | all: NVFP4 4/6 adaptive block scaling
  std::string fp4_4over6_err_mode = "mae";  // mae | mse: 4/6's block error metric (TransformerEngine's default MAE)
  // Mixture of Representations (bf16_with_mor_fp8_mixed; recipe.h MorSpec): -1 = the recipe's
  double mor_threshold = -1;
  double mor_nvfp4_threshold = -1;  // the NVFP4 ladder (bf16_with_mor_nvfp4_mixed)
  int64_t mor_interval = -1;
  std::string mor_granularity = "tensor";  // tensor | block (each 128x128 block decided in its quantization)
  bool mor_decide_now = false;             // CPU reference: no decision lag
  bool mor_three_way = false;              // the block rule: E5M2 between E4M3 and BF16
  std::string mor_scaling;                 // the block rule's scales: gam | amax | pow2 (empty: gam)
  bool mor_channel_stat = false;           // the E4M3 tensor rule: also measure per-row (per-channel) scaling
  bool mor_nvfp4_rows = false;             // the ladder per block: X's and dY's NVFP4 blocks 1x16, a copy per way
  bool first_last_layers_bf16 = false;
  int64_t num_layers_at_start_in_bf16 = -1, num_layers_at_end_in_bf16 = -1;  // -1 = the recipe's
  bool quant_stats = false;
  int64_t quant_stats_interval = 0;  // steps between --quant-stats records (0 = log_interval)
  // precision annealing (train/trainer_anneal.cpp): steps after S = round(F * train_iters) run anneal_recipe
  double anneal_start_fraction = 0;  // F; 0 = no annealing
  std::string anneal_recipe;         // bf16_mixed or an FP8 recipe
  bool anneal_fprop_only = false;    // only the Fprop GEMM switches (anneal_recipe bf16_mixed)
  // parameter-efficient fine-tuning (Megatron-Bridge's LoRA names and defaults; model/lora.h)
  std::string peft = "none";  // none | lora
  int64_t lora_rank = 32;
  double lora_alpha = 32, lora_dropout = 0;
  std::string lora_target = "linear_qkv,linear_proj,linear_fc1,linear_fc2";
  std::string lora_base_precision = "bf16";  // bf16 | fp8 | nvfp4 | mor_fp8: the frozen base's storage and GEMMs
  // data
  bool mock_data = true;
  std::string data_path;  // Megatron blend: "prefix" or "w1 p1 w2 p2 ..."
  std::string split = "969,30,1";
  std::string tokenizer;        // tokenizer.json or .tiktoken, for real data
  bool sft = false;             // --data-path is `preprocess --sft` output: answer-only loss, rows of packed samples
  bool packed_sequence = true;  // SFT: several samples per row (false: one sample per row, padded)
  // SFT: every sample's segment padded to a multiple of this many tokens (Megatron-Bridge's pad_seq_to_mult);
  // 0 = 2 x context-parallel-size for packed rows under context parallelism (each sequence is cut into 2C
  // chunks), else 1. sft_pad_multiple() is the value in effect.
  int64_t pad_seq_to_mult = 0;
  int64_t sft_pad_multiple() const {
    if (pad_seq_to_mult > 0) return pad_seq_to_mult;
    return context_parallel_size > 1 && packed_sequence ? 2 * context_parallel_size : 1;
  }
  int64_t eval_interval = 0, eval_iters = 10;
  // run
  std::string device = "auto";  // auto | cuda | cpu
  // Megatron's --deterministic-mode: a CUDA run repeats bit for bit (core/determinism.h says what changes)
  bool deterministic_mode = false;
  int64_t log_interval = 1;
  // --sample-interval N: a greedy continuation of sample_prompt (sample_tokens new tokens) every N steps,
  // printed and written to metrics.jsonl (0 = off; needs --tokenizer)
  int64_t sample_interval = 0, sample_tokens = 32;
  std::string sample_prompt = "The";
  // rank 0's TensorBoard event file goes to this folder (empty = none): step scalars every N steps and the last
  std::string tensorboard_dir;
  int64_t tensorboard_log_interval = 1;
  // --profile: the roofline of the step at the end of the run (train/roofline.h), files to profile_dir
  bool profile = false;
  std::string profile_dir;      // empty = the --save folder (stdout only without one)
  std::string save;             // output folder: resolved config, metrics.jsonl
  std::string on_nan = "stop";  // stop | skip
  double peak_tflops = 0;       // 0 = measured/datasheet BF16 peak of the device
  int64_t data_parallel = 1;    // world / (tensor x context x pipeline size) (set by the Trainer, not a key)
  // Context parallelism (docs/DISTRIBUTED.md): each row's tokens split over this many ranks (ring attention,
  // ops/cp_ring.h); ranks tp-cp-dp ordered, so consecutive ranks form a group. p2p is the only comm type.
  int64_t context_parallel_size = 1;
  std::string cp_comm_type = "p2p";
  // Tensor parallelism (docs/DISTRIBUTED.md): each layer's heads, FFN and vocabulary split over this many
  // consecutive ranks (model/tensor_parallel.h).
  int64_t tensor_model_parallel_size = 1;
  bool tp_comm_overlap = false;
  bool sequence_parallel = false;  // norms and residuals on tokens / T of each micro-batch (tensor parallelism)  // the
                                   // column-parallel input gradients' all-reduces beside their Wgrad GEMMs
  // Pipeline parallelism (Megatron's flags; model/pipeline_split.h has the split's rules): the decoder layers
  // split over this many stages, each rank V model chunks under the interleaved schedule (V from one of the two
  // virtual-stage keys, 0 = not given), the first / last stage's layer counts (0 = even) or the embedding / loss
  // counted as a layer, and the schedule's sends and receives overlapped with compute (--no-overlap-p2p-communication).
  int64_t pipeline_model_parallel_size = 1;
  int64_t num_layers_per_virtual_pipeline_stage = 0, num_virtual_stages_per_pipeline_rank = 0;
  bool account_for_embedding_in_pipeline_split = false, account_for_loss_in_pipeline_split = false;
  int64_t decoder_first_pipeline_num_layers = 0, decoder_last_pipeline_num_layers = 0;
  std::string pipeline_model_parallel_layout;  // every virtual stage's layers, Megatron's string (empty = not given)
  bool overlap_p2p_communication = true;
  // The split's options for V virtual stages per rank (V from pipeline_virtual_stages).
  pp::SplitOptions pipeline_split_options(int virtual_stages) const {
    pp::SplitOptions o;
    o.pipeline = int(pipeline_model_parallel_size);
    o.virtual_stages = virtual_stages;
    o.account_for_embedding = account_for_embedding_in_pipeline_split;
    o.account_for_loss = account_for_loss_in_pipeline_split;
    o.first_stage_layers = decoder_first_pipeline_num_layers;
    o.last_stage_layers = decoder_last_pipeline_num_layers;
    o.layout = pipeline_model_parallel_layout;
    return o;
  }
  // V, the virtual stages per pipeline rank, from the layout's stages or from the two virtual-stage keys.
  Status pipeline_virtual_stages(int64_t decoder_layers, int* virtual_stages) const;
  double distributed_timeout_minutes = 10;
  bool use_distributed_optimizer = false;  // shard master weights and AdamW state over the ranks
  // Megatron-FSDP (docs/DISTRIBUTED.md): no_shard (DDP) | optim (the distributed optimizer) | optim_grads
  // (gradients sharded too) | optim_grads_params (the compute copy too, gathered per layer when used).
  bool use_megatron_fsdp = false;
  std::string data_parallel_sharding_strategy = "no_shard";
  // optim_grads_params: a quantized layer's weight gathered as the codes and scales its GEMMs read (training),
  // or in BF16; auto = training unless something needs the BF16 weight (--quant-stats, annealing).
  std::string fsdp_param_gather = "auto";
  // optim_grads(_params): the embedding and an untied head gathered, and their gradients reduced, once per
  // optimizer step instead of every micro-batch (one more whole copy and FP32 gradient of each per rank).
  bool fsdp_embeddings_per_step = false;
  // The strategy in effect: the distributed optimizer is `optim` with or without --use-megatron-fsdp.
  std::string sharding_strategy() const {
    if (use_megatron_fsdp && data_parallel_sharding_strategy.rfind("optim_grads", 0) == 0)
      return data_parallel_sharding_strategy;
    return use_distributed_optimizer || (use_megatron_fsdp && data_parallel_sharding_strategy == "optim") ? "optim"
                                                                                                          : "no_shard";
  }
  // Megatron's DDP knobs (docs/DISTRIBUTED.md): bucket length in elements (0 = one bucket, or Megatron's
  // max(40M, 1M x ranks) with an overlap), reduction overlapped with the backward, gathers with the
  // next forward (distributed optimizer only), and gradients reduced in BF16.
  int64_t ddp_bucket_size = 0;
  bool overlap_grad_reduce = false;
  bool overlap_param_gather = false;
  bool grad_reduce_in_bf16 = false;
  // Megatron-Core's optimizer offload (optim/optimizer_state.h): a share of master, m and v in page-locked
  // host memory, streamed through the GPU's AdamW in chunks of this many MiB per array.
  bool optimizer_cpu_offload = false;
  double optimizer_offload_fraction = 1.0;
  double optimizer_state_offload_chunk_size_mb = 64;
  // checkpoints (Megatron's flags; see train/checkpoint.h)
  int64_t save_interval = 0;  // checkpoint every N iterations and at the end (0 = none)
  int64_t save_keep = 0;      // keep the newest N checkpoints (0 = all)
  bool async_save = true;     // write checkpoint files on a background thread
  int64_t exit_interval = 0;  // save and exit when the iteration is a multiple of N
  std::string load;           // resume from this folder's latest checkpoint
  int64_t ckpt_step = -1;     // load this iteration instead of the latest
  bool no_load_optim = false, no_load_rng = false;
  bool finetune = false;  // --load: weights only, iteration 0
  std::string load_hf;    // start from a Hugging Face Llama folder
};

struct ConfigKey {
  std::string name;  // dashed: "micro-batch-size"
  std::string help;
  std::function<Status(const std::string&)> set;
  std::function<std::string()> get;
  bool is_flag = false;  // boolean: the command line accepts it bare (= true) as well as with a value
  // Another spelling of a key printed under its own name (--no-overlap-p2p-communication): format_config leaves
  // it out, so the resolved config holds each setting once.
  bool spelling_only = false;
};

// The registry over a TrainConfig instance (captures pointers into `c`).
std::vector<ConfigKey> config_keys(TrainConfig& c);
// Applies a TOML file's keys; unknown keys and bad values are errors naming the file and key.
Status apply_config_file(const std::string& path, TrainConfig& c);
// The same for TOML text (a checkpoint's saved configuration); `origin` names it in errors.
Status apply_config_text(const std::string& text, const std::string& origin, TrainConfig& c);
// Cross-field checks that need no GPU (batch divisibility, schedule, model shape).
Status validate_train_config(const TrainConfig& c, const LlamaConfig& model);
// Resolves the model from the preset plus overrides, and defaults that depend on it.
Status resolve_model(TrainConfig& c, LlamaConfig* model);
// "key = value" lines in registry order (valid TOML), for the printout and run folder.
std::string format_config(TrainConfig& c);

}  // namespace nb
