// run_training: the job from configuration to summary. Order matters for users: every check that
// needs no GPU runs before the first allocation, and the memory estimate prints before step 1.
#include "train/trainer.h"
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include "core/device_info.h"
#include "core/gpu_profile.h"
#include "core/log.h"
#include "core/tensor.h"
#include "data/token_source.h"
#include "model/llama_model.h"
#include "recipe/recipe.h"
#include "tokenizer/bpe_tokenizer.h"
#include "ops/adamw.h"
#include "ops/elementwise.h"
#include "train/lr_schedule.h"
#include "train/metrics.h"

namespace nb {

namespace {

double gib(double bytes) { return bytes / 1073741824.0; }

std::string oom_advice(const TrainConfig& c, double need_gib, double free_gib) {
  return strprintf("needs about %.2f GiB of GPU memory but %.2f GiB is free; lower --micro-batch-size (now %lld), "
                   "use --recompute selective or full (now %s), or shorten --seq-length (now %lld)",
                   need_gib, free_gib, (long long)c.micro_batch_size, c.recompute.c_str(), (long long)c.seq_length);
}

struct Timer {
  std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
  double ms() const { return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count(); }
};

}  // namespace

Status run_training(TrainConfig cfg, TrainSummary* summary) {
  // ---- configuration: everything that needs no GPU is checked first
  LlamaConfig model_cfg;
  NB_TRY(resolve_model(cfg, &model_cfg));
  NB_TRY(validate_train_config(cfg, model_cfg));
  Recompute rc;
  NB_TRY(parse_recompute(cfg.recompute, &rc));
  recipe::Recipe rcp;
  NB_TRY(recipe::recipe_preset(cfg.recipe, &rcp).context("--recipe"));
  recipe::RecipeKnobs knobs;
  knobs.disable_fp4 = cfg.disable_fp4; knobs.fp4_disable_rht = cfg.fp4_disable_rht;
  knobs.fp4_disable_sr = cfg.fp4_disable_sr; knobs.fp4_disable_2d = cfg.fp4_disable_2d;
  knobs.first_last_layers_bf16 = cfg.first_last_layers_bf16;
  knobs.layers_at_start_bf16 = cfg.num_layers_at_start_in_bf16; knobs.layers_at_end_bf16 = cfg.num_layers_at_end_in_bf16;
  NB_TRY(recipe::apply_knobs(knobs, &rcp));
  rcp.seed = uint64_t(cfg.seed);

  // Real data: the tokenizer's ids must fit the model's vocabulary (a CUDA embedding cannot report it).
  if (!cfg.mock_data && !cfg.tokenizer.empty()) {
    std::unique_ptr<BpeTokenizer> tok;
    NB_TRY(BpeTokenizer::load(cfg.tokenizer, "auto", &tok).context("--tokenizer"));
    if (tok->vocab_size() > model_cfg.vocab)
      return errorf("the tokenizer %s has %lld tokens but model %s has a vocabulary of %lld; pass --vocab-size %lld "
                    "or a preset with a larger vocabulary", cfg.tokenizer.c_str(), (long long)tok->vocab_size(),
                    model_cfg.name.c_str(), (long long)model_cfg.vocab, (long long)tok->vocab_size());
  } else if (!cfg.mock_data) {
    NB_LOG_WARN("no --tokenizer given: nibble cannot check that the data's token ids fit the vocabulary (%lld)",
                (long long)model_cfg.vocab);
  }

  Device dev = Device::cpu;
  int cc_major = 0, cc_minor = 0;
  std::string why, device_name = "CPU (reference backend)";
  if (cfg.device != "cpu") {
    auto gpus = query_gpus(&why);
    if (!gpus.empty()) {
      dev = Device::cuda;
      device_name = gpus[0].name;
      cc_major = gpus[0].cc_major;
      cc_minor = gpus[0].cc_minor;
    } else if (cfg.device == "cuda") {
      return errorf("--device cuda was asked for but %s", why.c_str());
    } else {
      NB_LOG_WARN("no GPU (%s): training on the CPU backend, which is meant for tiny models", why.c_str());
    }
  }
  NB_TRY(recipe::check_supported(rcp, cc_major, cc_minor));
  std::printf("---------------- nibble train: resolved configuration ----------------\n%s", format_config(cfg).c_str());
  std::printf("device = \"%s\"\n", device_name.c_str());
  const int64_t accum = cfg.global_batch_size / (cfg.micro_batch_size * cfg.data_parallel);
  const int64_t tokens_per_step = cfg.global_batch_size * cfg.seq_length;
  const double flops_per_token = model_cfg.flops_per_token(cfg.seq_length);
  std::printf("model: %s, %lld layers, hidden %lld, ffn %lld, heads %lld/%lld kv, vocab %lld, %.2f M parameters\n",
              model_cfg.name.c_str(), (long long)model_cfg.layers, (long long)model_cfg.hidden, (long long)model_cfg.ffn,
              (long long)model_cfg.heads, (long long)model_cfg.kv_heads, (long long)model_cfg.vocab,
              model_cfg.total_params() / 1e6);
  std::printf("batch: %lld tokens/step = global batch %lld x seq %lld (micro-batch %lld, %lld accumulation steps); "
              "%.2f GFLOP/token\n",
              (long long)tokens_per_step, (long long)cfg.global_batch_size, (long long)cfg.seq_length,
              (long long)cfg.micro_batch_size, (long long)accum, flops_per_token / 1e9);
  // Which layer runs which format, per GEMM, and whether this GPU runs it natively.
  std::printf("recipe %s:\n", rcp.name.c_str());
  for (int64_t l = 0; l < model_cfg.layers;) {
    const bool bf16 = rcp.layer_in_bf16(l, model_cfg.layers);
    int64_t e = l;
    while (e + 1 < model_cfg.layers && rcp.layer_in_bf16(e + 1, model_cfg.layers) == bf16) ++e;
    std::printf("  layers %lld-%lld: %s\n", (long long)l, (long long)e,
                recipe::describe_gemms(rcp, bf16, cc_major, cc_minor).c_str());
    l = e + 1;
  }
  std::printf("  embedding, attention, norms, LM head and loss: bf16; master weights, gradients, AdamW: fp32\n");
  if (!cfg.save.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(cfg.save, ec);
    if (ec) return errorf("cannot create output folder %s: %s", cfg.save.c_str(), ec.message().c_str());
    std::ofstream(cfg.save + "/config.toml") << format_config(cfg);
  }

  // ---- memory estimate before step 1
  MicroBatchShape shape{cfg.micro_batch_size, cfg.seq_length};
  const double param_bytes = double(LlamaModel::parameter_bytes(model_cfg, dev, rcp));
  const double act_bytes = double(LlamaModel::plan_activation_bytes(model_cfg, dev, shape, rc, rcp));
  // cuBLASLt/cuDNN workspaces and allocator slack; quantized recipes add their weight and input copies
  // and the BF16 scratch of emulated GEMMs (estimated: about 1 byte per linear weight element).
  double workspace = dev == Device::cuda ? 512.0 * 1048576 : 0;
  if (rcp.quantized()) workspace += double(model_cfg.matmul_params() - model_cfg.hidden * model_cfg.vocab) * 1.0;
  size_t free_b = 0, total_b = 0;
  device_memory_info(&free_b, &total_b);
  std::printf("memory estimate: weights+grads+AdamW %.2f GiB (%.1f bytes/param), activations %.2f GiB per micro-batch "
              "of %lld, workspaces %.2f GiB, total %.2f GiB",
              gib(param_bytes), param_bytes / double(model_cfg.total_params()), gib(act_bytes),
              (long long)cfg.micro_batch_size, gib(workspace), gib(param_bytes + act_bytes + workspace));
  if (dev == Device::cuda) {
    int64_t best = 0;
    for (int64_t mbs = 1; mbs <= 1024; mbs *= 2) {
      double need = param_bytes + workspace +
                    double(LlamaModel::plan_activation_bytes(model_cfg, dev, {mbs, cfg.seq_length}, rc, rcp));
      if (need <= double(free_b)) best = mbs; else break;
    }
    std::printf("; %.2f GiB free of %.2f GiB: largest micro-batch that fits %lld\n", gib(double(free_b)),
                gib(double(total_b)), (long long)best);
    if (param_bytes + act_bytes + workspace > double(free_b))
      return Status::error("out of GPU memory before step 1: this job " +
                           oom_advice(cfg, gib(param_bytes + act_bytes + workspace), gib(double(free_b))));
  } else {
    std::printf("\n");
  }
  size_t base_used = total_b - free_b;

  // ---- model and data
  LlamaModel model;
  Status st = model.init(model_cfg, dev, shape, rc, uint64_t(cfg.seed), rcp);
  if (!st) {
    if (st.message().find("out of GPU memory") != std::string::npos)
      return Status::error("out of GPU memory while allocating: this job " +
                           oom_advice(cfg, gib(param_bytes + act_bytes + workspace), gib(double(free_b))));
    return st;
  }
  if (rcp.quantized())  // the estimate above guessed these; now they are allocated and known
    std::printf("quantized copies held by the linear layers: %.2f GiB\n", gib(double(model.quantized_copy_bytes())));
  std::unique_ptr<TokenSource> train_src, valid_src;
  const int64_t train_samples = cfg.train_iters * cfg.global_batch_size;
  const int64_t evals = cfg.eval_interval > 0 ? cfg.train_iters / cfg.eval_interval + 1 : 1;
  const int64_t valid_samples = evals * cfg.eval_iters * cfg.micro_batch_size;
  if (cfg.mock_data) {
    NB_TRY(make_mock_source(model_cfg.vocab, cfg.seq_length, cfg.micro_batch_size, uint64_t(cfg.seed), train_samples, 0,
                            &train_src));
    if (cfg.eval_interval > 0)
      NB_TRY(make_mock_source_split(model_cfg.vocab, cfg.seq_length, cfg.micro_batch_size, uint64_t(cfg.seed),
                                    Split::valid, valid_samples, 0, &valid_src));
  } else {
    DataConfig dc;
    dc.data_path = cfg.data_path;
    dc.split = cfg.split;
    dc.seq_length = cfg.seq_length;
    dc.seed = uint64_t(cfg.seed);
    dc.num_samples[0] = train_samples;
    dc.num_samples[1] = valid_samples;
    NB_TRY(make_gpt_source(dc, Split::train, cfg.micro_batch_size, 0, &train_src));
    Status vs = make_gpt_source(dc, Split::valid, cfg.micro_batch_size, 0, &valid_src);
    if (!vs) NB_LOG_WARN("no validation data: %s", vs.message().c_str());
  }

  LrSchedule sched;
  sched.lr = cfg.lr; sched.min_lr = cfg.min_lr; sched.warmup = cfg.lr_warmup_iters;
  sched.decay_iters = cfg.lr_decay_iters; sched.wsd_decay_iters = cfg.lr_wsd_decay_iters; sched.style = cfg.lr_decay_style;
  double peak = cfg.peak_tflops > 0 ? cfg.peak_tflops : (dev == Device::cuda ? bf16_peak_tflops(device_name) : 0);
  if (dev == Device::cuda)
    std::printf("MFU is reported against %.1f TFLOP/s (%s)\n", peak,
                cfg.peak_tflops > 0 ? "--peak-tflops" : "dense BF16 datasheet peak of this GPU");

  std::ofstream jsonl;
  if (!cfg.save.empty()) jsonl.open(cfg.save + "/metrics.jsonl", std::ios::trunc);
  ParamStore& P = model.params();
  Buffer norm_sq;
  NB_TRY(Buffer::allocate(&norm_sq, DType::f32, dev, {1}));

  auto validate_now = [&](int64_t iteration) -> Status {
    if (!valid_src) return Status::ok();
    double sum = 0;
    int64_t n = 0;
    for (int64_t i = 0; i < cfg.eval_iters; ++i) {
      Batch b;
      NB_TRY(valid_src->next(&b));
      NB_TRY(model.stage_batches(b.tokens.data(), b.labels.data(), 1));
      NB_TRY(model.forward_loss_staged(0));
      n += int64_t(b.tokens.size());
    }
    NB_TRY(model.take_loss_sum(&sum));
    double loss = sum / double(n);
    std::printf(" validation loss at iteration %lld | lm loss value: %.6E | lm loss PPL: %.6E | \n", (long long)iteration,
                loss, std::exp(loss));
    if (jsonl) jsonl << "{\"iteration\":" << iteration << ",\"val_loss\":" << loss << ",\"val_ppl\":" << std::exp(loss) << "}\n";
    summary->final_val_loss = loss;
    return Status::ok();
  };

  // ---- the loop
  StepMetrics m;
  m.total_iters = cfg.train_iters;
  m.global_batch = cfg.global_batch_size;
  double peak_mem = 0, time_sum_ms = 0;
  int64_t timed_steps = 0;
  std::vector<int32_t> step_tokens(size_t(accum * cfg.micro_batch_size * cfg.seq_length)), step_labels(step_tokens.size());
  for (int64_t it = 0; it < cfg.train_iters; ++it) {
    Timer step_timer;
    ops::fill(P.flat_grad(), 0.0f, nullptr);
    double loss_sum = 0, wait_ms = 0;
    const float grad_scale = 1.0f / float(tokens_per_step);
    // All micro-batches of the step go to the device in one transfer; the only host synchronization
    // of the step is reading the loss and gradient norm at its end.
    const int64_t T = cfg.micro_batch_size * cfg.seq_length;
    for (int64_t micro = 0; micro < accum; ++micro) {
      Batch b;
      Timer wait;
      NB_TRY(train_src->next(&b));
      wait_ms += wait.ms();
      std::copy(b.tokens.begin(), b.tokens.end(), step_tokens.begin() + micro * T);
      std::copy(b.labels.begin(), b.labels.end(), step_labels.begin() + micro * T);
    }
    model.begin_step(uint32_t(it));
    model.set_collect_stats(cfg.quant_stats && ((it + 1) % cfg.log_interval == 0 || it + 1 == cfg.train_iters));
    NB_TRY(model.stage_batches(step_tokens.data(), step_labels.data(), accum));
    for (int64_t micro = 0; micro < accum; ++micro) NB_TRY(model.forward_backward_staged(micro, grad_scale));
    NB_TRY(model.take_loss_sum(&loss_sum));
    if (dev == Device::cuda) {  // the arena is reserved up front, so use is at its peak after any micro-batch
      size_t f = 0, t = 0;
      device_memory_info(&f, &t);
      peak_mem = std::max(peak_mem, double(t - f - base_used));
    }
    const double loss = loss_sum / double(tokens_per_step);
    NB_PROFILE_BEGIN("optimizer: norm + AdamW");
    // Global gradient norm over the flat FP32 gradient buffer.
    ops::fill(norm_sq.tensor(), 0.0f, nullptr);
    ops::sum_squares_accumulate(P.flat_grad(), norm_sq.ptr<float>(), nullptr);
    float norm_sq_h = 0;
    NB_TRY(copy_bytes(&norm_sq_h, Device::cpu, norm_sq.data(), dev, 4));
    const double grad_norm = std::sqrt(double(norm_sq_h));
    const double lr = sched.at(it);
    m.iteration = it + 1;
    std::string nonfinite_where;
    recipe::LinearHealth health;
    NB_TRY(model.take_health(&nonfinite_where, &health));
    if (!nonfinite_where.empty())
      NB_LOG_WARN("step %lld: a non-finite amax reached the quantizer of %s (%lld quantizations)", (long long)(it + 1),
                  nonfinite_where.c_str(), (long long)health.nonfinite);
    if (health.has_stats && jsonl)
      jsonl << "{\"iteration\":" << it + 1 << ",\"quant_worst_sqnr_db\":" << health.sqnr_db
            << ",\"quant_max_flushed\":" << health.flushed << ",\"quant_max_saturated\":" << health.saturated << "}\n";
    if (!std::isfinite(loss) || !std::isfinite(grad_norm) || !nonfinite_where.empty()) {
      m.nan_iters++;
      if (cfg.on_nan == "stop")
        return errorf("step %lld: %s is not finite (loss %g, grad norm %g%s%s); stopping. Lower --lr, raise "
                      "--lr-warmup-iters, or pass --on-nan skip to skip such steps",
                      (long long)(it + 1), !std::isfinite(loss) ? "the loss" : !std::isfinite(grad_norm) ?
                      "the gradient norm" : "a quantizer input", loss, grad_norm,
                      nonfinite_where.empty() ? "" : "; first non-finite amax in ", nonfinite_where.c_str());
      m.skipped++;
      NB_LOG_WARN("step %lld: non-finite loss or gradients, update skipped", (long long)(it + 1));
    } else {
      float clip = 1.0f;
      if (cfg.clip_grad > 0 && grad_norm > cfg.clip_grad) clip = float(cfg.clip_grad / (grad_norm + 1e-6));
      ops::AdamWParams ap{float(lr), float(cfg.adam_beta1), float(cfg.adam_beta2), float(cfg.adam_eps),
                          float(cfg.weight_decay), it + 1 - m.skipped, clip};
      // Weight decay only on the 2-D weights, which the ParamStore keeps first. Master-only weights (quantized
      // layers) get no compute copy: their pieces pass an empty one.
      for (bool decayed : {true, false}) {
        ap.weight_decay = decayed ? float(cfg.weight_decay) : 0.f;
        const int64_t b = decayed ? 0 : P.decayed_count(), e = decayed ? P.decayed_count() : P.total();
        for (const ParamStore::Piece& pc : P.compute_pieces(b, e))
          ops::adamw_update(P.range(P.flat_master(), pc.begin, pc.end), P.range(P.flat_grad(), pc.begin, pc.end),
                            P.range(P.flat_m(), pc.begin, pc.end), P.range(P.flat_v(), pc.begin, pc.end), pc.compute,
                            ap, nullptr);
      }
    }
    NB_PROFILE_END("optimizer: norm + AdamW");
    if (dev == Device::cuda) device_synchronize();
    if (dev == Device::cuda && profile::enabled()) {  // step 1 (plans, autotuning) is left out
      if (it == 0) profile::reset(); else profile::collect(it + 1 == cfg.train_iters);
    }
    const double step_ms = step_timer.ms();
    if (it > 0) { time_sum_ms += step_ms; timed_steps++; }  // step 1 includes warm-up (plans, autotuning)
    m.consumed_samples = (it + 1) * cfg.global_batch_size;
    m.step_ms = step_ms;
    m.tokens_per_s = double(tokens_per_step) / (step_ms / 1000.0);
    m.tflops = flops_per_token * double(tokens_per_step) / (step_ms / 1000.0) / 1e12;
    m.mfu = peak > 0 ? m.tflops / peak : 0;
    m.lr = lr;
    m.loss = loss;
    m.grad_norm = grad_norm;
    m.data_wait_ms = wait_ms;
    m.peak_mem_gib = dev == Device::cuda ? gib(peak_mem) : gib(param_bytes + act_bytes);
    double mean_ms = timed_steps ? time_sum_ms / double(timed_steps) : step_ms;
    m.eta_s = mean_ms / 1000.0 * double(cfg.train_iters - it - 1);
    if ((it + 1) % cfg.log_interval == 0 || it + 1 == cfg.train_iters) std::printf("%s\n", format_log_line(m).c_str());
    std::fflush(stdout);
    if (jsonl) jsonl << format_jsonl(m) << "\n" << std::flush;
    if (it == 0) summary->first_loss = loss;
    summary->final_loss = loss;
    summary->losses.push_back(loss);
    if (cfg.eval_interval > 0 && (it + 1) % cfg.eval_interval == 0 && it + 1 != cfg.train_iters) NB_TRY(validate_now(it + 1));
  }
  NB_TRY(validate_now(cfg.train_iters));

  // ---- summary
  summary->steps = cfg.train_iters;
  summary->skipped = m.skipped;
  summary->device = device_name;
  summary->mean_step_ms = timed_steps ? time_sum_ms / double(timed_steps) : m.step_ms;
  summary->tokens_per_s = double(tokens_per_step) / (summary->mean_step_ms / 1000.0);
  summary->tflops = flops_per_token * double(tokens_per_step) / (summary->mean_step_ms / 1000.0) / 1e12;
  summary->mfu = peak > 0 ? summary->tflops / peak : 0;
  summary->peak_mem_gib = m.peak_mem_gib;
  std::printf("\n==================== nibble train: summary ====================\n");
  std::printf("| %-34s | %-22s |\n", "device", device_name.c_str());
  std::printf("| %-34s | %-22s |\n", "model", model_cfg.name.c_str());
  std::printf("| %-34s | %22lld |\n", "steps (skipped)", (long long)summary->steps);
  std::printf("| %-34s | %22.4f |\n", "loss: first step", summary->first_loss);
  std::printf("| %-34s | %22.4f |\n", "loss: last step", summary->final_loss);
  if (summary->final_val_loss >= 0) std::printf("| %-34s | %22.4f |\n", "validation loss", summary->final_val_loss);
  std::printf("| %-34s | %22.1f |\n", "step time (ms, mean after step 1)", summary->mean_step_ms);
  std::printf("| %-34s | %22.0f |\n", "tokens/s/GPU", summary->tokens_per_s);
  std::printf("| %-34s | %22.1f |\n", "model TFLOP/s/GPU", summary->tflops);
  if (peak > 0) std::printf("| %-34s | %21.1f%% |\n", "MFU", 100.0 * summary->mfu);
  std::printf("| %-34s | %22.2f |\n", "peak memory (GiB)", summary->peak_mem_gib);
  double wait_total = train_src->wait_ms_total();
  std::printf("| %-34s | %22.3f |\n", "data wait per step (ms)", wait_total / double(cfg.train_iters));
  return Status::ok();
}

}  // namespace nb
