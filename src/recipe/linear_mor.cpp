// Mixture of Representations inside one Linear (recipe.h MorSpec, docs/MOR.md): each quantization of a role adds
// its statistic into the role's cell, and each GEMM reads a role's FP8 copy or its BF16 values by the role's
// decision, which the model sets from the cells (model/llama_mor.cpp) once per decision interval.
#include <cstring>
#include "formats/mor/mor.h"
#include "recipe/linear.h"
#include "recipe/linear_device.h"
#include "recipe/linear_internal.h"

namespace nb::recipe {

using namespace detail;

Status Linear::Impl::mor_init(bool dry) {
  if (!recipe.mor.on || all_bf16) return Status::ok();
  if (frozen)
    return errorf(
        "linear '%s': recipe '%s' decides each operand's format by Mixture of Representations, which a frozen "
        "(LoRA) base does not support yet; use another recipe for the base",
        name.c_str(), recipe.name.c_str());
  for (const RoleSpec* r : {&recipe.input, &recipe.weight, &recipe.grad})
    if (r->fmt != Fmt::fp8_e4m3 && r->fmt != Fmt::fp8_e5m2)
      return errorf("internal: linear '%s': MoR needs per-tensor FP8 roles, got %s", name.c_str(), fmt_name(r->fmt));
  if (recipe.mor.decide_now && dev != Device::cpu)
    return errorf(
        "linear '%s': --mor-decide-now decides each quantization on the host from its own statistic, which only the "
        "CPU reference does (a GPU would wait for every quantization); drop it or run with --device cpu",
        name.c_str());
  (void)dry;  // the cells are allocated on first use, unless a model's board comes first (mor_cells_now)
  return Status::ok();
}

namespace {
// A Linear's three cells zeroed (device memory on cuda, queued on `stream`).
Status zero_cells(mor::StatCell* cells, Device dev, Stream stream) {
  if (dev == Device::cuda) return memset_cuda(cells, 0, 3 * sizeof(mor::StatCell), stream);
  std::memset(static_cast<void*>(cells), 0, 3 * sizeof(mor::StatCell));
  return Status::ok();
}
}  // namespace

// This Linear's cells: a model's board (set_mor_cells), else its own, allocated and zeroed the first time.
Status Linear::Impl::mor_cells_now(mor::StatCell** out) {
  if (!mor_cells) {
    NB_TRY(Buffer::allocate(&mor_own_cells, DType::u8, dev, {int64_t(3 * sizeof(mor::StatCell))})
               .context("linear '" + name + "' MoR statistics"));
    mor_cells = static_cast<mor::StatCell*>(mor_own_cells.data());
    NB_TRY(zero_cells(mor_cells, dev, nullptr));
  }
  *out = mor_cells;
  return Status::ok();
}

Status Linear::Impl::mor_stat_target(Role role, mor::StatCell* own, mor::StatCell** target) {
  mor::StatCell* cells = nullptr;
  NB_TRY(mor_cells_now(&cells));
  *target = dev == Device::cuda ? cells + int(role) : own;
  return Status::ok();
}

void Linear::Impl::mor_took_stat(Role role, const mor::StatCell& own) {
  if (dev == Device::cuda) return;  // the quantizer added into the cell itself
  mor::StatCell* cell = mor_cells + int(role);
  cell->err_fixed += own.err_fixed;
  cell->nonzero += own.nonzero;
  cell->nonfinite += own.nonfinite;
  if (recipe.mor.decide_now)  // the CPU reference without lag: this quantization's own statistic decides it
    mor_fp8[int(role)] = mor::decide_from_stat(mor::stat_of(own), recipe.mor.threshold).choice == mor::Choice::fp8_e4m3;
}

Status Linear::Impl::mor_operand(Role role, const Tensor& t, bool k_major, gemm::QOperand* op) {
  if (!recipe.mor.on || mor_fp8[int(role)]) return Status::ok();
  if (t.data == nullptr || t.ndim != 2)
    return errorf("linear '%s': its %s is BF16 by MoR, but the GEMM was not given the tensor", name.c_str(),
                  role == Role::input    ? "input"
                  : role == Role::weight ? "weight"
                                         : "gradient");
  gemm::QOperand b;
  b.format = gemm::QFormat::bf16;
  b.rows = k_major ? t.shape[0] : t.shape[1];
  b.k = k_major ? t.shape[1] : t.shape[0];
  b.k_major = k_major;
  if (dev == Device::cuda) {
    b.data = t.data;
  } else {  // the CPU's f32 tensor as the BF16 values the GPU would read
    std::vector<bf16>& v = mor_bf16[int(role)];
    v.resize(size_t(t.numel()));
    const float* f = t.ptr<float>();
    for (int64_t i = 0; i < t.numel(); ++i) v[size_t(i)] = f32_to_bf16(f[i]);
    b.data = v.data();
  }
  *op = b;
  return Status::ok();
}

bool Linear::mor() const { return impl_ && impl_->recipe.mor.on && !impl_->all_bf16; }

Status Linear::set_mor_cells(mor::StatCell* cells) {
  if (!mor()) return errorf("Linear::set_mor_cells: this Linear does not decide by MoR");
  impl_->mor_cells = cells ? cells : static_cast<mor::StatCell*>(impl_->mor_own_cells.data());  // null: own, lazily
  return Status::ok();
}

Status Linear::mor_stats(mor::ErrorStat out[3]) const {
  if (!mor()) return errorf("Linear::mor_stats: this Linear does not decide by MoR");
  mor::StatCell cells[3];
  if (!impl_->mor_cells) {  // nothing quantized yet
    for (int i = 0; i < 3; ++i) out[i] = mor::ErrorStat{};
    return Status::ok();
  }
  if (impl_->dev == Device::cuda)
    NB_TRY(copy_to_host_cuda(cells, impl_->mor_cells, sizeof cells, nullptr));
  else
    std::memcpy(static_cast<void*>(cells), impl_->mor_cells, sizeof cells);
  for (int i = 0; i < 3; ++i) out[i] = mor::stat_of(cells[i]);
  return Status::ok();
}

Status Linear::clear_mor_stats(Stream stream) {
  if (!mor()) return errorf("Linear::clear_mor_stats: this Linear does not decide by MoR");
  return impl_->mor_cells ? zero_cells(impl_->mor_cells, impl_->dev, stream) : Status::ok();
}

Status Linear::set_mor_fp8(int role, bool fp8) {
  if (!mor()) return errorf("Linear::set_mor_fp8: this Linear does not decide by MoR");
  if (role < 0 || role > 2)
    return errorf("Linear::set_mor_fp8: role %d is not 0 (input), 1 (weight) or 2 (grad)", role);
  impl_->mor_fp8[role] = fp8;
  return Status::ok();
}

void Linear::pause_mor_stats(bool paused) {
  if (impl_) impl_->mor_paused = paused;
}

bool Linear::mor_fp8(int role) const { return mor() && role >= 0 && role < 3 && impl_->mor_fp8[role]; }

}  // namespace nb::recipe
