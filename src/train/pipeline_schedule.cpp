// Pipeline schedules (pipeline_schedule.h): Megatron-Core's 1F1B and interleaved 1F1B orders, written for
// nibble's stage passes (LlamaModel::forward_chunk / backward_chunk) and grouped point-to-point messages.
#include "train/pipeline_schedule.h"
#include <algorithm>
#include "core/gpu_profile.h"

namespace nb {

namespace {
// --profile's phase of the compute stream's time in the messages or waiting for them: the measured bubble.
constexpr const char* kBubblePhase = "pipeline: messages + waits (bubble)";
}  // namespace

int64_t PipelineSchedule::warmup_passes(int P, int V, int rank, int64_t M) {
  if (V == 1) return std::min<int64_t>(P - rank - 1, M);
  return std::min<int64_t>(int64_t(P - rank - 1) * 2 + int64_t(V - 1) * P, M * V);
}

// In the steady state one more forward runs before each backward.
int64_t PipelineSchedule::max_in_flight(int P, int V, int rank, int64_t M) {
  return std::min<int64_t>(warmup_passes(P, V, rank, M) + 1, M * V);
}

Status PipelineSchedule::init(dist::Communicator* comm, LlamaModel* model, int virtual_stages, int64_t micro_batches,
                              Device dev, bool overlap) {
  comm_ = comm;
  dev_ = dev;
  overlap_ = overlap;
  model_ = model;
  P_ = comm->size();
  rank_ = comm->rank();
  V_ = virtual_stages;
  M_ = micro_batches;
  // With two stages a rank's two neighbours are one rank: a group's messages to it go in the order its receives
  // are posted (exchange: forward, then backward), which NCCL and Gloo match in order.
  if (V_ > 1 && M_ % P_ != 0)
    return errorf(
        "the interleaved pipeline schedule runs groups of %d micro-batches per chunk: %lld micro-batches per rank at "
        "%d stages cannot run it",
        P_, (long long)M_, P_);
  inputs_.assign(size_t(V_), {});
  grads_.assign(size_t(V_), {});
  if (!overlap_) return Status::ok();
  NB_TRY(messages_.create(dev_).context("the pipeline messages' stream"));
  return compute_done_.create(dev_);
}

std::vector<LlamaModel::PipelinePass> PipelineSchedule::pass_order(int P, int V, int rank, int64_t M) {
  const int64_t total = M * V, warmup = warmup_passes(P, V, rank, M);
  std::vector<LlamaModel::PipelinePass> order;
  const auto pass = [&](int64_t k, bool forward) {
    order.push_back({micro_of_pass(P, V, k), chunk_of_pass(P, V, k, forward), forward});
  };
  for (int64_t k = 0; k < warmup; ++k) pass(k, true);
  for (int64_t k = 0; k < total - warmup; ++k) {
    pass(warmup + k, true);
    pass(k, false);
  }
  for (int64_t k = total - warmup; k < total; ++k) pass(k, false);
  return order;
}

// Megatron's numbering of passes: groups of P micro-batches, each group through every chunk in turn; backward
// passes take the chunks in reverse.
int PipelineSchedule::chunk_of_pass(int P, int V, int64_t k, bool forward) {
  const int64_t group = int64_t(P) * V;
  const int c = int((k % group + group) % group / P);  // Python's modulo: the steady state asks about k < 0
  return forward ? c : V - 1 - c;
}
int PipelineSchedule::chunk_of(int64_t k, bool forward) const { return chunk_of_pass(P_, V_, k, forward); }
int64_t PipelineSchedule::micro_of_pass(int P, int V, int64_t k) { return k / (int64_t(P) * V) * P + k % P; }
int64_t PipelineSchedule::micro_of(int64_t k) const { return micro_of_pass(P_, V_, k); }

// The oldest pending send's buffer (or one with none) is the likeliest to be free already on the message stream.
Status PipelineSchedule::take_buffer(Message* out) {
  if (free_.empty()) {
    Buffer b;
    NB_TRY(model_->make_boundary(&b).context("a pipeline message buffer"));
    buffers_.push_back(std::move(b));
    free_.push_back({buffers_.back().tensor(), -1});
  }
  const auto oldest = std::min_element(free_.begin(), free_.end(),
                                       [](const Message& a, const Message& b) { return a.group < b.group; });
  *out = *oldest;
  free_.erase(oldest);
  return Status::ok();
}

void PipelineSchedule::wait_for(const Message& m) {
  if (!async_ || m.group < 0) return;
  // --profile: the compute stream's wait for a message (with overlap the transfers themselves run beside the passes).
  NB_PROFILE_BEGIN(kBubblePhase);
  group_done_[size_t(m.group)].wait_in(nullptr);
  NB_PROFILE_END(kBubblePhase);
}

Tensor PipelineSchedule::take_input(int c) {
  if (first_stage(c)) return Tensor{};
  NB_CHECK(!inputs_[size_t(c)].empty(), "internal: chunk %d's forward has no input", c);
  const Message input = inputs_[size_t(c)].front();
  inputs_[size_t(c)].pop_front();
  wait_for(input);
  return input.tensor;
}

Status PipelineSchedule::exchange(const Sends& s, int recv_forward_chunk, int recv_backward_chunk) {
  const int next = (rank_ + 1) % P_, prev = (rank_ + P_ - 1) % P_, group = groups_;
  std::vector<dist::Communicator::P2POp> ops;
  if (s.forward.data) ops.push_back({s.forward, next, true});
  if (s.backward.data && !async_) ops.push_back({s.backward, prev, true});
  Message copy;
  if (s.backward.data && async_) {  // from a copy: the slot holding it may be taken before the send runs
    NB_TRY(take_buffer(&copy));
    wait_for(copy);  // its last send done
    NB_TRY(copy_bytes_async(copy.tensor.data, dev_, s.backward.data, dev_, size_t(s.backward.bytes()), nullptr));
    ops.push_back({copy.tensor, prev, true});
  }
  auto receive = [&](std::deque<Message>& queue, int from) {
    Message m;
    NB_TRY(take_buffer(&m));
    queue.push_back({m.tensor, group});
    ops.push_back({m.tensor, from, false});
    return Status::ok();
  };
  if (recv_forward_chunk >= 0) NB_TRY(receive(inputs_[size_t(recv_forward_chunk)], prev));
  if (recv_backward_chunk >= 0) NB_TRY(receive(grads_[size_t(recv_backward_chunk)], next));
  if (copy.tensor.data) free_.push_back({copy.tensor, group});  // free once this group's send is done
  if (ops.empty()) return Status::ok();
  return post(ops);
}

Status PipelineSchedule::post(const std::vector<dist::Communicator::P2POp>& ops) {
  const int group = groups_++;
  if (!async_) {
    // --profile: on the GPU the message kernels hold the stream until the peer's side arrives, so this phase is the
    // transfers plus the time this rank waited: the measured bubble (with the transfers) of this rank.
    NB_PROFILE_BEGIN(kBubblePhase);
    const Status st = comm_->p2p(ops, nullptr);
    NB_PROFILE_END(kBubblePhase);
    return st;
  }
  compute_done_.record(nullptr);
  compute_done_.wait_in(messages_.get());
  NB_TRY(comm_->p2p(ops, messages_.get()));
  if (group_done_.size() <= size_t(group)) {
    group_done_.emplace_back();
    NB_TRY(group_done_.back().create(dev_).context("a pipeline message event"));
  }
  group_done_[size_t(group)].record(messages_.get());
  return Status::ok();
}

// Under overlap the compute stream takes up the message stream's end, and the host waits for it through the
// communicator (a dead neighbour becomes an error, never a hang). Every buffer's sends are then done.
Status PipelineSchedule::finish_messages() {
  if (async_ && groups_ > 0) {
    group_done_[size_t(groups_ - 1)].wait_in(nullptr);
    NB_TRY(comm_->wait(messages_.get()));
  }
  for (Message& m : free_) m.group = -1;
  groups_ = 0;
  async_ = false;
  return Status::ok();
}

Status PipelineSchedule::forward(int64_t k, Tensor* out) {
  const int c = chunk_of(k, true);
  const Tensor input = take_input(c);
  Tensor y;
  NB_TRY(model_->forward_chunk(micro_of(k), c, input, grad_scale_, &y));
  if (input.data) free_.push_back({input, -1});  // copied into the chunk's activations
  *out = last_stage(c) ? Tensor{} : y;
  return Status::ok();
}

Status PipelineSchedule::backward(int64_t k, Tensor* dx) {
  const int c = chunk_of(k, false);
  Tensor g;
  if (!last_stage(c)) {
    NB_CHECK(!grads_[size_t(c)].empty(), "internal: chunk %d's backward has no output gradient", c);
    const Message m = grads_[size_t(c)].front();
    grads_[size_t(c)].pop_front();
    wait_for(m);
    g = m.tensor;
  }
  Tensor d;
  NB_TRY(model_->backward_chunk(micro_of(k), c, g, &d));
  if (g.data) free_.push_back({g, -1});
  *dx = first_stage(c) ? Tensor{} : d;
  return Status::ok();
}

Status PipelineSchedule::run(float grad_scale) {
  grad_scale_ = grad_scale;
  async_ = overlap_;
  const Status st = V_ == 1 ? run_1f1b() : run_interleaved();
  const Status done = finish_messages();
  return st.ok() ? done : st;
}

// Megatron's forward_backward_pipelining_without_interleaving, with V = 1 (k is then the micro-batch).
Status PipelineSchedule::run_1f1b() {
  const int64_t warmup = warmup_passes(P_, 1, rank_, M_), remaining = M_ - warmup;
  const int recv_in = rank_ > 0 ? 0 : -1, recv_grad = rank_ < P_ - 1 ? 0 : -1;
  Tensor y, dx;
  for (int64_t i = 0; i < warmup; ++i) {
    NB_TRY(exchange({}, recv_in, -1));
    NB_TRY(forward(i, &y));
    NB_TRY(exchange({y, {}}, -1, -1));
  }
  if (remaining > 0) NB_TRY(exchange({}, recv_in, -1));
  for (int64_t i = 0; i < remaining; ++i) {
    NB_TRY(forward(warmup + i, &y));
    NB_TRY(exchange({y, {}}, -1, recv_grad));  // send forward, receive backward
    NB_TRY(backward(i, &dx));
    NB_TRY(exchange({{}, dx}, i + 1 < remaining ? recv_in : -1, -1));  // send backward, receive forward
  }
  for (int64_t i = 0; i < warmup; ++i) {
    NB_TRY(exchange({}, -1, recv_grad));
    NB_TRY(backward(remaining + i, &dx));
    NB_TRY(exchange({{}, dx}, -1, -1));
  }
  return Status::ok();
}

// Megatron's forward_backward_pipelining_with_interleaving, without overlap.
Status PipelineSchedule::run_interleaved() {
  const int64_t total = M_ * V_, warmup = warmup_passes(P_, V_, rank_, M_), remaining = total - warmup;
  NB_TRY(exchange({}, rank_ > 0 ? 0 : -1, -1));  // the first forward's input
  NB_TRY(interleaved_warmup(warmup, remaining));
  NB_TRY(interleaved_steady(warmup, remaining));
  if (remaining == 0) NB_TRY(exchange({}, -1, rank_ < P_ - 1 ? V_ - 1 : -1));
  return interleaved_cooldown(remaining);
}

Status PipelineSchedule::interleaved_warmup(int64_t warmup, int64_t remaining) {
  const int64_t total = M_ * V_;
  for (int64_t k = 0; k < warmup; ++k) {
    Tensor y;
    NB_TRY(forward(k, &y));
    const int next_c = chunk_of(k + 1, true);
    const bool recv_prev = !(rank_ == 0 && next_c == 0) && k + 1 < total;
    const bool recv_next = k == warmup - 1 && remaining > 0 && rank_ != P_ - 1;
    NB_TRY(exchange({y, {}}, recv_prev ? next_c : -1, recv_next ? V_ - 1 : -1));
  }
  return Status::ok();
}

Status PipelineSchedule::interleaved_steady(int64_t warmup, int64_t remaining) {
  for (int64_t k = 0; k < remaining; ++k) {
    const int64_t fk = k + warmup, bk = k;
    Tensor y, dx;
    NB_TRY(forward(fk, &y));
    NB_TRY(backward(bk, &dx));
    // The first stage runs P - 1 passes ahead of the last: its next input is for the chunk after the one the last
    // rank is finishing; likewise backwards on the last stage.
    bool recv_prev = true, recv_next = true;
    int next_f = chunk_of(fk + 1, true), next_b = chunk_of(bk + 1, false);
    if (rank_ == 0) {
      next_f = chunk_of(fk - (P_ - 1), true);
      recv_prev = next_f != V_ - 1;
      next_f += 1;
    }
    if (rank_ == P_ - 1) {
      next_b = chunk_of(bk - (P_ - 1), false);
      recv_next = next_b != 0;
      next_b -= 1;
    }
    if (k == remaining - 1) recv_prev = false;
    NB_TRY(exchange({y, dx}, recv_prev ? next_f : -1, recv_next ? next_b : -1));
  }
  return Status::ok();
}

Status PipelineSchedule::interleaved_cooldown(int64_t remaining) {
  const int64_t total = M_ * V_;
  for (int64_t k = remaining; k < total; ++k) {
    Tensor dx;
    NB_TRY(backward(k, &dx));
    const int next_b = chunk_of(k + 1, false);
    const bool recv_next = !(rank_ == P_ - 1 && next_b == V_ - 1) && k + 1 < total;
    NB_TRY(exchange({{}, dx}, -1, recv_next ? next_b : -1));
  }
  return Status::ok();
}

// Evaluation: micro-batch by micro-batch, chunk by chunk, a chain round the ranks.
Status PipelineSchedule::run_forward_only(int64_t micro_batches) {
  for (int64_t m = 0; m < micro_batches; ++m)
    for (int c = 0; c < V_; ++c) {
      if (!first_stage(c)) NB_TRY(exchange({}, c, -1));
      const Tensor input = take_input(c);
      Tensor y;
      NB_TRY(model_->forward_chunk_only(m, c, input, &y));
      if (input.data) free_.push_back({input, -1});
      if (!last_stage(c)) NB_TRY(exchange({y, {}}, -1, -1));
    }
  return finish_messages();
}

}  // namespace nb
