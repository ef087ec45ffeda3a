// Pipeline parallelism's schedules (docs/DISTRIBUTED.md): the order of one optimizer step's forward and backward
// passes on this pipeline rank and the residual stream's messages between neighbouring ranks, in place of the
// trainer's micro-batch loop. Each group of sends and receives is posted after the pass that produced them. With
// overlap (the default; --no-overlap-p2p-communication turns it off) the groups run on a stream of their own while
// the next passes compute, and a pass waits only for the message it reads; without it a group completes on the
// compute stream before the next pass. Megatron-Core's two schedules:
//   1F1B (V = 1): warm-up of P - rank - 1 forwards, then one forward and one backward in turn, then the cool-down
//     backwards (forward_backward_pipelining_without_interleaving);
//   interleaved 1F1B (V > 1 chunks per rank): warm-up of (P - rank - 1) x 2 + (V - 1) x P passes over groups of P
//     micro-batches per chunk (forward_backward_pipelining_with_interleaving); needs M a multiple of P and P > 2.
// Messages go to rank + 1 (forward) and rank - 1 (backward), modulo P: chunk c of rank P - 1 feeds chunk c + 1 of
// rank 0. Received tensors wait in a queue per chunk until their pass takes them. --profile reports the compute
// stream's time in the messages (without overlap) or waiting for them (with it) as the phase "pipeline: messages +
// waits (bubble)".
//
// Overlap's ordering, per message buffer: the message stream waits for the compute stream's work queued before the
// group (so a send reads a finished output and a receive overwrites a buffer no pass still reads); a pass waits for
// the group that filled its input; an input gradient is sent from a copy in a message buffer (it lives in the
// pass's activation slot, which a later forward may take before the send has run), and the compute stream waits for
// that send before writing the buffer again. A forward's output is sent from its slot: the slot is taken again only
// after the chunk's backward, which waited for a later group of the same in-order message stream.
#pragma once
#include <deque>
#include <vector>
#include "core/status.h"
#include "core/stream_event.h"
#include "distributed/communicator.h"
#include "model/llama_model.h"

namespace nb {

class PipelineSchedule {
 public:
  // comm: the pipeline group (rank = stage); model: this stage, its pipeline set; M micro-batches per step;
  // overlap: messages on their own stream (dev's), beside the passes.
  Status init(dist::Communicator* comm, LlamaModel* model, int virtual_stages, int64_t micro_batches, Device dev,
              bool overlap);
  // One step's passes over the staged micro-batches 0 .. M-1 (LlamaModel::stage_batches).
  Status run(float grad_scale);
  // Forward passes only (evaluation): each micro-batch through every chunk in turn.
  Status run_forward_only(int64_t micro_batches);
  // The most (micro-batch, chunk) pairs a rank holds between forward and backward: its activation slots.
  static int64_t max_in_flight(int pipeline, int virtual_stages, int rank, int64_t micro_batches);
  // Warm-up passes of `rank` (Megatron's counts; the whole step when they exceed it).
  static int64_t warmup_passes(int pipeline, int virtual_stages, int rank, int64_t micro_batches);
  // The step's passes on `rank` in the order the schedule runs them: warm-up forwards, then a forward and a backward
  // in turn, then the cool-down backwards (LlamaModel sizes its slots by replaying them).
  static std::vector<LlamaModel::PipelinePass> pass_order(int pipeline, int virtual_stages, int rank,
                                                          int64_t micro_batches);
  // Pass k's chunk and micro-batch (Megatron's numbering: groups of P micro-batches through every chunk; backwards
  // take the chunks in reverse).
  static int chunk_of_pass(int pipeline, int virtual_stages, int64_t k, bool forward);
  static int64_t micro_of_pass(int pipeline, int virtual_stages, int64_t k);

 private:
  struct Sends {  // the tensors a pass leaves to send (empty: nothing)
    Tensor forward, backward;
  };
  struct Message {  // a message buffer, and the group the compute stream waits for before using it (-1: none)
    Tensor tensor;
    int group = -1;
  };
  int chunk_of(int64_t k, bool forward) const;
  int64_t micro_of(int64_t k) const;
  bool first_stage(int c) const { return rank_ == 0 && c == 0; }
  bool last_stage(int c) const { return rank_ == P_ - 1 && c == V_ - 1; }
  Status forward(int64_t k, Tensor* out);
  Status backward(int64_t k, Tensor* dx);
  // One group: the sends, and receives into the back of the chunk queues named (-1: none).
  Status exchange(const Sends& s, int recv_forward_chunk, int recv_backward_chunk);
  Status run_1f1b();
  Status run_interleaved();
  Status interleaved_warmup(int64_t warmup, int64_t remaining);
  Status interleaved_steady(int64_t warmup, int64_t remaining);
  Status interleaved_cooldown(int64_t remaining);
  Status take_buffer(Message* out);  // the free message buffer whose last send is oldest (made when none is free)
  Tensor take_input(int c);          // chunk c's oldest received input (empty on the first stage)
  void wait_for(const Message& m);   // the compute stream waits for m's group
  Status post(const std::vector<dist::Communicator::P2POp>& ops);  // one group, numbered groups_++
  Status finish_messages();  // the step's last group done (its errors reported) before the step goes on

  dist::Communicator* comm_ = nullptr;
  LlamaModel* model_ = nullptr;
  int P_ = 1, V_ = 1, rank_ = 0;
  int64_t M_ = 1;
  float grad_scale_ = 0;
  Device dev_ = Device::cpu;
  bool overlap_ = false;         // --overlap-p2p-communication
  bool async_ = false;           // ... in effect: a training step's passes (evaluation posts on the compute stream)
  std::vector<Buffer> buffers_;  // every message buffer made so far
  std::vector<Message> free_;    // ... and those not waiting in a queue
  std::vector<std::deque<Message>> inputs_, grads_;  // per chunk: received inputs and output gradients, oldest first
  SideStream messages_;                              // the groups' stream under overlap
  StreamEvent compute_done_;                         // the compute stream's work before a group
  std::vector<StreamEvent> group_done_;  // per group of the step: its messages done (made as the step needs them)
  int groups_ = 0;                       // groups posted this step
};

}  // namespace nb
