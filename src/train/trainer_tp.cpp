// Trainer phases for tensor parallelism (docs/DISTRIBUTED.md): the groups' communicators (T consecutive
// ranks split each layer; the data x context ranks of one tensor-parallel index reduce gradients and shard the
// optimizer, as Megatron's dp_cp group), the model's views of them, and whole-tensor checkpoints: a save
// gathers the tensor-parallel ranks' parameter arrays into the whole model's on rank 0, a load slices them.
#include <algorithm>
#include <cstdio>
#include "model/hf_layout.h"
#include "train/comm_groups.h"
#include "train/trainer.h"

namespace nb {

int Trainer::dp_cp_rank() const {
  const std::vector<int>& g = layout_.dp_cp_group;
  return int(std::find(g.begin(), g.end(), world_.rank) - g.begin());
}

// The model-parallel groups, split from the world's communicator (connect_pipeline's pp first): T consecutive
// ranks form a tensor-parallel group; the data x context ranks of one (stage, tensor index) reduce gradients;
// with context parallelism, a stage's tensor x context ranks of one data index share amaxes.
Status Trainer::connect_tensor_parallel() {
  if (tp_size() == 1 && pp_size() == 1) return Status::ok();
  if (!world_comm_) world_comm_ = std::move(comm_);
  // Every rank of the world makes the same splits in the same order (Gloo counts them).
  if (tp_size() > 1) NB_TRY(world_comm_->split(world_.rank / tp_size(), layout_.tp, "tp", &tp_comm_));
  NB_TRY(world_comm_->split(layout_.pp * tp_size() + layout_.tp, dp_cp_rank(), "dp_cp", &comm_));
  if (tp_size() == 1) return Status::ok();
  if (cp_size() > 1)
    NB_TRY(world_comm_->split(layout_.pp * data_ranks() + layout_.dp, world_.rank, "tp_cp", &tp_cp_comm_));
  tp_group_ = std::make_unique<CommReduceGroup>(tp_comm_.get());
  tp_amax_ = std::make_unique<CommAmaxGroup>(tp_comm_.get(), dev_);
  if (tp_cp_comm_) tp_cp_amax_ = std::make_unique<CommAmaxGroup>(tp_cp_comm_.get(), dev_);
  model_.tp_group = tp_group_.get();
  model_.tp_comm_overlap = cfg_.tp_comm_overlap;
  model_.sequence_parallel = cfg_.sequence_parallel;
  model_.tp_amax_group = tp_amax_.get();
  model_.tp_cp_amax_group = tp_cp_amax_ ? tp_cp_amax_.get() : tp_amax_.get();
  const LlamaConfig local = tp::local_config(model_cfg_, tp_size());
  std::printf(
      "tensor parallel: %d ranks per group (ranks %d-%d with this one), each with %lld of %lld heads, %lld of %lld "
      "KV heads, %lld of %lld FFN columns and %lld vocabulary rows (of %lld, padded to %lld); gradients reduced "
      "over %d ranks\n",
      tp_size(), layout_.tp_group.front(), layout_.tp_group.back(), (long long)local.heads, (long long)model_cfg_.heads,
      (long long)local.kv_heads, (long long)model_cfg_.kv_heads, (long long)local.ffn, (long long)model_cfg_.ffn,
      (long long)local.vocab, (long long)model_cfg_.vocab, (long long)tp::padded_vocab(model_cfg_, tp_size()),
      comm_->size());
  return Status::ok();
}

// The replicated parameters' gradients that are each rank's partial sums, summed over the group: under sequence
// parallelism the norms' (each rank's block of tokens; they follow the 2-D weights in the flat space), with LoRA
// the whole adapter halves (a column-parallel A's gradient sums over the rank's output rows, a row-parallel B's
// over its input columns).
Status Trainer::reduce_replicated_grads() {
  if (!tp_comm_ || !(cfg_.sequence_parallel || lora())) return Status::ok();
  for (const GradPiece& g : grad_pieces())  // this rank's slices (the tensor-parallel ranks hold the same ones)
    if (g.replicated) NB_TRY(tp_comm_->all_reduce(g.grad, dist::ReduceOp::sum, nullptr));
  return tp_comm_->wait(nullptr);
}

// The ranks of rank 0's tensor-parallel group pass their arrays through the device in chunks (all-gathers of
// the group); rank 0 puts each rank's part of every parameter in its place in `whole`.
Status Trainer::gather_tensor_parallel(const float* local, float* whole) {
  const ParamStore& P = model_.params();
  const int64_t n = P.total(), T = tp_size();
  const int64_t chunk = std::min<int64_t>(n, int64_t(1) << 24);
  Buffer send, recv;
  NB_TRY(Buffer::allocate(&send, DType::f32, dev_, {chunk}));
  NB_TRY(Buffer::allocate(&recv, DType::f32, dev_, {T * chunk}));
  const bool root = layout_.tp == 0;
  std::vector<float> gathered(root ? size_t(T * n) : 0);  // the group's local arrays side by side
  for (int64_t b = 0; b < n; b += chunk) {
    const int64_t k = std::min(chunk, n - b);
    NB_TRY(copy_bytes(send.data(), dev_, local + b, Device::cpu, size_t(k) * 4));
    const Tensor out = Tensor::make(recv.data(), DType::f32, dev_, {T * k});
    NB_TRY(tp_comm_->all_gather(Tensor::make(send.data(), DType::f32, dev_, {k}), out, nullptr));
    NB_TRY(tp_comm_->wait(nullptr));
    for (int64_t r = 0; root && r < T; ++r)
      NB_TRY(copy_bytes(gathered.data() + r * n + b, Device::cpu, recv.ptr<float>() + r * k, dev_, size_t(k) * 4));
  }
  if (!root) return Status::ok();
  int64_t whole_total = 0;
  const std::vector<ParamInfo> wl = P.stage_whole_layout(&whole_total);  // (a pipeline stage's, or the model's)
  std::fill(whole, whole + whole_total, 0.0f);
  for (size_t i = 0; i < wl.size(); ++i)
    for (int r = 0; r < T; ++r)
      tp::place(wl[i], P.params()[i], {r, int(T)}, gathered.data() + r * n + P.params()[i].offset, whole + wl[i].offset,
                &model_cfg_);
  return Status::ok();
}

}  // namespace nb
