// Trainer loop phases: step (micro-batches, gradient norm, clipping, AdamW), evaluate, the checkpoint
// triggers (--save-interval, --exit-interval, SIGTERM) and the end-of-run summary.
#include "train/trainer.h"
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include "core/gpu_profile.h"
#include "core/log.h"
#include "core/memory_ledger.h"
#include "model/step_work.h"
#include "ops/adamw.h"
#include "ops/elementwise.h"
#include "train/quant_stats.h"
#include "train/roofline.h"

namespace nb {

namespace {

double gib(double bytes) { return bytes / 1073741824.0; }

struct Timer {
  std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
  double ms() const { return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count(); }
};

// SIGTERM (what schedulers send before pre-emption) asks the loop to save after the current step and stop.
std::atomic<int> g_term_signal{0};
extern "C" void on_term_signal(int sig) { g_term_signal.store(sig); }

struct TermSignalScope {
  struct sigaction old_ {};
  bool installed = false;
  explicit TermSignalScope(bool install) {
    if (!install) return;
    struct sigaction sa {};
    sa.sa_handler = on_term_signal;
    sigemptyset(&sa.sa_mask);
    installed = sigaction(SIGTERM, &sa, &old_) == 0;
  }
  ~TermSignalScope() {
    if (installed) sigaction(SIGTERM, &old_, nullptr);
  }
};

// Tokens whose prediction is trained: labels < 0 (SFT prompts, padding) are not.
int64_t trained_tokens(const std::vector<int32_t>& labels) {
  return std::count_if(labels.begin(), labels.end(), [](int32_t l) { return l >= 0; });
}

// --profile: the roofline of the step (train/roofline.h); its files go to --profile-dir, or --save.
Status report_roofline(const TrainConfig& cfg, const std::string& title, double step_ms) {
  return roofline::report(title, step_ms, cfg.profile_dir.empty() ? cfg.save : cfg.profile_dir);
}

}  // namespace

Trainer::Trainer() = default;
Trainer::~Trainer() = default;

Status Trainer::step(StepMetrics* m) {
  NB_TRY(anneal_if_due());  // precision annealing switches at the step boundary (trainer_anneal.cpp)
  const int64_t it = iteration_;
  double loss_sum = 0, wait_ms = 0;
  const double gathered0 = fsdp_ ? fsdp_->gathered_bytes() : 0, reduced0 = fsdp_ ? fsdp_->reduced_bytes() : 0;
  const double tp_gathered0 = tp_group_ ? tp_group_->gathered_bytes : 0;
  const double tp_reduced0 = tp_group_ ? tp_group_->reduced_bytes : 0;
  NB_TRY(run_micro_batches(&loss_sum, &wait_ms));
  NB_PROFILE_BEGIN("optimizer: norm + AdamW");
  NB_PROFILE_WORK("optimizer: norm + AdamW", work::grad_norm_adamw(model_.params().shard_len()));
  StepFigures f;
  NB_TRY(reduce_step_figures(loss_sum, &f));
  const double lr = sched_.at(it);
  NB_TRY(apply_update(lr, f));
  NB_PROFILE_END("optimizer: norm + AdamW");
  if (fsdp_) {  // this step's traffic (evaluations run outside the step)
    fsdp_step_gathered_ = m->fsdp_gathered_bytes = fsdp_->gathered_bytes() - gathered0;
    fsdp_step_reduced_ = m->fsdp_reduced_bytes = fsdp_->reduced_bytes() - reduced0;
  }
  if (tp_group_) {
    tp_step_gathered_ = m->tp_gathered_bytes = tp_group_->gathered_bytes - tp_gathered0;
    tp_step_reduced_ = m->tp_reduced_bytes = tp_group_->reduced_bytes - tp_reduced0;
  }
  // The step ends when the compute stream is done. Offloaded copy-outs may still run on their own stream,
  // hidden behind the next forward (the next update waits for them; see optim/adamw_stream.h).
  if (dev_ == Device::cuda && model_.params().optimizer_state().offloaded() && !sync_)
    stream_synchronize(nullptr);
  else if (dev_ == Device::cuda)
    device_synchronize();
  // A gated update may still be streaming behind the next forward: its time is read at the next update.
  if (!streamer_.gated() && optimizer_span_.pending()) optimizer_ms_ = optimizer_span_.ms();
  m->optimizer_ms = optimizer_ms_;
  iteration_++;
  rng_step_++;
  m->iteration = iteration_;
  m->lr = lr;
  m->loss = f.loss;
  m->grad_norm = f.grad_norm;
  m->mor_fp8_operands = f.mor_fp8_operands;
  m->mor_fp8_gemms = f.mor_fp8_gemms;
  m->mor_nvfp4_operands = f.mor_nvfp4_operands;
  m->mor_nvfp4_gemms = f.mor_nvfp4_gemms;
  m->mor_fp8_blocks = f.mor_fp8_blocks;
  m->mor_e5m2_blocks = f.mor_e5m2_blocks;
  m->mor_nvfp4_blocks = f.mor_nvfp4_blocks;
  m->data_wait_ms = wait_ms;
  m->skipped = skipped_;
  m->nan_iters = nan_iters_;
  m->consumed_samples = iteration_ * cfg_.global_batch_size;
  return Status::ok();
}

// This rank's micro-batches: forward and backward of each, then the gradients reduced over ranks. All
// micro-batches go to the device in one transfer; the step's only host synchronizations are reading
// the loss and the gradient norm.
Status Trainer::run_micro_batches(double* loss_sum, double* wait_ms) {
  const int64_t it = iteration_;
  if (!grads_zeroed_) ops::fill(model_.params().flat_grad(), 0.0f, nullptr);
  grads_zeroed_ = false;
  const int64_t T = cfg_.micro_batch_size * cfg_.seq_length;
  step_segments_.resize(size_t(accum_));
  for (int64_t micro = 0; micro < accum_; ++micro) {
    Batch b;
    Timer wait;
    NB_TRY(train_src_->next(&b));
    *wait_ms += wait.ms();
    std::copy(b.tokens.begin(), b.tokens.end(), step_tokens_.begin() + micro * T);
    std::copy(b.labels.begin(), b.labels.end(), step_labels_.begin() + micro * T);
    step_segments_[size_t(micro)] = std::move(b.segment_starts);
  }
  model_.begin_step(uint32_t(rng_step_), uint32_t(data_rank()), uint32_t(data_ranks()));
  // MoR measures the first step of each decision interval only (trainer_mor.cpp): the others pay nothing for it.
  if (recipe_.mor.on) model_.pause_mor_stats(!mor_decision_step(it));
  model_.set_collect_stats(quant_stats_step(cfg_, it));
  NB_TRY(model_.stage_batches(step_tokens_.data(), step_labels_.data(), accum_));
  NB_TRY(model_.stage_segments(step_segments_.data(), accum_));
  // The loss is the mean over the step's trained tokens on all ranks (NeMo's answer-token mean for SFT);
  // pretraining trains every token, so its divisor is known without a reduction.
  step_trained_ = double(tokens_per_step_);
  if (cfg_.sft) {
    step_trained_ = double(trained_tokens(step_labels_));
    NB_TRY(sum_over_ranks(&step_trained_, 1));
    step_trained_ /= cp_size();  // the ranks of a context-parallel group hold the same rows
  }
  const float grad_scale = step_trained_ > 0 ? float(1.0 / step_trained_) : 0.0f;
  if (pp_schedule_) {  // the stages' passes in the schedule's order; the buckets reduce after it
    if (sync_) sync_->begin_last_backward();
    model_.set_grads_final_reporting(fsdp_ != nullptr);  // Megatron-FSDP reduces every pass's gradients
    if (fsdp_) fsdp_->set_next_pass_follows(false);      // the next pass may be any chunk's, either way
    NB_TRY(pp_schedule_->run(grad_scale));
  }
  for (int64_t micro = 0; micro < accum_ && !pp_schedule_; ++micro) {
    const bool last = micro + 1 == accum_;
    if (sync_ && last) sync_->begin_last_backward();  // its backward completes the gradients, bucket by bucket
    model_.set_grads_final_reporting((sync_ && last) || fsdp_);  // FSDP reduces every micro-batch's
    if (fsdp_) fsdp_->set_next_pass_follows(!last);
    NB_TRY(model_.forward_backward_staged(micro, grad_scale));
  }
  model_.set_grads_final_reporting(false);
  NB_TRY(model_.take_loss_sum(loss_sum));
  NB_TRY(reduce_gradients());
  NB_TRY(reduce_replicated_grads());
  NB_TRY(reduce_amax_over_ranks());  // before the next begin_step rolls the FP8 delayed-scaling histories
  if (dev_ == Device::cuda) {        // the arena is reserved up front, so use is at its peak after any micro-batch
    size_t f = 0, t = 0;
    device_memory_info(&f, &t);
    peak_mem_ = std::max(peak_mem_, double(t - f - base_used_));
  }
  return Status::ok();
}

// The step's global figures: the loss, the gradient norm (over the whole flat FP32 gradient buffer, or
// with the distributed optimizer each rank's shard summed over ranks), quantizer health, and whether
// SIGTERM reached any rank. One reduction of host scalars makes every rank take the same decisions.
Status Trainer::reduce_step_figures(double loss_sum, StepFigures* f) {
  const int64_t it = iteration_;
  double norm_sq_h = 0;
  NB_TRY(grad_squares(&norm_sq_h));
  recipe::LinearHealth health;
  std::vector<LlamaModel::LinearStats> linear_stats;
  NB_TRY(model_.take_health(&f->nonfinite_where, &health, &linear_stats));
  double scalars[4] = {loss_sum, f->nonfinite_where.empty() ? 0.0 : 1.0, g_term_signal.load() != 0 ? 1.0 : 0.0,
                       sharded() ? double(norm_sq_h) : 0.0};
  NB_TRY(sum_over_ranks(scalars, 4));
  if (!sharded()) scalars[3] = norm_sq_h;
  NB_TRY(reduce_over_tensor_parallel(scalars));
  NB_TRY(reduce_over_pipeline(scalars, 4));  // the loss is the last stage's, the norm every stage's part
  f->loss = step_trained_ > 0 ? scalars[0] / step_trained_ : 0.0;
  f->grad_norm = std::sqrt(scalars[3]);
  if (scalars[1] > 0 && f->nonfinite_where.empty()) f->nonfinite_where = "another rank's layer";
  stop_requested_ = scalars[2] > 0;
  if (!f->nonfinite_where.empty())
    NB_LOG_WARN("step %lld: a non-finite amax reached the quantizer of %s (%lld quantizations)", (long long)(it + 1),
                f->nonfinite_where.c_str(), (long long)health.nonfinite);
  if (health.has_stats) {
    model_.set_collect_stats(false);  // the evaluation after this step must not feed the next record
    if (jsonl_) jsonl_ << format_quant_stats(it + 1, health, linear_stats) << std::flush;
    if (tb_) tb_->log_scalars(it + 1, quant_stats_scalars(health, linear_stats));
  }
  return mor_after_step(f);
}

// AdamW with the clipped gradient, or (non-finite loss, norm or quantizer input) --on-nan's choice.
Status Trainer::apply_update(double lr, const StepFigures& f) {
  const int64_t it = iteration_;
  if (std::isfinite(f.loss) && std::isfinite(f.grad_norm) && f.nonfinite_where.empty()) {
    NB_TRY(adamw_update(lr, f.grad_norm));
    // The Linears' quantized weight copies are the old weights' now: a forward before the next step (an evaluation)
    // quantizes the new ones, as one after a resume does (before, a quantized recipe's validation lagged an update).
    model_.weights_changed();
    return gather_updated_weights();
  }
  nan_iters_++;
  if (cfg_.on_nan == "stop")
    return errorf(
        "step %lld: %s is not finite (loss %g, grad norm %g%s%s); stopping. Lower --lr, raise "
        "--lr-warmup-iters, or pass --on-nan skip to skip such steps",
        (long long)(it + 1),
        !std::isfinite(f.loss)        ? "the loss"
        : !std::isfinite(f.grad_norm) ? "the gradient norm"
                                      : "a quantizer input",
        f.loss, f.grad_norm, f.nonfinite_where.empty() ? "" : "; first non-finite amax in ", f.nonfinite_where.c_str());
  skipped_++;
  NB_LOG_WARN("step %lld: non-finite loss or gradients, update skipped", (long long)(it + 1));
  return Status::ok();
}

// One AdamW update of every parameter with the clipped gradient (optim/adamw_stream.h: in place, or
// streamed from host memory with --optimizer-cpu-offload). Weight decay only on the 2-D weights, which
// the ParamStore keeps first.
Status Trainer::adamw_update(double lr, double grad_norm) {
  float clip = 1.0f;
  if (cfg_.clip_grad > 0 && grad_norm > cfg_.clip_grad) clip = float(cfg_.clip_grad / (grad_norm + 1e-6));
  ++adam_step_;
  const ops::AdamWParams ap{float(lr),
                            float(cfg_.adam_beta1),
                            float(cfg_.adam_beta2),
                            float(cfg_.adam_eps),
                            float(cfg_.weight_decay),
                            adam_step_,
                            clip};
  ParamStore& P = model_.params();
  if (update_segments_.empty()) NB_TRY(prepare_update());
  // A checkpoint written straight from the host state must be on disk before the state changes.
  if (saves_from_state() && summary_) NB_TRY(finish_saves(summary_));
  if (optimizer_span_.pending()) optimizer_ms_ = optimizer_span_.ms();  // done: this step's forward waited
  const Stream s = streamer_.update_stream();
  optimizer_span_.begin(s);
  // Gated, the gradients are zeroed on the update's queue once read, so the next step need not wait
  // for the update before its first forward.
  NB_TRY(streamer_.update(update_segments_, ap, streamer_.gated() ? P.flat_grad() : Tensor{}));
  grads_zeroed_ = streamer_.gated();
  optimizer_span_.end(s);
  return Status::ok();
}

// The streamer, its segments and, for an offloaded state on one rank, the gates that let the next
// forward run behind the stream (train/update_gates.h). With data parallelism the update stays on the
// compute stream: reductions and gathers read and write the same buffers.
Status Trainer::prepare_update() {
  ParamStore& P = model_.params();
  // NIBBLE_OFFLOAD_GATES=0 keeps the whole update before the next forward (for A/B timing; docs/OFFLOAD.md).
  const char* gates_env = std::getenv("NIBBLE_OFFLOAD_GATES");
  const bool gated =
      P.optimizer_state().offloaded() && !sync_ && !fsdp_ && !(gates_env && std::string(gates_env) == "0");
  NB_TRY(streamer_.init(&P.optimizer_state(), gated, P.decayed_count()));
  NB_TRY(optimizer_span_.create(dev_));
  update_segments_ = build_update_segments();
  if (gated) {
    gates_ = std::make_unique<UpdateGates>(P, streamer_);
    model_.set_step_hooks(gates_.get());
  }
  return Status::ok();
}

// This rank's slices (distributed optimizer; everything otherwise) cut at the decay boundary and the
// master-only range: master, m and v are indexed from each slice's local start; gradients and compute
// copies by flat position. Master-only weights (quantized layers) get no compute copy.
std::vector<optim::UpdateSegment> Trainer::build_update_segments() {
  ParamStore& P = model_.params();
  std::vector<optim::UpdateSegment> segs;
  for (const ParamStore::Slice& s : optimizer_slices())
    for (bool decayed : {true, false}) {
      const int64_t b = std::max(s.begin, decayed ? 0 : P.decayed_count());
      const int64_t e = std::min(s.end, decayed ? P.decayed_count() : P.total());
      if (e <= b) continue;
      const int64_t to_local = s.local - s.begin;
      if (P.fsdp()) {  // gradients (and with optim_grads_params the compute copy) in this rank's shards
        const Tensor g = P.slice_grad(s), c = P.slice_compute(s);
        segs.push_back({b + to_local, e + to_local, P.range(g, b - s.begin, e - s.begin),
                        P.range(c, b - s.begin, e - s.begin), decayed ? float(cfg_.weight_decay) : 0.f});
        continue;
      }
      for (const ParamStore::Piece& pc : P.compute_pieces(b, e))
        segs.push_back({pc.begin + to_local, pc.end + to_local, P.range(P.flat_grad(), pc.begin, pc.end), pc.compute,
                        decayed ? float(cfg_.weight_decay) : 0.f});
    }
  std::sort(segs.begin(), segs.end(), [](const auto& x, const auto& y) { return x.begin < y.begin; });
  return segs;
}

// Megatron's --eval-iters: each evaluation reads eval_iters global batches (all their micro-batches).
Status Trainer::evaluate(int64_t iteration, TrainSummary* summary) {
  if (!valid_src_) return Status::ok();
  streamer_.wait_all();
  double sum = 0;
  int64_t n = 0;
  // Evaluation forwards quantize too; MoR's statistics are the training steps' alone (a decision must not depend
  // on the evaluation schedule).
  model_.pause_mor_stats(true);
  struct Resume {
    LlamaModel& m;
    ~Resume() { m.pause_mor_stats(false); }
  } resume_mor{model_};
  for (int64_t i = 0; i < cfg_.eval_iters * accum_; ++i) {
    Batch b;
    NB_TRY(valid_src_->next(&b));
    NB_TRY(model_.stage_batches(b.tokens.data(), b.labels.data(), 1));
    NB_TRY(model_.stage_segments(&b.segment_starts, 1));
    if (pp_schedule_)
      NB_TRY(pp_schedule_->run_forward_only(1));
    else
      NB_TRY(model_.forward_loss_staged(0));
    n += trained_tokens(b.labels);
  }
  consumed_valid_ += cfg_.eval_iters * cfg_.global_batch_size;
  NB_TRY(reduce_amax_over_ranks());  // the validation forwards recorded amaxes too (each rank its own rows)
  NB_TRY(model_.take_loss_sum(&sum));
  double totals[2] = {sum, double(n)};  // every rank evaluated its rows of each global batch
  NB_TRY(sum_over_ranks(totals, 2));
  NB_TRY(reduce_over_pipeline(totals, 1));  // the last stage's loss
  totals[1] /= cp_size();                   // a context-parallel group's ranks counted the same rows' tokens
  const double loss = totals[1] > 0 ? totals[0] / totals[1] : 0.0;
  std::printf(" validation loss at iteration %lld | lm loss value: %.6E | lm loss PPL: %.6E | \n", (long long)iteration,
              loss, std::exp(loss));
  if (jsonl_)
    jsonl_ << "{\"iteration\":" << iteration << ",\"val_loss\":" << loss << ",\"val_ppl\":" << std::exp(loss) << "}\n";
  if (tb_) tb_->log_validation(iteration, loss);
  summary->final_val_loss = loss;
  return Status::ok();
}

// An out-of-memory anywhere in the run (a workspace that grows at step 1, an evaluation, a sample) is the
// estimate's mistake: explain_out_of_memory says so, with the part and its estimate.
Status Trainer::train(TrainSummary* summary) { return explain_out_of_memory(train_loop(summary)); }

Status Trainer::train_loop(TrainSummary* summary) {
  if (!cfg_.save.empty() && logging_rank()) jsonl_.open(cfg_.save + "/metrics.jsonl", std::ios::app);
  if (logging_rank()) NB_TRY(open_tensorboard_log(cfg_, &tb_));
  const bool checkpoints = !cfg_.save.empty() && (cfg_.save_interval > 0 || cfg_.exit_interval > 0);
  if (checkpoints) NB_TRY(prepare_saves());
  TermSignalScope term(!cfg_.save.empty());
  g_term_signal.store(0);
  summary_ = summary;
  summary->start_iteration = iteration_;
  summary->device = device_name_;
  StepMetrics m;
  m.total_iters = cfg_.train_iters;
  m.global_batch = cfg_.global_batch_size;
  double time_sum_ms = 0, optimizer_sum_ms = 0;
  int64_t timed_steps = 0;
  if (cfg_.profile && dev_ == Device::cuda) profile::set_enabled(true);
  while (iteration_ < cfg_.train_iters) {
    Timer step_timer;
    NB_TRY(step(&m));
    const int64_t it = iteration_ - 1;
    const double step_ms = step_timer.ms();
    if (dev_ == Device::cuda && profile::enabled())  // the first step (plans, autotuning) is left out
      it == summary->start_iteration ? profile::reset() : profile::collect(false);
    if (it > summary->start_iteration) {
      time_sum_ms += step_ms;
      optimizer_sum_ms += m.optimizer_ms;
      timed_steps++;
    }  // the first step warms up
    m.step_ms = step_ms;
    const double tokens_per_gpu = double(tokens_per_step_) / double(world_.size);  // Megatron reports per GPU
    m.tokens_per_s = tokens_per_gpu / (step_ms / 1000.0);
    m.tflops = flops_per_token_ * tokens_per_gpu / (step_ms / 1000.0) / 1e12;
    m.mfu = peak_tflops_ > 0 ? m.tflops / peak_tflops_ : 0;
    // The device's memory in use (nibble's and the libraries'); the CPU backend's allocator high-water mark.
    m.peak_mem_gib = dev_ == Device::cuda ? gib(peak_mem_) : gib(double(ledger_snapshot(dev_).total.peak));
    const double mean_ms = timed_steps ? time_sum_ms / double(timed_steps) : step_ms;
    m.eta_s = mean_ms / 1000.0 * double(cfg_.train_iters - iteration_);
    if (iteration_ % cfg_.log_interval == 0 || iteration_ == cfg_.train_iters)
      std::printf("%s\n", format_log_line(m).c_str());
    std::fflush(stdout);
    if (jsonl_) jsonl_ << format_jsonl(m) << "\n" << std::flush;
    if (tb_) tb_->log_step(m);
    if (summary->losses.empty()) summary->first_loss = m.loss;
    summary->final_loss = m.loss;
    summary->losses.push_back(m.loss);
    if (cfg_.eval_interval > 0 && iteration_ % cfg_.eval_interval == 0 && iteration_ != cfg_.train_iters)
      NB_TRY(evaluate(iteration_, summary));
    if (cfg_.sample_interval > 0 && iteration_ % cfg_.sample_interval == 0) NB_TRY(sample(iteration_));
    if (writer_ && writer_->failed()) NB_TRY(finish_saves(summary));  // a background save failed: stop now
    const bool exit_now = cfg_.exit_interval > 0 && iteration_ % cfg_.exit_interval == 0;
    const bool term_now = stop_requested_;
    if ((checkpoints && cfg_.save_interval > 0 && iteration_ % cfg_.save_interval == 0) || exit_now || term_now ||
        (checkpoints && iteration_ == cfg_.train_iters && cfg_.save_interval > 0))
      NB_TRY(save(summary));
    if (exit_now || term_now) {
      summary->stopped_by = term_now ? "SIGTERM" : "exit-interval";
      break;
    }
  }
  streamer_.wait_all();
  if (dev_ == Device::cuda && profile::enabled() && logging_rank())  // the roofline of the step (roofline.h)
    NB_TRY(report_roofline(cfg_, model_cfg_.name + ", " + cfg_.recipe + ", " + device_name_,
                           timed_steps ? time_sum_ms / double(timed_steps) : 0.0));
  if (summary->stopped_by.empty()) NB_TRY(evaluate(iteration_, summary));
  NB_TRY(finish_saves(summary));
  // Said once the background writer has finished: a save that failed has returned its error above instead.
  if (!summary->stopped_by.empty())
    std::printf("%s: checkpoint of iteration %lld saved, exiting\n",
                summary->stopped_by == "SIGTERM" ? "SIGTERM received" : "--exit-interval", (long long)iteration_);
  NB_TRY(write_lora_adapter());
  fill_summary(m, timed_steps ? time_sum_ms / double(timed_steps) : m.step_ms,
               timed_steps ? optimizer_sum_ms / double(timed_steps) : m.optimizer_ms, summary);
  NB_TRY(gather_stage_peaks(summary));
  report(*summary);
  if (logging_rank()) report_memory();
  return Status::ok();
}

// The end-of-run figures from the last step's metrics and the mean step and optimizer times after step 1.
void Trainer::fill_summary(const StepMetrics& m, double mean_step_ms, double optimizer_ms,
                           TrainSummary* summary) const {
  summary->steps = iteration_ - summary->start_iteration;
  summary->end_iteration = iteration_;
  summary->skipped = skipped_;
  summary->mean_step_ms = mean_step_ms;
  summary->optimizer_ms = optimizer_ms;
  const double tokens_per_gpu = double(tokens_per_step_) / double(world_.size);
  summary->tokens_per_s = summary->mean_step_ms > 0 ? tokens_per_gpu / (summary->mean_step_ms / 1000.0) : 0;
  summary->tflops =
      summary->mean_step_ms > 0 ? flops_per_token_ * tokens_per_gpu / (summary->mean_step_ms / 1000.0) / 1e12 : 0;
  summary->mfu = peak_tflops_ > 0 ? summary->tflops / peak_tflops_ : 0;
  summary->peak_mem_gib = m.peak_mem_gib;
}

void Trainer::report(const TrainSummary& s) const {
  std::printf("\n==================== nibble train: summary ====================\n");
  std::printf("| %-34s | %-22s |\n", "device", device_name_.c_str());
  std::printf("| %-34s | %-22s |\n", "model", model_cfg_.name.c_str());
  std::printf("| %-34s | %-22s |\n", "recipe (as run)", recipe_as_run_.c_str());
  std::printf("| %-34s | %22lld |\n", "steps run (from iteration)", (long long)s.steps);
  if (s.start_iteration > 0)
    std::printf("| %-34s | %22lld |\n", "resumed after iteration", (long long)s.start_iteration);
  if (!s.stopped_by.empty()) std::printf("| %-34s | %22s |\n", "stopped early by", s.stopped_by.c_str());
  std::printf("| %-34s | %22lld |\n", "skipped steps", (long long)s.skipped);
  std::printf("| %-34s | %22.4f |\n", "loss: first step", s.first_loss);
  std::printf("| %-34s | %22.4f |\n", "loss: last step", s.final_loss);
  if (s.final_val_loss >= 0) std::printf("| %-34s | %22.4f |\n", "validation loss", s.final_val_loss);
  std::printf("| %-34s | %22.1f |\n", "step time (ms, mean after step 1)", s.mean_step_ms);
  std::printf("| %-34s | %22.0f |\n", "tokens/s/GPU", s.tokens_per_s);
  std::printf("| %-34s | %22.1f |\n", "model TFLOP/s/GPU", s.tflops);
  if (peak_tflops_ > 0) std::printf("| %-34s | %21.1f%% |\n", "MFU", 100.0 * s.mfu);
  std::printf("| %-34s | %22.2f |\n", "peak memory (GiB)", s.peak_mem_gib);
  for (size_t r = 0; r < s.stage_peak_mem_gib.size(); ++r)
    std::printf("| %-34s | %22.2f |\n", strprintf("peak memory, stage %zu (GiB)", r).c_str(), s.stage_peak_mem_gib[r]);
  // nibble's own allocations at their most over the whole run, the final evaluation and save included.
  std::printf("| %-34s | %22.2f |\n", "allocator peak (GiB)", gib(double(ledger_snapshot(dev_).total.peak)));
  std::printf("| %-34s | %22.1f |\n", "optimizer update (ms, mean)", s.optimizer_ms);
  const optim::OptimizerState& state = model_.params().optimizer_state();
  if (state.offloaded())
    std::printf("| %-34s | %22.2f |\n", "optimizer state in host mem (GiB)", gib(double(state.host_bytes())));
  if (fsdp_) {
    std::printf("| %-34s | %22.2f |\n", "FSDP weights gathered/step (GiB)", gib(fsdp_step_gathered_));
    std::printf("| %-34s | %22.2f |\n", "FSDP grads reduced/step (GiB)", gib(fsdp_step_reduced_));
    std::printf("| %-34s | %22.2f |\n", "FSDP windows (GiB)", gib(double(fsdp_->window_bytes())));
  }
  if (tp_group_) {
    std::printf("| %-34s | %22.1f |\n", "TP all-gathered/step (MiB)", tp_step_gathered_ / 1048576.0);
    std::printf("| %-34s | %22.1f |\n", "TP reduced/step (MiB)", tp_step_reduced_ / 1048576.0);
  }
  const double wait_total = train_src_ ? train_src_->wait_ms_total() : 0;
  std::printf("| %-34s | %22.3f |\n", "data wait per step (ms)", s.steps ? wait_total / double(s.steps) : 0.0);
  if (cfg_.quant_stats)
    std::printf("| %-34s | %22.1f |\n", "quant-stats extra work, total (ms)", model_.quant_stats_ms());
  if (s.saves > 0) {
    std::printf("| %-34s | %22lld |\n", "checkpoints saved", (long long)s.saves);
    std::printf("| %-34s | %22.2f |\n", "checkpoint size (GiB)", s.checkpoint_gib);
    std::printf("| %-34s | %22.1f |\n", "save stall, max (ms)", s.save_stall_ms_max);
    std::printf("| %-34s | %22.1f |\n", "save write time, max (s)", s.save_write_s_max);
  }
}

Status run_training(TrainConfig cfg, TrainSummary* summary) {
  NB_TRY(check_tensorboard_dir(cfg.tensorboard_dir));  // before a setup that may take minutes
  Trainer t;
  NB_TRY(t.setup(std::move(cfg)));
  return t.train(summary);
}

}  // namespace nb
