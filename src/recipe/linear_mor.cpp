// Mixture of Representations inside one Linear (recipe.h MorSpec, docs/MOR.md): each quantization of a role adds
// its statistic into the role's cell, and each GEMM reads a role's FP8 copy or its BF16 values (the NVFP4 ladder: its
// NVFP4 copy, its E4M3 copy or its BF16 values) by the role's decision, which the model sets from the cells
// (model/llama_mor.cpp) once per decision interval.
#include <cstring>
#include <vector>
#include "formats/mor/mor.h"
#include "recipe/linear.h"
#include "recipe/linear_device.h"
#include "recipe/linear_internal.h"

namespace nb::recipe {

using namespace detail;

Status Linear::Impl::mor_init(bool dry) {
  if (!recipe.mor.on || all_bf16) return Status::ok();
  if (frozen && (mor_ladder() || recipe.mor.blocks))
    return errorf(
        "linear '%s': a frozen (LoRA) base decides by Mixture of Representations with the E4M3 tensor rule only "
        "(--lora-base-precision mor_fp8); the NVFP4 ladder and the block rule are not built for frozen weights",
        name.c_str());
  for (const RoleSpec* r : {&recipe.input, &recipe.weight, &recipe.grad})
    if (recipe.mor.blocks ? r->fmt != Fmt::mor_block
        : mor_ladder()    ? r->fmt != Fmt::nvfp4 || r->four_over_six
                          : r->fmt != Fmt::fp8_e4m3 && r->fmt != Fmt::fp8_e5m2)
      return errorf(
          "internal: linear '%s': MoR needs per-tensor FP8 roles (the ladder: NVFP4 without 4/6; the block rule: "
          "mor_block), got %s",
          name.c_str(), fmt_name(r->fmt));
  if (recipe.mor.channel_stat && (mor_ladder() || recipe.mor.blocks || recipe.mor.decide_now || frozen))
    return errorf(
        "internal: linear '%s': the per-channel statistic is built for the lagged E4M3 tensor rule of trained weights",
        name.c_str());
  if (mor_ladder() && recipe.mor.decide_now)
    return errorf("internal: linear '%s': the NVFP4 ladder has no --mor-decide-now", name.c_str());
  for (MorRung& r : mor_rung) r = mor_top();  // until the first decision every operand is on the top rung
  (void)dry;  // the cells are allocated on first use, unless a model's board comes first (mor_cells_now)
  return Status::ok();
}

// The ladder's E4M3 rung: each role's per-tensor E4M3 copies, placed as the NVFP4 ones are (the input's row copy and
// the gradient's copies transient, in the same workspace slots right after the NVFP4 pieces; the input's column copy,
// which backward reads, and the weight's owned), sized for the same tokens.
Status Linear::Impl::mor_init_ladder(int64_t tokens_cap, bool dry) {
  const RoleSpec e4m3{Fmt::fp8_e4m3};
  LinearWorkspace* ws = workspace.get();
  NB_TRY(q8[0].init(Role::input, e4m3, tokens_cap, in, dev, ws, false, false, -1, dry, q[0].slot_bytes));
  NB_TRY(q8[1].init(Role::weight, e4m3, out, in, dev, nullptr, false, false, -1, dry));
  NB_TRY(q8[2].init(Role::grad, e4m3, tokens_cap, out, dev, ws, false, false, -1, dry, q[2].slot_bytes));
  return Status::ok();
}

Status Linear::Impl::mor_block_quantize(Role role, const bf16* p, int64_t rows, bool measure, Stream stream) {
  QuantizeArgs qa = args(role);
  if (measure) {  // cells role (its E4M3 statistic) and 3 + role (its blocks per choice), on either device
    mor::StatCell* cells = nullptr;
    NB_TRY(mor_cells_now(&cells));
    qa.mor_stat = cells + int(role);
    qa.mor_blocks = reinterpret_cast<mor::BlockCounts*>(cells + 3 + int(role));
    if (qa.mor_top.threshold > 0) qa.mor_nvfp4 = cells + 6 + int(role);  // the ladder's NVFP4 statistic
  }
  static const char* const kNames[3] = {"input", "weight", "grad"};
  return q[int(role)].quantize(p, rows, qa, stream).context("linear '" + name + "' " + kNames[int(role)]);
}

Status Linear::Impl::mor_ladder_quantize(Role role, const bf16* p, int64_t rows, bool measure, Stream stream) {
  const int r = int(role);
  if (role != Role::weight) {  // the RHT cancels in dY^T X only when both Wgrad operands take it
    const bool pair_nvfp4 = mor_rung[0] == MorRung::nvfp4 && mor_rung[2] == MorRung::nvfp4;
    q[r].spec.rht = (role == Role::input ? recipe.input.rht : recipe.grad.rht) && pair_nvfp4;
  }
  NB_TRY(quantize_copies(q[r], role, p, rows, -1, stream, nullptr));
  const bool e4m3 = mor_rung[r] == MorRung::fp8;  // its E4M3 copy, with the statistic when measured
  if (e4m3) NB_TRY(quantize_copies(q8[r], role, p, rows, measure ? r : -1, stream, nullptr));
  return measure ? mor_ladder_measure(r, p, rows, e4m3, stream) : Status::ok();
}

// An E4M3 statistic without a copy reads the NVFP4 row copy's amax: max |x|, the E4M3 quantizer's amax too.
Status Linear::Impl::mor_ladder_measure(int r, const bf16* p, int64_t rows, bool e4m3_measured, Stream stream) {
  const QCopies& c = q[r];
  const float* amax = c.state_f.ptr<float>() + kRowAmax;
  const uint8_t *data = c.ptr(c.row_data), *scales = c.ptr(c.row_scales);
  mor::StatCell own_nvfp4, own_e4m3;
  mor::StatCell *nvfp4_cell = nullptr, *e4m3_cell = nullptr;
  NB_TRY(mor_stat_target(3 + r, &own_nvfp4, &nvfp4_cell));
  if (!e4m3_measured) NB_TRY(mor_stat_target(r, &own_e4m3, &e4m3_cell));
  if (dev == Device::cuda) {
    NB_TRY(mor::add_nvfp4_stat_cuda(p, rows, c.cols, data, scales, amax, nvfp4_cell, e4m3_cell, stream));
  } else {
    mor::add_nvfp4_stat_host(p, rows, c.cols, data, scales, *amax, nvfp4_cell);
    if (e4m3_cell) mor::add_fp8_stat_from_amax_host(p, rows * c.cols, *amax, fp8::Format::e4m3, e4m3_cell);
  }
  NB_TRY(mor_took_stat(3 + r, own_nvfp4, stream));
  return e4m3_measured ? Status::ok() : mor_took_stat(r, own_e4m3, stream);
}

// Straight into the cell on either device (the CPU's cells are host memory): no decide-now path, since this cell
// decides nothing.
Status Linear::Impl::mor_channel_measure(Role role, const bf16* p, int64_t rows, Stream stream) {
  const QCopies& c = q[int(role)];
  const fp8::Format fmt = c.spec.fmt == Fmt::fp8_e5m2 ? fp8::Format::e5m2 : fp8::Format::e4m3;
  mor::StatCell* cells = nullptr;
  NB_TRY(mor_cells_now(&cells));
  mor::StatCell* cell = cells + 3 + int(role);
  if (dev == Device::cuda) return mor::add_fp8_rowwise_stat_cuda(p, rows, c.cols, fmt, cell, stream);
  mor::add_fp8_rowwise_stat_host(p, rows, c.cols, fmt, cell);
  return Status::ok();
}

namespace {
// A Linear's `n` cells zeroed (device memory on cuda, queued on `stream`).
Status zero_cells(mor::StatCell* cells, int n, Device dev, Stream stream) {
  if (dev == Device::cuda) return memset_cuda(cells, 0, size_t(n) * sizeof(mor::StatCell), stream);
  std::memset(static_cast<void*>(cells), 0, size_t(n) * sizeof(mor::StatCell));
  return Status::ok();
}
}  // namespace

// This Linear's cells: a model's board (set_mor_cells), else its own, allocated and zeroed the first time.
Status Linear::Impl::mor_cells_now(mor::StatCell** out) {
  if (!mor_cells) {
    NB_TRY(Buffer::allocate(&mor_own_cells, DType::u8, dev, {int64_t(size_t(mor_cell_count()) * sizeof(mor::StatCell))})
               .context("linear '" + name + "' MoR statistics"));
    mor_cells = static_cast<mor::StatCell*>(mor_own_cells.data());
    NB_TRY(zero_cells(mor_cells, mor_cell_count(), dev, nullptr));
  }
  *out = mor_cells;
  return Status::ok();
}

Status Linear::Impl::mor_stat_target(int cell, mor::StatCell* own, mor::StatCell** target) {
  mor::StatCell* cells = nullptr;
  NB_TRY(mor_cells_now(&cells));
  *target = dev == Device::cuda ? cells + cell : own;
  return Status::ok();
}

// Without lag (--mor-decide-now, E4M3 recipe) the GPU's cell was zeroed before this quantization added into it
// (mor_cell_before_quantize), so it holds this quantization's statistic alone: read back, the stream waits for it.
Status Linear::Impl::mor_took_stat(int cell_index, const mor::StatCell& own, Stream stream) {
  mor::StatCell mine = own;
  if (dev == Device::cuda) {  // the quantizer (or the NVFP4 statistic's pass) added into the cell itself
    if (!recipe.mor.decide_now) return Status::ok();
    NB_TRY(copy_to_host_cuda(&mine, mor_cells + cell_index, sizeof mine, stream));
  } else {
    mor::StatCell* cell = mor_cells + cell_index;
    cell->err_fixed += own.err_fixed;
    cell->nonzero += own.nonzero;
    cell->nonfinite += own.nonfinite;
    if (!recipe.mor.decide_now) return Status::ok();
  }
  // Lag 0: this quantization's statistic decides its own role's GEMMs.
  const bool fp8 = mor::decide_from_stat(mor::stat_of(mine), recipe.mor.threshold).choice == mor::Choice::fp8_e4m3;
  mor_rung[cell_index] = fp8 ? MorRung::fp8 : MorRung::bf16;
  return Status::ok();
}

// On the GPU without lag, a cell holds one quantization's statistic at a time (the trainer reads no board then).
Status Linear::Impl::mor_cell_before_quantize(mor::StatCell* cell, Stream stream) {
  if (dev != Device::cuda || !recipe.mor.decide_now) return Status::ok();
  return memset_cuda(cell, 0, sizeof(mor::StatCell), stream);
}

// freeze_weight of a MoR Linear: the FP8 copy was just made (unmeasured); its statistic, taken now into a cell of
// its own, decides the weight once (a frozen weight never changes, so this is every step's decision, with no lag);
// a weight kept BF16 keeps its values here.
Status Linear::Impl::mor_freeze(const Tensor& w, Stream stream) {
  const QCopies& c = q[int(Role::weight)];
  const int64_t n = c.rows * c.cols;
  const auto* codes = c.ptr(c.row_data);
  const float* scale_inv = c.state_f.ptr<float>() + kScaleInv;
  const fp8::Format fmt = c.spec.fmt == Fmt::fp8_e5m2 ? fp8::Format::e5m2 : fp8::Format::e4m3;
  mor::StatCell cell;
  NB_TRY(Buffer::allocate(&mor_frozen_cell, DType::u8, dev, {int64_t(sizeof cell)}));
  if (dev == Device::cuda) {
    NB_TRY(memset_cuda(mor_frozen_cell.data(), 0, sizeof cell, stream));
    NB_TRY(mor::add_fp8_stat_cuda(w.ptr<bf16>(), codes, scale_inv, n, fmt,
                                  static_cast<mor::StatCell*>(mor_frozen_cell.data()), stream));
    NB_TRY(copy_to_host_cuda(&cell, mor_frozen_cell.data(), sizeof cell, stream));
  } else {
    mor::add_fp8_stat_host(host_bf16.data(), codes, *scale_inv, n, fmt, &cell);  // quantize's BF16 of w
    std::memcpy(mor_frozen_cell.data(), static_cast<const void*>(&cell), sizeof cell);
  }
  const bool fp8 = mor::decide_from_stat(mor::stat_of(cell), recipe.mor.threshold).choice == mor::Choice::fp8_e4m3;
  mor_rung[int(Role::weight)] = fp8 ? MorRung::fp8 : MorRung::bf16;
  if (fp8) return Status::ok();
  NB_TRY(Buffer::allocate(&mor_frozen_w, w.dtype, dev, {w.shape[0], w.shape[1]})
             .context("linear '" + name + "' BF16 weight"));
  return copy_bytes(mor_frozen_w.data(), dev, w.data, dev, size_t(w.numel()) * dtype_bytes(w.dtype, 1));
}

Status Linear::Impl::mor_frozen_weight_stat(Stream stream) {
  if (!frozen || !recipe.mor.on || mor_paused || mor_frozen_set || !mor_frozen_cell.data()) return Status::ok();
  mor::StatCell* cells = nullptr;
  NB_TRY(mor_cells_now(&cells));
  mor_frozen_set = true;
  if (dev == Device::cuda)
    return copy_device_to_device_cuda(cells + int(Role::weight), mor_frozen_cell.data(), sizeof(mor::StatCell), stream);
  std::memcpy(static_cast<void*>(cells + int(Role::weight)), mor_frozen_cell.data(), sizeof(mor::StatCell));
  return Status::ok();
}

Status Linear::Impl::mor_operand(Role role, const Tensor& t_given, bool k_major, gemm::QOperand* op) {
  if (!recipe.mor.on || mor_rung[int(role)] == mor_top()) return Status::ok();
  const Tensor& t = role == Role::weight && mor_frozen_w.data() ? mor_frozen_w.tensor() : t_given;
  if (mor_rung[int(role)] == MorRung::fp8) {  // the ladder's E4M3 rung
    const QCopies& c = q8[int(role)];
    *op = k_major ? c.row_operand() : c.col_operand();
    return Status::ok();
  }
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

int Linear::mor_cell_count() const { return mor() ? impl_->mor_cell_count() : 0; }

Status Linear::mor_stats(mor::ErrorStat* out) const {
  if (!mor()) return errorf("Linear::mor_stats: this Linear does not decide by MoR");
  const int n = impl_->mor_cell_count();
  std::vector<mor::StatCell> cells(static_cast<size_t>(n));
  if (!impl_->mor_cells) {  // nothing quantized yet
    for (int i = 0; i < n; ++i) out[i] = mor::ErrorStat{};
    return Status::ok();
  }
  const size_t bytes = cells.size() * sizeof(mor::StatCell);
  if (impl_->dev == Device::cuda)
    NB_TRY(copy_to_host_cuda(cells.data(), impl_->mor_cells, bytes, nullptr));
  else
    std::memcpy(static_cast<void*>(cells.data()), impl_->mor_cells, bytes);
  for (int i = 0; i < n; ++i) out[i] = mor::stat_of(cells[size_t(i)]);
  return Status::ok();
}

Status Linear::clear_mor_stats(Stream stream) {
  if (!mor()) return errorf("Linear::clear_mor_stats: this Linear does not decide by MoR");
  return impl_->mor_cells ? zero_cells(impl_->mor_cells, impl_->mor_cell_count(), impl_->dev, stream) : Status::ok();
}

Status Linear::set_mor_rung(int role, MorRung rung) {
  if (!mor()) return errorf("Linear::set_mor_rung: this Linear does not decide by MoR");
  if (role < 0 || role > 2)
    return errorf("Linear::set_mor_rung: role %d is not 0 (input), 1 (weight) or 2 (grad)", role);
  if (rung == MorRung::nvfp4 && !impl_->mor_ladder())
    return errorf("Linear::set_mor_rung: linear '%s' has no NVFP4 rung (its recipe is %s)", impl_->name.c_str(),
                  impl_->recipe.name.c_str());
  impl_->mor_rung[role] = rung;
  return Status::ok();
}

MorRung Linear::mor_rung(int role) const {
  return mor() && role >= 0 && role < 3 ? impl_->mor_rung[role] : MorRung::bf16;
}

Status Linear::set_mor_fp8(int role, bool fp8) { return set_mor_rung(role, fp8 ? MorRung::fp8 : MorRung::bf16); }

void Linear::pause_mor_stats(bool paused) {
  if (impl_) impl_->mor_paused = paused;
}

bool Linear::mor_stats_paused() const { return impl_ && impl_->mor_paused; }

bool Linear::mor_fp8(int role) const { return mor_rung(role) == MorRung::fp8; }

}  // namespace nb::recipe
