// AdamWStreamer (see adamw_stream.h): the resident part in place, the host part chunk by chunk through
// the staging windows.
#include "optim/adamw_stream.h"
#include <algorithm>
#include "core/dtype.h"
#include "core/memory_ledger.h"
#include "ops/elementwise.h"

namespace nb::optim {
namespace {
Tensor sub(const Tensor& t, int64_t at, int64_t n) {
  if (!t.data) return Tensor{};
  return Tensor::make(static_cast<uint8_t*>(t.data) + dtype_bytes(t.dtype, at), t.dtype, t.device, {n});
}
}  // namespace

Status AdamWStreamer::init(OptimizerState* state, bool gated, int64_t tail_begin) {
  state_ = state;
  windows_.clear();
  chunk_done_.clear();
  gated_ = false;
  in_flight_ = false;
  if (!state->offloaded()) return Status::ok();
  windows_.resize(kWindows);
  for (Window& w : windows_) {
    MemoryScope scope(MemPart::optimizer_staging);
    NB_TRY(Buffer::allocate(&w.stage, DType::f32, state->device(), {3 * state->chunk_elems()}));
    NB_TRY(w.in_done.create(state->device()));
    NB_TRY(w.updated.create(state->device()));
    NB_TRY(w.out_done.create(state->device()));
  }
  NB_TRY(last_out_.create(state->device()));
  gated_ = gated;
  tail_chunk_ = std::clamp((tail_begin - state->resident()) / state->chunk_elems(), int64_t(0), chunk_count() - 1);
  if (!gated_) return Status::ok();
  NB_TRY(own_.create(state->device(), /*high_priority=*/true));
  for (StreamEvent* e : {&start_, &resident_done_, &all_done_}) NB_TRY(e->create(state->device()));
  chunk_done_.resize(size_t(chunk_count()));
  for (StreamEvent& e : chunk_done_) NB_TRY(e.create(state->device()));
  return Status::ok();
}

int64_t AdamWStreamer::chunk_count() const {
  return (state_->len() - state_->resident() + state_->chunk_elems() - 1) / state_->chunk_elems();
}

int64_t AdamWStreamer::visit_of(int64_t k) const {
  return k >= tail_chunk_ ? k - tail_chunk_ : chunk_count() - tail_chunk_ + k;
}

Tensor AdamWStreamer::window_array(const Window& w, int a, int64_t n) const {
  return sub(w.stage.tensor(), int64_t(a) * state_->chunk_elems(), n);
}

// The segments' parts inside [begin, end), with master, m and v read from base[0..2], whose element 0
// is local element base_at.
void AdamWStreamer::update_range(const std::vector<UpdateSegment>& segs, int64_t begin, int64_t end, const Tensor* base,
                                 int64_t base_at, ops::AdamWParams p, Stream s) const {
  auto it =
      std::upper_bound(segs.begin(), segs.end(), begin, [](int64_t x, const UpdateSegment& s) { return x < s.end; });
  for (; it != segs.end() && it->begin < end; ++it) {
    const int64_t a = std::max(begin, it->begin), b = std::min(end, it->end), n = b - a;
    if (n <= 0) continue;
    p.weight_decay = it->weight_decay;
    ops::adamw_update(sub(base[0], a - base_at, n), sub(it->grad, a - it->begin, n), sub(base[1], a - base_at, n),
                      sub(base[2], a - base_at, n), sub(it->compute, a - it->begin, n), p, s);
  }
}

// Chunk k of the host part through window k mod kWindows: copy in, update on queue s, copy out.
Status AdamWStreamer::stream_chunk(const std::vector<UpdateSegment>& segs, int64_t k, int64_t visit, ops::AdamWParams p,
                                   Stream s) {
  OptimizerState& S = *state_;
  const Stream in = S.copy_in_stream(), out = S.copy_out_stream();
  const Device dev = S.device();
  Window& w = windows_[size_t(visit % kWindows)];
  const int64_t at = S.resident() + k * S.chunk_elems(), n = std::min(S.chunk_elems(), S.len() - at);
  w.out_done.wait_in(in);  // this window's previous chunk has left
  for (int a = 0; a < 3; ++a)
    NB_TRY(copy_bytes_async(window_array(w, a, n).data, dev, S.host_array(kStateArrays[a]) + at, Device::cpu,
                            size_t(n) * 4, in));
  w.in_done.record(in);
  w.in_done.wait_in(s);
  const Tensor base[3] = {window_array(w, 0, n), window_array(w, 1, n), window_array(w, 2, n)};
  update_range(segs, at, at + n, base, at, p, s);
  w.updated.record(s);
  if (gated_) chunk_done_[size_t(visit)].record(s);
  w.updated.wait_in(out);
  for (int a = 0; a < 3; ++a)
    NB_TRY(copy_bytes_async(S.host_array(kStateArrays[a]) + at, Device::cpu, window_array(w, a, n).data, dev,
                            size_t(n) * 4, out));
  w.out_done.record(out);
  return Status::ok();
}

Status AdamWStreamer::update(const std::vector<UpdateSegment>& segs, ops::AdamWParams p, const Tensor& zero_after) {
  OptimizerState& S = *state_;
  const Stream s = update_stream();
  wait_all();  // a previous update nobody waited for (e.g. a step without a forward since)
  if (gated_) {
    start_.record(nullptr);  // after the gradient norm
    start_.wait_in(s);
  }
  if (S.resident() > 0) {
    const Tensor base[3] = {S.device_part(StateArray::master), S.device_part(StateArray::m),
                            S.device_part(StateArray::v)};
    update_range(segs, 0, S.resident(), base, 0, p, s);
  }
  if (S.offloaded()) {
    if (gated_) resident_done_.record(s);
    S.note_host_written();
    last_out_.wait_in(S.copy_in_stream());  // the previous step's copy-outs have landed in the host arrays
    const int64_t chunks = chunk_count();
    for (int64_t visit = 0; visit < chunks; ++visit)
      NB_TRY(stream_chunk(segs, (tail_chunk_ + visit) % chunks, visit, p, s));
    last_out_.record(S.copy_out_stream());
  }
  if (zero_after.data) ops::fill(zero_after, 0.0f, s);
  if (gated_) {
    all_done_.record(s);
    in_flight_ = true;
    waited_visit_ = -1;
  }
  return Status::ok();
}

void AdamWStreamer::wait_for(int64_t begin, int64_t end) {
  if (!in_flight_ || end <= begin) return;
  const int64_t resident = state_->resident(), chunk = state_->chunk_elems();
  if (end <= resident) {
    if (waited_visit_ < 0) resident_done_.wait_in(nullptr);
    return;
  }
  const int64_t kb = (std::max(begin, resident) - resident) / chunk, ke = (end - 1 - resident) / chunk;
  int64_t last = visit_of(ke);  // chunks are visited in index order from tail_chunk_ on, then from 0
  if (kb < tail_chunk_) last = std::max(last, visit_of(std::min(ke, tail_chunk_ - 1)));
  if (last <= waited_visit_) return;
  chunk_done_[size_t(last)].wait_in(nullptr);
  waited_visit_ = last;
}

void AdamWStreamer::wait_all() {
  if (!in_flight_) return;
  all_done_.wait_in(nullptr);
  in_flight_ = false;
}

}  // namespace nb::optim
