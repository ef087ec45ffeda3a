// The Wgrad error measurement of StatsAccumulator (linear_stats.h): the BF16 input copy kept by forward,
// dW_q isolated around the recipe's Wgrad GEMM, dW_ref and the RHT-toggled alternative, all in a
// StatsScratch. One code path for both backends: ops, gemm::matmul and gemm::matmul_quantized pick the
// device from their tensors, the NVFP4 quantizer is called as QCopies::quantize calls it.
#include <chrono>
#include <cmath>
#include "core/bf16.h"
#include "core/memory_ledger.h"
#include "formats/nvfp4/nvfp4.h"
#include "gemm/gemm.h"
#include "gemm/gemm_quantized.h"
#include "ops/elementwise.h"
#include "recipe/linear_device.h"
#include "recipe/linear_internal.h"
#include "recipe/linear_stats.h"

namespace nb::recipe {

namespace {

// Bytes of an NVFP4 column-wise copy of a [rows, cols] source: data [cols, rows/2], scales [cols, rows/16].
size_t nvfp4_col_bytes(int64_t rows, int64_t cols) {
  return align256(size_t(rows * cols / 2)) + align256(size_t(rows * cols / 16));
}

bool has_alt(const Recipe& r) {
  return r.input.fmt == Fmt::nvfp4 && r.grad.fmt == Fmt::nvfp4 && !r.input.two_d && !r.grad.two_d;
}

// Wall time of one statistics pass. On cuda the queue is drained first (untimed) so that the pass does
// not count training kernels queued before it, and again at the end so that it counts its own.
struct PassTimer {
  Device dev;
  std::chrono::steady_clock::time_point t0;
  explicit PassTimer(Device d) : dev(d) {
    if (dev == Device::cuda) device_synchronize();
    t0 = std::chrono::steady_clock::now();
  }
  double ms() const {
    if (dev == Device::cuda) device_synchronize();
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  }
};

// The alternative column-wise copy of a BF16 source [rows, cols] into `data` (nvfp4_col_bytes), with the
// role's options but `rht`, and its operand for gemm::matmul_quantized (as QCopies::col_operand).
Status quantize_alt(const bf16* src, int64_t rows, int64_t cols, const RoleSpec& spec, bool rht, RngKey key, Device dev,
                    uint8_t* data, float* amax, Stream stream, gemm::QOperand* op) {
  nvfp4::Options o;
  o.rowwise = false;
  o.colwise = true;
  o.rht = rht;
  o.sr = spec.sr;
  o.four_over_six = spec.four_over_six;
  o.err_mode = spec.four_over_six_err;
  o.rng = key;
  uint8_t* scales = data + align256(size_t(rows * cols / 2));
  nvfp4::QuantizedView v{rows, cols, nullptr, nullptr, data, scales, amax, amax + 1, nullptr};
  NB_TRY(dev == Device::cuda ? nvfp4::quantize_cuda(src, o, v, stream) : nvfp4::quantize_ref(src, o, v));
  *op = gemm::QOperand{};
  op->format = gemm::QFormat::nvfp4;
  op->rows = cols;
  op->k = rows;
  op->data = data;
  op->scales = scales;
  op->amax = amax + 1;
  op->k_major = true;
  op->nvfp4_4over6 = spec.four_over_six;
  return Status::ok();
}

}  // namespace

Status StatsScratch::reserve(int64_t f32_elements, size_t bytes) {
  MemoryScope scope(MemPart::quant_stats);  // the estimate's row for --quant-stats
  if (f32_elements > f32_cap_) {
    f32_.reset();  // free first: the old contents are dead and its memory may be needed
    NB_TRY(Buffer::allocate(&f32_, DType::f32, dev_, {f32_elements}));
    f32_cap_ = f32_elements;
  }
  if (bytes > bytes_cap_) {
    bytes_.reset();
    NB_TRY(Buffer::allocate(&bytes_, DType::u8, dev_, {int64_t(bytes)}));
    bytes_cap_ = bytes;
  }
  if (!sums_.data()) NB_TRY(Buffer::allocate(&sums_, DType::f32, dev_, {kSums}));
  return Status::ok();
}

Tensor StatsScratch::f32(int64_t rows, int64_t cols) const {
  return Tensor::make(f32_.data(), DType::f32, dev_, {rows, cols});
}

size_t StatsScratch::allocated() const { return size_t(f32_cap_) * 4 + bytes_cap_ + (sums_.data() ? kSums * 4 : 0); }

void StatsAccumulator::set_collect(bool on, std::shared_ptr<StatsScratch> scratch) {
  if (scratch) scratch_ = std::move(scratch);
  armed_ = on;
  x_kept_ = false;
}

size_t StatsAccumulator::input_copy_bytes() const { return x_.data() ? size_t(x_.tensor().bytes()) : 0; }

// Forward of the measured micro-batch: x (bf16 on cuda; f32 on the cpu, rounded to BF16 here as the
// quantizer rounds it) into the Linear's BF16 copy, which backward reads after the model reused x.
Status StatsAccumulator::keep_input(const Linear::Impl& s, const Tensor& x, Stream stream) {
  if (!armed_ || s.frozen || s.all_bf16) return Status::ok();
  PassTimer timer(s.dev);
  if (!x_.data()) {
    MemoryScope scope(MemPart::quant_stats);
    Status st = Buffer::allocate(&x_, DType::bf16, s.dev, {s.max_tokens, s.in});
    if (!st)
      return errorf(
          "--quant-stats: linear '%s' could not allocate %lld bytes for the BF16 copy of its input that the "
          "Wgrad error needs (%s)",
          s.name.c_str(), (long long)(s.max_tokens * s.in * 2), st.message().c_str());
  }
  const int64_t m = x.shape[0];
  ops::cast(x, Tensor::make(x_.data(), DType::bf16, s.dev, {m, s.in}), stream);
  x_rows_ = m;
  x_kept_ = true;
  ms_ += timer.ms();
  return Status::ok();
}

// Before the Wgrad GEMM: dw_f32 as it stands, so that after the GEMM the difference is this micro-batch's dW_q.
Status StatsAccumulator::before_wgrad(const Linear::Impl& s, const Tensor& dw_f32, Stream stream) {
  if (!x_kept_) return Status::ok();
  PassTimer timer(s.dev);
  if (!scratch_) scratch_ = std::make_shared<StatsScratch>(s.dev);
  const size_t alt = has_alt(s.recipe) ? nvfp4_col_bytes(s.max_tokens, s.in) + nvfp4_col_bytes(s.max_tokens, s.out) : 0;
  Status st = scratch_->reserve(s.out * s.in, alt);
  if (!st)
    return errorf("--quant-stats: linear '%s' could not allocate the Wgrad comparison's scratch (%s)", s.name.c_str(),
                  st.message().c_str());
  ops::cast(dw_f32, scratch_->f32(s.out, s.in), stream);
  ms_ += timer.ms();
  return Status::ok();
}

Status StatsAccumulator::after_wgrad(const Linear::Impl& s, const Tensor& dy, const Tensor& dw_f32, Stream stream) {
  if (!x_kept_) return Status::ok();
  x_kept_ = false;
  armed_ = false;  // one micro-batch per arming
  if (dy.shape[0] != x_rows_)
    return errorf("--quant-stats: linear '%s' kept a %lld-token input but its backward got %lld tokens", s.name.c_str(),
                  (long long)x_rows_, (long long)dy.shape[0]);
  PassTimer timer(s.dev);
  const Tensor a = scratch_->f32(s.out, s.in);
  ops::scale_inplace(a, -1.f, stream);  // a = dw_after - dw_before = dW_q
  ops::add_inplace(a, dw_f32, stream);
  NB_TRY(measure(s, dy, a, stream));
  ms_ += timer.ms();
  return Status::ok();
}

// a = dW_q on entry. The reference GEMM runs twice (into a - dW_ref, then dW_ref alone) so that one
// weight-sized FP32 buffer suffices; then the alternative's error, and one synchronizing read of the sums.
Status StatsAccumulator::measure(const Linear::Impl& s, const Tensor& dy, const Tensor& a, Stream stream) {
  const int64_t m = x_rows_;
  const bf16* xb = x_.ptr<bf16>();
  const bf16* dyb = nullptr;
  Tensor xr = Tensor::make(x_.data(), DType::bf16, s.dev, {m, s.in}), dyr = dy;
  StatsScratch& sc = *scratch_;
  if (s.dev == Device::cuda) {
    dyb = dy.ptr<bf16>();
  } else {  // the FP32 GEMM on the BF16-rounded values the quantizers read
    sc.host_x.resize(size_t(m * s.in));
    sc.host_dy.resize(size_t(m * s.out));
    sc.host_dy_bf16.resize(size_t(m * s.out));
    for (int64_t i = 0; i < m * s.in; ++i) sc.host_x[size_t(i)] = bf16_to_f32(xb[i]);
    for (int64_t i = 0; i < m * s.out; ++i) {
      sc.host_dy_bf16[size_t(i)] = f32_to_bf16(dy.ptr<float>()[i]);
      sc.host_dy[size_t(i)] = bf16_to_f32(sc.host_dy_bf16[size_t(i)]);
    }
    xr = Tensor::make(sc.host_x.data(), DType::f32, s.dev, {m, s.in});
    dyr = Tensor::make(sc.host_dy.data(), DType::f32, s.dev, {m, s.out});
    dyb = sc.host_dy_bf16.data();
  }
  float* sums = sc.sums();
  ops::fill(Tensor::make(sums, DType::f32, s.dev, {StatsScratch::kSums}), 0.f, stream);
  NB_TRY(gemm::matmul(dyr, xr, a, {.trans_a = true, .alpha = -1.f, .beta = 1.f}, stream));  // dW_q - dW_ref
  ops::sum_squares_accumulate(a, sums + 0, stream);
  NB_TRY(gemm::matmul(dyr, xr, a, {.trans_a = true}, stream));  // dW_ref
  ops::sum_squares_accumulate(a, sums + 1, stream);
  const bool alt = has_alt(s.recipe);
  if (alt) NB_TRY(alt_wgrad(s, xb, dyb, m, a, stream));
  float h[3] = {0, 0, 0};
  if (s.dev == Device::cuda)
    NB_TRY(detail::copy_to_host_cuda(h, sums, sizeof h, stream));
  else
    std::copy(sums, sums + 3, h);
  noise_sq_ += double(h[0]);
  grad_sq_ += double(h[1]);
  alt_sq_ += double(h[2]);
  wgrad_.measured = true;
  wgrad_.has_alt = alt;
  wgrad_.alt_rht = !(s.recipe.input.rht && s.recipe.grad.rht);
  return Status::ok();
}

// a = dW_ref on entry: a becomes dW_alt - dW_ref, its sum of squares goes to sums[2].
Status StatsAccumulator::alt_wgrad(const Linear::Impl& s, const bf16* x, const bf16* dy, int64_t m, const Tensor& a,
                                   Stream stream) {
  const bool rht = !(s.recipe.input.rht && s.recipe.grad.rht);
  StatsScratch& sc = *scratch_;
  float* sums = sc.sums();
  gemm::QOperand xo, dyo;
  uint8_t* xd = sc.bytes();
  uint8_t* dyd = xd + nvfp4_col_bytes(m, s.in);
  // The SR keys the Linear used for this micro-batch (its counter moves on only after backward).
  NB_TRY(quantize_alt(x, m, s.in, s.recipe.input, rht, s.rng_key(Role::input), s.dev, xd, sums + 3, stream, &xo));
  NB_TRY(quantize_alt(dy, m, s.out, s.recipe.grad, rht, s.rng_key(Role::grad), s.dev, dyd, sums + 5, stream, &dyo));
  ops::scale_inplace(a, -1.f, stream);
  NB_TRY(gemm::matmul_quantized(dyo, xo, a, {1.f, false}, stream).context("linear '" + s.name + "' Wgrad (stats)"));
  ops::sum_squares_accumulate(a, sums + 2, stream);
  return Status::ok();
}

}  // namespace nb::recipe
