// The AdamW update over an OptimizerState, wherever its parts live. The device part is updated in place;
// the host part is streamed through the GPU in chunks: copy-in of chunk k+1, the update of chunk k and
// the copy-out of chunk k-1 run at once on three queues (copy-in stream, the default stream, copy-out
// stream), through kWindows staging windows of chunk_elems x 3 arrays on the device. Every element goes
// through the same ops::adamw_update kernel as without offload, so the result is bit-identical.
// Order across steps: a step's copy-ins wait for the previous step's copy-outs (one event); host reads
// of the state wait for them (OptimizerState::settle).
// Gated (one rank with a host part): the update kernels run on a queue of their own, one event per
// chunk, and the default stream waits only where told: wait_for(begin, end) before a layer's forward
// reads its weights, wait_all() before anything else touches the state or the gradients. So the next
// step's first forward runs layer by layer behind the stream. The chunks holding the tail of the flat
// space (the 1-D norms, which every layer reads) go first, then the rest in order (embedding, layers).
// Ungated, everything runs on the default stream and the next forward follows the last update kernel.
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
  // Staging windows and events when the state has a host part (nothing otherwise). gated: see above;
  // tail_begin: the chunks holding elements >= tail_begin are streamed first.
  Status init(OptimizerState* state, bool gated = false, int64_t tail_begin = 0);
  // Device bytes of the staging windows for a chunk length (the memory estimate counts them).
  static size_t staging_bytes(int64_t chunk_elems) { return size_t(kWindows) * 3 * size_t(chunk_elems) * 4; }
  // Queues the update of every segment (sorted by begin, disjoint); p.weight_decay is taken per segment.
  // zero_after (optional) is zeroed on the update's queue once the update has read it (the gradients).
  Status update(const std::vector<UpdateSegment>& segs, ops::AdamWParams p, const Tensor& zero_after = Tensor{});
  bool gated() const { return gated_; }
  Stream update_stream() const { return gated_ ? own_.get() : nullptr; }
  // The default stream waits until local elements [begin, end) are updated, or the whole update is
  // done (no-ops when ungated or nothing is in flight).
  void wait_for(int64_t begin, int64_t end);
  void wait_all();

 private:
  struct Window {
    Buffer stage;  // master, m, v of one chunk, back to back
    StreamEvent in_done, updated, out_done;
  };
  void update_range(const std::vector<UpdateSegment>& segs, int64_t begin, int64_t end, const Tensor* base,
                    int64_t base_at, ops::AdamWParams p, Stream s) const;
  Status stream_chunk(const std::vector<UpdateSegment>& segs, int64_t k, int64_t visit, ops::AdamWParams p, Stream s);
  Tensor window_array(const Window& w, int a, int64_t n) const;
  int64_t chunk_count() const;
  int64_t visit_of(int64_t k) const;  // when chunk k is streamed (0 = first)
  OptimizerState* state_ = nullptr;
  std::vector<Window> windows_;
  StreamEvent last_out_;  // the previous update's final copy-out
  // Gating: the update's own queue, its start (after the gradient norm), the resident part, each chunk
  // (indexed by visit), and the end.
  bool gated_ = false, in_flight_ = false;
  int64_t tail_chunk_ = 0;     // the first chunk streamed
  int64_t waited_visit_ = -1;  // the default stream already waits for chunks visited up to here
  SideStream own_;
  StreamEvent start_, resident_done_, all_done_;
  std::vector<StreamEvent> chunk_done_;
};

}  // namespace nb::optim
