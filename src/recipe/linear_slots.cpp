// Linear's input slots (linear.h, set_input_slots): under pipeline parallelism without full recompute several
// micro-batches are between their forward and their backward at once, and each backward's Wgrad reads the input
// column copy its own forward made. Each slot keeps that copy's pieces and the input role's state floats (its
// scale_inv or amaxes); the slot in use sits in q[input], so the quantize and GEMM code paths are unchanged. The
// state's integers (the non-finite flag and count) stay shared: take_health reads them once for all slots.
#include <algorithm>
#include <utility>
#include "recipe/linear.h"
#include "recipe/linear_device.h"
#include "recipe/linear_internal.h"

namespace nb::recipe {

using namespace detail;

namespace {

// A fresh buffer shaped as `like` (an empty one stays empty), its bytes copied from `like` (the state's initial
// scale of 1 and zero amaxes; pieces are overwritten by the slot's first quantize).
Status clone_buffer(const Buffer& like, Device dev, Buffer* out) {
  if (like.data() == nullptr) return Status::ok();
  const Tensor& t = like.tensor();
  NB_TRY(Buffer::allocate(out, t.dtype, dev, {t.numel()}));
  return copy_bytes(out->data(), dev, like.data(), dev, size_t(t.bytes()));
}

// A column copy the Linear holds itself (not the row copy read transposed, not a transient or borrowed piece).
bool owns_column_copy(const QCopies& c) {
  return !c.col_is_row && !c.row_only && !c.col_data.transient && !c.col_data.external;
}

}  // namespace

size_t input_slot_allocated_bytes(const QCopies& input) {
  return input.col_allocated_bytes + align256(kStateFloats * sizeof(float));
}

size_t Linear::Impl::slot_bytes() const {
  return input_slot_allocated_bytes(q[int(Role::input)]) +
         (mor_ladder() ? input_slot_allocated_bytes(q8[int(Role::input)]) : 0);
}

void Linear::Impl::swap_input_slot(InputSlot* slot) {
  QCopies& c = q[int(Role::input)];
  std::swap(c.col_data.owned, slot->col_data);
  std::swap(c.col_scales.owned, slot->col_scales);
  std::swap(c.state_f, slot->state_f);
  std::swap(c.rows, slot->rows);
  std::swap(have_input, slot->have_input);
  if (!mor_ladder()) return;
  QCopies& e = q8[int(Role::input)];
  std::swap(e.col_data.owned, slot->e4m3_col_data);
  std::swap(e.col_scales.owned, slot->e4m3_col_scales);
  std::swap(e.state_f, slot->e4m3_state_f);
  std::swap(e.rows, slot->e4m3_rows);
}

Status Linear::set_input_slots(int n) {
  if (!impl_) return errorf("Linear::set_input_slots before a successful init");
  Impl& s = *impl_;
  if (n < 1) return errorf("linear '%s': %d input slots; at least 1", s.name.c_str(), n);
  if (s.all_bf16) return Status::ok();
  const QCopies& in = s.q[int(Role::input)];
  const char* why = s.frozen                                        ? "it is frozen and keeps no input copy"
                    : s.input_col_slot >= 0                         ? "its input copy lives in a shared workspace slot"
                    : in.col_is_row || in.row_only                  ? "its input has no column copy of its own"
                    : in.col_data.transient || in.col_data.external ? "its input column copy is not its own"
                    : s.recipe.fp8_scaling == Fp8Scaling::delayed   ? "FP8 delayed scaling keeps one history per role"
                    : s.mor_ladder() && !owns_column_copy(s.q8[int(Role::input)])
                        ? "its E4M3 rung's input column copy is not its own"
                    : s.collect_stats ? "quantization statistics keep one micro-batch's input"
                                      : nullptr;
  if (why) return errorf("linear '%s' cannot keep several micro-batches' inputs: %s", s.name.c_str(), why);
  if (!s.input_slots.empty()) return errorf("linear '%s': set_input_slots was called already", s.name.c_str());
  s.input_slots.resize(size_t(n));
  for (int i = 1; i < n; ++i) {
    Impl::InputSlot& slot = s.input_slots[size_t(i)];
    NB_TRY(clone_buffer(in.col_data.owned, s.dev, &slot.col_data));
    NB_TRY(clone_buffer(in.col_scales.owned, s.dev, &slot.col_scales));
    NB_TRY(clone_buffer(in.state_f, s.dev, &slot.state_f));
    if (!s.mor_ladder()) continue;
    const QCopies& e = s.q8[int(Role::input)];
    NB_TRY(clone_buffer(e.col_data.owned, s.dev, &slot.e4m3_col_data));
    NB_TRY(clone_buffer(e.col_scales.owned, s.dev, &slot.e4m3_col_scales));
    NB_TRY(clone_buffer(e.state_f, s.dev, &slot.e4m3_state_f));
  }
  s.active_input_slot = 0;
  return Status::ok();
}

Status Linear::use_input_slot(int i) {
  if (!impl_) return errorf("Linear::use_input_slot before a successful init");
  Impl& s = *impl_;
  if (s.all_bf16) return Status::ok();
  if (i < 0 || i >= int(std::max<size_t>(s.input_slots.size(), 1)))
    return errorf("internal: linear '%s' has %zu input slots; slot %d asked for", s.name.c_str(), s.input_slots.size(),
                  i);
  if (i == s.active_input_slot) return Status::ok();
  if (s.collect_stats)
    return errorf("linear '%s': quantization statistics keep one micro-batch's input; not with input slots",
                  s.name.c_str());
  s.swap_input_slot(&s.input_slots[size_t(s.active_input_slot)]);  // the slot in use goes back to its entry
  s.swap_input_slot(&s.input_slots[size_t(i)]);                    // and slot i comes in
  s.active_input_slot = i;
  return Status::ok();
}

}  // namespace nb::recipe
