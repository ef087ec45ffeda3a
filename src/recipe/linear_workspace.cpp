// LinearWorkspace (linear_workspace.h): the transient slots shared by a model's Linears.
#include "recipe/linear_workspace.h"

#include <algorithm>

namespace nb::recipe {

static const char* slot_name(LinearWorkspace::Slot s) {
  switch (s) {
    case LinearWorkspace::Slot::input_row: return "input-row";
    case LinearWorkspace::Slot::grad: return "grad";
    case LinearWorkspace::Slot::weight_col: return "weight-column";
    default: return "shared input-column";
  }
}

void LinearWorkspace::reserve(Slot slot, size_t bytes) { need_[int(slot)] = std::max(need_[int(slot)], bytes); }

size_t LinearWorkspace::bytes() const {
  size_t n = 0;
  for (size_t a : allocated_) n += a;
  return n;
}

size_t LinearWorkspace::planned_bytes() const {
  size_t n = 0;
  for (size_t need : need_) n += need > 0 ? (need + 255) / 256 * 256 : 0;
  return n;
}

Status LinearWorkspace::grow(Slot slot, size_t bytes) {
  const int i = int(slot);
  if (bytes <= allocated_[i]) return Status::ok();
  // Kernels queued before this call may still read the old buffer: wait for them before freeing it.
  if (dev_ == Device::cuda && allocated_[i] > 0) device_synchronize();
  slots_[i].reset();
  allocated_[i] = 0;
  Status st = Buffer::allocate(&slots_[i], DType::u8, dev_, {int64_t(bytes)});
  if (!st)
    return errorf(
        "linear workspace: cannot allocate the %s slot of %zu bytes on %s (%s); lower the micro-batch "
        "tokens or use a recipe with smaller quantized copies",
        slot_name(slot), bytes, device_name(dev_), st.message().c_str());
  allocated_[i] = bytes;
  return Status::ok();
}

Status LinearWorkspace::allocate() {
  for (int i = 0; i < kSlots; ++i) NB_TRY(grow(Slot(i), need_[i]));
  return Status::ok();
}

Status LinearWorkspace::acquire(Slot slot, size_t bytes, uint8_t** out) {
  reserve(slot, bytes);
  NB_TRY(grow(slot, need_[int(slot)]));
  *out = data(slot);
  return Status::ok();
}

}  // namespace nb::recipe
