// Optional quantization statistics of a Linear's operands (set_collect_stats): per role, over the
// row-wise copy of every quantization since the last take_health:
//   flushed   share of non-zero source elements that dequantize to 0 (underflow)
//   saturated share of elements stored at the format's largest magnitude code (clipped or at the top
//             of the range: e4m3 448, e5m2 57344, e2m1 6 times the block/tensor scale)
//   sqnr_db   10 log10(sum x^2 / sum (x - x_hat)^2) with x the BF16 source, x_hat the dequantized copy
//   crest     NVFP4 input and grad roles: mean over the sampled column-wise blocks (16 consecutive tokens
//             of one feature, the blocks the Wgrad operands are quantized in) of max|x| / rms(x), all-zero
//             blocks skipped; crest_rht the same after the 16-point RHT (rht16_ref). The RHT raises the FP4
//             error of an operand whose crest factor it lowers and lowers it where it raises the crest
//             factor (tests/nvfp4/rht_study_test.cpp; bench/convergence/NOTES.md).
// The report keeps each role (LinearHealth::roles) and the worst role (largest flushed/saturated,
// smallest SQNR). Computed on the host from copies of the device data (a synchronizing diagnostic, not
// for every step).
//
// Wgrad error (linear_stats_wgrad.cpp), on the first micro-batch after new_step() or after collection
// was turned on (a non-frozen quantized Linear):
//   dW_ref = dY^T X of the BF16 sources (the values the quantizers read), FP32 accumulation: a BF16
//            GEMM with FP32 output on cuda, the FP32 GEMM on the cpu
//   dW_q   = what the recipe's Wgrad GEMM added to dw_f32 for that micro-batch (dw_f32 is copied to the
//            scratch before the GEMM and subtracted after, so the training numerics are untouched)
//   grad_norm = ||dW_ref||, noise_norm = ||dW_q - dW_ref|| (Frobenius; squares summed in FP32 on cuda)
//   NVFP4 Wgrad operands (input and grad nvfp4, 1x16 blocks): dW_alt is the same Wgrad with the random
//   Hadamard transform toggled -- X and dY quantized column-wise with the roles' options except rht (the
//   same SR keys), through gemm::matmul_quantized as the Linear's Wgrad -- and alt_noise_norm its error.
//   The alternative's rht is true unless both of the recipe's Wgrad operands use RHT.
// Memory: X is not kept in BF16 by a quantized Linear, so while collection is on the forward of the
// measured micro-batch copies x into a BF16 buffer owned by the Linear (tokens * in_features * 2 bytes,
// allocated at the first measured forward and kept). The comparison works in a StatsScratch: one FP32
// [out, in] buffer (4 bytes per weight element) plus, for NVFP4, the two alternative column-wise copies
// (9/16 byte per element of X and dY); shared by a model's Linears, it grows to the largest need.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>
#include "core/bf16.h"
#include "core/status.h"
#include "core/stream.h"
#include "core/tensor.h"
#include "formats/nvfp4/nvfp4.h"
#include "recipe/linear.h"

namespace nb::recipe {

struct QCopies;

// The Wgrad comparison's working memory on one device (see the header comment). The Linears that share
// it run one after another on one stream and each finishes (synchronizes) before the next uses it.
class StatsScratch {
 public:
  static constexpr int kSums = 8;  // [noise^2, grad^2, alt^2, x amax row/col, dy amax row/col, spare]
  explicit StatsScratch(Device dev) : dev_(dev) {}
  StatsScratch(const StatsScratch&) = delete;
  StatsScratch& operator=(const StatsScratch&) = delete;
  Device device() const { return dev_; }
  // Grows (never shrinks) to hold `f32_elements` FP32 values and `bytes` bytes.
  Status reserve(int64_t f32_elements, size_t bytes);
  Tensor f32(int64_t rows, int64_t cols) const;  // a view of the FP32 buffer
  uint8_t* bytes() const { return bytes_.ptr<uint8_t>(); }
  float* sums() const { return sums_.ptr<float>(); }  // kSums floats on the device
  size_t allocated() const;                           // bytes held now
  // cpu backend: host temporaries (BF16-rounded operands as FP32, the rounded dY as BF16).
  std::vector<float> host_x, host_dy;
  std::vector<bf16> host_dy_bf16;

 private:
  Device dev_;
  int64_t f32_cap_ = 0;
  size_t bytes_cap_ = 0;
  Buffer f32_, bytes_, sums_;
};

class StatsAccumulator {
 public:
  // src: the BF16 source the copies were made from (device memory when c.dev is cuda).
  Status add(const QCopies& c, const bf16* src, Stream stream);
  // Fills the roles, the worst role, the Wgrad error and stats_ms; then resets.
  void take(LinearHealth* out);

  // Collection on/off (Linear::set_collect_stats); on re-arms the Wgrad measurement.
  void set_collect(bool on, std::shared_ptr<StatsScratch> scratch);
  void arm() { armed_ = true; }  // new_step: the step's first micro-batch is measured
  // Hooks of Linear::forward / backward (linear_stats_wgrad.cpp); no-ops unless a measurement is armed.
  Status keep_input(const Linear::Impl& s, const Tensor& x, Stream stream);
  Status before_wgrad(const Linear::Impl& s, const Tensor& dw_f32, Stream stream);
  Status after_wgrad(const Linear::Impl& s, const Tensor& dy, const Tensor& dw_f32, Stream stream);
  size_t input_copy_bytes() const;  // the BF16 input copy (0 until the first measurement)

 private:
  struct Sums {
    double sig = 0, err = 0;
    int64_t n = 0, nonzero = 0, flushed = 0, saturated = 0;
    Fmt fmt = Fmt::bf16;
    nvfp4::CrestSums crest;
  };
  Status measure(const Linear::Impl& s, const Tensor& dy, const Tensor& a, Stream stream);
  Status alt_wgrad(const Linear::Impl& s, const bf16* x, const bf16* dy, int64_t m, const Tensor& a, Stream stream);

  Sums roles_[3];
  double ms_ = 0;
  // Wgrad measurement: armed -> the next forward keeps x -> its backward measures and disarms.
  bool armed_ = false, x_kept_ = false;
  int64_t x_rows_ = 0;
  Buffer x_;  // BF16 [max_tokens, in] on the Linear's device
  std::shared_ptr<StatsScratch> scratch_;
  WgradQuantStats wgrad_;
  double grad_sq_ = 0, noise_sq_ = 0, alt_sq_ = 0;
};

}  // namespace nb::recipe
