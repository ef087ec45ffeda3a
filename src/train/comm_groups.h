// The model's views of a communicator (train/trainer_cp.cpp, trainer_tp.cpp): the quantized Linears' amax
// group (recipe::AmaxGroup) and the tensor-parallel group's reductions (ops::tp::ReduceGroup), each an
// in-place all-reduce on the tensor's device, on the model's stream.
#pragma once
#include "distributed/communicator.h"
#include "ops/vocab_parallel_ce.h"
#include "recipe/linear.h"

namespace nb {

class CommAmaxGroup : public recipe::AmaxGroup {
 public:
  CommAmaxGroup(dist::Communicator* comm, Device dev) : comm_(comm), dev_(dev) {}
  Status max(float* values, int n, Stream stream) override {
    return comm_->all_reduce(Tensor::make(values, DType::f32, dev_, {n}), dist::ReduceOp::max, stream);
  }

 private:
  dist::Communicator* comm_;
  Device dev_;
};

// Counts what it moves, as tp::collective_bytes does: an all-reduce its tensor, a reduce-scatter its input
// (reduced_bytes), an all-gather its output (gathered_bytes); the trainer reports them per step.
class CommReduceGroup : public ops::tp::ReduceGroup {
 public:
  explicit CommReduceGroup(dist::Communicator* comm) : comm_(comm) {}
  int rank() const override { return comm_->rank(); }
  int size() const override { return comm_->size(); }
  Status max(const Tensor& values, Stream stream) override {
    reduced_bytes += double(values.bytes());
    return comm_->all_reduce(values, dist::ReduceOp::max, stream);
  }
  Status sum(const Tensor& values, Stream stream) override {
    reduced_bytes += double(values.bytes());
    return comm_->all_reduce(values, dist::ReduceOp::sum, stream);
  }
  Status reduce_scatter(const Tensor& in, const Tensor& out, Stream stream) override {
    reduced_bytes += double(in.bytes());
    return comm_->reduce_scatter(in, out, stream);
  }
  Status all_gather(const Tensor& in, const Tensor& out, Stream stream) override {
    gathered_bytes += double(out.bytes());
    return comm_->all_gather(in, out, stream);
  }
  double gathered_bytes = 0, reduced_bytes = 0;

 private:
  dist::Communicator* comm_;
};

}  // namespace nb
