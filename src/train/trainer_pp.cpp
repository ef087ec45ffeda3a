// Trainer phases for pipeline parallelism (docs/DISTRIBUTED.md): the layers' split over the stages and this
// rank's chunks (model/pipeline_split.h), the pipeline and data x context communicators, the schedule that runs a
// step's passes (train/pipeline_schedule.h), the step's figures summed over the stages, and whole-tensor
// checkpoints: a save gathers every stage's arrays into the whole model's on rank 0, a load keeps this stage's.
#include <algorithm>
#include <cstdio>
#include "ops/elementwise.h"
#include "train/trainer.h"

namespace nb {

// What pipeline parallelism does not combine with yet, each in one sentence (the configuration check refused the
// rest before any rank started).
Status Trainer::check_pipeline_job() const {
  if (pp_size() == 1) return Status::ok();
  // Input slots (recipe::Linear::set_input_slots) would split a role's step amax over the micro-batches in flight.
  if (recipe_.fp8_scaling == recipe::Fp8Scaling::delayed && recompute_ != Recompute::full && !lora())
    return errorf(
        "FP8 delayed scaling records one amax per Linear role and step, which the micro-batches in flight under "
        "--pipeline-model-parallel-size %d would keep apart: pass --recompute full (each layer's forward runs again "
        "right before its backward)",
        pp_size());
  if (cfg_.overlap_grad_reduce || cfg_.overlap_param_gather)
    return errorf(
        "--overlap-grad-reduce and --overlap-param-gather follow one micro-batch's backward; under pipeline "
        "parallelism the gradients are reduced after the schedule: leave them out");
  return Status::ok();
}

LlamaModel::PipelineStage Trainer::pipeline_stage(int r) const {
  LlamaModel::PipelineStage s;
  s.chunks = pp::rank_chunks(pp_stages_, r, pp_size());
  s.first = r == 0;
  s.last = r == pp_size() - 1;
  return s;
}

Status Trainer::plan_pipeline() {
  if (pp_size() == 1) return Status::ok();
  NB_TRY(cfg_.pipeline_virtual_stages(model_cfg_.layers, &virtual_stages_));
  NB_TRY(pp::split_layers(model_cfg_.layers, cfg_.pipeline_split_options(virtual_stages_), &pp_stages_));
  LlamaModel::PipelineStage stage = pipeline_stage(layout_.pp);
  stage.order = PipelineSchedule::pass_order(pp_size(), virtual_stages_, layout_.pp, accum_);
  model_.pipeline = stage;
  return check_pipeline_job();
}

void Trainer::print_pipeline_plan() const {
  if (pp_size() == 1) return;
  std::printf("pipeline parallel: %d stages, %d chunk%s per rank (%s schedule), %lld micro-batches per step; layers:",
              pp_size(), virtual_stages_, virtual_stages_ > 1 ? "s" : "",
              virtual_stages_ > 1 ? "interleaved 1F1B" : "1F1B", (long long)accum_);
  for (int r = 0; r < pp_size(); ++r) {
    std::printf(" rank %d", r);
    for (const pp::LayerRange& c : pp::rank_chunks(pp_stages_, r, pp_size()))
      if (c.count() == 0)
        std::printf(" [no layers]");  // a layout's empty stage passes the residual stream on
      else
        std::printf(" [%lld-%lld]", (long long)c.begin, (long long)c.end - 1);
    std::printf(r + 1 < pp_size() ? ";" : "\n");
  }
  std::printf(
      "pipeline bubble by formula (P - 1) / (V x M) = %d / (%d x %lld) = %.1f%% of the ideal step; first stage holds "
      "%lld micro-batch chunks of activations in flight; messages %s\n",
      pp_size() - 1, virtual_stages_, (long long)accum_,
      100.0 * pp::bubble_fraction(pp_size(), virtual_stages_, accum_),
      (long long)PipelineSchedule::max_in_flight(pp_size(), virtual_stages_, 0, accum_),
      cfg_.overlap_p2p_communication ? "overlapped with compute (a stream of their own; a pass waits for its input)"
                                     : "posted between passes on the compute stream (--no-overlap-p2p-communication)");
}

// Stage index outermost: the stages of one (data, context, tensor) index form a pipeline group (the data x context
// groups of each stage and tensor index are connect_tensor_parallel's).
Status Trainer::connect_pipeline() {
  if (pp_size() == 1) return Status::ok();
  world_comm_ = std::move(comm_);
  const int per_stage = world_.size / pp_size();
  return world_comm_->split(world_.rank % per_stage, layout_.pp, "pp", &pp_comm_);
}

Status Trainer::start_pipeline() {
  if (pp_size() == 1) return Status::ok();
  if (!pp_comm_) return errorf("pipeline parallelism needs its ranks connected (a distributed launch)");
  pp_schedule_ = std::make_unique<PipelineSchedule>();
  return pp_schedule_->init(pp_comm_.get(), &model_, virtual_stages_, accum_, dev_, cfg_.overlap_p2p_communication);
}

Status Trainer::reduce_over_pipeline(double* values, int n) {
  if (!pp_comm_) return Status::ok();
  return pp_comm_->all_reduce_host(values, n, dist::ReduceOp::sum);
}

// Each stage holds other layers and other passes in flight (the first the most), so one rank's peak is not the job's:
// every stage's goes into the summary. Called on every rank.
Status Trainer::gather_stage_peaks(TrainSummary* summary) {
  if (!pp_comm_) return Status::ok();
  std::vector<double> peaks(size_t(pp_size()), 0.0);
  peaks[size_t(layout_.pp)] = summary->peak_mem_gib;
  NB_TRY(reduce_over_pipeline(peaks.data(), pp_size()));
  summary->stage_peak_mem_gib = std::move(peaks);
  return Status::ok();
}

// Under both tensor and pipeline parallelism each stage's tensor-parallel ranks gather its whole arrays on their
// rank 0 first; those ranks then gather the stages'.
Status Trainer::gather_whole(const float* local, float* whole) {
  if (pp_size() == 1) return gather_tensor_parallel(local, whole);
  const ParamStore& P = model_.params();
  if (tp_size() == 1 && !P.fsdp()) return gather_pipeline(local, whole);
  if (tp_size() == 1) {  // Megatron-FSDP lays out groups padded to the shards: first the stage's own layout, by name
    int64_t n = 0;
    const std::vector<ParamInfo> stage_layout = P.stage_whole_layout(&n);
    std::vector<float> stage(size_t(n), 0.0f);
    for (const ParamInfo& p : stage_layout)
      std::copy_n(local + P.info(p.name).offset, p.numel, stage.data() + p.offset);
    return gather_pipeline(stage.data(), whole);
  }
  int64_t n = 0;
  model_.params().stage_whole_layout(&n);
  std::vector<float> stage(layout_.tp == 0 ? size_t(n) : 0);
  NB_TRY(gather_tensor_parallel(local, stage.data()));
  return layout_.tp == 0 ? gather_pipeline(stage.data(), whole) : Status::ok();
}

// The stages' arrays are gathered in chunks as equal-length slices (padded to the longest stage's), and rank 0 puts
// each stage's parameters in their places in `whole`, by name.
Status Trainer::gather_pipeline(const float* local, float* whole) {
  int64_t mine = 0;
  model_.params().stage_whole_layout(&mine);
  double longest = double(mine);
  NB_TRY(pp_comm_->all_reduce_host(&longest, 1, dist::ReduceOp::max));
  const int64_t n = int64_t(longest), P = pp_size();
  const int64_t chunk = std::min<int64_t>(std::max<int64_t>(n, 1), int64_t(1) << 24);
  Buffer send, recv;
  NB_TRY(Buffer::allocate(&send, DType::f32, dev_, {chunk}));
  NB_TRY(Buffer::allocate(&recv, DType::f32, dev_, {P * chunk}));
  const bool root = layout_.pp == 0;
  std::vector<float> gathered(root ? size_t(P * n) : 0, 0.0f);
  for (int64_t b = 0; b < n; b += chunk) {
    const int64_t k = std::min(chunk, n - b), have = std::clamp<int64_t>(mine - b, 0, k);
    ops::fill(send.tensor(), 0.0f, nullptr);
    if (have > 0) NB_TRY(copy_bytes(send.data(), dev_, local + b, Device::cpu, size_t(have) * 4));
    const Tensor out = Tensor::make(recv.data(), DType::f32, dev_, {P * k});
    NB_TRY(pp_comm_->all_gather(Tensor::make(send.data(), DType::f32, dev_, {k}), out, nullptr));
    NB_TRY(pp_comm_->wait(nullptr));
    for (int64_t r = 0; root && r < P; ++r)
      NB_TRY(copy_bytes(gathered.data() + r * n + b, Device::cpu, recv.ptr<float>() + r * k, dev_, size_t(k) * 4));
  }
  if (!root) return Status::ok();
  int64_t whole_total = 0, stage_total = 0;
  const std::vector<ParamInfo> wl = model_.params().whole_layout(&whole_total);  // the model's, or its adapters'
  std::fill(whole, whole + whole_total, 0.0f);
  for (int r = 0; r < P; ++r) {
    const LlamaModel::PipelineStage stage = pipeline_stage(r);
    std::vector<ParamInfo> held;
    for (const ParamInfo& p : wl)
      if (LlamaModel::stage_holds(stage, p.name)) held.push_back(p);
    for (const ParamInfo& p : ParamStore::laid_out(held, &stage_total)) {
      const auto w = std::find_if(wl.begin(), wl.end(), [&](const ParamInfo& q) { return q.name == p.name; });
      std::copy_n(gathered.data() + r * n + p.offset, p.numel, whole + w->offset);
    }
  }
  return Status::ok();
}

}  // namespace nb
