// CPU reference of MoR's statistics, scales and rules (formats/mor/mor.h).
#include "formats/mor/mor.h"
#include "formats/mor/mor_block.h"
#include <algorithm>
#include <cmath>

namespace nb::mor {

namespace {

// Index of element (r, c)'s scaling group in fp8_scales_ref's layout.
int64_t group_of(int64_t r, int64_t c, int64_t cols, Scaling scaling) {
  switch (scaling) {
    case Scaling::tensor: return 0;
    case Scaling::block: return (r / kBlock) * (cols / kBlock) + c / kBlock;
    case Scaling::channel: return r;
  }
  return 0;
}

int64_t group_count(int64_t rows, int64_t cols, Scaling scaling) {
  switch (scaling) {
    case Scaling::tensor: return 1;
    case Scaling::block: return (rows / kBlock) * (cols / kBlock);
    case Scaling::channel: return rows;
  }
  return 1;
}

// max |x| of each group (fmax: a NaN does not propagate, as fp8.h's amax).
std::vector<float> group_amax(const bf16* x, int64_t rows, int64_t cols, Scaling scaling) {
  std::vector<float> amax(size_t(group_count(rows, cols, scaling)), 0.0f);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      float& a = amax[size_t(group_of(r, c, cols, scaling))];
      a = std::fmax(a, std::fabs(bf16_to_f32(x[r * cols + c])));
    }
  return amax;
}

Status check_block_multiple(int64_t rows, int64_t cols, const char* what) {
  if (rows < 1 || cols < 1)
    return errorf("mor: %s needs a non-empty tensor; got [%lld, %lld]", what, (long long)rows, (long long)cols);
  if (rows % kBlock != 0 || cols % kBlock != 0)
    return errorf("mor: %s needs rows and cols that are multiples of %lld; got [%lld, %lld]", what, (long long)kBlock,
                  (long long)rows, (long long)cols);
  return Status::ok();
}

// The statistic and the non-finite flag of the elements of one 128x128 block against x_hat of that block.
ErrorStat block_stat(const bf16* x, const std::vector<float>& x_hat, int64_t cols, int64_t br, int64_t bc) {
  ErrorStat s;
  for (int64_t r = br * kBlock; r < (br + 1) * kBlock; ++r)
    for (int64_t c = bc * kBlock; c < (bc + 1) * kBlock; ++c) {
      const float v = bf16_to_f32(x[r * cols + c]);
      if (!std::isfinite(v)) {
        s.nonfinite = true;
        continue;
      }
      if (v == 0.0f) continue;
      s.err_fixed += element_error_fixed(v, x_hat[size_t(r * cols + c)]);
      ++s.nonzero;
    }
  return s;
}

// amax and the smallest non-zero |x| of one 128x128 block.
void block_range(const bf16* x, int64_t cols, int64_t br, int64_t bc, float* amax, float* min_nonzero) {
  *amax = 0.0f;
  *min_nonzero = INFINITY;
  for (int64_t r = br * kBlock; r < (br + 1) * kBlock; ++r)
    for (int64_t c = bc * kBlock; c < (bc + 1) * kBlock; ++c) {
      const float a = std::fabs(bf16_to_f32(x[r * cols + c]));
      if (!std::isfinite(a)) continue;
      *amax = std::fmax(*amax, a);
      if (a > 0.0f) *min_nonzero = std::fmin(*min_nonzero, a);
    }
}

BlockDecision decide_one_block(const ErrorStat& e4m3, const ErrorStat& e5m2, float amax, float min_nonzero,
                               const BlockRule& rule) {
  BlockDecision d;
  d.e4m3 = e4m3;
  d.e5m2 = e5m2;
  // The choice is the one training makes (mor_block.h); the reason says which test kept a block BF16.
  d.choice = block_rule_choice(rule, e4m3.err_fixed, e5m2.err_fixed, uint64_t(e4m3.nonzero), e4m3.nonfinite, amax,
                               min_nonzero);
  d.reason = d.choice != Choice::bf16 ? Reason::below_threshold
             : e4m3.nonfinite         ? Reason::nonfinite
             : rule.three_way         ? Reason::range
                                      : Reason::above_threshold;
  return d;
}

}  // namespace

const char* scaling_name(Scaling s) {
  switch (s) {
    case Scaling::tensor: return "tensor";
    case Scaling::block: return "block";
    case Scaling::channel: return "channel";
  }
  return "?";
}

const char* scale_mode_name(ScaleMode m) {
  switch (m) {
    case ScaleMode::amax: return "amax";
    case ScaleMode::gam: return "gam";
    case ScaleMode::pow2: return "pow2";
  }
  return "?";
}

const char* choice_name(Choice c) {
  switch (c) {
    case Choice::fp8_e4m3: return "e4m3";
    case Choice::fp8_e5m2: return "e5m2";
    case Choice::bf16: return "bf16";
    case Choice::nvfp4: return "nvfp4";
  }
  return "?";
}

uint64_t element_error_fixed(float x, float x_hat) {
  if (x == 0.0f) return 0;
  float e = std::fabs(x - x_hat) / std::fabs(x);
  if (!(e < 1.0f)) e = 1.0f;              // saturation (and a non-finite x_hat) counts as a whole element's error
  return uint64_t(e * float(kFixedOne));  // exact power-of-two scaling, then truncation
}

ErrorStat error_stat_ref(const bf16* x, const float* x_hat, int64_t n) {
  ErrorStat s;
  for (int64_t i = 0; i < n; ++i) {
    const float v = bf16_to_f32(x[i]);
    if (!std::isfinite(v)) {
      s.nonfinite = true;
      continue;
    }
    if (v == 0.0f) continue;
    s.err_fixed += element_error_fixed(v, x_hat[i]);
    ++s.nonzero;
  }
  return s;
}

bool below_threshold(const ErrorStat& s, double threshold) {
  return !s.nonfinite && fixed_below_threshold(s.err_fixed, uint64_t(s.nonzero), threshold);
}

uint8_t gam_exponent_byte(float gam_scale) { return uint8_t((f32_bits(gam_scale) >> 23) & 0xFFu); }

Status fp8_scales_ref(const bf16* x, int64_t rows, int64_t cols, fp8::Format fmt, Scaling scaling, ScaleMode mode,
                      std::vector<float>* scales, float whole_amax) {
  if (scaling == Scaling::block) NB_TRY(check_block_multiple(rows, cols, "block scaling"));
  if (rows < 1 || cols < 1) return errorf("mor: empty tensor [%lld, %lld]", (long long)rows, (long long)cols);
  const float max = fp8::format_max(fmt);
  std::vector<float> amax = group_amax(x, rows, cols, scaling);
  if (scaling == Scaling::tensor && whole_amax >= 0.0f) amax[0] = whole_amax;
  scales->resize(amax.size());
  for (size_t g = 0; g < amax.size(); ++g) (*scales)[g] = fp8::scale_from_amax(amax[g], max, mode == ScaleMode::pow2);
  if (mode == ScaleMode::gam && scaling != Scaling::tensor) {
    float tensor_amax = whole_amax;  // a shard: the whole tensor's
    if (tensor_amax < 0.0f) tensor_amax = *std::max_element(amax.begin(), amax.end());
    const float m = gam_mantissa(fp8::scale_from_amax(tensor_amax, max, false));
    for (float& s : *scales) s = gam_group_scale(m, s);
  }
  return Status::ok();
}

void fp8_fake_quantize_ref(const bf16* x, int64_t rows, int64_t cols, fp8::Format fmt, Scaling scaling,
                           const std::vector<float>& scales, std::vector<float>* x_hat) {
  x_hat->resize(size_t(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const float scale = scales[size_t(group_of(r, c, cols, scaling))];
      const float v = bf16_to_f32(x[r * cols + c]);
      (*x_hat)[size_t(r * cols + c)] = fp8::decode(fp8::encode(v * scale, fmt), fmt) * (1.0f / scale);
    }
}

Status tensor_stat_ref(const bf16* x, int64_t rows, int64_t cols, const TensorRule& rule, float whole_amax,
                       ErrorStat* out) {
  std::vector<float> scales, x_hat;
  NB_TRY(fp8_scales_ref(x, rows, cols, fp8::Format::e4m3, rule.scaling, rule.mode, &scales, whole_amax));
  fp8_fake_quantize_ref(x, rows, cols, fp8::Format::e4m3, rule.scaling, scales, &x_hat);
  *out = error_stat_ref(x, x_hat.data(), rows * cols);
  return Status::ok();
}

TensorDecision decide_from_stat(const ErrorStat& s, double threshold) {
  TensorDecision d;
  d.stat = s;
  if (s.nonfinite) {
    d.reason = Reason::nonfinite;
  } else if (below_threshold(s, threshold)) {
    d.choice = Choice::fp8_e4m3;
    d.reason = Reason::below_threshold;
  }
  return d;
}

Status decide_tensor_ref(const bf16* x, int64_t rows, int64_t cols, const TensorRule& rule, TensorDecision* out) {
  ErrorStat s;
  NB_TRY(tensor_stat_ref(x, rows, cols, rule, -1.0f, &s));
  *out = decide_from_stat(s, rule.threshold);
  return Status::ok();
}

std::array<double, 4> stat_to_sum(const ErrorStat& s) {
  return {double(s.err_fixed >> 32), double(s.err_fixed & 0xFFFFFFFFu), double(s.nonzero), s.nonfinite ? 1.0 : 0.0};
}

ErrorStat stat_from_sum(const std::array<double, 4>& sum) {
  ErrorStat s;
  s.err_fixed = (uint64_t(sum[0]) << 32) + uint64_t(sum[1]);  // the low halves' carries land in the high bits
  s.nonzero = int64_t(sum[2]);
  s.nonfinite = sum[3] > 0.0;
  return s;
}

Status decide_blocks_ref(const bf16* x, int64_t rows, int64_t cols, const BlockRule& rule,
                         std::vector<BlockDecision>* out) {
  NB_TRY(check_block_multiple(rows, cols, "the sub-tensor rule"));
  std::vector<float> s4, s5, x4, x5;
  NB_TRY(fp8_scales_ref(x, rows, cols, fp8::Format::e4m3, Scaling::block, rule.mode, &s4));
  fp8_fake_quantize_ref(x, rows, cols, fp8::Format::e4m3, Scaling::block, s4, &x4);
  if (rule.three_way) {
    NB_TRY(fp8_scales_ref(x, rows, cols, fp8::Format::e5m2, Scaling::block, rule.mode, &s5));
    fp8_fake_quantize_ref(x, rows, cols, fp8::Format::e5m2, Scaling::block, s5, &x5);
  }
  const int64_t brows = rows / kBlock, bcols = cols / kBlock;
  out->assign(size_t(brows * bcols), BlockDecision{});
  for (int64_t br = 0; br < brows; ++br)
    for (int64_t bc = 0; bc < bcols; ++bc) {
      const ErrorStat e4 = block_stat(x, x4, cols, br, bc);
      const ErrorStat e5 = rule.three_way ? block_stat(x, x5, cols, br, bc) : ErrorStat{};
      float amax = 0.0f, min_nonzero = 0.0f;
      block_range(x, cols, br, bc, &amax, &min_nonzero);
      (*out)[size_t(br * bcols + bc)] = decide_one_block(e4, e5, amax, min_nonzero, rule);
    }
  return Status::ok();
}

}  // namespace nb::mor
