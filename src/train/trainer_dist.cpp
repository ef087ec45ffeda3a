// Trainer phases for data parallelism (docs/DISTRIBUTED.md): who this rank is, the GPU of its local
// rank, the rendezvous store and the communicator, and the per-step reductions. Plain DDP: every rank
// holds the whole model and optimizer; gradients are summed over ranks after the last micro-batch
// (each rank's backward already scaled them by 1 / tokens of the global batch, so the sum is the mean).
#include <cstdio>
#include <cstdlib>
#include "core/device_info.h"
#include "core/log.h"
#include "train/trainer.h"

namespace nb {

// Before the configuration is resolved: the data-parallel size divides the global batch.
Status Trainer::detect_ranks() {
  NB_TRY(dist::detect_world(&world_));
  cfg_.data_parallel = world_.size;
  if (cfg_.use_distributed_optimizer && world_.size > 1) {
    model_.optimizer_shard_rank = world_.rank;
    model_.optimizer_shard_count = world_.size;
  }
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
  NB_TRY(dist::TcpStore::open(world_, timeout, &store_));
  NB_TRY(dist::make_communicator(world_, dev_, store_.get(), timeout, &comm_));
  std::printf("data parallel: %d ranks (%s, launched by %s), rank 0 at %s:%d, %lld micro-batches per rank per step\n",
              world_.size, comm_->backend(), world_.launcher.c_str(), world_.master_addr.c_str(), world_.store_port,
              (long long)accum_);
  return Status::ok();
}

// The summed FP32 gradients: on every rank (DDP), or each rank's own shard, reduce-scattered in place
// (NCCL's in-place form: the output is the input at rank x shard length).
Status Trainer::reduce_gradients() {
  if (!comm_) return Status::ok();
  ParamStore& P = model_.params();
  const Tensor all = P.padded_grad();
  if (!sharded())
    NB_TRY(comm_->all_reduce(P.flat_grad(), dist::ReduceOp::sum, nullptr));
  else
    NB_TRY(comm_->reduce_scatter(all, P.range(all, P.shard_begin(), P.shard_begin() + P.shard_len()), nullptr));
  return comm_->wait(nullptr);  // the step reads the gradient norm next: never block on a dead peer
}

// After AdamW updated this rank's shard of the compute copy: every rank's shard, gathered in place.
Status Trainer::gather_updated_weights() {
  if (!sharded()) return Status::ok();
  ParamStore& P = model_.params();
  const Tensor all = P.padded_compute();
  NB_TRY(comm_->all_gather(P.range(all, P.shard_begin(), P.shard_begin() + P.shard_len()), all, nullptr));
  return comm_->wait(nullptr);
}

// A save needs master, m and v whole on rank 0: each is gathered into the gradient buffer (free between
// steps: the next step zeroes it) and copied to the host by rank 0. Every rank must call this.
Status Trainer::gather_optimizer_state(const Tensor& shard, float* host) {
  ParamStore& P = model_.params();
  NB_TRY(comm_->all_gather(shard, P.padded_grad(), nullptr));
  NB_TRY(comm_->wait(nullptr));
  if (!logging_rank()) return Status::ok();
  return P.get_flat(P.flat_grad(), host);
}

// Host scalars summed over ranks (loss sums, token counts, flags).
Status Trainer::sum_over_ranks(double* values, int n) {
  if (!comm_) return Status::ok();
  return comm_->all_reduce_host(values, n, dist::ReduceOp::sum);
}

}  // namespace nb
