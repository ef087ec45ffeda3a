// CPU reference of MoR's mixed-block operands and their GEMM (formats/mor/mixed.h).
#include "formats/mor/mixed.h"

namespace nb::mor {

namespace {
fp8::Format fp8_format(Choice c) { return c == Choice::fp8_e5m2 ? fp8::Format::e5m2 : fp8::Format::e4m3; }
}  // namespace

float MixedOperand::stored(int64_t r, int64_t c) const {
  const Choice ch = choice[size_t(block_of(r, c))];
  const size_t i = size_t(r * cols + c);
  return ch == Choice::bf16 ? bf16_to_f32(values[i]) : fp8::decode(codes[i], fp8_format(ch));
}

float MixedOperand::dequantized(int64_t r, int64_t c) const { return stored(r, c) * scale_inv[size_t(block_of(r, c))]; }

Status quantize_mixed_ref(const bf16* x, int64_t rows, int64_t cols, const std::vector<BlockDecision>& decisions,
                          ScaleMode mode, MixedOperand* out) {
  std::vector<float> s4, s5;
  NB_TRY(fp8_scales_ref(x, rows, cols, fp8::Format::e4m3, Scaling::block, mode, &s4));  // checks the shape
  NB_TRY(fp8_scales_ref(x, rows, cols, fp8::Format::e5m2, Scaling::block, mode, &s5));
  if (decisions.size() != s4.size())
    return errorf("mor: %zu block decisions for a [%lld, %lld] tensor of %zu blocks", decisions.size(), (long long)rows,
                  (long long)cols, s4.size());
  *out = MixedOperand{rows, cols, {}, {}, {}, {}};
  out->codes.assign(size_t(rows * cols), 0);
  out->values.assign(size_t(rows * cols), bf16{});
  for (const BlockDecision& d : decisions) out->choice.push_back(d.choice);
  for (size_t b = 0; b < decisions.size(); ++b) {
    const Choice ch = decisions[b].choice;
    out->scale_inv.push_back(ch == Choice::bf16 ? 1.0f : 1.0f / (ch == Choice::fp8_e5m2 ? s5[b] : s4[b]));
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const size_t i = size_t(r * cols + c), b = size_t(out->block_of(r, c));
      const Choice ch = out->choice[b];
      if (ch == Choice::bf16) {
        out->values[i] = x[i];
        continue;
      }
      const float scale = ch == Choice::fp8_e5m2 ? s5[b] : s4[b];
      out->codes[i] = uint8_t(fp8::encode(bf16_to_f32(x[i]) * scale, fp8_format(ch)));
    }
  return Status::ok();
}

Status mixed_gemm_ref(const MixedOperand& a, const MixedOperand& b, std::vector<float>* y) {
  if (a.cols != b.cols)
    return errorf("mor: the mixed GEMM's operands disagree on K: [%lld, %lld] and [%lld, %lld]", (long long)a.rows,
                  (long long)a.cols, (long long)b.rows, (long long)b.cols);
  const int64_t M = a.rows, N = b.rows, K = a.cols;
  y->assign(size_t(M * N), 0.0f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      float acc = 0.0f;
      for (int64_t k0 = 0; k0 < K; k0 += kBlock) {
        float partial = 0.0f;
        for (int64_t k = k0; k < k0 + kBlock; ++k) partial += a.stored(m, k) * b.stored(n, k);
        acc += partial * a.scale_inv[size_t(a.block_of(m, k0))] * b.scale_inv[size_t(b.block_of(n, k0))];
      }
      (*y)[size_t(m * N + n)] = acc;
    }
  return Status::ok();
}

}  // namespace nb::mor
