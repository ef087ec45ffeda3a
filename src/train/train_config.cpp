// Key registry, TOML loading (toml++) and the printed config for TrainConfig; its checks are in train_config_check.cpp.
#include "train/train_config.h"
#include <algorithm>
#include <fstream>
#include <iterator>
#include <sstream>
#include <vector>
#include <toml++/toml.h>

namespace nb {

namespace {

Status parse_int(const std::string& key, const std::string& v, int64_t* out) {
  try {
    size_t pos = 0;
    long long x = std::stoll(v, &pos);
    if (pos != v.size()) throw std::invalid_argument(v);
    *out = x;
    return Status::ok();
  } catch (...) { return errorf("%s expects an integer, got '%s'", key.c_str(), v.c_str()); }
}
Status parse_double(const std::string& key, const std::string& v, double* out) {
  try {
    size_t pos = 0;
    double x = std::stod(v, &pos);
    if (pos != v.size()) throw std::invalid_argument(v);
    *out = x;
    return Status::ok();
  } catch (...) { return errorf("%s expects a number, got '%s'", key.c_str(), v.c_str()); }
}
Status parse_bool(const std::string& key, const std::string& v, bool* out) {
  if (v == "true" || v == "1" || v == "on") {
    *out = true;
    return Status::ok();
  }
  if (v == "false" || v == "0" || v == "off") {
    *out = false;
    return Status::ok();
  }
  return errorf("%s expects true or false, got '%s'", key.c_str(), v.c_str());
}
Status parse_choice(const std::string& key, const std::string& v, const std::vector<const char*>& choices,
                    std::string* out) {
  std::string list;
  for (const char* c : choices) {
    if (v == c) {
      *out = v;
      return Status::ok();
    }
    list += (list.empty() ? "" : ", ") + std::string(c);
  }
  return errorf("%s must be one of %s; got '%s'", key.c_str(), list.c_str(), v.c_str());
}
std::string fmt_double(double d) {
  std::ostringstream s;
  s << d;
  std::string r = s.str();
  if (r.find_first_of(".eEn") == std::string::npos) r += ".0";  // stays a TOML float
  return r;
}
// A TOML basic string in ASCII: quotes, backslashes and control characters escaped, and every non-ASCII
// character as \\uXXXX / \\UXXXXXXXX (so the resolved config and checkpoints read back, see check_ascii).
std::string toml_quoted(const std::string& s) {
  std::string out = "\"";
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) {
      if (c == '"' || c == '\\') out += '\\';
      if (c < 0x20 || c == 0x7f)
        out += strprintf("\\u%04x", c);
      else
        out += char(c);
      ++i;
      continue;
    }
    const int n = c >= 0xf0 ? 4 : c >= 0xe0 ? 3 : c >= 0xc0 ? 2 : 1;
    uint32_t cp = n == 1 ? 0xfffd : c & (0x7f >> n);
    for (int k = 1; k < n; ++k)
      cp = i + k < s.size() ? (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3f) : 0xfffd;
    out += cp > 0xffff ? strprintf("\\U%08x", cp) : strprintf("\\u%04x", cp);
    i += size_t(n);
  }
  return out + "\"";
}

ConfigKey int_key(const char* name, const char* help, int64_t* p) {
  return {name, help, [=](const std::string& v) { return parse_int(std::string("--") + name, v, p); },
          [=] { return std::to_string(*p); }};
}
ConfigKey double_key(const char* name, const char* help, double* p) {
  return {name, help, [=](const std::string& v) { return parse_double(std::string("--") + name, v, p); },
          [=] { return fmt_double(*p); }};
}
ConfigKey bool_key(const char* name, const char* help, bool* p) {
  return {name, help, [=](const std::string& v) { return parse_bool(std::string("--") + name, v, p); },
          [=] { return std::string(*p ? "true" : "false"); }, true};
}
// Megatron's `--no-X` form of a bool key X that defaults to true: bare, it turns X off. It is only another
// spelling (ConfigKey::spelling_only), so the resolved config records X alone.
ConfigKey negated_bool_key(const char* name, const char* help, bool* p) {
  ConfigKey k{name, help,
              [=](const std::string& v) {
                bool b = false;
                NB_TRY(parse_bool(std::string("--") + name, v, &b));
                *p = !b;
                return Status::ok();
              },
              [=] { return std::string(*p ? "false" : "true"); }, true};
  k.spelling_only = true;
  return k;
}
ConfigKey string_key(const char* name, const char* help, std::string* p) {
  return {name, help,
          [=](const std::string& v) {
            *p = v;
            return Status::ok();
          },
          [=] { return toml_quoted(*p); }};
}
ConfigKey choice_key(const char* name, const char* help, std::string* p, std::initializer_list<const char*> choices) {
  std::vector<const char*> cs(choices);
  return {name, help, [=](const std::string& v) { return parse_choice(std::string("--") + name, v, cs, p); },
          [=] { return toml_quoted(*p); }};
}

// The model, batch, schedule, optimizer and precision recipe.
std::vector<ConfigKey> model_keys(TrainConfig& c) {
  return {
      string_key("model", "model preset (llama3.1-8b, llama3-8b-proxy, tiny, ...)", &c.model),
      int_key("num-layers", "override the preset's layer count (0 = preset)", &c.num_layers),
      int_key("vocab-size", "override the preset's vocabulary (0 = preset), padded to a multiple of 128",
              &c.vocab_size),
      int_key("seq-length", "tokens per sample (0 = preset default)", &c.seq_length),
      int_key("micro-batch-size", "samples per micro-batch per GPU", &c.micro_batch_size),
      int_key("global-batch-size", "samples per optimizer step (0 = micro-batch x data-parallel)",
              &c.global_batch_size),
      int_key("train-iters", "optimizer steps", &c.train_iters),
      double_key("lr", "peak learning rate", &c.lr),
      double_key("min-lr", "final learning rate of the decay", &c.min_lr),
      int_key("lr-warmup-iters", "linear warmup steps from 0", &c.lr_warmup_iters),
      choice_key("lr-decay-style", "cosine, wsd (warmup-stable-decay), linear or constant", &c.lr_decay_style,
                 {"cosine", "wsd", "linear", "constant"}),
      int_key("lr-wsd-decay-iters", "wsd: steps of the final decay phase", &c.lr_wsd_decay_iters),
      int_key("lr-decay-iters", "steps over which the LR decays (0 = train-iters)", &c.lr_decay_iters),
      double_key("weight-decay", "decoupled AdamW weight decay (not on 1-D parameters)", &c.weight_decay),
      double_key("adam-beta1", "AdamW beta1", &c.adam_beta1),
      double_key("adam-beta2", "AdamW beta2", &c.adam_beta2),
      double_key("adam-eps", "AdamW epsilon", &c.adam_eps),
      double_key("clip-grad", "global gradient-norm clip (0 = off)", &c.clip_grad),
      int_key("seed", "seed for weights, data order and stochastic rounding", &c.seed),
      choice_key("recompute", "activation recompute: none, selective (attention/SwiGLU) or full (whole layer)",
                 &c.recompute, {"none", "selective", "full"}),
      string_key("recipe",
                 "precision recipe: bf16_mixed, bf16_with_fp8_current_scaling_mixed, "
                 "bf16_with_fp8_delayed_scaling_mixed, bf16_with_fp8_subchannel_scaling_mixed, bf16_with_mxfp8_mixed, "
                 "bf16_with_nvfp4_mixed, bf16_with_mor_fp8_mixed, bf16_with_mor_nvfp4_mixed",
                 &c.recipe),
      bool_key("disable-fp4", "run the same job in bf16_mixed", &c.disable_fp4),
      bool_key("fp4-disable-rht", "NVFP4: no random Hadamard transform on the Wgrad operands", &c.fp4_disable_rht),
      bool_key("fp4-disable-sr", "NVFP4: round gradients to nearest instead of stochastically", &c.fp4_disable_sr),
      bool_key("fp4-disable-2d", "NVFP4: 1x16 weight blocks instead of 16x16", &c.fp4_disable_2d),
      choice_key("fp4-4over6",
                 "NVFP4 4/6 adaptive block scaling (each block scaled to 4 or 6, the lower error wins; "
                 "TransformerEngine's 4over6) on the weights, the activations, all (both) or none; gradients never",
                 &c.fp4_4over6, {"none", "weights", "activations", "all"}),
      choice_key("fp4-4over6-err-mode",
                 "NVFP4 4/6: the block error that picks 4 or 6, mae (summed absolute error, TransformerEngine's "
                 "default) or mse (summed squared error)",
                 &c.fp4_4over6_err_mode, {"mae", "mse"}),
      bool_key("emulated-weight-cache",
               "MXFP8/NVFP4 on Hopper: dequantize each weight to BF16 once per step for the emulated GEMMs instead "
               "of in every micro-batch (faster; 2 bytes per weight element, 4 for MXFP8)",
               &c.emulated_weight_cache),
      bool_key("first-last-layers-bf16", "keep the first and last transformer layers in BF16",
               &c.first_last_layers_bf16),
      int_key("num-layers-at-start-in-bf16", "transformer layers at the start kept in BF16 (-1 = the recipe's)",
              &c.num_layers_at_start_in_bf16),
      int_key("num-layers-at-end-in-bf16", "transformer layers at the end kept in BF16 (-1 = the recipe's)",
              &c.num_layers_at_end_in_bf16),
      bool_key("quant-stats",
               "write per-linear quantization statistics (flushed, saturated, SQNR, Wgrad error) to the JSONL",
               &c.quant_stats),
      int_key("quant-stats-interval", "steps between --quant-stats records (0 = log-interval)",
              &c.quant_stats_interval),
      double_key("anneal-start-fraction",
                 "precision annealing: steps after S = round(F x train-iters) (nearest step, halves up) run "
                 "--anneal-recipe; 0 < F < 1 (0 = off)",
                 &c.anneal_start_fraction),
      string_key("anneal-recipe",
                 "the recipe of the steps after the annealing switch: bf16_mixed or an FP8 recipe (its own BF16 "
                 "layer counts)",
                 &c.anneal_recipe),
      bool_key("anneal-fprop-only",
               "precision annealing switches only the Fprop GEMM (Dgrad and Wgrad keep --recipe); needs "
               "--anneal-recipe bf16_mixed",
               &c.anneal_fprop_only),
  };
}

// Parameter-efficient fine-tuning: LoRA on a frozen base.
// Mixture of Representations (bf16_with_mor_fp8_mixed, bf16_with_mor_nvfp4_mixed; docs/MOR.md).
std::vector<ConfigKey> mor_keys(TrainConfig& c) {
  return {
      double_key("mor-threshold",
                 "Mixture of Representations: an operand stays E4M3 while its mean relative error is below this, "
                 "else BF16 (-1 = the recipe's 0.045)",
                 &c.mor_threshold),
      double_key("mor-nvfp4-threshold",
                 "Mixture of Representations' NVFP4 ladder: an operand stays NVFP4 while its mean relative error is "
                 "below this, else it tries E4M3 (-1 = the recipe's 0.3)",
                 &c.mor_nvfp4_threshold),
      int_key("mor-interval",
              "Mixture of Representations: decide after step 1 and then every N steps, each time from that step's "
              "statistics (the steps between measure nothing)",
              &c.mor_interval),
      bool_key("mor-decide-now",
               "Mixture of Representations (E4M3 tensor rule): each quantization decides from its own statistic "
               "(no lag), to measure what the one-step lag changes; on a GPU the host waits for every quantization",
               &c.mor_decide_now),
      choice_key("mor-granularity",
                 "Mixture of Representations: one decision per tensor, from the last step's statistics (tensor), or "
                 "one per 128x128 block inside each quantization (block; bf16_with_mor_fp8_mixed)",
                 &c.mor_granularity, {"tensor", "block"}),
      bool_key("mor-three-way",
               "Mixture of Representations' block rule: E4M3 where its error beats E5M2's, else E5M2 where the "
               "block's range fits, else BF16 (without it: E4M3 below --mor-threshold, else BF16)",
               &c.mor_three_way),
      string_key("mor-scaling",
                 "Mixture of Representations' block rule: each block's FP8 scale from its amax (amax), that rounded "
                 "down to a power of two (pow2: exact BF16 operands), or GAM's shared mantissa with the block's "
                 "exponent (gam, the default)",
                 &c.mor_scaling),
      bool_key("mor-nvfp4-rows",
               "Mixture of Representations' NVFP4 ladder per block: the input's and gradient's NVFP4 blocks are 1x16 "
               "along each GEMM's K, as bf16_with_nvfp4_mixed's (a copy per direction, each block decided in each), "
               "not 16x16 tiles in one copy",
               &c.mor_nvfp4_rows),
      bool_key("mor-channel-statistic",
               "Mixture of Representations (E4M3 tensor rule): also measure each operand's error with per-row "
               "(per-channel) E4M3 scaling, for the study; decisions still use the per-tensor statistic",
               &c.mor_channel_stat),
  };
}

std::vector<ConfigKey> peft_keys(TrainConfig& c) {
  return {
      choice_key("peft", "none, or lora: train LoRA adapters on a frozen base", &c.peft, {"none", "lora"}),
      int_key("lora-rank", "LoRA rank r (Megatron-Bridge's dim)", &c.lora_rank),
      double_key("lora-alpha", "LoRA alpha: the update is scaled by alpha / rank", &c.lora_alpha),
      double_key("lora-dropout", "dropout probability on the LoRA input", &c.lora_dropout),
      string_key("lora-target",
                 "adapted linears: linear_qkv,linear_proj,linear_fc1,linear_fc2 (any subset) or all-linear",
                 &c.lora_target),
      choice_key("lora-base-precision",
                 "the frozen base's storage and GEMM format: bf16 (bf16_mixed), fp8 (per-tensor current scaling), "
                 "nvfp4 (16x16 weight blocks) or mor_fp8 (Mixture of Representations: each operand E4M3 or BF16 by "
                 "its data, a frozen weight decided once); it chooses the recipe",
                 &c.lora_base_precision, {"bf16", "fp8", "nvfp4", "mor_fp8"}),
  };
}

// Data, SFT and validation.
std::vector<ConfigKey> data_keys(TrainConfig& c) {
  return {
      bool_key("mock-data", "train on Megatron-style mock data", &c.mock_data),
      string_key("data-path", "Megatron dataset prefix or blend 'w1 p1 w2 p2 ...'", &c.data_path),
      string_key("split", "train,valid,test split weights", &c.split),
      string_key("tokenizer", "tokenizer.json or .tiktoken file (real data)", &c.tokenizer),
      bool_key("sft",
               "supervised fine-tuning: --data-path is the prefix given to nibble preprocess --sft; the loss is "
               "the mean over answer tokens (NeMo)",
               &c.sft),
      bool_key("packed-sequence",
               "SFT: pack several samples per row, attention and RoPE positions restarting per sample (NeMo's "
               "packed_sequence); false: one sample per row",
               &c.packed_sequence),
      int_key("pad-seq-to-mult",
              "SFT: pad every sample's segment to a multiple of this many tokens, the padding untrained (0 = 2 x "
              "context-parallel-size for packed rows under context parallelism, else 1)",
              &c.pad_seq_to_mult),
      int_key("eval-interval", "validate every N steps (0 = only at the end when data has a valid split)",
              &c.eval_interval),
      int_key("eval-iters", "global batches per validation (Megatron's meaning)", &c.eval_iters),
  };
}

// Data parallelism, sharding and the optimizer state's placement.
std::vector<ConfigKey> parallel_keys(TrainConfig& c) {
  return {
      int_key("tensor-model-parallel-size",
              "split every layer's heads, FFN and vocabulary over this many ranks (column- and row-parallel GEMMs, "
              "a vocabulary-parallel embedding and loss)",
              &c.tensor_model_parallel_size),
      bool_key("sequence-parallel",
               "tensor parallelism: norms and residual adds on 1/T of the tokens; all-gathers before and "
               "reduce-scatters after the split GEMMs instead of all-reduces",
               &c.sequence_parallel),
      bool_key("tp-comm-overlap",
               "tensor parallelism: run the column-parallel input gradients' all-reduces on a side stream beside "
               "their Wgrad GEMMs",
               &c.tp_comm_overlap),
      int_key("context-parallel-size",
              "split every sequence over this many ranks (ring attention; chunks r and 2C-1-r per rank); data "
              "parallelism takes the rest of the world",
              &c.context_parallel_size),
      choice_key("cp-comm-type", "context parallelism's attention exchange: p2p (K/V passed round a ring)",
                 &c.cp_comm_type, {"p2p"}),
      bool_key("use-distributed-optimizer",
               "shard FP32 master weights and AdamW m, v over the data-parallel ranks (6 + 12/d bytes/param)",
               &c.use_distributed_optimizer),
      bool_key("use-megatron-fsdp",
               "Megatron-FSDP: shard what --data-parallel-sharding-strategy names over the data-parallel ranks",
               &c.use_megatron_fsdp),
      choice_key("data-parallel-sharding-strategy",
                 "with --use-megatron-fsdp: no_shard (DDP), optim (optimizer state), optim_grads (and gradients), "
                 "optim_grads_params (and weights, gathered per layer when used): 18, 6 + 12/d, 2 + 16/d, 18/d "
                 "bytes/param",
                 &c.data_parallel_sharding_strategy, {"no_shard", "optim", "optim_grads", "optim_grads_params"}),
      choice_key("fsdp-param-gather",
                 "optim_grads_params: gather a quantized layer's weight as its training format's codes and scales "
                 "(training) or in BF16; auto = training unless --quant-stats or annealing needs the BF16 weight",
                 &c.fsdp_param_gather, {"auto", "training", "bf16"}),
      bool_key("fsdp-embeddings-per-step",
               "optim_grads(_params): gather the embedding and output layer and reduce their gradients once per "
               "step, not every micro-batch (costs a whole copy and FP32 gradient of each per GPU)",
               &c.fsdp_embeddings_per_step),
      bool_key("optimizer-cpu-offload",
               "keep FP32 master weights and AdamW m, v in page-locked host memory and stream them through the "
               "GPU's AdamW each step (bit-identical results)",
               &c.optimizer_cpu_offload),
      double_key("optimizer-offload-fraction",
                 "with --optimizer-cpu-offload: the share of the optimizer state kept in host memory (0..1)",
                 &c.optimizer_offload_fraction),
      double_key("optimizer-state-offload-chunk-size-mb",
                 "with --optimizer-cpu-offload: MiB per state array in each streamed chunk (3 staging windows of 3 "
                 "arrays live on the GPU)",
                 &c.optimizer_state_offload_chunk_size_mb),
      int_key(
          "ddp-bucket-size",
          "data parallel: gradient bucket length in elements (0 = one bucket; with an overlap max(40M, 1M x ranks))",
          &c.ddp_bucket_size),
      bool_key("overlap-grad-reduce", "data parallel: reduce each gradient bucket during the backward",
               &c.overlap_grad_reduce),
      bool_key("overlap-param-gather",
               "distributed optimizer: gather the updated weights during the next forward, bucket by bucket",
               &c.overlap_param_gather),
      bool_key("grad-reduce-in-bf16", "data parallel: reduce gradients in BF16 (half the traffic, BF16 sums)",
               &c.grad_reduce_in_bf16),
      double_key("distributed-timeout-minutes",
                 "data parallel: give up on a rendezvous or collective after this long (a rank died or hangs)",
                 &c.distributed_timeout_minutes),
  };
}

// Pipeline parallelism (Megatron's flags): the stages, the interleaved schedule's model chunks, the layer split.
std::vector<ConfigKey> pipeline_keys(TrainConfig& c) {
  return {
      int_key("pipeline-model-parallel-size",
              "split the decoder layers over this many pipeline stages (consecutive layers per stage; the embedding "
              "on the first, the final norm, output layer and loss on the last)",
              &c.pipeline_model_parallel_size),
      int_key("num-layers-per-virtual-pipeline-stage",
              "layers per model chunk of the interleaved schedule (0 = not given)",
              &c.num_layers_per_virtual_pipeline_stage),
      int_key("num-virtual-stages-per-pipeline-rank",
              "model chunks per rank of the interleaved schedule (0 = not given)",
              &c.num_virtual_stages_per_pipeline_rank),
      bool_key("account-for-embedding-in-pipeline-split", "count the embedding as a layer of the first stage",
               &c.account_for_embedding_in_pipeline_split),
      bool_key("account-for-loss-in-pipeline-split", "count the output layer and loss as a layer of the last stage",
               &c.account_for_loss_in_pipeline_split),
      int_key("decoder-first-pipeline-num-layers", "decoder layers on the first stage (0 = an even split)",
              &c.decoder_first_pipeline_num_layers),
      int_key("decoder-last-pipeline-num-layers", "decoder layers on the last stage (0 = an even split)",
              &c.decoder_last_pipeline_num_layers),
      string_key("pipeline-model-parallel-layout",
                 "every virtual stage's layers, Megatron's string: 'E' embedding, 't' decoder layer, 'L' loss, '|' "
                 "between stages, x*n and (...)*n repeats; sets the virtual stages (empty = not given)",
                 &c.pipeline_model_parallel_layout),
      bool_key("overlap-p2p-communication",
               "run the stages' sends and receives on a stream of their own, beside the passes (both schedules)",
               &c.overlap_p2p_communication),
      negated_bool_key("no-overlap-p2p-communication", "turn --overlap-p2p-communication off (Megatron's spelling)",
                       &c.overlap_p2p_communication),
  };
}

// The device, logging and checkpoints.
std::vector<ConfigKey> run_keys(TrainConfig& c) {
  return {
      choice_key("device", "auto (GPU if present), cuda or cpu", &c.device, {"auto", "cuda", "cpu"}),
      bool_key("deterministic-mode",
               "CUDA: repeat a run bit for bit (same binary, GPU model and rank count): attention backward without "
               "atomics, no split-K GEMMs, NCCL Ring/Simple; slower, and attention takes more memory",
               &c.deterministic_mode),
      int_key("log-interval", "steps between log lines", &c.log_interval),
      int_key("sample-interval",
              "every N steps print a greedy continuation of --sample-prompt and record it in metrics.jsonl (0 = off; "
              "needs --tokenizer)",
              &c.sample_interval),
      string_key("sample-prompt", "the prompt of the --sample-interval samples", &c.sample_prompt),
      int_key("sample-tokens", "new tokens per --sample-interval sample", &c.sample_tokens),
      string_key("tensorboard-dir",
                 "write the step figures (loss, learning rate, throughput, memory, ...), validation loss and "
                 "--quant-stats figures as TensorBoard scalars to an event file in this folder (rank 0)",
                 &c.tensorboard_dir),
      int_key("tensorboard-log-interval", "steps between TensorBoard step scalars (the last step is always written)",
              &c.tensorboard_log_interval),
      string_key("save", "output folder: config.toml, metrics.jsonl, and checkpoints (--save-interval)", &c.save),
      choice_key("on-nan", "stop or skip a step whose loss or gradients are not finite", &c.on_nan, {"stop", "skip"}),
      double_key("peak-tflops", "peak TFLOP/s for MFU (0 = the device's dense BF16 datasheet peak)", &c.peak_tflops),
      int_key("save-interval", "write a checkpoint to --save every N iterations and at the end (0 = none)",
              &c.save_interval),
      int_key("save-keep", "keep only the newest N checkpoints in --save (0 = all)", &c.save_keep),
      bool_key("async-save", "write checkpoint files on a background thread (the step waits only for the copy)",
               &c.async_save),
      int_key("exit-interval", "save a checkpoint and exit when the iteration is a multiple of N (0 = off)",
              &c.exit_interval),
      string_key("load", "resume from the latest checkpoint in this folder (Megatron layout)", &c.load),
      int_key("ckpt-step", "with --load: the iteration to load instead of the latest (-1 = latest)", &c.ckpt_step),
      bool_key("no-load-optim", "with --load: do not load the AdamW state (fresh moments)", &c.no_load_optim),
      bool_key("no-load-rng", "with --load: do not load the RNG state (stochastic rounding restarts its stream)",
               &c.no_load_rng),
      bool_key("finetune", "with --load: load the weights only and start at iteration 0", &c.finetune),
      string_key("load-hf", "start from a Hugging Face Llama folder (config.json + safetensors)", &c.load_hf),
  };
}

// The roofline of the step (train/roofline.h).
std::vector<ConfigKey> profile_keys(TrainConfig& c) {
  return {
      bool_key("profile",
               "end the run with a roofline of the step: per phase time, FLOPs, bytes, TFLOP/s, GB/s, the measured "
               "ceiling that bounds it and the share of the step lost to it (also NIBBLE_PROFILE=1); roofline.json "
               "and roofline.svg go to --profile-dir",
               &c.profile),
      string_key("profile-dir", "folder for --profile's roofline.json and roofline.svg (default: the --save folder)",
                 &c.profile_dir),
  };
}

}  // namespace

std::vector<ConfigKey> config_keys(TrainConfig& c) {
  std::vector<ConfigKey> keys = model_keys(c);
  for (auto* group : {mor_keys, peft_keys, data_keys, parallel_keys, pipeline_keys, run_keys, profile_keys}) {
    auto more = group(c);
    keys.insert(keys.end(), std::make_move_iterator(more.begin()), std::make_move_iterator(more.end()));
  }
  return keys;
}

namespace {
Status apply_config_table(const toml::table& tbl, const std::string& path, TrainConfig& c);

// Config files are ASCII (non-ASCII text goes in strings as \\u escapes): the toml++ of Debian 12 reaches
// an unreachable branch on some non-ASCII input, in keys, strings and escapes alike (found by fuzzing),
// so such a byte is refused here, with its line, before toml++ sees it.
Status check_ascii(const std::string& text, const std::string& where) {
  int64_t line = 1;
  for (const char ch : text) {
    if (ch == '\n') ++line;
    if (static_cast<unsigned char>(ch) >= 0x80)
      return errorf(
          "config file %s line %lld: a non-ASCII character; config files are ASCII (write it as a \\uXXXX "
          "escape inside a quoted string, or pass the value as a flag)",
          where.c_str(), (long long)line);
  }
  return Status::ok();
}
}  // namespace

Status apply_config_file(const std::string& path, TrainConfig& c) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return errorf("cannot read the config file %s", path.c_str());
  return apply_config_text(std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()), path, c);
}

Status apply_config_text(const std::string& text, const std::string& origin, TrainConfig& c) {
  NB_TRY(check_ascii(text, origin));
  toml::table tbl;
  try {
    tbl = toml::parse(text, origin);
  } catch (const toml::parse_error& e) {
    return errorf("config file %s: %s (line %u)", origin.c_str(), std::string(e.description()).c_str(),
                  e.source().begin.line);
  }
  return apply_config_table(tbl, origin, c);
}

namespace {
Status apply_config_table(const toml::table& tbl, const std::string& path, TrainConfig& c) {
  auto keys = config_keys(c);
  Status result = Status::ok();
  // Flatten one level of tables so "[training] micro-batch-size = 2" and "micro-batch-size = 2" both work.
  std::function<void(const toml::table&)> visit = [&](const toml::table& t) {
    for (const auto& [k, node] : t) {
      if (!result) return;
      if (node.is_table()) {
        visit(*node.as_table());
        continue;
      }
      std::string name(k.str());
      std::replace(name.begin(), name.end(), '_', '-');
      auto it = std::find_if(keys.begin(), keys.end(), [&](const ConfigKey& ck) { return ck.name == name; });
      if (it == keys.end()) {
        result = errorf("config file %s: unknown key '%s' (see `nibble train --help` for the keys)", path.c_str(),
                        std::string(k.str()).c_str());
        return;
      }
      std::string v;
      if (auto s = node.value<std::string>())
        v = *s;
      else if (auto b = node.value_exact<bool>())
        v = *b ? "true" : "false";
      else if (auto i = node.value_exact<int64_t>())
        v = std::to_string(*i);
      else if (auto d = node.value<double>()) {
        std::ostringstream o;
        o.precision(17);
        o << *d;
        v = o.str();
      } else {
        result = errorf("config file %s: key '%s' has an unsupported value type", path.c_str(), name.c_str());
        return;
      }
      Status st = it->set(v);
      if (!st) result = st.context("config file " + path);
    }
  };
  visit(tbl);
  return result;
}
}  // namespace

std::string format_config(TrainConfig& c) {
  std::string out;
  for (const auto& k : config_keys(c)) {
    if (k.spelling_only) continue;
    std::string name = k.name;
    std::replace(name.begin(), name.end(), '-', '_');
    out += name + " = " + k.get() + "\n";
  }
  return out;
}

}  // namespace nb
