// Data-parallel gradient reduction and weight gathering, bucket by bucket (Megatron's DDP buckets,
// docs/DISTRIBUTED.md). After the step's backward each bucket of the flat FP32 gradients is summed over
// the ranks: all-reduced (plain DDP) or reduce-scattered into each rank's slice (distributed optimizer),
// in FP32 or, with --grad-reduce-in-bf16, cast to BF16 first. After AdamW the updated compute-copy
// slices are all-gathered. With --overlap-grad-reduce a bucket is reduced on a side stream as soon as
// the last micro-batch's backward has finished every parameter in it; with --overlap-param-gather the
// gathers run on the side stream and the next forward waits for each bucket just before it reads it.
// Every rank issues the same collectives in the same order: buckets are launched in the order the
// model reports them, which is the same on every rank.
#pragma once
#include <string>
#include <unordered_map>
#include <vector>
#include "core/stream_event.h"
#include "distributed/communicator.h"
#include "model/llama_model.h"

namespace nb {

class GradSync : public LlamaModel::StepHooks {
 public:
  struct Options {
    bool overlap_grad_reduce = false, overlap_param_gather = false, reduce_in_bf16 = false;
  };
  // forward_order: the parameters in the order a forward first reads them (gathers follow it).
  Status init(const ParamStore* params, dist::Communicator* comm, Device dev, Options o,
              const std::vector<std::string>& forward_order);
  bool overlapped() const { return opt_.overlap_grad_reduce || opt_.overlap_param_gather; }

  // Before the backward of the step's last micro-batch: every bucket waits for its parameters again.
  void begin_last_backward();
  // The gradients: every bucket not yet launched, then the default stream waits for all of them (and
  // the host, for at most the communicator's timeout: a dead peer becomes an error, not a hang).
  Status finish_reduce();
  // After AdamW wrote this rank's slices of the compute copy (distributed optimizer only).
  Status gather_weights();
  // Before any other collective: the default stream waits for the gathers still in flight.
  void settle();

  // StepHooks: from the model's forward and backward.
  Status weights_needed(const std::vector<std::string>& names) override;
  Status grads_final(const std::vector<std::string>& names) override;

 private:
  Status reduce_bucket(int b, Stream s);
  Status reduce_bucket_bf16(int b, Stream s);
  Status gather_bucket(int b, Stream s);
  const std::vector<int>& buckets_of(const std::string& name) const;

  const ParamStore* P_ = nullptr;
  dist::Communicator* comm_ = nullptr;
  Device dev_ = Device::cpu;
  Options opt_;
  bool sharded_ = false;
  std::unordered_map<std::string, std::vector<int>> buckets_of_;  // parameter -> the buckets it overlaps
  std::vector<int> params_in_bucket_, pending_;                   // per bucket: parameters, still unfinished
  std::vector<char> reduced_;                                     // per bucket: launched this step
  std::vector<int> gather_order_;                                 // buckets in the order a forward needs them
  std::vector<StreamEvent> gathered_;                             // per bucket: its gather's end
  std::vector<char> gather_pending_;                              // per bucket: the default stream has not waited
  SideStream side_;
  StreamEvent mark_;     // the default stream's progress, for the side stream to wait on
  Buffer bf16_scratch_;  // one bucket in BF16 (--grad-reduce-in-bf16); the side stream reuses it in order
};

}  // namespace nb
