// The AdamW update over an OptimizerState, wherever its parts live. The device part is updated in place;
// the host part is streamed through the GPU in chunks: copy-in of chunk k+1, the update of chunk k and
// the copy-out of chunk k-1 run at once on three queues (copy-in stream, the default stream, copy-out
// stream), through kWindows staging windows of chunk_elems x 3 arrays on the device. Every element goes
// through the same ops::adamw_update kernel as without offload, so the result is bit-identical.
// Order across steps: a step's copy-ins wait for the previous step's copy-outs (one event); the next
// forward runs on the default stream after the update kernels and overlaps the last copy-outs; host reads
// of the state wait for them (OptimizerState::settle).
#pragma once
#include <vector>
#include "core/stream_event.h"
#include "ops/adamw.h"
#include "optim/optimizer_state.h"

namespace nb::optim {

// A stretch of the update: local state elements [begin, end) with their gradient and compute-copy
// views (device tensors of end - begin elements; compute.data == nullptr writes no copy) and the weight
// decay they take.
struct UpdateSegment {
  int64_t begin = 0, end = 0;
  Tensor grad, compute;
  float weight_decay = 0;
};

class AdamWStreamer {
 public:
  static constexpr int kWindows = 3;
  // Staging windows and events when the state has a host part (nothing otherwise).
  Status init(OptimizerState* state);
  // Device bytes of the staging windows for a chunk length (the memory estimate counts them).
  static size_t staging_bytes(int64_t chunk_elems) { return size_t(kWindows) * 3 * size_t(chunk_elems) * 4; }
  // Queues the update of every segment (sorted by begin, disjoint); p.weight_decay is taken per segment.
  Status update(const std::vector<UpdateSegment>& segs, ops::AdamWParams p);

 private:
  struct Window {
    Buffer stage;  // master, m, v of one chunk, back to back
    StreamEvent in_done, updated, out_done;
  };
  void update_range(const std::vector<UpdateSegment>& segs, int64_t begin, int64_t end, const Tensor* base,
                    int64_t base_at, ops::AdamWParams p) const;
  Tensor window_array(const Window& w, int a, int64_t n) const;
  OptimizerState* state_ = nullptr;
  std::vector<Window> windows_;
  StreamEvent last_out_;  // the previous update's final copy-out
};

}  // namespace nb::optim
