// FsdpSync: Megatron-FSDP's gathers and reduce-scatters around the model's pass (fsdp.h).
#include "distributed/fsdp.h"
#include <algorithm>
#include <cstdlib>
#include "core/memory_ledger.h"
#include "ops/elementwise.h"

namespace nb {

Status FsdpSync::init(ParamStore* params, dist::Communicator* comm, Device dev) {
  NB_CHECK(params->fsdp(), "internal: FsdpSync over a store without the FSDP layout");
  P_ = params;
  comm_ = comm;
  dev_ = dev;
  ranks_ = comm->size();
  rank_ = comm->rank();
  const int layers = P_->unit_count() - 2;
  for (int u = 1; u <= layers; ++u) layer_elems_ = std::max(layer_elems_, P_->unit_elems(u));
  for (int i = 0; i < 4; ++i) pools_[i].dt = i < 2 ? P_->compute_dtype() : DType::f32;
  for (int u = 0; u < P_->unit_count(); ++u)
    for (bool grads : {false, true}) {
      Pool* pool = pool_for(grads, u);
      pool->capacity = std::max(pool->capacity, P_->unit_elems(u));
    }
  pools_[2].depth = 2;  // layer gradients: one window reduced while the next unit's backward writes the other
  int64_t most = 1;     // a frozen store (a LoRA base) has no gradients to reduce
  for (const ParamStore::Group& g : P_->groups()) most = std::max(most, P_->frozen() ? 1 : g.chunk());
  MemoryScope scope(MemPart::comm_buffers);
  NB_TRY(Buffer::allocate(&reduced_chunk_, DType::f32, dev, {most}));
  NB_TRY(side_.create(dev));
  return mark_.create(dev);
}

std::set<int> FsdpSync::units_of(const std::vector<std::string>& names) const {
  std::set<int> out;
  for (const std::string& n : names) out.insert(P_->unit_of(n));
  return out;
}

FsdpSync::Window* FsdpSync::bound(bool grads, int unit) {
  for (auto& w : pool_for(grads, unit)->all)
    if (w->unit == unit) return w.get();
  return nullptr;
}

// The oldest freed window of the pool once it holds `depth` windows, else a new one (first step only: the
// pass is the same every micro-batch, so the pool reaches its size once).
Status FsdpSync::acquire(Pool* pool, int unit, Window** out) {
  if (!pool->free.empty() && pool->all.size() >= pool->depth) {
    *out = pool->free.front();
    pool->free.pop_front();
    (*out)->unit = unit;
    return Status::ok();
  }
  const int64_t n = pool->capacity;
  auto w = std::make_unique<Window>();
  // Weight and gradient windows are the parameters' gathered form (the estimate's parameter row); the
  // training-format pool holds quantized copies.
  MemoryScope scope(pool->dt == DType::u8 ? MemPart::quantized_copies : MemPart::params);
  NB_TRY(Buffer::allocate(&w->buf, pool->dt, dev_, {n})
             .context("Megatron-FSDP window of " + std::to_string(n) + " elements"));
  w->capacity = n;
  w->unit = unit;
  NB_TRY(w->ready.create(dev_));
  NB_TRY(w->reusable.create(dev_));
  *out = w.get();
  pool->all.push_back(std::move(w));
  return Status::ok();
}

// `last_user`: the stream whose queued work is the window's last use; the next owner waits for it.
void FsdpSync::release(Pool* pool, Window* w, Stream last_user) {
  w->reusable.record(last_user);
  w->unit = -1;
  w->waited = false;
  pool->free.push_back(w);
}

// Every group of the unit: this rank's chunk of the compute shard, all-gathered into the window.
Status FsdpSync::gather_unit(int unit) {
  Window* w = nullptr;
  NB_TRY(acquire(pool_for(false, unit), unit, &w));
  const Stream s = side_.get();
  if (w->reusable.recorded()) w->reusable.wait_in(s);
  const Tensor shard = P_->padded_compute(), window = w->buf.tensor();
  for (size_t gi = 0; gi < P_->groups().size(); ++gi) {
    const ParamStore::Group& g = P_->groups()[gi];
    if (g.unit != unit || !g.stored || (!quantized_group_.empty() && quantized_group_[gi])) continue;
    const Tensor mine = P_->range(shard, g.local, g.local + g.chunk());
    const Tensor all = P_->range(window, g.unit_offset, g.unit_offset + g.chunk() * ranks_);
    NB_TRY(comm_->all_gather(mine, all, s));
    gathered_bytes_ += double(all.bytes()) * (ranks_ - 1) / ranks_;
  }
  if (!unit_chunk_bytes_.empty() && unit_chunk_bytes_[size_t(unit)] > 0) NB_TRY(gather_quantized(unit));
  w->ready.record(s);
  P_->bind_compute(unit, w->buf.data());
  return Status::ok();
}

Status FsdpSync::weights_needed(const std::vector<std::string>& names) {
  if (!P_->compute_sharded()) return Status::ok();
  const std::set<int> want = units_of(names);
  if (!qlinears_.empty() && amaxes_stale_ && !frozen_linears_) NB_TRY(reduce_amaxes());
  // Units the pass has left: their windows go back once the default stream's queued reads are done
  // (the embedding and head held for the step stay until weights_updated).
  for (int i = 0; i < 2; ++i)
    for (auto& w : pools_[i].all)
      if (w->unit >= 0 && !want.count(w->unit) && !prefetched_.count(w->unit) && !held_for_step(w->unit)) {
        P_->bind_compute(w->unit, nullptr);
        release_quantized(w->unit);
        release(&pools_[i], w.get(), nullptr);
      }
  for (int u : want) {
    if (!P_->compute_bound(u)) {
      mark_.record(nullptr);  // the gather may overwrite a window the default stream read before
      mark_.wait_in(side_.get());
      NB_TRY(gather_unit(u));
    }
    prefetched_.erase(u);
    Window* w = bound(false, u);
    if (!w->waited) {
      w->ready.wait_in(nullptr);
      w->waited = true;
    }
  }
  // Forward: the next unit (layers and the head; the embedding's next use is the next micro-batch).
  const int top = *want.rbegin();
  if (top >= last_unit_ && top + 1 < P_->unit_count() && !P_->compute_bound(top + 1)) {
    NB_TRY(gather_unit(top + 1));
    prefetched_.insert(top + 1);
  }
  last_unit_ = top;
  return Status::ok();
}

Status FsdpSync::grads_needed(const std::vector<std::string>& names) {
  const std::set<int> want = units_of(names);
  for (int u : want) {
    if (P_->frozen() || P_->grad_bound(u)) continue;  // a frozen store (a LoRA base): only the prefetch below
    Window* w = nullptr;
    NB_TRY(acquire(pool_for(true, u), u, &w));
    if (w->reusable.recorded()) w->reusable.wait_in(nullptr);  // its last reduce-scatter read it
    if (!w->zeroed) ops::fill(P_->range(w->buf.tensor(), 0, P_->unit_elems(u)), 0.0f, nullptr);
    w->zeroed = false;
    P_->bind_grad(u, w->buf.ptr<float>());
  }
  // Backward: the unit below this one (layer units; the embedding's backward reads no weights). Before
  // the first layer's backward with another micro-batch to follow: the embedding, for the next forward,
  // queued ahead of this backward's last reductions; the first layer's window stays for it too.
  const int next = *want.rbegin() - 1;
  last_unit_ = *want.rbegin();
  const bool ahead = next == 0 && next_pass_follows_;
  if (P_->compute_sharded() && (next >= 1 || ahead) && !P_->compute_bound(next)) {
    mark_.record(nullptr);
    mark_.wait_in(side_.get());
    NB_TRY(gather_unit(next));
    prefetched_.insert(next);
  }
  if (P_->compute_sharded() && ahead) prefetched_.insert(1);
  return Status::ok();
}

Status FsdpSync::set_reduce_in_bf16(bool on) {
  bf16_piece_ = 0;
  if (!on || P_->frozen()) return Status::ok();
  int64_t most = 1;
  for (const ParamStore::Group& g : P_->groups()) most = std::max(most, g.chunk());
  int64_t piece = kPieceElems / ranks_;
  // Tests cut the tiny model's groups into several pieces, the last one partial (the sums are the same).
  if (const char* v = std::getenv("NIBBLE_FSDP_BF16_PIECE"); v && *v)
    piece = std::clamp<int64_t>(std::atoll(v), 1, piece);
  bf16_piece_ = std::max<int64_t>(1, std::min(most, piece));
  MemoryScope scope(MemPart::comm_buffers);
  return Buffer::allocate(&bf16_scratch_, DType::bf16, dev_, {bf16_piece_ * ranks_})
      .context("Megatron-FSDP BF16 reduction scratch");
}

// One group in BF16, a piece at a time: the piece of every rank's chunk cast side by side into the scratch,
// reduce-scattered in place, this rank's part cast back to FP32 and added into the shard. The scratch is
// reused by the next piece on the same stream, so the casts and collectives stay in order.
Status FsdpSync::reduce_group_bf16(const Tensor& window_part, int64_t chunk, const Tensor& shard_part) {
  const Stream s = side_.get();
  for (int64_t o = 0; o < chunk; o += bf16_piece_) {
    const int64_t n = std::min(bf16_piece_, chunk - o);
    const Tensor scratch = P_->range(bf16_scratch_.tensor(), 0, n * ranks_);
    for (int r = 0; r < ranks_; ++r)
      ops::cast(P_->range(window_part, r * chunk + o, r * chunk + o + n), P_->range(scratch, r * n, (r + 1) * n), s);
    const Tensor mine = P_->range(scratch, rank_ * n, (rank_ + 1) * n);
    NB_TRY(comm_->reduce_scatter(scratch, mine, s));
    const Tensor out = P_->range(reduced_chunk_.tensor(), 0, n);
    ops::cast(mine, out, s);
    ops::add_inplace(P_->range(shard_part, o, o + n), out, s);
    reduced_bytes_ += double(scratch.bytes()) * (ranks_ - 1) / ranks_;
  }
  return Status::ok();
}

// Every group of the window's unit: reduce-scattered (sum) into the scratch chunk, added into the shard.
Status FsdpSync::reduce_unit(Window* w) {
  const Stream s = side_.get();
  const Tensor shard = P_->padded_grad(), window = w->buf.tensor();
  for (const ParamStore::Group& g : P_->groups()) {
    if (g.unit != w->unit) continue;
    const Tensor all = P_->range(window, g.unit_offset, g.unit_offset + g.chunk() * ranks_);
    if (bf16_piece_ > 0) {
      NB_TRY(reduce_group_bf16(all, g.chunk(), P_->range(shard, g.local, g.local + g.chunk())));
      continue;
    }
    const Tensor out = P_->range(reduced_chunk_.tensor(), 0, g.chunk());
    NB_TRY(comm_->reduce_scatter(all, out, s));
    ops::add_inplace(P_->range(shard, g.local, g.local + g.chunk()), out, s);
    reduced_bytes_ += double(all.bytes()) * (ranks_ - 1) / ranks_;
  }
  return Status::ok();
}

Status FsdpSync::grads_final(const std::vector<std::string>& names) {
  // A frozen store (a LoRA base) has no gradients: nothing to reduce.
  if (P_->frozen()) return Status::ok();
  std::set<int> units = units_of(names);
  if (next_pass_follows_)  // the embedding's and head's accumulate until the step's last micro-batch
    std::erase_if(units, [&](int u) { return held_for_step(u); });
  if (units.empty()) return Status::ok();
  mark_.record(nullptr);  // the side stream starts after the backward work queued so far
  mark_.wait_in(side_.get());
  for (int u : units) {
    Window* w = bound(true, u);
    NB_CHECK(w, "internal: gradients of unit %d reported final without a window", u);
    NB_TRY(reduce_unit(w));
    ops::fill(w->buf.tensor(), 0.0f, side_.get());  // ready for its next unit
    w->zeroed = true;
    P_->bind_grad(u, nullptr);
    release(pool_for(true, u), w, side_.get());
  }
  return Status::ok();
}

void FsdpSync::settle() {
  mark_.record(side_.get());
  mark_.wait_in(nullptr);
}

Status FsdpSync::finish_reduce() {
  for (int i = 2; i < 4; ++i)
    for (auto& w : pools_[i].all) NB_CHECK(w->unit < 0, "internal: gradients of unit %d never reported final", w->unit);
  settle();
  return comm_->wait(side_.get());  // the step reads the gradient norm next: never block on a dead peer
}

// optim_grads: each group's chunks all-gathered in place in the whole compute copy.
Status FsdpSync::gather_compute_in_place() {
  const Tensor all = P_->padded_compute();
  for (const ParamStore::Group& g : P_->groups()) {
    const Tensor mine = P_->range(all, g.begin + rank_ * g.chunk(), g.begin + (rank_ + 1) * g.chunk());
    NB_TRY(comm_->all_gather(mine, P_->range(all, g.begin, g.begin + g.chunk() * ranks_), nullptr));
    gathered_bytes_ += double(mine.bytes()) * (ranks_ - 1);
  }
  return comm_->wait(nullptr);
}

Status FsdpSync::weights_updated() {
  if (!P_->compute_sharded()) return gather_compute_in_place();
  for (int i = 0; i < 2; ++i)
    for (auto& w : pools_[i].all)
      if (w->unit >= 0) {
        P_->bind_compute(w->unit, nullptr);
        release_quantized(w->unit);
        release(&pools_[i], w.get(), nullptr);
      }
  amaxes_stale_ = true;  // the next pass quantizes the updated chunks
  prefetched_.clear();
  last_unit_ = -1;
  return Status::ok();
}

Status FsdpSync::gather_state(optim::StateArray a, float* host) {
  settle();
  for (const ParamStore::Group& g : P_->groups()) {
    const int64_t piece_rows = std::clamp<int64_t>(kPieceElems / g.cols, 1, g.rows_per_rank);
    Buffer in, out;
    NB_TRY(Buffer::allocate(&in, DType::f32, dev_, {piece_rows * g.cols}));
    NB_TRY(Buffer::allocate(&out, DType::f32, dev_, {piece_rows * g.cols * ranks_}));
    for (int64_t j = 0; j < g.rows_per_rank; j += piece_rows) {
      const int64_t k = std::min(piece_rows, g.rows_per_rank - j), n = k * g.cols;
      NB_TRY(P_->optimizer_state().read_to_device(a, g.local + j * g.cols, in.data(), n));
      NB_TRY(comm_->all_gather(P_->range(in.tensor(), 0, n), P_->range(out.tensor(), 0, n * ranks_), nullptr));
      NB_TRY(comm_->wait(nullptr));
      if (!host) continue;
      for (int r = 0; r < ranks_; ++r)
        NB_TRY(copy_bytes(host + g.begin + (r * g.rows_per_rank + j) * g.cols, Device::cpu, out.ptr<float>() + r * n,
                          dev_, size_t(n) * 4));
    }
  }
  return Status::ok();
}

size_t FsdpSync::window_bytes() const {
  size_t n = 0;
  for (const Pool* p : {&pools_[0], &pools_[1], &pools_[2], &pools_[3], &qpool_})
    for (const auto& w : p->all) n += size_t(w->capacity) * size_t(dtype_bits(p->dt) / 8);
  return n;
}

}  // namespace nb
