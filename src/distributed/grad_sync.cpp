// GradSync: bucketed, optionally overlapped gradient reduction and weight gathering (grad_sync.h).
#include "distributed/grad_sync.h"
#include <algorithm>
#include "core/memory_ledger.h"
#include "ops/elementwise.h"

namespace nb {

Status GradSync::init(const ParamStore* params, dist::Communicator* comm, Device dev, Options o,
                      const std::vector<std::string>& forward_order) {
  P_ = params;
  comm_ = comm;
  dev_ = dev;
  opt_ = o;
  sharded_ = P_->shard_count() > 1;
  const int nb = P_->bucket_count();
  params_in_bucket_.assign(size_t(nb), 0);
  for (const ParamInfo& p : P_->params()) {
    std::vector<int>& mine = buckets_of_[p.name];
    for (int b = 0; b < nb; ++b)
      if (p.offset < P_->bucket_end(b) && p.offset + p.numel > P_->bucket_begin(b)) {
        mine.push_back(b);
        params_in_bucket_[size_t(b)]++;
      }
  }
  // Gathers follow the forward's first reads (the norms, stored last, are read by layer 0).
  std::vector<char> placed(size_t(nb), 0);
  for (const std::string& name : forward_order)
    for (int b : buckets_of(name))
      if (!placed[size_t(b)]) gather_order_.push_back(b), placed[size_t(b)] = 1;
  for (int b = 0; b < nb; ++b)
    if (!placed[size_t(b)]) gather_order_.push_back(b);
  gathered_.resize(size_t(nb));
  gather_pending_.assign(size_t(nb), 0);
  reduced_.assign(size_t(nb), 0);
  pending_ = params_in_bucket_;
  NB_TRY(side_.create(dev));
  NB_TRY(mark_.create(dev));
  for (StreamEvent& e : gathered_) NB_TRY(e.create(dev));
  MemoryScope scope(MemPart::comm_buffers);
  if (opt_.reduce_in_bf16) NB_TRY(Buffer::allocate(&bf16_scratch_, DType::bf16, dev, {P_->bucket_len()}));
  return Status::ok();
}

const std::vector<int>& GradSync::buckets_of(const std::string& name) const {
  static const std::vector<int> none;
  auto it = buckets_of_.find(name);
  return it == buckets_of_.end() ? none : it->second;
}

void GradSync::begin_last_backward() {
  pending_ = params_in_bucket_;
  std::fill(reduced_.begin(), reduced_.end(), char(0));
}

// In place: the output slice is the input at rank x slice length (NCCL's in-place form).
Status GradSync::reduce_bucket(int b, Stream s) {
  reduced_[size_t(b)] = 1;
  if (opt_.reduce_in_bf16) return reduce_bucket_bf16(b, s);
  const Tensor g = P_->padded_grad();
  const Tensor bucket = P_->range(g, P_->bucket_begin(b), P_->bucket_end(b));
  if (!sharded_) return comm_->all_reduce(bucket, dist::ReduceOp::sum, s);
  const ParamStore::Slice mine = P_->own_slice(b);
  return comm_->reduce_scatter(bucket, P_->range(g, mine.begin, mine.end), s);
}

// The bucket cast to BF16 in the scratch, reduced there, and this rank's part cast back to FP32. The
// scratch is reused by the next bucket on the same stream, so the casts and collectives stay in order.
Status GradSync::reduce_bucket_bf16(int b, Stream s) {
  const int64_t begin = P_->bucket_begin(b), n = P_->bucket_end(b) - begin;
  const Tensor g = P_->padded_grad();
  const Tensor scratch = P_->range(bf16_scratch_.tensor(), 0, n);
  ops::cast(P_->range(g, begin, begin + n), scratch, s);
  if (!sharded_) {
    NB_TRY(comm_->all_reduce(scratch, dist::ReduceOp::sum, s));
    ops::cast(scratch, P_->range(g, begin, begin + n), s);
    return Status::ok();
  }
  const ParamStore::Slice mine = P_->own_slice(b);
  const Tensor part = P_->range(scratch, mine.begin - begin, mine.end - begin);
  NB_TRY(comm_->reduce_scatter(scratch, part, s));
  ops::cast(part, P_->range(g, mine.begin, mine.end), s);
  return Status::ok();
}

Status GradSync::grads_final(const std::vector<std::string>& names) {
  if (!opt_.overlap_grad_reduce) return Status::ok();
  bool marked = false;
  for (const std::string& name : names)
    for (int b : buckets_of(name)) {
      if (--pending_[size_t(b)] > 0 || reduced_[size_t(b)]) continue;
      if (!marked) {  // the side stream starts after the backward work queued so far
        mark_.record(nullptr);
        mark_.wait_in(side_.get());
        marked = true;
      }
      NB_TRY(reduce_bucket(b, side_.get()));
    }
  return Status::ok();
}

Status GradSync::finish_reduce() {
  settle();
  const Stream s = opt_.overlap_grad_reduce ? side_.get() : nullptr;
  if (s) {
    mark_.record(nullptr);
    mark_.wait_in(s);
  }
  for (int b = 0; b < int(reduced_.size()); ++b)
    if (!reduced_[size_t(b)]) NB_TRY(reduce_bucket(b, s));
  if (s) {
    mark_.record(s);
    mark_.wait_in(nullptr);
  }
  return comm_->wait(s);  // the step reads the gradient norm next: never block on a dead peer
}

Status GradSync::gather_bucket(int b, Stream s) {
  const Tensor all = P_->padded_compute();
  const ParamStore::Slice mine = P_->own_slice(b);
  return comm_->all_gather(P_->range(all, mine.begin, mine.end), P_->range(all, P_->bucket_begin(b), P_->bucket_end(b)),
                           s);
}

Status GradSync::gather_weights() {
  if (!sharded_) return Status::ok();
  if (!opt_.overlap_param_gather) {
    for (int b : gather_order_) NB_TRY(gather_bucket(b, nullptr));
    return comm_->wait(nullptr);
  }
  mark_.record(nullptr);  // after AdamW
  mark_.wait_in(side_.get());
  for (int b : gather_order_) {
    NB_TRY(gather_bucket(b, side_.get()));
    gathered_[size_t(b)].record(side_.get());
    gather_pending_[size_t(b)] = 1;
  }
  return Status::ok();
}

Status GradSync::weights_needed(const std::vector<std::string>& names) {
  for (const std::string& name : names)
    for (int b : buckets_of(name))
      if (gather_pending_[size_t(b)]) {
        gathered_[size_t(b)].wait_in(nullptr);
        gather_pending_[size_t(b)] = 0;
      }
  return Status::ok();
}

void GradSync::settle() {
  for (size_t b = 0; b < gathered_.size(); ++b)
    if (gather_pending_[b]) {
      gathered_[b].wait_in(nullptr);
      gather_pending_[b] = 0;
    }
}

}  // namespace nb
