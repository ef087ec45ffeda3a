// Scalar and per-block NVFP4 math shared by the CPU reference and the CUDA kernels (NB_HD: one
// source, compiled without FMA contraction on both sides, so identical bits). Spec §1 steps 2-5, in
// the spec's FP32 operation order:
//   S_enc = min(6*448 / amax, FLT_MAX); S_enc = 1 if amax == 0, S_enc == 0 (amax Inf) or amax NaN
//   s_b   = e4m3_rne_satfinite(block_amax * (S_enc * (1/6)))
//   enc_b = min(1 / (float(s_b) * (1 / S_enc)), FLT_MAX)
//   q     = e2m1(x * enc_b)   (RNE, or SR with one Philox byte per element)
// and the 4/6 variant (two candidate scales per block, lower error wins) further down.
// amax values are compared by bit pattern (|x| as unsigned), which orders finite values and Inf like
// floats and makes a NaN the largest, so a NaN anywhere shows up in the amax instead of vanishing.
#pragma once
#include <cfloat>
#include <cmath>
#include <cstdint>
#include "core/bf16.h"
#include "core/philox.h"
#include "formats/nvfp4/nvfp4.h"
#include "formats/scalar_codecs.h"

namespace nb::nvfp4 {

NB_HD uint32_t abs_bits(float v) { return f32_bits(v) & 0x7FFFFFFFu; }
NB_HD bool amax_is_finite(float amax) { return abs_bits(amax) < 0x7F800000u; }

// The E4M3 bound of a copy's global scale (448, or 256 for a 4/6 copy), and the copy's decode denominator: an
// element is e2m1(q) * float(s_b) * amax / (6 * bound), and a GEMM of two copies divides by both denominators. Every
// encoder and decoder, host and CUDA, reads them here.
NB_HD float e4m3_bound(bool four_over_six) { return four_over_six ? 256.0f : 448.0f; }
NB_HD float decode_denominator(bool four_over_six) { return 6.0f * e4m3_bound(four_over_six); }

NB_HD float global_encode_scale(float amax) {
  float s = fminf(decode_denominator(false) / amax, FLT_MAX);
  if (amax == 0.0f || s == 0.0f || !amax_is_finite(amax)) s = 1.0f;
  return s;
}

NB_HD uint32_t block_scale_code(float block_amax, float s_enc) {
  return f32_to_e4m3_satfinite(block_amax * (s_enc * (1.0f / 6.0f)));
}

// enc_b from the block scale code and S_dec = 1 / S_enc.
NB_HD float block_encode_scale_dec(uint32_t scale_code, float s_dec) {
  return fminf(1.0f / (e4m3_to_f32(scale_code) * s_dec), FLT_MAX);
}
NB_HD float block_encode_scale(uint32_t scale_code, float s_enc) {
  return block_encode_scale_dec(scale_code, 1.0f / s_enc);
}

// Tensor amax from the largest |x| bit pattern: any NaN becomes the one quiet NaN 0x7FC00000, so
// the stored amax does not depend on NaN payloads (which differ between CPU and GPU arithmetic).
NB_HD float amax_from_abs_bits(uint32_t max_abs_bits) {
  return bits_f32(max_abs_bits < 0x7FC00000u ? max_abs_bits : 0x7FC00000u);
}

NB_HD float block_amax16(const float* v) {
  uint32_t m = 0;
  NB_UNROLL
  for (int i = 0; i < 16; ++i) {
    uint32_t a = abs_bits(v[i]);
    m = a > m ? a : m;
  }
  return bits_f32(m);
}

// Branch-free E2M1 encoders for the quantizer's inner loop (it is compute-bound): the same codes as
// f32_to_e2m1_rne / f32_to_e2m1_sr in scalar_codecs.h for every non-NaN input (a test sweeps the
// float range against them). A NaN gives code 7 (+-6) instead of the codec's 0; NaN only arises from
// non-finite input, which sets the non-finite flag, and CPU and CUDA share this code, so the bytes
// still agree. Sign rule as the codec: negative -> 8 | magnitude, -0.0 -> 0. Inputs are products
// (x * enc), so never signaling NaNs (fminf would pass those through on the CPU).
//
// RNE: one magic add whose ulp is the grid step of a's binade, so the FPU does the rounding (ties to an
// even multiple of the step, which is the even code): M = 2^22 (step 0.5) for a < 2, 2^23 (step 1) for
// 2 <= a < 4, 2^24 (step 2) for a >= 4, i.e. M = 2^(e - 105) with e = max(exponent field of a, 127)
// (a <= 6, so e <= 129). The code is the number of steps plus 2 * (e - 127); adding those 2 * (e - 127)
// steps to M itself (an even number of steps, so tie parity is unchanged, and M stays in its binade)
// makes the low 3 bits of a + M' the code: M' bits = (e << 23) + 0x0B000000 + 2 * (e - 127)
// = e * 0x800002 + 0x0AFFFF02. About 5 instructions for the magnitude.
NB_HD uint32_t e2m1_code_rne(float x) {
  const float a = fminf(fabsf(x), 6.0f);  // saturate (NaN -> 6)
  const uint32_t ab = f32_bits(a);
  const uint32_t e = (ab > 0x3F800000u ? ab : 0x3F800000u) >> 23;
  const float magic = bits_f32(e * 0x800002u + 0x0AFFFF02u);
  return (x < 0.0f ? 8u : 0u) | (f32_bits(a + magic) & 7u);
}

// Stochastic rounding: t = |x| + rand8 * step / 256 (exact, as the codec), then floor onto the E2M1
// grid: below 1 the grid is {0, 0.5}; from 1 up, truncating the mantissa to 1 bit is the floor.
NB_HD uint32_t e2m1_code_sr(float x, uint32_t rand8) {
  const float a = fabsf(x);
  const float step_over_256 = a < 2.0f ? 0.5f / 256.0f : (a < 4.0f ? 1.0f / 256.0f : 2.0f / 256.0f);
  const float t = fminf(a + float(rand8 & 0xFFu) * step_over_256, 6.0f);  // >= 6 saturates (NaN -> 6)
  // From 1 up the code is (bits >> 22) - 252; below 1 that is <= 1 (negative below 0.5), so the
  // larger of it and (t >= 0.5) is the floor everywhere: one max instead of a second compare + select.
  const int hi = int(f32_bits(t) >> 22) - 252;
  const int lo = t >= 0.5f ? 1 : 0;
  return (x < 0.0f ? 8u : 0u) | uint32_t(hi > lo ? hi : lo);
}

// 16 elements scaled by enc into 16 E2M1 codes packed little-nibble-first into 8 bytes.
// Packed in two 32-bit words (elements 0-7, 8-15) so the GPU needs no 64-bit shifts.
NB_HD uint64_t encode_block16(const float* v, float enc, bool sr, const Philox4x32& rand) {
  uint32_t word[2] = {0, 0};
  NB_UNROLL
  for (int i = 0; i < 16; ++i) {
    float scaled = v[i] * enc;
    uint32_t code = sr ? e2m1_code_sr(scaled, (rand.v[i / 4] >> (8 * (i % 4))) & 0xFFu) : e2m1_code_rne(scaled);
    word[i / 8] |= code << (4 * (i % 8));
  }
  return uint64_t(word[0]) | (uint64_t(word[1]) << 32);
}

// Dequantized value of one element: e2m1(q) * float(s_b) * amax / (6*bound), left to right; bound is the
// copy's E4M3 bound, 448, or 256 for a 4/6 copy (e4m3_bound).
NB_HD float dequant_value(uint32_t code, uint32_t scale_code, float amax, float bound = 448.0f) {
  return e2m1_to_f32(code) * e4m3_to_f32(scale_code) * amax / (6.0f * bound);
}

// ---- 4/6 adaptive block scaling: TransformerEngine's 4over6 (NVFP4QuantizerRef, nvfp4_use_4over6) ----
// S_enc keeps headroom: E4M3 bound 256 instead of 448, so a block scale may grow by 1.5 (256 * 1.5 = 384
// <= 448) and the block's largest value lands on E2M1's 4 instead of 6 ("map to 4"), where the grid
// near the block max is finer (3, 4 instead of 4, 6). Each block keeps the candidate with the lower
// error, each element decoded as the stored bytes will be: ((e2m1(q) * float(s)) * amax) / (6*256), FP32,
// amax the true tensor amax. Operation orders are TE's (its kernel and its reference agree on them).

NB_HD float global_encode_scale_4over6(float amax) {
  float s = fminf(decode_denominator(true) / amax, FLT_MAX);
  if (amax == 0.0f || s == 0.0f || !amax_is_finite(amax)) s = 1.0f;
  return s;
}

// The two scale codes of a block (or 2D tile) with largest magnitude block_amax: map to 6 (the plain rule
// at the 256 bound) and map to 4 (1.5 x the same base, saturating at 448). TE divides the block amax by 6
// first ((block_amax / 6) * S_enc), where plain NVFP4 multiplies by S_enc * (1/6): the two round
// differently for some amaxes, so this is not block_scale_code's expression.
NB_HD void scale_codes_4over6(float block_amax, float s_enc, uint32_t* map6, uint32_t* map4) {
  const float base = (block_amax / 6.0f) * s_enc;
  *map6 = f32_to_e4m3_satfinite(base);
  *map4 = f32_to_e4m3_satfinite(base * 1.5f);
}

// err + the errors of 16 packed codes with scale code s against v, added one by one in element order
// (FP32, no FMA): |d| (MAE) or d * d (MSE) with d = ((e2m1(q) * float(s)) * amax) / (6*256) - v[i].
NB_HD float add_error16(const float* v, uint64_t packed, uint32_t scale_code, float amax, ErrMode mode, float err) {
  const float s = e4m3_to_f32(scale_code);
  NB_UNROLL
  for (int i = 0; i < 16; ++i) {
    const uint32_t code = uint32_t(packed >> (4 * i)) & 0xFu;
    const float d = e2m1_to_f32(code) * s * amax / decode_denominator(true) - v[i];
    err = err + (mode == ErrMode::mse ? d * d : fabsf(d));
  }
  return err;
}

// One 16-element block with 4/6: both candidates encoded (RNE, or SR with the same random bytes), map to
// 4 kept iff its error is strictly lower (ties and NaN errors keep map to 6, as TE). s_enc =
// global_encode_scale_4over6(amax). Returns the scale code; *packed gets the codes.
NB_HD uint32_t quantize_block16_4over6(const float* v, float s_enc, float amax, ErrMode mode, bool sr,
                                       const Philox4x32& rand, uint64_t* packed) {
  uint32_t s6 = 0, s4 = 0;
  scale_codes_4over6(block_amax16(v), s_enc, &s6, &s4);
  const uint64_t p6 = encode_block16(v, block_encode_scale(s6, s_enc), sr, rand);
  const uint64_t p4 = encode_block16(v, block_encode_scale(s4, s_enc), sr, rand);
  const bool four = add_error16(v, p4, s4, amax, mode, 0.0f) < add_error16(v, p6, s6, amax, mode, 0.0f);
  *packed = four ? p4 : p6;
  return four ? s4 : s6;
}

// Sum of 16 partial errors in TE's tree order (its 16-lane shuffle-down reduction: lane i adds lane
// i + 8, then i + 4, i + 2, i + 1). Overwrites e.
NB_HD float tree_sum16(float* e) {
  NB_UNROLL
  for (int half = 8; half > 0; half /= 2) {
    NB_UNROLL
    for (int i = 0; i < half; ++i) e[i] = e[i] + e[i + half];
  }
  return e[0];
}

// The 4/6 scale code of the 16x16 tile at (r0, c0) of a row-major BF16 tensor with `cols` columns, as
// one copy decides it (2D weights: RNE only). TE quantizes each copy as its own row-major matrix (the
// column copy is the transposed tensor): each of the tile's 16 lines of that copy (rows of the tile for
// the row copy, columns for the column copy) gets its error summed in element order, and the 16 line
// errors are summed by tree_sum16.
NB_HD uint32_t tile_scale_4over6(const bf16* x, int64_t cols, int64_t r0, int64_t c0, float s_enc, float amax,
                                 ErrMode mode, bool colwise) {
  uint32_t m = 0;
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 16; ++j) {
      const uint32_t a = abs_bits(bf16_to_f32(x[(r0 + i) * cols + c0 + j]));
      m = a > m ? a : m;
    }
  uint32_t s6 = 0, s4 = 0;
  scale_codes_4over6(bits_f32(m), s_enc, &s6, &s4);
  const float enc6 = block_encode_scale(s6, s_enc), enc4 = block_encode_scale(s4, s_enc);
  const Philox4x32 no_rand{};
  float err6[16], err4[16];
  for (int line = 0; line < 16; ++line) {
    float v[16];
    for (int j = 0; j < 16; ++j)
      v[j] = bf16_to_f32(colwise ? x[(r0 + j) * cols + c0 + line] : x[(r0 + line) * cols + c0 + j]);
    err6[line] = add_error16(v, encode_block16(v, enc6, false, no_rand), s6, amax, mode, 0.0f);
    err4[line] = add_error16(v, encode_block16(v, enc4, false, no_rand), s4, amax, mode, 0.0f);
  }
  return tree_sum16(err4) < tree_sum16(err6) ? s4 : s6;
}

// Key of the column-wise copy's random stream (the row-wise copy uses the key as given).
NB_HD RngKey colwise_key(RngKey key) {
  key.stream ^= 1u;
  return key;
}

// Context parallelism's row map (nvfp4.h, SrOrigin::cp) in any unit that divides c (rows, or the column copy's
// 16-row blocks): local row p of the rank's rows -> row of the whole tensor. 32-bit division: check_shape keeps
// the rank's rows below 2^31.
NB_HD int64_t sr_cp_row(int64_t p, int64_t chunk, int64_t seq, int64_t first, int64_t second) {
  const uint32_t pair = uint32_t(2 * chunk), q = uint32_t(p) / pair, j = uint32_t(p) - q * pair;
  return int64_t(q) * seq + (j < chunk ? first * chunk + j : second * chunk + (j - chunk));
}
// Rows of the whole tensor (W_r): the rank's whole_rows (or this tensor's rows) mapped to whole sequences.
NB_HD int64_t sr_whole_rows(const SrOrigin& o, int64_t rows) {
  const int64_t local = o.whole_rows ? o.whole_rows : rows;
  return o.cp.chunk ? local / (2 * o.cp.chunk) * o.cp.seq : local;
}

// SR's Philox block of block blk of line `outer` of one copy (outer = row of the row-wise copy, column of
// the column-wise one) is e / 16 with e the whole tensor's index of nvfp4.h's SR origin rule (whole dims,
// row0, col0 and column segments are multiples of 16, so a block never straddles two Philox blocks or two
// segments): base + outer * pitch + blk + the shift of the block's column segment. The first segment's
// shift (col0 without segments) is folded into base, so the default and one-segment origins have no
// lookup (n_shifts 0); segment i + 1 starts at from[i] and adds shift[i], counted in blocks along the row
// for the row copy (its blocks are 16 columns), in lines for the column copy (its lines are columns).
// A context-parallel row map adds the map's offset from the identity row (sr_cp_shift) to the row term, in rows
// for the row copy (times pitch) and in 16-row blocks for the column copy; cp_chunk 0 (no map) adds nothing.
struct SrBlocks {
  int64_t base = 0, pitch = 0;
  bool by_line = false;  // the column copy: the segment follows the line, not the block
  int n_shifts = 0;      // column segments after the first
  int64_t from[kMaxSrColSegments - 1] = {}, shift[kMaxSrColSegments - 1] = {};
  // SrCpRows and row0 in the copy's row unit (rows, or 16-row blocks); cp_mul: Philox blocks per unit.
  int64_t cp_chunk = 0, cp_seq = 0, cp_first = 0, cp_second = 0, cp_row0 = 0, cp_mul = 0;
};
NB_HD SrBlocks sr_blocks(const SrOrigin& o, int64_t rows, int64_t cols, bool colwise) {
  const int64_t whole_rows16 = sr_whole_rows(o, rows) / 16;
  const int64_t whole_cols16 = (o.whole_cols ? o.whole_cols : cols) / 16;
  const int64_t col_shift0 = o.n_col_segments > 0 ? o.col_segments[0].whole : o.col0;  // segment 0: local 0
  SrBlocks b;
  b.by_line = colwise;
  b.base = colwise ? col_shift0 * whole_rows16 + o.row0 / 16 : o.row0 * whole_cols16 + col_shift0 / 16;
  b.pitch = colwise ? whole_rows16 : whole_cols16;
  const int n = o.n_col_segments < kMaxSrColSegments ? o.n_col_segments : kMaxSrColSegments;  // check_shape'd
  b.n_shifts = n > 1 ? n - 1 : 0;
  for (int i = 1; i < n; ++i) {
    const SrColSegment& seg = o.col_segments[i];
    const int64_t d = seg.whole - seg.local - col_shift0;  // whole_col(c) - c - col_shift0, a multiple of 16
    b.from[i - 1] = colwise ? seg.local : seg.local / 16;
    b.shift[i - 1] = colwise ? d * whole_rows16 : d / 16;
  }
  if (o.cp.chunk) {
    const int64_t unit = colwise ? 16 : 1;
    b.cp_chunk = o.cp.chunk / unit;
    b.cp_seq = o.cp.seq / unit;
    b.cp_first = o.cp.first;
    b.cp_second = o.cp.second;
    b.cp_row0 = o.row0 / unit;
    b.cp_mul = colwise ? 1 : b.pitch;
  }
  return b;
}
// The segment shift of block or line u (see SrBlocks): the last segment starting at or before u.
NB_HD int64_t sr_shift(const SrBlocks& b, int64_t u) {
  if (b.n_shifts == 0) return 0;  // default and one-segment origins: a uniform branch on the GPU, no compares
  int64_t shift = 0;
  NB_UNROLL
  for (int i = 0; i < kMaxSrColSegments - 1; ++i)
    if (i < b.n_shifts && u >= b.from[i]) shift = b.shift[i];
  return shift;
}
// The row-map shift of local row unit u (a row of the row copy, a block of the column copy): the Philox blocks
// between the whole tensor's row of the unit and the identity's, row0 + u. The CUDA kernels take it only in
// their instances for a map (kCp below; sr_blocks_have_map picks), so the default ones keep their code.
NB_HD int64_t sr_cp_shift(const SrBlocks& b, int64_t u) {
  const int64_t p = b.cp_row0 + u;
  return (sr_cp_row(p, b.cp_chunk, b.cp_seq, b.cp_first, b.cp_second) - p) * b.cp_mul;
}
NB_HD bool sr_blocks_have_map(const SrBlocks& b) { return b.cp_chunk != 0; }
// kCp = false: for SrBlocks without a row map only (the kernels' default instances).
template <bool kCp = true>
NB_HD int64_t sr_block_index(const SrBlocks& b, int64_t outer, int64_t blk) {
  const int64_t i = b.base + outer * b.pitch + blk + sr_shift(b, b.by_line ? outer : blk);
  if constexpr (kCp)
    if (sr_blocks_have_map(b)) return i + sr_cp_shift(b, b.by_line ? blk : outer);
  return i;
}

// The swizzled (cuBLAS 128x4 tile) byte offset of scale (r, c) for a padded scale-column count kp.
NB_HD int64_t swizzle_offset_padded(int64_t r, int64_t c, int64_t kp) {
  return ((r / 128) * (kp / 4) + c / 4) * 512 + (r % 32) * 16 + ((r % 128) / 32) * 4 + (c % 4);
}

}  // namespace nb::nvfp4
