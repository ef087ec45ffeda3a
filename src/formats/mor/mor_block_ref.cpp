// CPU reference of MoR's block rule in training (mor_block.h): one 128x128 block (clipped) at a time.
#include <algorithm>
#include <cmath>
#include "formats/mor/mor_block.h"

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

void write_block(const bf16* x, int64_t cols, const BlockSpan& b, Choice choice, float scale, bf16* out) {
  const fp8::Format fmt = choice == Choice::fp8_e5m2 ? fp8::Format::e5m2 : fp8::Format::e4m3;
  for (int64_t r = b.r0; r < b.r1; ++r)
    for (int64_t c = b.c0; c < b.c1; ++c) {
      const int64_t i = r * cols + c;
      out[i] = choice == Choice::bf16 ? x[i] : f32_to_bf16(fake_quantize(bf16_to_f32(x[i]), scale, fmt));
    }
}

void count(Choice choice, bool nonfinite, BlockCounts* counts) {
  if (!counts) return;
  if (choice == Choice::fp8_e4m3) ++counts->e4m3;
  if (choice == Choice::fp8_e5m2) ++counts->e5m2;
  if (choice == Choice::bf16) ++counts->bf16;
  if (nonfinite) ++counts->nonfinite;
}

}  // namespace

Status apply_block_rule_ref(const bf16* x, int64_t rows, int64_t cols, const BlockRule& rule, bf16* out,
                            StatCell* e4m3_stat, BlockCounts* counts) {
  if (rows < 1 || cols < 1)
    return errorf("mor: the block rule needs a non-empty tensor; got [%lld, %lld]", (long long)rows, (long long)cols);
  float m4 = 1.0f, m5 = 1.0f;  // GAM's shared mantissas, from the tensor's amax
  if (rule.mode == ScaleMode::gam) {
    float amax = 0.0f;
    for (int64_t i = 0; i < rows * cols; ++i) amax = std::fmax(amax, std::fabs(bf16_to_f32(x[i])));
    m4 = gam_mantissa(fp8::scale_from_amax(amax, kE4M3Max, false));
    m5 = gam_mantissa(fp8::scale_from_amax(amax, kE5M2Max, false));
  }
  for (int64_t r0 = 0; r0 < rows; r0 += kBlock)
    for (int64_t c0 = 0; c0 < cols; c0 += kBlock) {
      const BlockSpan b{r0, std::min(rows, r0 + kBlock), c0, std::min(cols, c0 + kBlock)};
      const BlockMeasure m = measure_block(x, cols, b);
      const float s4 = block_rule_scale(rule.mode, m.amax, kE4M3Max, m4);
      const float s5 = block_rule_scale(rule.mode, m.amax, kE5M2Max, m5);
      const ErrorStat e4 = block_error(x, cols, b, s4, fp8::Format::e4m3);
      const ErrorStat e5 = rule.three_way ? block_error(x, cols, b, s5, fp8::Format::e5m2) : ErrorStat{};
      const Choice choice = block_rule_choice(rule, e4.err_fixed, e5.err_fixed, uint64_t(e4.nonzero), m.nonfinite > 0,
                                              m.finite_amax, m.min_nonzero);
      write_block(x, cols, b, choice, choice == Choice::fp8_e5m2 ? s5 : s4, out);
      count(choice, m.nonfinite > 0, counts);
      if (e4m3_stat) {
        e4m3_stat->err_fixed += e4.err_fixed;
        e4m3_stat->nonzero += uint64_t(e4.nonzero);
        e4m3_stat->nonfinite += m.nonfinite;
      }
    }
  return Status::ok();
}

#if !defined(NIBBLE_HAVE_CUDA)
Status apply_block_rule_cuda(const bf16*, int64_t, int64_t, const BlockRule&, bf16*, StatCell*, BlockCounts*, float*,
                             Stream) {
  return errorf("MoR's block rule on the GPU needs the CUDA backend; rebuild nibble with the CUDA toolkit");
}
#endif

}  // namespace nb::mor
