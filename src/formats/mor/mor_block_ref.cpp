// CPU reference of MoR's block rule in training (mor_block.h): one 128x128 block (clipped) at a time, with the
// NVFP4 ladder's rung above it when asked.
#include <algorithm>
#include <cmath>
#include <vector>
#include "formats/mor/mor_block.h"
#include "formats/nvfp4/nvfp4_math.h"

namespace nb::mor {

namespace {

struct BlockSpan {
  int64_t r0, r1, c0, c1;  // rows [r0, r1), cols [c0, c1)
};

struct BlockMeasure {
  float amax = 0.0f;         // max |x| (Inf included; NaN skipped by fmax), what the scales read
  float finite_amax = 0.0f;  // over the finite elements, and their smallest non-zero |x|: the range test
  float min_nonzero = INFINITY;
  uint32_t nonfinite = 0;  // NaN or Inf elements
};

BlockMeasure measure_block(const bf16* x, int64_t cols, const BlockSpan& b) {
  BlockMeasure m;
  for (int64_t r = b.r0; r < b.r1; ++r)
    for (int64_t c = b.c0; c < b.c1; ++c) {
      const float a = std::fabs(bf16_to_f32(x[r * cols + c]));
      m.amax = std::fmax(m.amax, a);
      if (!std::isfinite(a)) {
        ++m.nonfinite;
        continue;
      }
      m.finite_amax = std::fmax(m.finite_amax, a);
      if (a > 0.0f) m.min_nonzero = std::fmin(m.min_nonzero, a);
    }
  return m;
}

float fake_quantize(float v, float scale, fp8::Format fmt) {
  return fp8::decode(fp8::encode(v * scale, fmt), fmt) * (1.0f / scale);
}

// The block's statistic against its quantization to fmt with `scale` (finite non-zero elements only).
ErrorStat block_error(const bf16* x, int64_t cols, const BlockSpan& b, float scale, fp8::Format fmt) {
  ErrorStat s;
  for (int64_t r = b.r0; r < b.r1; ++r)
    for (int64_t c = b.c0; c < b.c1; ++c) {
      const float v = bf16_to_f32(x[r * cols + c]);
      if (!std::isfinite(v)) {
        s.nonfinite = true;
        continue;
      }
      if (v == 0.0f) continue;
      s.err_fixed += element_error_fixed(v, fake_quantize(v, scale, fmt));
      ++s.nonzero;
    }
  return s;
}

// nv: the block's NVFP4 values (row-major over the block), read when choice is nvfp4.
void write_block(const bf16* x, int64_t cols, const BlockSpan& b, Choice choice, float scale,
                 const std::vector<float>& nv, bf16* out) {
  const fp8::Format fmt = choice == Choice::fp8_e5m2 ? fp8::Format::e5m2 : fp8::Format::e4m3;
  const int64_t w = b.c1 - b.c0;
  for (int64_t r = b.r0; r < b.r1; ++r)
    for (int64_t c = b.c0; c < b.c1; ++c) {
      const int64_t i = r * cols + c;
      if (choice == Choice::nvfp4)
        out[i] = f32_to_bf16(nv[size_t((r - b.r0) * w + c - b.c0)]);
      else
        out[i] = choice == Choice::bf16 ? x[i] : f32_to_bf16(fake_quantize(bf16_to_f32(x[i]), scale, fmt));
    }
}

// The block's NVFP4 values (row-major over the block) as an NVFP4 copy holds them: each 16x16 tile's, or each 1x16 or
// 16x1 block's, scale code from its amax (by bit pattern) and the tensor's S_enc, each element's E2M1 code by RNE or
// SR, decoded with the tensor's amax. The block's sides are multiples of 16.
std::vector<float> nvfp4_block_values(const bf16* x, int64_t rows, int64_t cols, const BlockSpan& b, float amax,
                                      const BlockLadder& top) {
  const float s_enc = nvfp4::global_encode_scale(amax);
  const int64_t w = b.c1 - b.c0;
  std::vector<float> nv(size_t((b.r1 - b.r0) * w));
  const auto val = [&](int64_t r, int64_t c) { return bf16_to_f32(x[r * cols + c]); };
  // 16 elements from (r, c), to the right or (down) below, with scale code sc.
  const auto encode = [&](int64_t r, int64_t c, bool down, uint32_t sc) {
    const float enc = nvfp4::block_encode_scale(sc, s_enc);
    const int64_t e0 = down ? c * rows + r : r * cols + c;  // a multiple of 16: one Philox block per 16 elements
    const Philox4x32 rand = top.sr ? philox_block(top.rng, uint64_t(e0) / 16) : Philox4x32{};
    for (int j = 0; j < 16; ++j) {
      const int64_t rj = down ? r + j : r, cj = down ? c : c + j;
      const float v = val(rj, cj) * enc;
      const uint32_t code = top.sr ? nvfp4::e2m1_code_sr(v, philox_byte(rand, j)) : nvfp4::e2m1_code_rne(v);
      nv[size_t((rj - b.r0) * w + cj - b.c0)] = nvfp4::dequant_value(code, sc, amax);
    }
  };
  const auto amax_of = [&](int64_t r, int64_t c, int64_t h, int64_t wd) {
    uint32_t m = 0;
    for (int64_t i = r; i < r + h; ++i)
      for (int64_t j = c; j < c + wd; ++j) m = std::max(m, nvfp4::abs_bits(val(i, j)));
    return nvfp4::block_scale_code(bits_f32(m), s_enc);
  };
  for (int64_t tr = b.r0; tr < b.r1; tr += 16)
    for (int64_t tc = b.c0; tc < b.c1; tc += 16) {
      if (top.blocks == Nvfp4Blocks::tiles) {
        const uint32_t sc = amax_of(tr, tc, 16, 16);
        for (int64_t r = tr; r < tr + 16; ++r) encode(r, tc, false, sc);
      } else if (top.blocks == Nvfp4Blocks::rows) {
        for (int64_t r = tr; r < tr + 16; ++r) encode(r, tc, false, amax_of(r, tc, 1, 16));
      } else {
        for (int64_t c = tc; c < tc + 16; ++c) encode(tr, c, true, amax_of(tr, c, 16, 1));
      }
    }
  return nv;
}

// The block's statistic against its NVFP4 values (finite non-zero elements only).
uint64_t nvfp4_block_error(const bf16* x, int64_t cols, const BlockSpan& b, const std::vector<float>& nv) {
  uint64_t err = 0;
  const int64_t w = b.c1 - b.c0;
  for (int64_t r = b.r0; r < b.r1; ++r)
    for (int64_t c = b.c0; c < b.c1; ++c) {
      const float v = bf16_to_f32(x[r * cols + c]);
      if (std::isfinite(v) && v != 0.0f) err += element_error_fixed(v, nv[size_t((r - b.r0) * w + c - b.c0)]);
    }
  return err;
}

void count(Choice choice, bool nonfinite, BlockCounts* counts) {
  if (!counts) return;
  if (choice == Choice::fp8_e4m3) ++counts->e4m3;
  if (choice == Choice::fp8_e5m2) ++counts->e5m2;
  if (choice == Choice::nvfp4) ++counts->nvfp4;
  if (choice == Choice::bf16) ++counts->bf16;
  if (nonfinite) ++counts->nonfinite;
}

}  // namespace

void block_rule_amaxes_ref(const bf16* x, int64_t n, float* amaxes) {
  float amax = 0.0f;
  uint32_t nv_bits = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float v = bf16_to_f32(x[i]);
    amax = std::fmax(amax, std::fabs(v));
    nv_bits = std::max(nv_bits, nvfp4::abs_bits(v));
  }
  amaxes[0] = amax;
  amaxes[1] = nvfp4::amax_from_abs_bits(nv_bits);
}

namespace {

// Both entry points: top null, the FP8 rule alone.
Status apply_ref(const bf16* x, int64_t rows, int64_t cols, const BlockRule& rule, const BlockLadder* top, bf16* out,
                 const BlockTallies& t, const float* given) {
  float amaxes[2];
  if (given)
    std::copy(given, given + 2, amaxes);
  else
    block_rule_amaxes_ref(x, rows * cols, amaxes);
  float m4 = 1.0f, m5 = 1.0f;  // GAM's shared mantissas, from the tensor's amax
  if (rule.mode == ScaleMode::gam) {
    m4 = gam_mantissa(fp8::scale_from_amax(amaxes[0], kE4M3Max, false));
    m5 = gam_mantissa(fp8::scale_from_amax(amaxes[0], kE5M2Max, false));
  }
  const float nv_amax = amaxes[1];
  for (int64_t r0 = 0; r0 < rows; r0 += kBlock)
    for (int64_t c0 = 0; c0 < cols; c0 += kBlock) {
      const BlockSpan b{r0, std::min(rows, r0 + kBlock), c0, std::min(cols, c0 + kBlock)};
      const BlockMeasure m = measure_block(x, cols, b);
      const float s4 = block_rule_scale(rule.mode, m.amax, kE4M3Max, m4);
      const float s5 = block_rule_scale(rule.mode, m.amax, kE5M2Max, m5);
      const ErrorStat e4 = block_error(x, cols, b, s4, fp8::Format::e4m3);
      const ErrorStat e5 = rule.three_way ? block_error(x, cols, b, s5, fp8::Format::e5m2) : ErrorStat{};
      std::vector<float> nv;
      uint64_t nv_err = 0;
      if (top) {
        nv = nvfp4_block_values(x, rows, cols, b, nv_amax, *top);
        nv_err = nvfp4_block_error(x, cols, b, nv);
      }
      Choice choice = block_rule_choice(rule, e4.err_fixed, e5.err_fixed, uint64_t(e4.nonzero), m.nonfinite > 0,
                                        m.finite_amax, m.min_nonzero);
      if (top && ladder_keeps_nvfp4(*top, nv_err, uint64_t(e4.nonzero), m.nonfinite > 0)) choice = Choice::nvfp4;
      write_block(x, cols, b, choice, choice == Choice::fp8_e5m2 ? s5 : s4, nv, out);
      count(choice, m.nonfinite > 0, t.counts);
      if (t.e4m3_stat) {
        t.e4m3_stat->err_fixed += e4.err_fixed;
        t.e4m3_stat->nonzero += uint64_t(e4.nonzero);
        t.e4m3_stat->nonfinite += m.nonfinite;
      }
      if (top && t.nvfp4_stat) {
        t.nvfp4_stat->err_fixed += nv_err;
        t.nvfp4_stat->nonzero += uint64_t(e4.nonzero);
        t.nvfp4_stat->nonfinite += m.nonfinite;
      }
    }
  return Status::ok();
}

}  // namespace

Status apply_block_rule_ref(const bf16* x, int64_t rows, int64_t cols, const BlockRule& rule, bf16* out,
                            StatCell* e4m3_stat, BlockCounts* counts, const float* amaxes) {
  if (rows < 1 || cols < 1)
    return errorf("mor: the block rule needs a non-empty tensor; got [%lld, %lld]", (long long)rows, (long long)cols);
  return apply_ref(x, rows, cols, rule, nullptr, out, BlockTallies{e4m3_stat, nullptr, counts}, amaxes);
}

Status apply_block_ladder_ref(const bf16* x, int64_t rows, int64_t cols, const BlockRule& rule, const BlockLadder& top,
                              bf16* out, const BlockTallies& tallies, const float* amaxes) {
  NB_TRY(check_block_ladder(rows, cols, top));
  return apply_ref(x, rows, cols, rule, &top, out, tallies, amaxes);
}

#if !defined(NIBBLE_HAVE_CUDA)
Status block_rule_amaxes_cuda(const bf16*, int64_t, int64_t, bool, float*, Stream) {
  return errorf("MoR's block rule on the GPU needs the CUDA backend; rebuild nibble with the CUDA toolkit");
}
Status apply_block_rule_cuda(const bf16*, int64_t, int64_t, const BlockRule&, bf16*, StatCell*, BlockCounts*, float*,
                             Stream, bool) {
  return errorf("MoR's block rule on the GPU needs the CUDA backend; rebuild nibble with the CUDA toolkit");
}
Status apply_block_ladder_cuda(const bf16*, int64_t, int64_t, const BlockRule&, const BlockLadder&, bf16*,
                               const BlockTallies&, float*, Stream, bool) {
  return errorf("MoR's block ladder on the GPU needs the CUDA backend; rebuild nibble with the CUDA toolkit");
}
#endif

}  // namespace nb::mor
