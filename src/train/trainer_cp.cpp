// Trainer phases for context parallelism (docs/DISTRIBUTED.md): the group sizes and this rank's place in
// Megatron's tp-cp-dp order (distributed/parallel_layout.h), and the group's communicator behind the model's
// ring. Gradients, the distributed optimizer and Megatron-FSDP run over the data x context ranks (comm_): the
// context-parallel ranks hold the same weights, as Megatron's dp_cp group does.
#include <algorithm>
#include <cstdio>
#include "core/log.h"
#include "train/comm_groups.h"
#include "train/trainer.h"

namespace nb {

namespace {

// The model's ring over the context-parallel communicator: send to the next rank, receive from the previous.
class CommRingLink : public ops::cp::RingLink {
 public:
  explicit CommRingLink(dist::Communicator* comm) : comm_(comm) {}
  int rank() const override { return comm_->rank(); }
  int size() const override { return comm_->size(); }
  Status pass(const Tensor& send, const Tensor& recv, Stream stream) override {
    const int n = comm_->size(), r = comm_->rank();
    return comm_->send_recv(send, (r + 1) % n, recv, (r + n - 1) % n, stream);
  }

 private:
  dist::Communicator* comm_;
};

// Tokens per block along the token dimension of the recipe's activation and gradient copies (the Wgrad's
// column-wise blocks: NVFP4 16, with its RHT; MXFP8 32; FP8 sub-channel 128; per-tensor formats 1).
int64_t token_block(const recipe::Recipe& r) {
  int64_t b = 1;
  for (const recipe::RoleSpec* s : {&r.input, &r.grad}) {
    if (s->fmt == recipe::Fmt::nvfp4) b = std::max<int64_t>(b, 16);
    if (s->fmt == recipe::Fmt::mxfp8) b = std::max<int64_t>(b, 32);
    if (s->fmt == recipe::Fmt::fp8_block128 || s->fmt == recipe::Fmt::fp8_block128x128) b = std::max<int64_t>(b, 128);
  }
  return b;
}

}  // namespace

Status Trainer::set_parallel_layout() {
  return dist::make_parallel_layout(
      world_.size, world_.rank,
      {int(cfg_.tensor_model_parallel_size), int(cfg_.context_parallel_size), int(cfg_.pipeline_model_parallel_size)},
      &layout_);
}

Status Trainer::connect_context_parallel() {
  if (cp_size() == 1) return Status::ok();
  NB_TRY(comm_->split(layout_.dp, layout_.cp, "cp", &cp_comm_));
  cp_link_ = std::make_unique<CommRingLink>(cp_comm_.get());
  model_.cp_link = cp_link_.get();
  cp_amax_ = std::make_unique<CommAmaxGroup>(cp_comm_.get(), dev_);
  model_.cp_amax_group = cp_amax_.get();
  const int64_t chunk = cfg_.seq_length / (int64_t(2) * cp_size()), block = token_block(recipe_);
  if (recipe_.quantized() && chunk % block != 0)
    NB_LOG_WARN(
        "context parallelism cuts rows into chunks of %lld tokens, not a multiple of recipe %s's %lld-token blocks: "
        "the gradient GEMMs' blocks mix tokens a single GPU would not (numbers differ from one GPU's); use a "
        "--seq-length that is a multiple of %lld",
        (long long)chunk, recipe_.name.c_str(), (long long)block, (long long)(int64_t(2) * cp_size() * block));
  std::printf(
      "context parallel: %d ranks per group (ranks %d-%d with this one), each row's %lld tokens in %d chunks, "
      "%lld per rank; K/V passed round the ring (%s); gradients reduced over %d ranks\n",
      cp_size(), layout_.cp_group.front(), layout_.cp_group.back(), (long long)cfg_.seq_length, 2 * cp_size(),
      (long long)(cfg_.seq_length / cp_size()), cfg_.cp_comm_type.c_str(), comm_->size());
  return Status::ok();
}

}  // namespace nb
