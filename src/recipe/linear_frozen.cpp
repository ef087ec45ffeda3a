// Linear's frozen-weight mode (linear.h, LoRA base weights): freeze_weight() quantizes the weight once,
// backward() runs Dgrad only. A frozen per-tensor FP8 weight keeps its row copy only; Dgrad reads the
// row copy's codes transposed into the workspace's weight_col slot. That is exact: the FP8 quantizers
// (formats/fp8) encode each element once with the tensor's one scale and write the same code into both
// copies, so the column copy is the row copy's bytes transposed, with the same scale_inv.
#include <algorithm>
#include "gemm/gemm.h"
#include "gemm/gemm_quantized.h"
#include "recipe/linear.h"
#include "recipe/linear_device.h"
#include "recipe/linear_internal.h"

namespace nb::recipe {

using namespace detail;

// src [rows, cols] bytes -> dst [cols, rows], in 16 x 16 blocks (the CPU side of transpose_bytes_cuda).
static void transpose_bytes_host(const uint8_t* src, int64_t rows, int64_t cols, uint8_t* dst) {
  constexpr int64_t kB = 16;
  for (int64_t r0 = 0; r0 < rows; r0 += kB)
    for (int64_t c0 = 0; c0 < cols; c0 += kB)
      for (int64_t r = r0; r < std::min(rows, r0 + kB); ++r)
        for (int64_t c = c0; c < std::min(cols, c0 + kB); ++c) dst[c * rows + r] = src[r * cols + c];
}

Status Linear::freeze_weight(const Tensor& w, Stream stream) {
  if (!impl_) return errorf("Linear::freeze_weight before a successful init");
  Impl& s = *impl_;
  if (!s.frozen)
    return errorf(
        "linear '%s': freeze_weight is for a frozen Linear (init with frozen = true); a trained weight is "
        "quantized by forward() once per step",
        s.name.c_str());
  if (s.all_bf16)
    return errorf(
        "linear '%s': a frozen BF16 layer keeps no quantized weight to freeze; pass its BF16 weight to "
        "forward() and backward() instead",
        s.name.c_str());
  const DType act = s.dev == Device::cuda ? DType::bf16 : DType::f32;
  NB_TRY(check_2d(w, "w", s.name, s.out, s.in, act, s.dev));
  s.weight_valid = false;  // a failed quantization leaves no half-frozen weight behind
  const bool paused = s.mor_paused;
  s.mor_paused = true;  // MoR measures the frozen weight once, into a cell of its own (mor_freeze)
  const Status st = s.quantize(Role::weight, w, stream);
  s.mor_paused = paused;
  NB_TRY(st);
  if (s.recipe.mor.on) NB_TRY(s.mor_freeze(w, stream));
  s.weight_valid = true;
  return Status::ok();
}

// The Dgrad weight operand [in, K = out]: the kept column copy (or the 2D NVFP4 row copy), or for a
// per-tensor FP8 weight the row copy transposed into the shared weight_col slot.
Status Linear::Impl::dgrad_weight_operand(Stream stream, gemm::QOperand* op) {
  Impl& s = *this;
  const QCopies& w = s.q[int(Role::weight)];
  if (!s.weight_transposed_on_use) {
    *op = w.col_operand();
    return Status::ok();
  }
  uint8_t* t = nullptr;
  NB_TRY(s.workspace->acquire(LinearWorkspace::Slot::weight_col, size_t(w.rows * w.cols), &t));
  const uint8_t* row = w.ptr(w.row_data);
  if (s.dev == Device::cuda)
    NB_TRY(transpose_bytes_cuda(row, w.rows, w.cols, t, stream).context("linear '" + s.name + "' weight transpose"));
  else
    transpose_bytes_host(row, w.rows, w.cols, t);
  *op = w.col_operand_at(t);
  return Status::ok();
}

// dy, dx and the token count were checked by backward(); a BF16 layer's w is checked here (the only
// tensor its Dgrad reads besides dy). Nothing of the forward is read (no Wgrad), so a backward need not follow
// its own micro-batch's forward: pipeline parallelism runs other micro-batches' forwards in between.
Status Linear::Impl::frozen_backward(const Tensor& dy, const Tensor& w, const Tensor& dx, float dx_beta,
                                     Stream stream) {
  if (all_bf16) {
    const DType act = dev == Device::cuda ? DType::bf16 : DType::f32;
    NB_TRY(check_2d(w, "w", name, out, in, act, dev));
    return gemm::matmul(dy, w, dx, {.beta = dx_beta}, stream);
  }
  if (!weight_valid) return errorf("linear '%s': backward before freeze_weight gave it its weight", name.c_str());
  NB_TRY(quantize(Role::grad, dy, stream));
  gemm::QOperand wcol, dy_row = q[int(Role::grad)].row_operand();
  NB_TRY(dgrad_weight_operand(stream, &wcol));
  NB_TRY(mor_operand(Role::grad, dy, true, &dy_row));  // MoR: either operand may be its BF16 values
  NB_TRY(mor_operand(Role::weight, Tensor{}, false, &wcol));
  NB_TRY(gemm::matmul_quantized(dy_row, wcol, dx, {dx_beta, false}, stream).context("linear '" + name + "' Dgrad"));
  have_input = false;
  micro += micro_stride;
  return Status::ok();
}

}  // namespace nb::recipe
