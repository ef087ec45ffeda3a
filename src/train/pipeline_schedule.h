// Pipeline parallelism's schedules (docs/DISTRIBUTED.md): the order of one optimizer step's forward and backward
// passes on this pipeline rank and the residual stream's messages between neighbouring ranks, in place of the
// trainer's micro-batch loop. Megatron-Core's two schedules, without overlap of the messages (each group of sends
// and receives is posted after the pass that produced them and completes before the next pass):
//   1F1B (V = 1): warm-up of P - rank - 1 forwards, then one forward and one backward in turn, then the cool-down
//     backwards (forward_backward_pipelining_without_interleaving);
//   interleaved 1F1B (V > 1 chunks per rank): warm-up of (P - rank - 1) x 2 + (V - 1) x P passes over groups of P
//     micro-batches per chunk (forward_backward_pipelining_with_interleaving); needs M a multiple of P and P > 2.
// Messages go to rank + 1 (forward) and rank - 1 (backward), modulo P: chunk c of rank P - 1 feeds chunk c + 1 of
// rank 0. Received tensors wait in a queue per chunk until their pass takes them. --profile reports the messages and
// the waits for them as the phase "pipeline: messages + waits (bubble)".
#pragma once
#include <deque>
#include <vector>
#include "core/status.h"
#include "distributed/communicator.h"
#include "model/llama_model.h"

namespace nb {

class PipelineSchedule {
 public:
  // comm: the pipeline group (rank = stage); model: this stage, its pipeline set; M micro-batches per step.
  Status init(dist::Communicator* comm, LlamaModel* model, int virtual_stages, int64_t micro_batches);
  // One step's passes over the staged micro-batches 0 .. M-1 (LlamaModel::stage_batches).
  Status run(float grad_scale);
  // Forward passes only (evaluation): each micro-batch through every chunk in turn.
  Status run_forward_only(int64_t micro_batches);
  // The most (micro-batch, chunk) pairs a rank holds between forward and backward: its activation slots.
  static int64_t max_in_flight(int pipeline, int virtual_stages, int rank, int64_t micro_batches);
  // Warm-up passes of `rank` (Megatron's counts; the whole step when they exceed it).
  static int64_t warmup_passes(int pipeline, int virtual_stages, int rank, int64_t micro_batches);

 private:
  struct Sends {  // the tensors a pass leaves to send (empty: nothing)
    Tensor forward, backward;
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
  Status take_buffer(Tensor* out);  // a free message buffer (made when none is)
  Tensor take_input(int c);         // chunk c's oldest received input (empty on the first stage)

  dist::Communicator* comm_ = nullptr;
  LlamaModel* model_ = nullptr;
  int P_ = 1, V_ = 1, rank_ = 0;
  int64_t M_ = 1;
  float grad_scale_ = 0;
  std::vector<Buffer> buffers_;                     // every message buffer made so far
  std::vector<Tensor> free_;                        // ... and those not waiting in a queue
  std::vector<std::deque<Tensor>> inputs_, grads_;  // per chunk: received inputs and output gradients, oldest first
};

}  // namespace nb
