// Megatron-FSDP's step (--use-megatron-fsdp, strategies optim_grads and optim_grads_params; the layout is
// ParamStore's, model/params.h). Each rank keeps 1/d of every parameter group's rows; the model's hooks
// say when a unit (the embedding, a transformer layer, the head) is about to be read or written:
//   - weights_needed (optim_grads_params): the unit's rows are all-gathered into a window, on a side
//     stream, and the next unit in the pass's direction is prefetched while this one computes; windows of
//     units the pass has left are recycled. A unit is gathered before its forward and again before its
//     backward, as Megatron-FSDP and FSDP2 do.
//   - grads_needed: a zeroed FP32 gradient window for the unit (zeroed on the side stream right after its
//     previous unit's reduction, so the backward's queue does not spend the memory pass). Layer-sized
//     gradient windows come two deep: a unit's backward writes one while the unit above it is reduced
//     out of the other, so the default stream never waits for a reduction.
//   - grads_final: the window is reduce-scattered (sum) over the ranks on the side stream and this rank's
//     rows are added into its gradient shard; every micro-batch's, so no rank holds the whole gradient.
// BF16 reductions (set_reduce_in_bf16; --grad-reduce-in-bf16): each group's window is cast to BF16 piece by
// piece (one piece of every rank's chunk side by side in a scratch of kPieceElems elements), reduce-scattered
// in BF16 (half the bytes on the wire) and this rank's part cast back and added into the FP32 shard, as
// Megatron-FSDP does when gradients are not reduced in FP32. Each micro-batch's sum is rounded to BF16.
// Between the micro-batches of one step (set_next_pass_follows): the backward's last layer stays gathered
// and the embedding is gathered during that layer's backward, so the next forward starts without waiting
// for the side stream, which is still reducing the backward's last units.
// The embedding and head once per step (set_embeddings_per_step; --fsdp-embeddings-per-step): the first and
// last units stay gathered from their first read to the optimizer step, and their gradient windows keep
// accumulating until the step's last micro-batch, whose backward reduces them once: a step moves their
// bytes once instead of once per micro-batch, for one more large weight and gradient window per rank.
// Windows come in two sizes: one for the transformer layers, one for the units larger than a layer (the
// embedding and an untied head), each pool reused oldest-freed first and grown only in the first step.
// Training-format gathers (set_quantized_linears; optim_grads_params with a quantized recipe): a quantized
// Linear's weight is not gathered in BF16. Once per optimizer step every rank max-reduces the chunk amaxes
// (one all-reduce for the whole model); a unit's gather then quantizes this rank's chunk of each such weight
// with its amax (recipe::Linear's sharded-weight mode), all-gathers the chunks' bytes (codes and scales) once,
// and each Linear assembles them into a window of quantized copies it reads instead of quantizing
// (fsdp_quantized.cpp).
// A frozen store (a LoRA base under optim_grads_params, model/params.h): the same gathers before each unit's
// forward and backward, never a gradient window or a reduction; its frozen quantized Linears keep their
// chunk quantized once at load (recipe::Linear::freeze_weight_chunk), so a gather copies it instead of
// quantizing, and no amax is reduced.
// A window is handed out again only after the work that used it: events order the two streams. On the CPU
// backend every call completes before it returns, so the events are no-ops. Every rank issues the same
// collectives in the same order: the model's pass is the same on every rank.
#pragma once
#include <deque>
#include <memory>
#include <set>
#include <string>
#include <vector>
#include "core/stream_event.h"
#include "distributed/communicator.h"
#include "model/llama_model.h"
#include "recipe/linear.h"

namespace nb {

class FsdpSync : public LlamaModel::StepHooks {
 public:
  Status init(ParamStore* params, dist::Communicator* comm, Device dev);

  // StepHooks, from the model's pass.
  Status weights_needed(const std::vector<std::string>& names) override;
  Status grads_needed(const std::vector<std::string>& names) override;
  Status grads_final(const std::vector<std::string>& names) override;

  // Training-format gathers for these Linears (each with its weight's first parameter, as
  // LlamaModel::quantized_linears gives them): their groups are no longer gathered in BF16.
  Status set_quantized_linears(const std::vector<std::pair<std::string, recipe::Linear*>>& linears);
  // Tensor parallelism: each rank's weights are its slices of the layer's, so a weight's amax is also the MAX over
  // the tensor-parallel ranks (this communicator), as one GPU takes it over the whole weight. Before the first pass.
  void set_tensor_parallel(dist::Communicator* tp) { tp_comm_ = tp; }
  size_t quantized_linear_count() const { return qlinears_.size(); }

  // Before each micro-batch's pass: whether another micro-batch of this step follows (its weights are the
  // same, so this backward leaves the next forward's first units gathered).
  void set_next_pass_follows(bool more) { next_pass_follows_ = more; }
  // Before the first pass: the embedding and head units gathered and reduced once per optimizer step.
  void set_embeddings_per_step(bool on) { embeddings_per_step_ = on; }
  // Before the first pass: gradients reduce-scattered in BF16 (allocates the scratch; a frozen store: no-op).
  Status set_reduce_in_bf16(bool on);
  // Device bytes of the BF16 reduction scratch (the memory estimate's share of --grad-reduce-in-bf16).
  static int64_t bf16_scratch_bytes() { return kPieceElems * 2; }

  // After the step's backward: the default stream waits for every reduction (bounded by the timeout).
  Status finish_reduce();
  // After AdamW wrote this rank's shard: optim_grads gathers the whole compute copy; optim_grads_params
  // drops the gathered windows (the next read gathers the new values).
  Status weights_updated();
  // Before another collective: the default stream waits for the side stream.
  void settle();
  // Checkpoints: master, m or v whole in `host` (total() elements; nullptr on ranks that do not write),
  // gathered group by group in pieces of at most kPieceElems per rank. Every rank must call it.
  Status gather_state(optim::StateArray a, float* host);

  // Bytes all-gathered (weights) and reduce-scattered (gradients) by this rank's calls so far.
  double gathered_bytes() const { return gathered_bytes_; }
  double reduced_bytes() const { return reduced_bytes_; }
  size_t window_bytes() const;  // device bytes of the windows allocated so far

  static constexpr int64_t kPieceElems = int64_t(1) << 24;

 private:
  struct Window {
    Buffer buf;
    int64_t capacity = 0;
    int unit = -1;         // bound to this unit, or free
    StreamEvent ready;     // compute: the gather is done (recorded on the side stream)
    StreamEvent reusable;  // the last work reading or writing it is done
    bool waited = false;   // compute: the default stream already waits for `ready`
    bool zeroed = false;   // gradients: zeroed by the side stream after its last reduction
  };
  struct Pool {
    DType dt = DType::f32;
    int64_t capacity = 0;  // elements of each window: the largest unit of its size class
    size_t depth = 1;      // windows allocated before a freed one is handed out again
    std::vector<std::unique_ptr<Window>> all;
    std::deque<Window*> free;  // oldest freed first
  };
  // The pool of unit u's windows: weights or gradients, layer-sized or large.
  Pool* pool_for(bool grads, int unit) { return &pools_[(grads ? 2 : 0) + (large(unit) ? 1 : 0)]; }
  std::set<int> units_of(const std::vector<std::string>& names) const;
  Status acquire(Pool* pool, int unit, Window** out);
  void release(Pool* pool, Window* w, Stream last_user);
  Window* bound(bool grads, int unit);
  bool large(int unit) const { return P_->unit_elems(unit) > layer_elems_; }
  bool held_for_step(int unit) const { return embeddings_per_step_ && (unit == 0 || unit == P_->unit_count() - 1); }
  Status gather_unit(int unit);
  Status reduce_unit(Window* w);
  Status reduce_group_bf16(const Tensor& window_part, int64_t chunk, const Tensor& shard_part);
  Status gather_compute_in_place();
  // fsdp_quantized.cpp
  struct QLinear {
    recipe::Linear* linear = nullptr;
    int group = 0, unit = 0;
    size_t chunk_offset = 0;   // in one rank's slot of the staging buffer (its unit's chunks)
    size_t window_offset = 0;  // in its unit's window of quantized copies
  };
  Status reduce_amaxes();             // every quantized weight's amax, once per optimizer step
  Status gather_quantized(int unit);  // the unit's chunks, assembled into a quantized window
  void release_quantized(int unit);
  Tensor chunk_of(const ParamStore::Group& g) const;  // this rank's compute rows of the group, 2-D

  std::vector<QLinear> qlinears_;
  std::vector<char> quantized_group_;  // per group: gathered in its training format
  std::vector<size_t> unit_chunk_bytes_, unit_window_bytes_;
  Buffer qstaging_, amaxes_;
  Pool qpool_;  // windows of quantized copies, one size (the largest layer's)
  bool amaxes_stale_ = true;
  bool frozen_linears_ = false;  // every quantized Linear is frozen: its chunk is quantized already

  ParamStore* P_ = nullptr;
  dist::Communicator* comm_ = nullptr;
  dist::Communicator* tp_comm_ = nullptr;  // set_tensor_parallel
  Device dev_ = Device::cpu;
  int ranks_ = 1, rank_ = 0, last_unit_ = -1;
  bool next_pass_follows_ = false;
  bool embeddings_per_step_ = false;
  Pool pools_[4];             // weights layer-sized, weights large, gradients layer-sized, gradients large
  int64_t layer_elems_ = 0;   // the largest transformer layer unit
  std::set<int> prefetched_;  // gathered ahead of the request
  SideStream side_;
  StreamEvent mark_;
  Buffer reduced_chunk_;    // one group's chunk: the reduce-scatter's output before it is added in
  Buffer bf16_scratch_;     // --grad-reduce-in-bf16: one piece of every rank's chunk, side by side
  int64_t bf16_piece_ = 0;  // elements per rank in the scratch; 0 when gradients are reduced in FP32
  double gathered_bytes_ = 0, reduced_bytes_ = 0;
};

}  // namespace nb
