// Internals of Linear shared by linear.cpp (quantized copies of one role) and linear_layer.cpp (the
// layer: schedule, GEMMs, health). Not part of the public API.
//
// QCopies holds the two copies of one role's source [rows, cols] (rows <= the capacity given at init):
//   row copy   blocks along cols (the Fprop / Dgrad operand)
//   col copy   blocks along rows, stored transposed [cols, rows] (MXFP8: un-transposed, as its quantizer
//              writes it); the Dgrad weight operand and both Wgrad operands
//              2D NVFP4 (16x16 tiles, the weight): not stored. Both copies would hold the same values,
//              so col_operand() is the row copy read as [K = rows, cols] (k_major = false) with the row
//              amax; this saves 9/16 byte per element. A native FP4 GEMM (sm_100, not implemented)
//              needs K-major operands and would need the real column-wise copy here again.
// plus a small state block (linear_device.h): amaxes, FP8 scale/scale_inv, non-finite flag and count.
// Where the copies live: owned Buffers for the copies kept across calls (input column, weight both), a
// LinearWorkspace slot for the transient ones (input row -> input_row slot, grad both -> grad slot). In a
// slot the pieces sit at 256-byte-aligned offsets (as separate cudaMalloc'd buffers were):
//   [row data | row scales | col data | col scales]  (only the transient pieces of the role)
// The state block and the delayed-scaling history are always owned. Pointers into a slot are looked up
// at each use: another Linear may have grown (reallocated) the slot since this one last quantized.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>
#include "core/bf16.h"
#include "core/philox.h"
#include "core/tensor.h"
#include "formats/fp8/fp8.h"
#include "gemm/gemm_quantized.h"
#include "recipe/linear.h"
#include "recipe/linear_workspace.h"

namespace nb::recipe {

enum class Role : int { input = 0, weight = 1, grad = 2 };

// Granularity each format's GEMMs need of every dimension that is some GEMM's rows or K
// (gemm_quantized.cpp validates the same numbers; NVFP4's GEMM K must be a multiple of 32).
inline int64_t fmt_multiple(Fmt f) {
  switch (f) {
    case Fmt::fp8_e4m3:
    case Fmt::fp8_e5m2: return 16;
    case Fmt::fp8_block128:
    case Fmt::fp8_block128x128: return 128;
    case Fmt::mxfp8:
    case Fmt::nvfp4: return 32;
    default: return 1;
  }
}

struct QuantizeArgs {
  Fp8Scaling scaling = Fp8Scaling::none;
  bool pow2_scales = false;
  RngKey rng{};
};

struct QCopies {
  // One piece of a copy: an owned buffer, or `offset` bytes into the workspace slot.
  struct Piece {
    Buffer owned;
    bool transient = false;
    size_t offset = 0;
  };
  Role role = Role::input;
  RoleSpec spec;
  int64_t rows = 0, cols = 0;
  Device dev = Device::cpu;
  Piece row_data, row_scales, col_data, col_scales;
  bool col_is_row = false;  // 2D NVFP4: no column-wise copy; col_operand() reads the row copy
  Buffer state_f, state_i;
  LinearWorkspace* workspace = nullptr;  // set when some piece is transient (the Linear keeps it alive)
  LinearWorkspace::Slot slot = LinearWorkspace::Slot::input_row;
  size_t slot_bytes = 0;        // this role's need in the slot (registered at init)
  size_t owned_bytes = 0;       // bytes of the owned pieces and the state block
  fp8::DelayedScaling delayed;  // host history (delayed scaling only)
  bool has_history = false;     // delayed scaling: some step's amax was recorded (else current scaling)
  bool used_in_step = false;

  // workspace == nullptr: every piece owned. Otherwise the input role's row pieces (or all the grad
  // role's pieces) go into the workspace, whose need is registered here.
  Status init(Role role, const RoleSpec& s, int64_t rows_cap, int64_t cols, Device dev, LinearWorkspace* workspace);
  // src: BF16 [rows, cols] on dev. Writes both copies (the row copy only when col_is_row), then folds
  // flag/amax into the state.
  Status quantize(const bf16* src, int64_t rows, const QuantizeArgs& a, Stream stream);
  gemm::QOperand row_operand() const;  // [rows, cols]
  gemm::QOperand col_operand() const;  // [cols, rows] (col_is_row: the row copy, stored [rows, cols])
  uint8_t* ptr(const Piece& p) const;  // the piece's memory now
  // Whole state block to / from the host (synchronizes on cuda).
  Status read_state(float* floats, int* ints, Stream stream) const;
  Status write_state(const float* floats, const int* ints, Stream stream);
  Status clear_nonfinite_count();
};

}  // namespace nb::recipe
