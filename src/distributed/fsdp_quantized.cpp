// FsdpSync's training-format gathers (fsdp.h): a quantized Linear's weight travels as the bytes its GEMMs
// read (FP8 codes, MXFP8 codes and E8M0 scales, NVFP4 codes and E4M3 scales, FP8 128x128 codes and scales)
// instead of BF16. Once per optimizer step every rank takes the amax of its chunk of each such weight and one
// all-reduce (MAX) gives every rank every weight's amax. A unit's gather then quantizes this rank's chunk of
// each of its weights with that amax (recipe::Linear's sharded-weight mode, linear_sharded.cpp) straight into
// the rank's slot of a staging buffer, all-gathers the staging buffer in place, and each Linear lays the
// chunks out as its copies in a window of the quantized pool (bound with the unit's BF16 window, released
// with it). The chunk of a block-aligned row range quantized with the whole weight's amax is byte for byte
// that range of the whole weight's copies. Quantizing at each gather (a pass over 1/d of the unit's BF16
// rows, on the side stream) instead of keeping every chunk quantized saves a rank 1/d of the model's
// quantized bytes.
#include <algorithm>
#include "core/memory_ledger.h"
#include "distributed/fsdp.h"

namespace nb {

namespace {
size_t align256(size_t n) { return (n + 255) / 256 * 256; }
}  // namespace

Tensor FsdpSync::chunk_of(const ParamStore::Group& g) const {
  const Tensor flat = P_->range(P_->padded_compute(), g.local, g.local + g.chunk());
  return Tensor::make(flat.data, flat.dtype, flat.device, {g.rows_per_rank, g.cols});
}

Status FsdpSync::set_quantized_linears(const std::vector<std::pair<std::string, recipe::Linear*>>& linears) {
  NB_CHECK(P_ && P_->compute_sharded(), "internal: training-format gathers need optim_grads_params");
  const int units = P_->unit_count();
  quantized_group_.assign(P_->groups().size(), 0);
  unit_chunk_bytes_.assign(size_t(units), 0);
  unit_window_bytes_.assign(size_t(units), 0);
  qlinears_.clear();
  frozen_linears_ = !linears.empty();
  for (const auto& [name, lin] : linears) {
    frozen_linears_ = frozen_linears_ && lin->frozen();
    QLinear q;
    q.linear = lin;
    q.unit = P_->unit_of(name);
    q.group = P_->group_index(name);
    const ParamStore::Group& g = P_->groups()[size_t(q.group)];
    NB_CHECK(g.begin == P_->info(name).offset, "internal: %s does not start a group", name.c_str());
    NB_TRY(lin->set_sharded_weight(g.rows_per_rank, ranks_));  // a no-op if the model did it
    quantized_group_[size_t(q.group)] = 1;
    // Its chunk's place in one rank's slot of the staging buffer, and its copies' place in its unit's window.
    q.chunk_offset = unit_chunk_bytes_[size_t(q.unit)];
    q.window_offset = unit_window_bytes_[size_t(q.unit)];
    unit_chunk_bytes_[size_t(q.unit)] += align256(lin->weight_chunk_bytes());
    unit_window_bytes_[size_t(q.unit)] += align256(lin->weight_window_bytes());
    qlinears_.push_back(q);
  }
  const size_t most_chunk = *std::max_element(unit_chunk_bytes_.begin(), unit_chunk_bytes_.end());
  qpool_.dt = DType::u8;
  qpool_.capacity =
      int64_t(std::max<size_t>(256, *std::max_element(unit_window_bytes_.begin(), unit_window_bytes_.end())));
  MemoryScope scope(MemPart::quantized_copies);
  NB_TRY(Buffer::allocate(&qstaging_, DType::u8, dev_, {int64_t(std::max<size_t>(most_chunk * size_t(ranks_), 256))})
             .context("Megatron-FSDP quantized gather staging"));
  NB_TRY(Buffer::allocate(&amaxes_, DType::f32, dev_, {int64_t(std::max<size_t>(qlinears_.size(), 1))}));
  amaxes_stale_ = true;
  return Status::ok();
}

// Every chunk's amax on the default stream, MAX-reduced on the side stream (ordered with the other
// collectives); the default stream waits for it.
Status FsdpSync::reduce_amaxes() {
  const auto& groups = P_->groups();
  float* amax = amaxes_.ptr<float>();
  for (size_t i = 0; i < qlinears_.size(); ++i) {
    const QLinear& q = qlinears_[i];
    NB_TRY(q.linear->weight_chunk_amax(chunk_of(groups[size_t(q.group)]), amax + i, nullptr));
  }
  mark_.record(nullptr);
  mark_.wait_in(side_.get());
  const Tensor amaxes = P_->range(amaxes_.tensor(), 0, int64_t(qlinears_.size()));
  NB_TRY(comm_->all_reduce(amaxes, dist::ReduceOp::max, side_.get()));
  if (tp_comm_) NB_TRY(tp_comm_->all_reduce(amaxes, dist::ReduceOp::max, side_.get()));
  settle();
  amaxes_stale_ = false;
  return Status::ok();
}

// On the side stream, after the unit's BF16 groups: this rank's chunks quantized into its staging slot, one
// all-gather in place, then each Linear's copies laid out in a quantized window and bound. The staging buffer
// is only ever used on the side stream, one unit after another.
Status FsdpSync::gather_quantized(int unit) {
  Window* qw = nullptr;
  NB_TRY(acquire(&qpool_, unit, &qw));
  const Stream s = side_.get();
  if (qw->reusable.recorded()) qw->reusable.wait_in(s);
  const size_t n = unit_chunk_bytes_[size_t(unit)];
  uint8_t* staging = qstaging_.ptr<uint8_t>();
  const float* amax = amaxes_.ptr<float>();
  for (size_t i = 0; i < qlinears_.size(); ++i) {
    const QLinear& q = qlinears_[i];
    if (q.unit != unit) continue;
    uint8_t* slot = staging + size_t(rank_) * n + q.chunk_offset;
    if (q.linear->frozen())  // a frozen base weight: its chunk was quantized once, at load
      NB_TRY(copy_bytes_async(slot, dev_, q.linear->frozen_chunk(), dev_, q.linear->weight_chunk_bytes(), s));
    else
      NB_TRY(q.linear->quantize_weight_chunk(chunk_of(P_->groups()[size_t(q.group)]), amax + i, slot, s));
  }
  const Tensor all = P_->range(qstaging_.tensor(), 0, int64_t(n) * ranks_);
  NB_TRY(comm_->all_gather(P_->range(all, int64_t(n) * rank_, int64_t(n) * (rank_ + 1)), all, s));
  gathered_bytes_ += double(n) * (ranks_ - 1);
  for (const QLinear& q : qlinears_) {
    if (q.unit != unit) continue;
    uint8_t* window = qw->buf.ptr<uint8_t>() + q.window_offset;
    NB_TRY(q.linear->assemble_weight(staging + q.chunk_offset, n, window, s));
    q.linear->bind_weight(window);
  }
  return Status::ok();
}

void FsdpSync::release_quantized(int unit) {
  for (auto& qw : qpool_.all) {
    if (qw->unit != unit) continue;
    for (const QLinear& q : qlinears_)
      if (q.unit == unit) q.linear->bind_weight(nullptr);
    release(&qpool_, qw.get(), nullptr);
  }
}

}  // namespace nb
