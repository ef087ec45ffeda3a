// Trainer::reduce_amax_over_ranks (trainer.h) and the reduction it runs (amax_reduce.h).
// One MAX all-reduce of one contiguous buffer per call, not one per Linear role: the roles' step amaxes
// live in separate state blocks, and a gather and a scatter (one kernel each on CUDA) are cheaper than
// 3 collectives per Linear (384 for a 32-layer model).
#include "recipe/amax_gather.h"
#include "core/memory_ledger.h"
#include "train/amax_reduce.h"
#include "train/trainer.h"

namespace nb {

Status all_reduce_step_amaxes(const LlamaModel& model, dist::Communicator& comm, Buffer* scratch) {
  std::vector<Tensor> amaxes;
  model.step_amax_views(&amaxes);
  if (amaxes.empty()) return Status::ok();  // no delayed scaling (the same answer on every rank)
  const auto n = int64_t(amaxes.size());
  const Device dev = amaxes[0].device;
  const Tensor& t = scratch->tensor();
  MemoryScope scope(MemPart::comm_buffers);
  if (!scratch->data() || t.numel() != n || t.device != dev) NB_TRY(Buffer::allocate(scratch, DType::f32, dev, {n}));
  NB_TRY(recipe::gather_amaxes(amaxes, scratch->tensor(), nullptr));
  NB_TRY(comm.all_reduce(scratch->tensor(), dist::ReduceOp::max, nullptr).context("FP8 amax reduction"));
  NB_TRY(recipe::scatter_amaxes(scratch->tensor(), amaxes, nullptr));
  return comm.wait(nullptr);  // begin_step reads the amaxes on the host next: never block on a dead peer
}

Status Trainer::reduce_amax_over_ranks() {
  if (!comm_ || model_.recipe().fp8_scaling != recipe::Fp8Scaling::delayed) return Status::ok();
  settle_collectives();  // no collective may start while weight gathers are still in flight
  NB_TRY(all_reduce_step_amaxes(model_, *comm_, &amax_scratch_));
  // Tensor parallelism: a sharded weight's, input's or gradient's amax is the MAX over its shards (TE's
  // amax_reduction_group), so every rank's scale is one GPU's.
  return tp_comm_ ? all_reduce_step_amaxes(model_, *tp_comm_, &amax_scratch_) : Status::ok();
}

}  // namespace nb
