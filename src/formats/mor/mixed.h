// A GEMM operand of MoR's sub-tensor rule: each 128x128 block in the format its decision chose (E4M3 or E5M2
// codes with the block's FP32 scale, or its BF16 values), and the GEMM of two such operands as a block-scaled
// GEMM runs it. The CPU reference that a mixed-block kernel matches, and what the tests check against the
// dequantized operands' float64 GEMM (as today's emulated GEMMs are checked).
#pragma once
#include <cstdint>
#include <vector>
#include "core/bf16.h"
#include "core/status.h"
#include "formats/mor/mor.h"

namespace nb::mor {

// [rows, cols] (multiples of 128), blocks in row-major order over [rows/128, cols/128]. Elements are stored
// row-major in `codes` (the FP8 blocks' codes) or `values` (the BF16 blocks'); a block uses one of the two.
struct MixedOperand {
  int64_t rows = 0, cols = 0;
  std::vector<Choice> choice;    // per block
  std::vector<float> scale_inv;  // per block: 1 / scale for an FP8 block, 1 for a BF16 one
  std::vector<uint8_t> codes;    // [rows, cols]
  std::vector<bf16> values;      // [rows, cols]

  int64_t block_of(int64_t r, int64_t c) const { return (r / kBlock) * (cols / kBlock) + c / kBlock; }
  // The element's stored value before its block's scale_inv: the decoded code, or the BF16 value.
  float stored(int64_t r, int64_t c) const;
  // The element as the GEMM reads it: stored(r, c) * scale_inv (FP32).
  float dequantized(int64_t r, int64_t c) const;
};

// x [rows, cols] in the formats `decisions` chose (decide_blocks_ref's, one per block), each FP8 block with its
// format's block scale under `mode` (fp8_scales_ref with Scaling::block: GAM's group is the whole tensor).
Status quantize_mixed_ref(const bf16* x, int64_t rows, int64_t cols, const std::vector<BlockDecision>& decisions,
                          ScaleMode mode, MixedOperand* out);

// y [M, N] = a [M, K] b [N, K]^T, FP32. For each output element and each 128-wide step along K, the products of
// the two blocks' stored values are summed in FP32, multiplied by the two blocks' scale_inv and added to the
// element's FP32 accumulator, K steps in order: what a block-scaled FP8 GEMM computes, with a BF16 block's scale 1.
Status mixed_gemm_ref(const MixedOperand& a, const MixedOperand& b, std::vector<float>* y);

}  // namespace nb::mor
