// Trainer phases for data parallelism (docs/DISTRIBUTED.md): who this rank is, the GPU of its local
// rank, the rendezvous store and the communicator, and the per-step reductions. Plain DDP: every rank
// holds the whole model and optimizer; gradients are summed over ranks after the last micro-batch
// (each rank's backward already scaled them by 1 / tokens of the global batch, so the sum is the mean).
#include <cstdio>
#include <algorithm>
#include <cstdlib>
#include "core/device_info.h"
#include "core/log.h"
#include "ops/elementwise.h"
#include "train/trainer.h"

namespace nb {

// Before the configuration is resolved: the data-parallel size divides the global batch.
Status Trainer::detect_ranks() {
  NB_TRY(dist::detect_world(&world_));
  return apply_world();
}

// What the rank count sets: the data-parallel size, the optimizer's sharding, the bucket, rank 0's logging.
Status Trainer::apply_world() {
  NB_TRY(set_parallel_layout());
  cfg_.data_parallel = data_ranks();
  // The sharding and the bucket as the memory estimate derives them (MemoryJob, train/memory_estimate.h): LoRA
  // shards only with optim_grads_params (its frozen base); Megatron's default bucket is one bucket without an
  // overlap, else max(40M, 1M x ranks) elements.
  MemoryJob j;
  j.ranks = world_.size;
  j.pipeline = pp_size();
  j.tensor_parallel = tp_size();  // sharded and reduced over the data x context ranks of one tensor-parallel index
  j.strategy = cfg_.sharding_strategy();
  j.lora = lora();
  j.ddp_bucket_size = cfg_.ddp_bucket_size;
  j.overlap = cfg_.overlap_grad_reduce || cfg_.overlap_param_gather;
  if (j.shards() > 1) {
    model_.optimizer_shard_rank = dp_cp_rank();
    model_.optimizer_shard_count = j.shards();
    model_.fsdp = j.fsdp();
  }
  if (j.ranks > 1) model_.optimizer_bucket_elems = j.bucket_elems();
  // Rank 0 logs (Megatron's convention); the others print only warnings and errors, on stderr.
  const char* all = std::getenv("NIBBLE_LOG_ALL_RANKS");
  if (world_.rank != 0 && !(all && *all == '1')) {
    if (!std::freopen("/dev/null", "w", stdout))
      NB_LOG_WARN("rank %d: could not silence stdout; every rank will print its log lines", world_.rank);
  }
  return Status::ok();
}

// After the device is chosen: meet the other ranks. The store's timeout bounds start-up; the
// communicator's bounds each collective (--distributed-timeout-minutes, Megatron's flag).
Status Trainer::connect_ranks() {
  if (!world_.distributed()) return Status::ok();
  const auto timeout = std::chrono::milliseconds(int64_t(cfg_.distributed_timeout_minutes * 60'000));
  // --deterministic-mode: NCCL sums in a fixed order for a fixed rank count, algorithm and protocol; its
  // tuner picks those per message size from the topology, so pin them (a user's own setting wins).
  if (cfg_.deterministic_mode && dev_ == Device::cuda) {
    setenv("NCCL_ALGO", "Ring", 0);
    setenv("NCCL_PROTO", "Simple", 0);
  }
  NB_TRY(dist::TcpStore::open(world_, timeout, &store_));
  NB_TRY(dist::make_communicator(world_, dev_, store_.get(), timeout, &comm_));
  std::printf("data parallel: %d ranks (%s, launched by %s), rank 0 at %s:%d, %lld micro-batches per rank per step\n",
              data_ranks(), comm_->backend(), world_.launcher.c_str(), world_.master_addr.c_str(), world_.store_port,
              (long long)accum_);
  NB_TRY(connect_pipeline());
  NB_TRY(connect_tensor_parallel());
  return connect_context_parallel();
}

// Megatron-FSDP's gathers and reductions around the model's pass. With LoRA (optim_grads_params) over the
// frozen base: gathers only; the adapters' gradients are all-reduced by prepare_grad_sync's buckets.
Status Trainer::prepare_fsdp() {
  fsdp_ = std::make_unique<FsdpSync>();
  NB_TRY(fsdp_->init(&model_.base(), comm_.get(), dev_));
  if (tp_size() > 1) fsdp_->set_tensor_parallel(tp_comm_.get());
  model_.set_step_hooks(fsdp_.get());
  fsdp_->set_embeddings_per_step(cfg_.fsdp_embeddings_per_step);
  NB_TRY(fsdp_->set_reduce_in_bf16(cfg_.grad_reduce_in_bf16));  // a frozen LoRA base reduces nothing
  NB_TRY(choose_param_gather());
  if (cfg_.fsdp_embeddings_per_step)
    std::printf("Megatron-FSDP: the embedding%s gathered once per step%s (--fsdp-embeddings-per-step)\n",
                model_cfg_.tied_embeddings ? "" : " and output layer",
                lora() ? "" : ", their gradients reduced after the step's last micro-batch");
  if (lora()) {
    std::printf(
        "Megatron-FSDP %s over %d ranks: the frozen LoRA base sharded (1/%d of every layer per rank, %s), each "
        "unit gathered before its forward and its backward, the next one prefetched, never reduced; the "
        "adapters whole on every rank, their gradients all-reduced\n",
        cfg_.sharding_strategy().c_str(), comm_->size(), comm_->size(), cfg_.lora_base_precision.c_str());
    return Status::ok();
  }
  std::printf(
      "Megatron-FSDP %s over %d ranks: %s sharded; each unit's gradients reduce-scattered in %s after its "
      "backward%s\n",
      cfg_.sharding_strategy().c_str(), comm_->size(),
      model_.fsdp == LlamaModel::Fsdp::optim_grads ? "master, AdamW state and gradients"
                                                   : "master, AdamW state, gradients and weights",
      cfg_.grad_reduce_in_bf16 ? "BF16" : "FP32",
      model_.fsdp == LlamaModel::Fsdp::optim_grads ? ""
                                                   : "; each unit's weights gathered before its forward "
                                                     "and its backward, the next one prefetched");
  return Status::ok();
}

// Buckets over the flat space and, when asked, the model's hooks that launch collectives early.
Status Trainer::prepare_grad_sync() {
  if (!comm_) return Status::ok();
  if (model_.fsdp != LlamaModel::Fsdp::off) {
    NB_TRY(prepare_fsdp());
    if (!lora()) return Status::ok();
  } else if (lora() && cfg_.sharding_strategy() != "no_shard") {
    std::printf(
        "LoRA with %s: the frozen base whole on every rank (it has no gradients or optimizer state to "
        "shard), the adapters too\n",
        cfg_.sharding_strategy().c_str());
  }
  const ParamStore& P = model_.params();
  GradSync::Options o{cfg_.overlap_grad_reduce, cfg_.overlap_param_gather, cfg_.grad_reduce_in_bf16};
  // The model's hooks are the base's gathers; the adapters' buckets go after the backward.
  if (fsdp_) o = {false, false, cfg_.grad_reduce_in_bf16};
  std::vector<std::string> order{"model.embed_tokens.weight"};
  for (int64_t l = 0; l < model_cfg_.layers; ++l)
    for (std::string& n : LlamaModel::layer_param_names(l)) order.push_back(std::move(n));
  order.insert(order.end(), {"model.norm.weight", "lm_head.weight"});
  sync_ = std::make_unique<GradSync>();
  NB_TRY(sync_->init(&P, comm_.get(), dev_, o, order));
  if (sync_->overlapped()) model_.set_step_hooks(sync_.get());  // (never with fsdp_: its options are off)
  std::printf("gradient buckets: %d of up to %lld elements, reduced in %s%s%s\n", P.bucket_count(),
              (long long)P.bucket_len(), o.reduce_in_bf16 ? "BF16" : "FP32",
              o.overlap_grad_reduce ? ", overlapped with the backward" : "",
              o.overlap_param_gather ? "; weight gathers overlapped with the forward" : "");
  return Status::ok();
}

// optim_grads_params with a quantized recipe: the quantized layers' weights travel in their training format
// unless the run reads their BF16 weight (--fsdp-param-gather; the config check refused an impossible ask).
Status Trainer::choose_param_gather() {
  if (model_.fsdp != LlamaModel::Fsdp::optim_grads_params) return Status::ok();
  const auto linears = model_.quantized_linears();
  if (lora() && !linears.empty()) {  // a frozen quantized base has no BF16 copy: always its stored format
    NB_TRY(fsdp_->set_quantized_linears(linears));
    std::printf("Megatron-FSDP gathers %zu frozen base weights in their stored format (%s codes and scales)\n",
                linears.size(), cfg_.lora_base_precision.c_str());
    return Status::ok();
  }
  if (!training_format_gather()) {
    if (!linears.empty())
      std::printf("Megatron-FSDP gathers every weight in BF16 (%s)\n",
                  cfg_.fsdp_param_gather == "bf16" ? "--fsdp-param-gather bf16"
                  : cfg_.quant_stats               ? "--quant-stats reads the BF16 weights"
                  : recipe_.mor.on                 ? "Mixture of Representations decides from the BF16 weights"
                                                   : "annealing runs BF16 steps");
    return Status::ok();
  }
  NB_TRY(fsdp_->set_quantized_linears(linears));
  std::printf("Megatron-FSDP gathers %zu quantized linear weights in their training format (%s codes and scales)\n",
              linears.size(), cfg_.recipe.c_str());
  return Status::ok();
}

std::vector<ParamStore::Slice> Trainer::optimizer_slices() {
  const ParamStore& P = model_.params();
  if (!sharded()) return {{0, P.total(), 0}};
  return P.own_slices();
}

// The gradients of this rank's optimizer slices. Under tensor parallelism each piece says whether it holds the
// norms' weights (whole on every rank of the group; they follow the 2-D weights in the flat space): a slice is
// cut there, or with Megatron-FSDP (a slice is one parameter group's chunk) classified whole. LoRA's adapters (one
// unsharded slice) are cut into runs of whole and split parameters (tp::split_of).
std::vector<Trainer::GradPiece> Trainer::grad_pieces() {
  const ParamStore& P = model_.params();
  std::vector<GradPiece> out;
  if (tp_size() > 1 && lora()) {
    const std::vector<ParamInfo>& list = P.params();
    int64_t begin = 0;
    for (size_t i = 1; i <= list.size(); ++i) {
      const bool whole = tp::split_of(list[i - 1].name) == tp::Split::whole;
      if (i < list.size() && whole == (tp::split_of(list[i].name) == tp::Split::whole)) continue;
      const int64_t end = i < list.size() ? list[i].offset : P.total();
      out.push_back({P.range(P.padded_grad(), begin, end), whole});
      begin = end;
    }
    return out;
  }
  for (const ParamStore::Slice& s : optimizer_slices()) {
    if (tp_size() == 1 || P.fsdp()) {
      out.push_back({P.slice_grad(s), tp_size() > 1 && s.begin >= P.decayed_count()});
      continue;
    }
    const int64_t cut = std::clamp(P.decayed_count(), s.begin, s.end);
    if (cut > s.begin) out.push_back({P.range(P.padded_grad(), s.begin, cut), false});
    if (s.end > cut) out.push_back({P.range(P.padded_grad(), cut, s.end), true});
  }
  return out;
}

// This rank's sum of squared gradients (its slices). Under tensor parallelism the replicated parameters' squares
// (the norms', LoRA's whole halves) count 1/T here, so the group's sum counts them once.
Status Trainer::grad_squares(double* out) {
  ops::fill(norm_sq_.tensor(), 0.0f, nullptr);
  for (const GradPiece& g : grad_pieces())
    ops::sum_squares_accumulate(g.grad, norm_sq_.ptr<float>() + (g.replicated ? 1 : 0), nullptr);
  float h[2] = {0, 0};
  NB_TRY(copy_bytes(h, Device::cpu, norm_sq_.data(), dev_, sizeof h));
  *out = double(h[0]) + double(h[1]) / tp_size();
  return Status::ok();
}

// Tensor parallelism: the step's figures [loss, non-finite flag, stop flag, squared gradient norm] after the
// data x context reduction: the ranks of a group agree on the flags (MAX) and sum their norms' parts.
Status Trainer::reduce_over_tensor_parallel(double* figures) {
  if (!tp_comm_) return Status::ok();
  NB_TRY(tp_comm_->all_reduce_host(figures + 1, 2, dist::ReduceOp::max));
  return tp_comm_->all_reduce_host(figures + 3, 1, dist::ReduceOp::sum);
}

// The summed FP32 gradients: on every rank (DDP), or in each rank's own slices (grad_sync.h).
// (LoRA under Megatron-FSDP has both: the base's gathers settle first, then the adapters' buckets.)
Status Trainer::reduce_gradients() {
  if (fsdp_) NB_TRY(fsdp_->finish_reduce());
  return sync_ ? sync_->finish_reduce() : Status::ok();
}

// After AdamW updated this rank's slices of the compute copy: every rank's slices, gathered in place.
Status Trainer::gather_updated_weights() {
  if (fsdp_) NB_TRY(fsdp_->weights_updated());
  return sync_ ? sync_->gather_weights() : Status::ok();
}

void Trainer::settle_collectives() {
  if (sync_) sync_->settle();
  if (fsdp_) fsdp_->settle();
}

// A save needs master, m and v whole on rank 0: each is gathered, bucket by bucket, into the gradient
// buffer (free between steps: the next step zeroes it) and copied to the host by rank 0. Every rank
// must call this.
// This rank's slice is first copied to its own place in the bucket (from the device or host part of the
// state), then gathered in place.
Status Trainer::gather_optimizer_state(optim::StateArray a, float* host) {
  ParamStore& P = model_.params();
  if (fsdp_ && !lora()) return fsdp_->gather_state(a, state_rank() ? host : nullptr);
  if (sync_) sync_->settle();
  for (int b = 0; b < P.bucket_count(); ++b) {
    const ParamStore::Slice s = P.own_slice(b);
    const Tensor mine = P.range(P.padded_grad(), s.begin, s.end);
    NB_TRY(P.optimizer_state().read_to_device(a, s.local, mine.data, s.end - s.begin));
    NB_TRY(comm_->all_gather(mine, P.range(P.padded_grad(), P.bucket_begin(b), P.bucket_end(b)), nullptr));
  }
  NB_TRY(comm_->wait(nullptr));
  if (!state_rank()) return Status::ok();
  return P.get_flat(P.flat_grad(), host);
}

// Host scalars summed over ranks (loss sums, token counts, flags).
Status Trainer::sum_over_ranks(double* values, int n) {
  if (!comm_) return Status::ok();
  settle_collectives();  // no collective may start while weight gathers are still in flight
  return comm_->all_reduce_host(values, n, dist::ReduceOp::sum);
}

}  // namespace nb
