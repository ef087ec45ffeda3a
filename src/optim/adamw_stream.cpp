// AdamWStreamer (see adamw_stream.h): the resident part in place, the host part chunk by chunk through
// the staging windows.
#include "optim/adamw_stream.h"
#include <algorithm>
#include "core/dtype.h"

namespace nb::optim {
namespace {
Tensor sub(const Tensor& t, int64_t at, int64_t n) {
  if (!t.data) return Tensor{};
  return Tensor::make(static_cast<uint8_t*>(t.data) + dtype_bytes(t.dtype, at), t.dtype, t.device, {n});
}
}  // namespace

Status AdamWStreamer::init(OptimizerState* state) {
  state_ = state;
  windows_.clear();
  if (!state->offloaded()) return Status::ok();
  windows_.resize(kWindows);
  for (Window& w : windows_) {
    NB_TRY(Buffer::allocate(&w.stage, DType::f32, state->device(), {3 * state->chunk_elems()}));
    NB_TRY(w.in_done.create(state->device()));
    NB_TRY(w.updated.create(state->device()));
    NB_TRY(w.out_done.create(state->device()));
  }
  return last_out_.create(state->device());
}

Tensor AdamWStreamer::window_array(const Window& w, int a, int64_t n) const {
  return sub(w.stage.tensor(), int64_t(a) * state_->chunk_elems(), n);
}

// The segments' parts inside [begin, end), with master, m and v read from base[0..2], whose element 0
// is local element base_at.
void AdamWStreamer::update_range(const std::vector<UpdateSegment>& segs, int64_t begin, int64_t end, const Tensor* base,
                                 int64_t base_at, ops::AdamWParams p) const {
  auto it =
      std::upper_bound(segs.begin(), segs.end(), begin, [](int64_t x, const UpdateSegment& s) { return x < s.end; });
  for (; it != segs.end() && it->begin < end; ++it) {
    const int64_t a = std::max(begin, it->begin), b = std::min(end, it->end), n = b - a;
    if (n <= 0) continue;
    p.weight_decay = it->weight_decay;
    ops::adamw_update(sub(base[0], a - base_at, n), sub(it->grad, a - it->begin, n), sub(base[1], a - base_at, n),
                      sub(base[2], a - base_at, n), sub(it->compute, a - it->begin, n), p, nullptr);
  }
}

Status AdamWStreamer::update(const std::vector<UpdateSegment>& segs, ops::AdamWParams p) {
  OptimizerState& S = *state_;
  const int64_t resident = S.resident(), len = S.len(), chunk = S.chunk_elems();
  if (resident > 0) {
    const Tensor base[3] = {S.device_part(StateArray::master), S.device_part(StateArray::m),
                            S.device_part(StateArray::v)};
    update_range(segs, 0, resident, base, 0, p);
  }
  if (!S.offloaded()) return Status::ok();
  S.note_host_written();
  const Stream in = S.copy_in_stream(), out = S.copy_out_stream();
  const Device dev = S.device();
  last_out_.wait_in(in);  // the previous step's copy-outs have landed in the host arrays
  for (int64_t k = 0, at = resident; at < len; ++k, at += chunk) {
    Window& w = windows_[size_t(k % kWindows)];
    const int64_t n = std::min(chunk, len - at);
    w.out_done.wait_in(in);  // this window's previous chunk has left
    for (int a = 0; a < 3; ++a)
      NB_TRY(copy_bytes_async(window_array(w, a, n).data, dev, S.host_array(kStateArrays[a]) + at, Device::cpu,
                              size_t(n) * 4, in));
    w.in_done.record(in);
    w.in_done.wait_in(nullptr);
    const Tensor base[3] = {window_array(w, 0, n), window_array(w, 1, n), window_array(w, 2, n)};
    update_range(segs, at, at + n, base, at, p);
    w.updated.record(nullptr);
    w.updated.wait_in(out);
    for (int a = 0; a < 3; ++a)
      NB_TRY(copy_bytes_async(S.host_array(kStateArrays[a]) + at, Device::cpu, window_array(w, a, n).data, dev,
                              size_t(n) * 4, out));
    w.out_done.record(out);
  }
  last_out_.record(out);
  return Status::ok();
}

}  // namespace nb::optim
