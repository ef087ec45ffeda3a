// Linear (linear.h): the quantized copies of X, W and dY of one linear layer and its three GEMMs.
// One code path for both backends: the format quantizers' *_ref (host) or *_cuda (device) functions
// write the same layouts, and gemm::matmul_quantized picks its backend from the output tensor.
#include "recipe/linear.h"

#include <cmath>
#include <vector>
#include "core/bf16.h"
#include "formats/fp8/fp8.h"
#include "formats/fp8/fp8_block.h"
#include "formats/mxfp8/mxfp8.h"
#include "formats/nvfp4/nvfp4.h"
#include "gemm/gemm.h"
#include "gemm/gemm_quantized.h"
#include "recipe/linear_device.h"
#include "recipe/linear_internal.h"

namespace nb::recipe {

using namespace detail;

static gemm::QFormat qformat(Fmt f) {
  switch (f) {
    case Fmt::fp8_e5m2: return gemm::QFormat::fp8_e5m2;
    case Fmt::fp8_block128: return gemm::QFormat::fp8_block128;
    case Fmt::fp8_block128x128: return gemm::QFormat::fp8_block128x128;
    case Fmt::mxfp8: return gemm::QFormat::mxfp8;
    case Fmt::nvfp4: return gemm::QFormat::nvfp4;
    case Fmt::mor_block: return gemm::QFormat::bf16;
    default: return gemm::QFormat::fp8_e4m3;
  }
}

static Status alloc_bytes(Buffer* b, Device dev, int64_t bytes) {
  return Buffer::allocate(b, DType::u8, dev, {bytes > 0 ? bytes : 1});
}

// The bytes of one copy's codes and of its row-wise and column-wise scales, for a [rows, cols] source.
static void piece_bytes(Fmt fmt, int64_t rows, int64_t cols, int64_t* data, int64_t* row_scales, int64_t* col_scales) {
  const int64_t n = rows * cols;
  *data = fmt == Fmt::nvfp4 ? n / 2 : fmt == Fmt::mor_block ? 2 * n : n;
  *row_scales = *col_scales = 0;
  if (fmt == Fmt::fp8_block128 || fmt == Fmt::fp8_block128x128) {
    auto kind = fmt == Fmt::fp8_block128 ? fp8::BlockKind::vec128 : fp8::BlockKind::blk128x128;
    *row_scales = 4 * fp8::block_scale_count(kind, rows, cols, false);
    *col_scales = 4 * fp8::block_scale_count(kind, rows, cols, true);
  } else if (fmt == Fmt::mxfp8) {
    *row_scales = *col_scales = n / 32;
  } else if (fmt == Fmt::nvfp4) {
    *row_scales = *col_scales = n / 16;
  }
}

Status QCopies::init(Role role_, const RoleSpec& s, int64_t rows_cap, int64_t cols_, Device dev_,
                     LinearWorkspace* workspace_, bool row_only_, bool external, int input_col_slot, bool dry,
                     size_t slot_base) {
  role = role_;
  spec = s;
  cols = cols_;
  dev = dev_;
  rows = 0;
  // MoR's block rule: one BF16 operand whose 128x128 blocks read the same either way, as 2D NVFP4's tiles. The input's
  // must outlive Fprop for Wgrad, so it is kept where other formats keep their input's column copy (owned, or an
  // input slot), and its row piece is empty: Fprop reads the same bytes (row_data_piece). The ladder's 1x16 NVFP4
  // blocks (nvfp4_rows) make two copies, a row copy and a column copy, as NVFP4's.
  const bool one_block_copy = s.fmt == Fmt::mor_block && !s.nvfp4_rows;
  col_is_row = (s.fmt == Fmt::nvfp4 && s.two_d) || (one_block_copy && role != Role::input);
  row_only = row_only_ && !col_is_row;
  if (s.fmt == Fmt::bf16) return Status::ok();
  int64_t data_bytes = 0, row_scale_bytes = 0, col_scale_bytes = 0;
  piece_bytes(s.fmt, rows_cap, cols, &data_bytes, &row_scale_bytes, &col_scale_bytes);
  // Transient pieces: the input's row copy (Fprop only) and both grad copies (backward only).
  const bool row_transient = workspace_ && role != Role::weight;
  const bool col_shared = workspace_ && role == Role::input && input_col_slot >= 0;
  const bool col_transient = workspace_ && (role == Role::grad || col_shared) && !row_only;
  workspace = (row_transient || col_transient) ? workspace_ : nullptr;
  slot = role == Role::grad ? LinearWorkspace::Slot::grad : LinearWorkspace::Slot::input_row;
  col_slot = col_shared ? LinearWorkspace::Slot(int(LinearWorkspace::Slot::input_col0) + input_col_slot) : slot;
  slot_bytes = slot_base;
  col_slot_bytes = 0;
  col_owned_bytes = 0;
  col_allocated_bytes = 0;
  owned_bytes = 0;
  allocated_bytes = 0;
  external_base = nullptr;
  external_bytes = 0;
  auto place = [&](Piece* p, bool transient, int64_t bytes, bool in_col_slot = false) -> Status {
    p->transient = transient;
    p->external = external;
    if (external) {
      p->offset = external_bytes;
      external_bytes += align256(size_t(bytes));
      return Status::ok();
    }
    if (transient) {
      size_t& used = in_col_slot && col_slot != slot ? col_slot_bytes : slot_bytes;
      p->slot = in_col_slot ? col_slot : slot;
      p->offset = used;
      used += align256(size_t(bytes));
      return Status::ok();
    }
    owned_bytes += size_t(bytes);
    allocated_bytes += align256(size_t(bytes > 0 ? bytes : 1));
    if (in_col_slot) {
      col_owned_bytes += size_t(bytes);
      col_allocated_bytes += align256(size_t(bytes > 0 ? bytes : 1));
    }
    return dry ? Status::ok() : alloc_bytes(&p->owned, dev, bytes);
  };
  NB_TRY(place(&row_data, row_transient, one_block_copy && !col_is_row ? 0 : data_bytes));
  NB_TRY(place(&row_scales, row_transient, row_scale_bytes));
  if (!col_is_row && !row_only) {
    NB_TRY(place(&col_data, col_transient, data_bytes, true));
    NB_TRY(place(&col_scales, col_transient, col_scale_bytes, true));
  }
  if (workspace) workspace->reserve(slot, slot_bytes);
  if (workspace && col_slot_bytes > 0) workspace->reserve(col_slot, col_slot_bytes);
  owned_bytes += kStateFloats * 4 + kStateInts * 4;
  allocated_bytes += align256(size_t(kStateFloats) * 4) + align256(size_t(kStateInts) * 4);
  if (dry) return Status::ok();
  NB_TRY(Buffer::allocate(&state_f, DType::f32, dev, {kStateFloats}));
  NB_TRY(Buffer::allocate(&state_i, DType::i32, dev, {kStateInts}));
  float f[kStateFloats] = {};
  f[kScale] = f[kScaleInv] = 1.f;
  int i[kStateInts] = {0, 0};
  NB_TRY(copy_bytes(state_f.data(), dev, f, Device::cpu, sizeof f));
  NB_TRY(copy_bytes(state_i.data(), dev, i, Device::cpu, sizeof i));
  if (s.fmt == Fmt::fp8_e4m3 || s.fmt == Fmt::fp8_e5m2)
    delayed = fp8::DelayedScaling(s.fmt == Fmt::fp8_e4m3 ? fp8::Format::e4m3 : fp8::Format::e5m2, 1024);
  return Status::ok();
}

// Where this quantize writes, once the workspace slot is acquired (transient pieces live in it).
QCopies::Outputs QCopies::outputs() const {
  const bool colwise = !col_is_row && !row_only;
  return {colwise,
          ptr(row_data),
          ptr(row_scales),
          colwise ? ptr(col_data) : nullptr,
          colwise ? ptr(col_scales) : nullptr,
          state_i.ptr<int>() + kFlag};
}

// The workspace slot may be unallocated (no allocate() yet) or smaller (a larger Linear registered later).
// The NVFP4 quantizer only ever sets the non-finite flag; the others clear it themselves. Clear it for all.
Status QCopies::begin_quantize(Stream stream) {
  if (workspace) {
    uint8_t* base = nullptr;
    NB_TRY(workspace->acquire(slot, slot_bytes, &base));
    if (col_slot_bytes > 0) NB_TRY(workspace->acquire(col_slot, col_slot_bytes, &base));
  }
  int* si = state_i.ptr<int>();
  if (dev == Device::cuda) return memset_cuda(si + kFlag, 0, sizeof(int), stream);
  si[kFlag] = 0;
  return Status::ok();
}

// Per-tensor FP8 (current or delayed scaling): one scale for the row copy and its transpose.
Status QCopies::quantize_fp8_tensor(const bf16* src, const QuantizeArgs& a, const Outputs& o, Stream stream) {
  const bool cuda = dev == Device::cuda;
  float* sf = state_f.ptr<float>();
  const auto f = spec.fmt == Fmt::fp8_e4m3 ? fp8::Format::e4m3 : fp8::Format::e5m2;
  fp8::TensorView v{rows, cols, o.row_data, o.col_data, sf + kScaleInv, sf + kRowAmax, o.flag, a.mor_stat};
  // Delayed scaling needs a history: a role's first step (nothing recorded yet) scales by its current
  // amax. TE starts from scale 1 instead, which flushes the whole first step's gradients to zero
  // when they are below E5M2's 2^-16 (e.g. the loss gradient of 65,536 tokens, ~1.5e-5 per token).
  if (a.scaling == Fp8Scaling::delayed && has_history) {
    NB_TRY(cuda ? fp8::quantize_with_scale_cuda(src, f, sf + kScale, v, stream)
                : fp8::quantize_with_scale_ref(src, f, sf[kScale], v));
  } else if (a.amax_group) {  // the amax of the whole tensor, over the ranks that hold its tokens
    if (cuda) {
      NB_TRY(fp8::amax_cuda(src, rows * cols, sf + kRowAmax, o.flag, stream));
    } else {
      int32_t nonfinite = 0;
      sf[kRowAmax] = fp8::amax_ref(src, rows * cols, &nonfinite);
      if (nonfinite && o.flag) *o.flag = 1;
    }
    NB_TRY(a.amax_group->max(sf + kRowAmax, 1, stream));
    NB_TRY(cuda ? fp8::quantize_with_amax_cuda(src, f, a.pow2_scales, v, stream)
                : fp8::quantize_with_amax_ref(src, f, a.pow2_scales, sf[kRowAmax], v));
  } else {
    NB_TRY(cuda ? fp8::quantize_current_cuda(src, f, false, v, stream) : fp8::quantize_current_ref(src, f, false, v));
  }
  // The transposed copy has the same scale and amax.
  if (cuda) return memset_cuda(sf + kColAmax, 0, sizeof(float), stream);
  sf[kColAmax] = 0.f;
  return Status::ok();
}

// FP8 sub-channel (1x128 or 128x128 blocks), each block with its own FP32 scale.
Status QCopies::quantize_fp8_block(const bf16* src, const QuantizeArgs& a, const Outputs& o, Stream stream) {
  fp8::BlockOptions opt;
  opt.kind = spec.fmt == Fmt::fp8_block128 ? fp8::BlockKind::vec128 : fp8::BlockKind::blk128x128;
  opt.pow2_scales = a.pow2_scales;
  opt.colwise = o.colwise;
  fp8::BlockView v{rows,       cols,
                   o.row_data, reinterpret_cast<float*>(o.row_scales),
                   o.col_data, reinterpret_cast<float*>(o.col_scales),
                   o.flag};
  return dev == Device::cuda ? fp8::quantize_block_cuda(src, opt, v, stream) : fp8::quantize_block_ref(src, opt, v);
}

Status QCopies::quantize_mxfp8(const bf16* src, const Outputs& o, Stream stream) {
  mxfp8::QuantizedView v{rows, cols, o.row_data, o.row_scales, o.col_data, o.col_scales, o.flag};
  const mxfp8::Options opt{true, o.colwise};
  return dev == Device::cuda ? mxfp8::quantize_cuda(src, opt, v, stream) : mxfp8::quantize_ref(src, opt, v);
}

// MoR's block rule (mor_block.h): the BF16 operand into the row data (col_is_row: the only copy), the blocks decided
// and counted as they are quantized; GAM's tensor amax is taken into the row amax slot first (the ladder's NVFP4 amax
// into the column one).
Status QCopies::quantize_mor_block(const bf16* src, const QuantizeArgs& a, const Outputs& o, Stream stream) {
  auto* out = reinterpret_cast<bf16*>(o.colwise ? o.col_data : o.row_data);  // the input's one copy: its column piece
  float* scratch = state_f.ptr<float>() + kRowAmax;                          // GAM's amax, then NVFP4's in kColAmax
  static_assert(kColAmax == kRowAmax + 1, "the block rule's two amaxes are adjacent");
  const bool cuda = dev == Device::cuda, ladder = a.mor_top.threshold > 0;
  // Context parallelism: the whole sequences' amaxes (the MAX over the ranks that hold their tokens), so each rank's
  // blocks are scaled as one GPU scales them. On the CPU the state block is host memory.
  bool given = false;
  if (a.amax_group) {
    if (cuda)
      NB_TRY(mor::block_rule_amaxes_cuda(src, rows, cols, ladder, scratch, stream));
    else
      mor::block_rule_amaxes_ref(src, rows * cols, scratch);
    NB_TRY(a.amax_group->max(scratch, 2, stream));
    given = true;
  }
  const float* host_amaxes = given && !cuda ? scratch : nullptr;
  if (!ladder) {
    if (cuda)
      return mor::apply_block_rule_cuda(src, rows, cols, a.mor_rule, out, a.mor_stat, a.mor_blocks, scratch, stream,
                                        given);
    return mor::apply_block_rule_ref(src, rows, cols, a.mor_rule, out, a.mor_stat, a.mor_blocks, host_amaxes);
  }
  const mor::BlockTallies t{a.mor_stat, a.mor_nvfp4, a.mor_blocks};
  const auto apply = [&](const mor::BlockLadder& top, bf16* to, bool amaxes_given) {
    if (cuda)
      return mor::apply_block_ladder_cuda(src, rows, cols, a.mor_rule, top, to, t, scratch, stream, amaxes_given);
    return mor::apply_block_ladder_ref(src, rows, cols, a.mor_rule, top, to, t, host_amaxes);
  };
  if (!spec.nvfp4_rows) return apply(a.mor_top, out, given);
  // A copy per direction, as NVFP4's: the row copy's blocks along K, the column copy's down the tokens (its SR key
  // the row copy's with the stream's low bit flipped, as nvfp4.h keys a column-wise copy; the amaxes the row copy's
  // pass left). Both are counted.
  mor::BlockLadder top = a.mor_top;
  top.blocks = mor::Nvfp4Blocks::rows;
  NB_TRY(apply(top, reinterpret_cast<bf16*>(o.row_data), given));
  if (!o.colwise) return Status::ok();
  top.blocks = mor::Nvfp4Blocks::cols;
  top.rng.stream ^= 1u;
  return apply(top, reinterpret_cast<bf16*>(o.col_data), /*amaxes_given=*/true);
}

// col_is_row or row_only: row copy only; the column amax slot is left as init set it (0) on both
// backends (col_operand() uses the row amax, which is the column one for 2D).
Status QCopies::quantize_nvfp4(const bf16* src, const QuantizeArgs& a, const Outputs& o, Stream stream) {
  nvfp4::Options opt;
  opt.two_d = spec.two_d;
  opt.rht = spec.rht;
  opt.sr = spec.sr;
  opt.four_over_six = spec.four_over_six;
  opt.err_mode = spec.four_over_six_err;
  opt.rng = a.rng;
  opt.sr_origin = a.sr_origin;
  opt.colwise = o.colwise;
  float* sf = state_f.ptr<float>();
  nvfp4::QuantizedView v{rows,       cols,         o.row_data,    o.row_scales,
                         o.col_data, o.col_scales, sf + kRowAmax, o.colwise ? sf + kColAmax : nullptr,
                         o.flag};
  if (!a.amax_group)
    return dev == Device::cuda ? nvfp4::quantize_cuda(src, opt, v, stream) : nvfp4::quantize_ref(src, opt, v);
  // The whole tensor's amaxes (the column copy's after the RHT), over the ranks that hold its tokens.
  // (nvfp4::quantize_cuda and quantize_ref in two halves, the group's reduction between them.)
  float* col = o.colwise ? sf + kColAmax : nullptr;  // else left as init set it (0), as above
  if (dev == Device::cuda) {
    NB_TRY(nvfp4::compute_amax_cuda(src, rows, cols, opt.rht && o.colwise, sf + kRowAmax, col, stream));
  } else {
    float col_amax = 0;
    nvfp4::compute_amax_ref(src, rows, cols, opt.rht && o.colwise, sf + kRowAmax, col ? col : &col_amax);
    if (o.flag && (!std::isfinite(sf[kRowAmax]) || (col && !std::isfinite(*col)))) *o.flag = 1;
  }
  NB_TRY(a.amax_group->max(sf + kRowAmax, col ? 2 : 1, stream));  // kRowAmax, kColAmax: adjacent
  return dev == Device::cuda ? nvfp4::quantize_cuda_with_amax(src, opt, v, stream)
                             : nvfp4::quantize_ref_with_amax(src, opt, v);
}

// Block formats carry no per-tensor amax: step_amax stays 0 for them (only delayed scaling reads it).
Status QCopies::clear_block_amaxes(Stream stream) {
  if (spec.fmt != Fmt::fp8_block128 && spec.fmt != Fmt::fp8_block128x128 && spec.fmt != Fmt::mxfp8) return Status::ok();
  float* sf = state_f.ptr<float>();
  if (dev != Device::cuda) {
    sf[kRowAmax] = sf[kColAmax] = 0.f;
    return Status::ok();
  }
  NB_TRY(memset_cuda(sf + kRowAmax, 0, sizeof(float), stream));
  return memset_cuda(sf + kColAmax, 0, sizeof(float), stream);
}

Status QCopies::quantize(const bf16* src, int64_t rows_, const QuantizeArgs& a, Stream stream, const Outputs* into) {
  rows = rows_;
  NB_TRY(begin_quantize(stream));
  const Outputs o = into ? *into : outputs();
  switch (spec.fmt) {
    case Fmt::bf16: return errorf("internal: a bf16 role has no quantized copies");
    case Fmt::fp8_e4m3:
    case Fmt::fp8_e5m2: NB_TRY(quantize_fp8_tensor(src, a, o, stream)); break;
    case Fmt::fp8_block128:
    case Fmt::fp8_block128x128: NB_TRY(quantize_fp8_block(src, a, o, stream)); break;
    case Fmt::mxfp8: NB_TRY(quantize_mxfp8(src, o, stream)); break;
    case Fmt::nvfp4: NB_TRY(quantize_nvfp4(src, a, o, stream)); break;
    case Fmt::mor_block: NB_TRY(quantize_mor_block(src, a, o, stream)); break;
  }
  NB_TRY(clear_block_amaxes(stream));
  used_in_step = true;
  if (dequantized_kept() && !into) {
    NB_TRY(gemm::dequantize_operand_cuda(row_operand(), dequant_row.data(), stream));
    if (o.colwise) NB_TRY(gemm::dequantize_operand_cuda(col_operand(), dequant_col.data(), stream));
  }
  float* sf = state_f.ptr<float>();
  int* si = state_i.ptr<int>();
  if (dev == Device::cuda) return fold_role_state_cuda(sf, si, stream);
  fold_role_state_host(sf, si);
  return Status::ok();
}

Status QCopies::keep_dequantized(int64_t rows_cap, bool dry) {
  const bool emulated = spec.fmt == Fmt::mxfp8 || spec.fmt == Fmt::nvfp4;
  if (!emulated || dev != Device::cuda || workspace != nullptr) return Status::ok();
  const int64_t n = rows_cap * cols;
  const int copies = !col_is_row && !row_only ? 2 : 1;
  owned_bytes += size_t(copies) * size_t(n) * 2;
  allocated_bytes += size_t(copies) * align256(size_t(n) * 2);
  if (dry) return Status::ok();
  NB_TRY(Buffer::allocate(&dequant_row, DType::bf16, dev, {n}));
  if (copies == 2) NB_TRY(Buffer::allocate(&dequant_col, DType::bf16, dev, {n}));
  return Status::ok();
}

uint8_t* QCopies::ptr(const Piece& p) const {
  if (p.external) return external_base ? external_base + p.offset : nullptr;
  if (!p.transient) return p.owned.ptr<uint8_t>();
  uint8_t* base = workspace->data(p.slot);
  return base ? base + p.offset : nullptr;
}

gemm::QOperand QCopies::row_operand() const {
  gemm::QOperand op;
  op.format = qformat(spec.fmt);
  op.rows = rows;
  op.k = cols;
  op.data = ptr(row_data_piece());
  const float* sf = state_f.ptr<float>();
  op.scales = (spec.fmt == Fmt::fp8_e4m3 || spec.fmt == Fmt::fp8_e5m2) ? static_cast<const void*>(sf + kScaleInv)
              : spec.fmt == Fmt::mor_block                             ? nullptr
                                                                       : static_cast<const void*>(ptr(row_scales));
  op.amax = sf + kRowAmax;
  op.nvfp4_4over6 = spec.fmt == Fmt::nvfp4 && spec.four_over_six;  // decodes with amax / (6*256)
  // The dequantized row copy; col_operand() keeps it for col_is_row (the same stored bytes).
  if (dequantized_kept()) op.dequantized = dequant_row.data();
  return op;
}

gemm::QOperand QCopies::col_operand() const {
  gemm::QOperand op = row_operand();
  op.rows = cols;
  op.k = rows;
  if (col_is_row) {
    // The row copy [rows, cols] is the column operand [cols, K = rows] stored K-first; same values,
    // same amax (2D: one scale per 16x16 tile serves both directions). Native sm_100 FP4 GEMMs would
    // need a K-major column-wise copy instead (see linear_internal.h).
    op.k_major = false;
    return op;
  }
  return col_operand_at(ptr(col_data));
}

gemm::QOperand QCopies::col_operand_at(const uint8_t* data) const {
  gemm::QOperand op = row_operand();
  op.rows = cols;
  op.k = rows;
  op.data = data;
  if (spec.fmt != Fmt::fp8_e4m3 && spec.fmt != Fmt::fp8_e5m2) op.scales = ptr(col_scales);
  op.amax = state_f.ptr<float>() + kColAmax;
  op.k_major = spec.fmt != Fmt::mxfp8 && spec.fmt != Fmt::mor_block;  // these keep it un-transposed
  op.dequantized = dequantized_kept() && data == ptr(col_data) ? dequant_col.data() : nullptr;
  return op;
}

Status QCopies::read_state(float* floats, int* ints, Stream stream) const {
  if (dev == Device::cuda) {
    NB_TRY(copy_to_host_cuda(floats, state_f.data(), kStateFloats * sizeof(float), stream));
    return copy_to_host_cuda(ints, state_i.data(), kStateInts * sizeof(int), stream);
  }
  std::copy(state_f.ptr<float>(), state_f.ptr<float>() + kStateFloats, floats);
  std::copy(state_i.ptr<int>(), state_i.ptr<int>() + kStateInts, ints);
  return Status::ok();
}

Status QCopies::clear_nonfinite_count() {
  int* si = state_i.ptr<int>();
  if (dev == Device::cuda) return memset_cuda(si + kNonfiniteCount, 0, sizeof(int), nullptr);
  si[kNonfiniteCount] = 0;
  return Status::ok();
}

Status QCopies::write_state(const float* floats, const int* ints, Stream stream) {
  if (dev == Device::cuda) {
    NB_TRY(copy_to_device_cuda(state_f.data(), floats, kStateFloats * sizeof(float), stream));
    return copy_to_device_cuda(state_i.data(), ints, kStateInts * sizeof(int), stream);
  }
  std::copy(floats, floats + kStateFloats, state_f.ptr<float>());
  std::copy(ints, ints + kStateInts, state_i.ptr<int>());
  return Status::ok();
}

}  // namespace nb::recipe
