// MoR's sub-tensor rule as training applies it (docs/MOR.md, "The block rule in training"): each 128x128 block of
// x [rows, cols] (the blocks of the last rows and columns clipped to the tensor) is quantized to E4M3 (and, with the
// three-way rule, to E5M2) with its own scale, measured, and decided as decide_blocks_ref decides a block (mor.h);
// the output is x itself with every FP8-decided block replaced by its FP8 values. A GEMM over that BF16 operand is
// the mixed-block GEMM of mixed.h up to FP32 accumulation order. With pow2 scales each FP8 value is a code times a
// power of two, a BF16 value, so the operand is exact; with amax or GAM scales (not powers of two) the FP8 values are
// rounded once to BF16 (what fake quantization does, as the paper's evaluation did).
//
// The NVFP4 ladder per block (BlockLadder, docs/MOR.md "The NVFP4 ladder per block"): an NVFP4 rung above E4M3. The
// block is quantized to NVFP4 as an NVFP4 copy is (nvfp4.h: each 16x16 tile, or 1x16 or 16x1 block, one E4M3 scale
// from its amax and the tensor's S_enc, elements E2M1 by RNE or, for gradients, SR with nvfp4.h's random byte of the
// element's index in the copy), measured, and kept while its error is below the ladder's threshold; else the FP8 rule
// above decides. NVFP4
// values are written as nvfp4::dequant_value's FP32 value rounded to BF16 (fake quantization again: the tensor's
// global scale is not a power of two). rows and cols must be multiples of 16 (whole tiles).
//
// The decision needs nothing from the host, so it is made inside the quantization, on the data it quantizes: no lag.
// Per call the E4M3 statistic of every block (the tensor's E4M3 error under block scaling), with the ladder the NVFP4
// statistic of every block, are added into StatCells, and the blocks per choice into BlockCounts; all integer sums, so
// the GPU adds exactly what the host does.
#pragma once
#include <cstdint>
#include <cstring>
#include "core/bf16.h"
#include "core/macros.h"
#include "core/philox.h"
#include "core/status.h"
#include "core/stream.h"
#include "formats/fp8/fp8.h"
#include "formats/mor/mor.h"
#include "formats/mor/mor_stat.h"

namespace nb::mor {

// Blocks per choice, added by each call; 24 bytes, as a StatCell (a model's board holds both kinds of cell). A step's
// operand has far fewer than 2^32 blocks.
struct BlockCounts {
  uint32_t e4m3 = 0, e5m2 = 0, nvfp4 = 0;
  uint32_t bf16 = 0;       // every block kept in BF16, the non-finite ones included
  uint32_t nonfinite = 0;  // blocks with a NaN or Inf
  uint32_t unused = 0;
};
static_assert(sizeof(BlockCounts) == sizeof(StatCell), "BlockCounts shares the board with StatCells");
// A board cell that holds BlockCounts, read as them.
inline BlockCounts block_counts_of(const StatCell& cell) {
  BlockCounts b;
  std::memcpy(static_cast<void*>(&b), static_cast<const void*>(&cell), sizeof b);
  return b;
}

// The FP8 scale of a block under `mode` (gam_mantissa: the tensor's shared mantissa; unused otherwise).
NB_HD float block_rule_scale(ScaleMode mode, float block_amax, float fmt_max, float gam_mantissa_) {
  if (mode == ScaleMode::gam) return gam_group_scale(gam_mantissa_, fp8::scale_from_amax(block_amax, fmt_max, false));
  return fp8::scale_from_amax(block_amax, fmt_max, mode == ScaleMode::pow2);
}

// decide_blocks_ref's choice of one block from its E4M3 and E5M2 sums over its `nonzero` finite non-zero elements,
// its finite amax and smallest non-zero |x|.
NB_HD Choice block_rule_choice(const BlockRule& rule, uint64_t err4, uint64_t err5, uint64_t nonzero, bool nonfinite,
                               float finite_amax, float min_nonzero) {
  if (nonfinite) return Choice::bf16;
  if (!rule.three_way) return fixed_below_threshold(err4, nonzero, rule.threshold) ? Choice::fp8_e4m3 : Choice::bf16;
  if (err4 < err5) return Choice::fp8_e4m3;  // a tie is no win for E4M3: the range test decides
  return fits_e5m2_range(finite_amax, min_nonzero) ? Choice::fp8_e5m2 : Choice::bf16;
}

// The ladder's NVFP4 rung; threshold 0: none (the FP8 block rule alone).
// The NVFP4 rung's blocks, each with one E4M3 scale: 16x16 tiles (a 2D weight's, one copy reads the same in every
// GEMM), 1x16 along a row (an NVFP4 row-wise copy's: the Fprop or Dgrad operand) or 16x1 down a column (a column-wise
// copy's, in x's own layout: the Wgrad operand).
enum class Nvfp4Blocks : uint8_t { tiles, rows, cols };

struct BlockLadder {
  double threshold = 0.0;  // NVFP4 while the block's NVFP4 error is below it, in (0, 1)
  bool sr = false;         // stochastic rounding of the elements (the gradient's rung)
  // SR's key. Element e reads philox_byte(philox_block(rng, e / 16), e % 16), e its index in the copy's layout as
  // nvfp4.h numbers it: r * cols + c for tiles and rows, c * rows + r for cols (the column-wise copy [cols, rows];
  // its caller flips the stream's low bit, as nvfp4.h keys a column-wise copy).
  RngKey rng{};
  Nvfp4Blocks blocks = Nvfp4Blocks::tiles;
};

// The ladder keeps a block NVFP4 while its NVFP4 error over its `nonzero` finite non-zero elements is below the
// threshold; a non-finite block never (it stays BF16).
NB_HD bool ladder_keeps_nvfp4(const BlockLadder& top, uint64_t err, uint64_t nonzero, bool nonfinite) {
  return !nonfinite && fixed_below_threshold(err, nonzero, top.threshold);
}
// The ladder's arguments: a threshold in (0, 1) and whole 16x16 tiles.
inline Status check_block_ladder(int64_t rows, int64_t cols, const BlockLadder& top) {
  if (rows < 16 || cols < 16 || rows % 16 != 0 || cols % 16 != 0)
    return errorf(
        "mor: the NVFP4 ladder per block needs rows and columns that are positive multiples of 16 (its 16x16 "
        "tiles); got [%lld, %lld]",
        (long long)rows, (long long)cols);
  if (!(top.threshold > 0.0 && top.threshold < 1.0))
    return errorf("mor: the NVFP4 ladder's threshold %g is outside (0, 1)", top.threshold);
  return Status::ok();
}

// Where a call adds what it measured; each may be null.
struct BlockTallies {
  StatCell* e4m3_stat = nullptr;   // every block's E4M3 statistic
  StatCell* nvfp4_stat = nullptr;  // every block's NVFP4 statistic (the ladder)
  BlockCounts* counts = nullptr;
};

// The tensor's two amaxes the rule reads (GAM's shared mantissa, the ladder's S_enc): [0] max |x| with NaN skipped
// (fp8::amax_ref's), [1] NVFP4's by bit pattern (nvfp4.h's, a NaN kept). Each call takes them from x itself unless
// they are given: context parallelism gives the whole sequences' (each rank's, then a MAX over the group), so that
// a rank's blocks, whole blocks of the whole tensor, are quantized as one GPU quantizes them.
void block_rule_amaxes_ref(const bf16* x, int64_t n, float* amaxes);
// The same into two device floats; NVFP4's only when `nvfp4` (it needs rows and cols multiples of 16).
Status block_rule_amaxes_cuda(const bf16* x, int64_t rows, int64_t cols, bool nvfp4, float* amaxes, Stream stream);

// x [rows, cols] -> out [rows, cols] (may not alias x). e4m3_stat, counts: added into when not null. Host memory.
// amaxes: the two amaxes above, or null to take them from x.
Status apply_block_rule_ref(const bf16* x, int64_t rows, int64_t cols, const BlockRule& rule, bf16* out,
                            StatCell* e4m3_stat, BlockCounts* counts, const float* amaxes = nullptr);
// The same on the GPU (device memory), queued on `stream`; bit for bit the host's. `scratch` is two device floats,
// the amaxes: passes of their own write them first, unless amaxes_given (then they are read as they are).
Status apply_block_rule_cuda(const bf16* x, int64_t rows, int64_t cols, const BlockRule& rule, bf16* out,
                             StatCell* e4m3_stat, BlockCounts* counts, float* scratch, Stream stream,
                             bool amaxes_given = false);
// The rule with the ladder's NVFP4 rung above it (top.threshold > 0; rows and cols multiples of 16).
Status apply_block_ladder_ref(const bf16* x, int64_t rows, int64_t cols, const BlockRule& rule, const BlockLadder& top,
                              bf16* out, const BlockTallies& tallies, const float* amaxes = nullptr);
Status apply_block_ladder_cuda(const bf16* x, int64_t rows, int64_t cols, const BlockRule& rule, const BlockLadder& top,
                               bf16* out, const BlockTallies& tallies, float* scratch, Stream stream,
                               bool amaxes_given = false);

}  // namespace nb::mor
