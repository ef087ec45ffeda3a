// LinearWorkspace: one buffer, shared by the Linears of a model, for the quantized copies that live
// only inside one call of one Linear (see linear.h for the schedule):
//   input_row slot  the input role's row-wise copy (data + scales): written and read by forward()'s
//                   Fprop GEMM, dead after it (backward's Wgrad reads the column-wise copy, which the
//                   Linear owns, as it owns both weight copies, reused by every micro-batch of a step)
//   grad slot       the grad role's row-wise and column-wise copies (data + scales): quantized at the
//                   start of backward(), read by its Dgrad and Wgrad GEMMs, dead after them
//   weight_col slot a per-tensor FP8 weight's column-wise copy (the row copy's codes transposed), for a
//                   frozen or a sharded weight: written at the start of backward()'s Dgrad, read by it,
//                   dead after it (such Linears keep only the row copy; linear.h). Empty unless some
//                   Linear needs it.
//   input_col0..3   with full activation recompute, the input's column-wise copy of the i-th Linear of
//                   every layer (linear.h, Linear::init's input_col_slot): the recomputed forward writes it
//                   right before the layer's backward reads it, so one per Linear of a layer suffices.
//   gather          sequence parallelism's quantized input gather (linear.h, set_input_gather): this rank's
//                   quantized chunk of tokens and the gathered chunks of every rank, dead once assembled.
// A model's Linears run one after another on one stream, so each slot needs the largest of the Linears'
// needs, not their sum. Each Linear registers its needs at init (reserve); allocate() then allocates every
// slot once. A Linear that quantizes before allocate(), or needs more than was allocated, makes the
// slot grow then (acquire): on cuda after synchronizing the device, because kernels queued earlier may
// still read the old buffer. So a Linear alone works without anyone calling allocate().
// Memory: plain bytes on the workspace's device (cudaMalloc-aligned); the Linear lays out its pieces in a
// slot at 256-byte-aligned offsets (linear_internal.h). Contents are valid only until another Linear
// sharing the workspace quantizes into the same slot. Not thread-safe: one stream, one caller at a time.
#pragma once
#include <cstddef>
#include <cstdint>
#include "core/status.h"
#include "core/tensor.h"

namespace nb::recipe {

class LinearWorkspace {
 public:
  enum class Slot : int { input_row = 0, grad = 1, weight_col = 2, input_col0 = 3, gather = 7 };
  static constexpr int kInputColSlots = 4;
  static constexpr int kSlots = 4 + kInputColSlots;
  static_assert(int(Slot::gather) == int(Slot::input_col0) + kInputColSlots);

  explicit LinearWorkspace(Device dev) : dev_(dev) {}
  LinearWorkspace(const LinearWorkspace&) = delete;
  LinearWorkspace& operator=(const LinearWorkspace&) = delete;

  Device device() const { return dev_; }
  // Registers that some Linear needs `bytes` in `slot`; the workspace keeps the largest need per slot.
  void reserve(Slot slot, size_t bytes);
  size_t need(Slot slot) const { return need_[int(slot)]; }
  // Allocates (or grows) every slot to its need; call once after every Linear's init.
  Status allocate();
  // Bytes allocated now, all slots (host bytes on the cpu backend).
  size_t bytes() const;
  // Bytes allocate() would hold for the needs registered so far (each slot a 256-byte multiple, as the
  // allocator holds it): the memory estimate's figure for the workspace.
  size_t planned_bytes() const;
  // Makes `slot` at least `bytes` long (registering the need, growing if needed) and returns its memory.
  // The pointer stays valid until the next call that grows this slot.
  Status acquire(Slot slot, size_t bytes, uint8_t** out);
  // The slot's current memory (nullptr before it was allocated).
  uint8_t* data(Slot slot) const { return static_cast<uint8_t*>(slots_[int(slot)].data()); }

 private:
  Status grow(Slot slot, size_t bytes);

  Device dev_;
  size_t need_[kSlots] = {};
  size_t allocated_[kSlots] = {};
  Buffer slots_[kSlots];
};

}  // namespace nb::recipe
