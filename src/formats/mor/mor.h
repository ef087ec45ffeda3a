// Mixture of Representations (MoR; Su, Dykas, Chrzanowski, Chhugani, arXiv 2512.22804): a tensor, or each
// 128x128 block of it, picks its number format from its own numbers. This is the CPU reference of the
// statistics and the rules (the spec that CUDA matches bit for bit); docs/MOR.md says where nibble departs
// from the paper and why.
//
// The statistic: the mean relative quantization error over the non-zero elements,
//   e_i = min(1, |x_i - x_hat_i| / |x_i|)   (FP32: one exactly rounded subtraction and division)
//   E   = sum_i e_i / n_nonzero
// The sum is kept in fixed point, floor(e_i * 2^32) added as 64-bit integers: integer adds give the same sum
// in any order, so a GPU reduction decides exactly as this reference (a float sum would not). An element
// under round to nearest is off by at most its own magnitude (it rounds to zero or to a neighbour within a
// factor of two), so e_i <= 1 already; the clamp only bounds saturation. 2^32 per element leaves room for
// 2^31 elements, more than any Linear operand of the models nibble trains. An all-zero tensor has E = 0.
// A tensor or block with a NaN or Inf is never quantized: it stays BF16, and the decision says why.
//
// Scales (E4M3 / E5M2, TransformerEngine's compute_scale_from_amax as formats/fp8/fp8.h):
//   amax  each scaling group (the tensor, a 128x128 block, a row) has its own FP32 scale = fp8_max / amax
//   gam   "group amax mantissa": the tensor's FP32 scale gives one shared mantissa m in [1, 2); each group
//         keeps only the 8-bit exponent e of its own scale s, so its scale is m * 2^e, lowered to
//         m * 2^(e-1) when m * 2^e > s (the group's amax would then saturate). Stored: one FP32 mantissa
//         per tensor and one byte per group.
#pragma once
#include <array>
#include <cmath>
#include <cstdint>
#include <vector>
#include "core/bf16.h"
#include "core/macros.h"
#include "core/status.h"
#include "formats/fp8/fp8.h"

namespace nb::mor {

constexpr int64_t kBlock = 128;                  // the sub-tensor rule's blocks and the block scaling's tiles
constexpr double kFixedOne = 4294967296.0;       // 2^32: one element's error of 1 in the fixed-point sum
constexpr double kDefaultE4M3Threshold = 0.045;  // the paper's tensor-level default

// The error statistic of one tensor or block.
struct ErrorStat {
  uint64_t err_fixed = 0;  // sum of floor(e_i * 2^32)
  int64_t nonzero = 0;     // elements with x_i != 0 (finite)
  bool nonfinite = false;  // a NaN or Inf among the inputs
  double mean() const { return nonzero == 0 ? 0.0 : double(err_fixed) / kFixedOne / double(nonzero); }
  void add(const ErrorStat& o) {
    err_fixed += o.err_fixed;
    nonzero += o.nonzero;
    nonfinite = nonfinite || o.nonfinite;
  }
};

// One element's term, as the CUDA kernels compute it: 0 for x == 0 (not counted).
uint64_t element_error_fixed(float x, float x_hat);
// The statistic of x against its dequantized x_hat (n elements): any format's error, NVFP4's included.
ErrorStat error_stat_ref(const bf16* x, const float* x_hat, int64_t n);
// E < threshold, decided on integers and one double product (so both sides decide alike); never with a
// non-finite input. threshold in (0, 1).
bool below_threshold(const ErrorStat& s, double threshold);
// The same on the sum's integers (host and device): one rounding of a double product, the same on both sides.
NB_HD bool fixed_below_threshold(uint64_t err_fixed, uint64_t nonzero, double threshold) {
  return nonzero == 0 || double(err_fixed) < threshold * kFixedOne * double(nonzero);
}

enum class Scaling : uint8_t { tensor, block, channel };  // one scale per tensor, per 128x128 block, per row
// pow2: each group's amax scale rounded down to a power of two (TransformerEngine's blockwise FP8 default): a
// group's FP8 values times 2^k are BF16 values, so the sub-tensor rule's operands train exactly (mor_block.h).
enum class ScaleMode : uint8_t { amax, gam, pow2 };
const char* scaling_name(Scaling s);
const char* scale_mode_name(ScaleMode m);

// GAM's parts: the shared mantissa of the tensor's scale (in [1, 2), as an FP32 value) and a group's scale.
NB_HD float gam_mantissa(float tensor_scale) { return bits_f32((f32_bits(tensor_scale) & 0x007FFFFFu) | 0x3F800000u); }
NB_HD float gam_group_scale(float mantissa, float group_scale) {
  // The group's own exponent: its scale with the mantissa cleared (scales are normal, positive FP32).
  const float pow2 = bits_f32(f32_bits(group_scale) & 0x7F800000u);
  const float s = mantissa * pow2;
  return s > group_scale ? mantissa * (pow2 * 0.5f) : s;
}
// The biased 8-bit exponent a GAM scale stores (its mantissa is the tensor's).
uint8_t gam_exponent_byte(float gam_scale);

// The FP8 scale of every scaling group of x [rows, cols] (rows and cols multiples of 128 for Scaling::block):
// tensor: 1 value; block: [rows/128, cols/128] row-major; channel: [rows]. whole_amax >= 0: x is one rank's rows of
// a tensor whose amax (the MAX of every rank's) this is; the per-tensor scale and GAM's shared mantissa read it in
// place of x's own, so each rank's groups get the scales they have in the whole tensor (rows are whole groups).
Status fp8_scales_ref(const bf16* x, int64_t rows, int64_t cols, fp8::Format fmt, Scaling scaling, ScaleMode mode,
                      std::vector<float>* scales, float whole_amax = -1.0f);
// x_hat of x quantized to fmt with the given group scales (scale_inv = 1 / scale, as TE).
void fp8_fake_quantize_ref(const bf16* x, int64_t rows, int64_t cols, fp8::Format fmt, Scaling scaling,
                           const std::vector<float>& scales, std::vector<float>* x_hat);

// ---- Tensor-level rule: E4M3 when its error is below the threshold, else the whole tensor stays BF16 ----
// nvfp4: the NVFP4 ladder per block only (mor_block.h); the tensor ladder decides its rungs in recipe::MorRung.
enum class Choice : uint8_t { fp8_e4m3, fp8_e5m2, bf16, nvfp4 };
const char* choice_name(Choice c);
enum class Reason : uint8_t { below_threshold, above_threshold, nonfinite, range };
struct TensorDecision {
  Choice choice = Choice::bf16;
  Reason reason = Reason::above_threshold;
  ErrorStat stat;  // the error that decided
};
struct TensorRule {
  Scaling scaling = Scaling::tensor;
  ScaleMode mode = ScaleMode::amax;
  double threshold = kDefaultE4M3Threshold;
};
Status decide_tensor_ref(const bf16* x, int64_t rows, int64_t cols, const TensorRule& rule, TensorDecision* out);
// The rule's statistic of x, one rank's rows of a tensor split by rows with amax whole_amax (see fp8_scales_ref;
// -1: x is the whole tensor). The ranks' statistics summed (stat_to_sum, an all-reduce, stat_from_sum) equal the
// whole tensor's exactly, so every rank then decides alike and as one GPU would (decide_from_stat).
Status tensor_stat_ref(const bf16* x, int64_t rows, int64_t cols, const TensorRule& rule, float whole_amax,
                       ErrorStat* out);
TensorDecision decide_from_stat(const ErrorStat& s, double threshold);
// An ErrorStat as four doubles that a sum over ranks adds exactly (up to 2^21 ranks): the fixed-point sum's high
// and low 32 bits, the non-zero count and the non-finite flag (0 or 1); and the sum back into an ErrorStat.
std::array<double, 4> stat_to_sum(const ErrorStat& s);
ErrorStat stat_from_sum(const std::array<double, 4>& sum);

// ---- Sub-tensor rule: each 128x128 block on its own, scales by `mode` (GAM's group is the tensor) ----
//   two-way:   E4M3 when the block's E4M3 error is below the threshold, else BF16.
//   three-way: E4M3 when its error is below E5M2's; else E5M2 when the block's dynamic range fits E5M2's
//              normal range (amax / smallest non-zero |x| <= 57344 / 2^-14); else BF16.
struct BlockRule {
  bool three_way = false;
  ScaleMode mode = ScaleMode::gam;
  double threshold = kDefaultE4M3Threshold;  // two-way only
};
struct BlockDecision {
  Choice choice = Choice::bf16;
  Reason reason = Reason::above_threshold;
  ErrorStat e4m3, e5m2;  // e5m2 measured by the three-way rule only
};
// Blocks in row-major order over [rows/128, cols/128]; rows and cols multiples of 128.
Status decide_blocks_ref(const bf16* x, int64_t rows, int64_t cols, const BlockRule& rule,
                         std::vector<BlockDecision>* out);
// True when every non-zero |x| of the block lies within E5M2's normal range once its amax is scaled to 57344.
NB_HD bool fits_e5m2_range(float amax, float min_nonzero) {
  if (!(min_nonzero > 0.0f) || min_nonzero == INFINITY) return true;  // no non-zero element: nothing to lose
  return double(amax) / double(min_nonzero) <= double(kE5M2Max) / 6.103515625e-05;  // 57344 / 2^-14
}

}  // namespace nb::mor
