// Mixture of Representations' statistic over a per-tensor FP8 (or an NVFP4) quantization that already exists
// (recipe::Linear's copies of an operand), on the host or the GPU, added into a cell that a step's quantizations of one
// operand share. x_hat_i = decode(code_i) * scale_inv, the value the FP8 GEMM reads; e_i and the fixed-point sum are
// mor.h's, so the GPU's atomics add the same integers as element_error_fixed in any order: both sides decide alike.
#pragma once
#include <cstdint>
#include "core/bf16.h"
#include "core/status.h"
#include "core/stream.h"
#include "formats/fp8/fp8.h"
#include "formats/mor/mor.h"

namespace nb::mor {

// Plain integers, 24 bytes: what a GPU reduction adds atomically. An ErrorStat once read back (stat_of).
struct StatCell {
  uint64_t err_fixed = 0;
  uint64_t nonzero = 0;
  uint32_t nonfinite = 0;  // non-finite elements seen (any count > 0 keeps the operand BF16)
  uint32_t unused = 0;
};
static_assert(sizeof(StatCell) == 24, "StatCell is read back as raw bytes");
ErrorStat stat_of(const StatCell& c);

// Adds the statistic of x [n] against its FP8 codes [n] (format fmt, one scale_inv) into *cell (host memory).
void add_fp8_stat_host(const bf16* x, const uint8_t* codes, float scale_inv, int64_t n, fp8::Format fmt,
                       StatCell* cell);
// The same on the GPU (every pointer device memory; scale_inv read there), queued on `stream`.
Status add_fp8_stat_cuda(const bf16* x, const uint8_t* codes, const float* scale_inv, int64_t n, fp8::Format fmt,
                         StatCell* cell, Stream stream);

// The statistic a per-tensor current-scaled FP8 quantization of x [n] with this amax would add (scale =
// fp8::scale_from_amax(amax), the codes x * scale rounded as the FP8 quantizer rounds them), without writing a copy:
// the NVFP4 ladder measures its E4M3 rung this way from the NVFP4 copy's amax (the same max |x|). Host memory; on
// the GPU, add_nvfp4_stat_cuda computes it beside NVFP4's in one pass.
void add_fp8_stat_from_amax_host(const bf16* x, int64_t n, float amax, fp8::Format fmt, StatCell* cell);

// The statistic per-row ("per-channel") scaling would give, measured beside the per-tensor one for the study (the
// paper scales per channel; nibble's tensor rule decides per tensor). x [rows, cols] is an operand as the Linear
// quantizes it row-wise: X [tokens, K] and dY [tokens, N] (a row is a token), W [out, K] (a row is an output
// channel). Each row r is quantized on its own, as the per-tensor current-scaling FP8 quantizer quantizes a tensor:
//   amax_r    = max |x| over the row, fmax-folded as fp8::amax_ref (a NaN is skipped, an Inf makes it Inf)
//   scale_r   = fp8::scale_from_amax(amax_r, format max, pow2 = false) (amax 0, Inf or NaN: 1)
//   x_hat     = decode(encode(x * scale_r)) * (1 / scale_r), encoded as the FP8 quantizer encodes (satfinite RNE)
// and each element's term, the non-zero and the non-finite counts are mor.h's (add_fp8_stat_from_amax_host per row).
// All rows add into the one *cell. An all-zero row adds nothing; a NaN or Inf is counted non-finite (and, being a
// non-finite cell, keeps what it would decide BF16). Host memory here; device memory in the CUDA version, which
// equals the host bit for bit (integer sums), for any cols (no alignment needed; faster with cols % 8 == 0).
void add_fp8_rowwise_stat_host(const bf16* x, int64_t rows, int64_t cols, fp8::Format fmt, StatCell* cell);
Status add_fp8_rowwise_stat_cuda(const bf16* x, int64_t rows, int64_t cols, fp8::Format fmt, StatCell* cell,
                                 Stream stream);

// The NVFP4 ladder's statistic over an NVFP4 row-wise copy that already exists: x [rows, cols] against data
// [rows, cols/2] and scales [rows, cols/16] (formats/nvfp4/nvfp4.h's layout, 2D tiles included) and the copy's FP32
// amax; x_hat_i = nvfp4::dequant_value (E4M3 bound 448: 4/6 copies are not measured). Host memory here, device
// memory (amax read there) in the CUDA version, which with e4m3_cell also adds add_fp8_stat_from_amax's E4M3
// statistic from the same amax there, in the same pass over x.
void add_nvfp4_stat_host(const bf16* x, int64_t rows, int64_t cols, const uint8_t* data, const uint8_t* scales,
                         float amax, StatCell* cell);
Status add_nvfp4_stat_cuda(const bf16* x, int64_t rows, int64_t cols, const uint8_t* data, const uint8_t* scales,
                           const float* amax, StatCell* cell, StatCell* e4m3_cell, Stream stream);

}  // namespace nb::mor
