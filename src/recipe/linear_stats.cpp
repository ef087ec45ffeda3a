// StatsAccumulator (linear_stats.h): host-side flushed / saturated / SQNR of a role's row-wise copy, and
// the report of everything collected (take). The Wgrad measurement is in linear_stats_wgrad.cpp.
#include "recipe/linear_stats.h"

#include <chrono>
#include <cmath>
#include <vector>
#include "formats/fp8/fp8_block.h"
#include "gemm/gemm_quantized.h"
#include "recipe/linear_device.h"
#include "recipe/linear_internal.h"

namespace nb::recipe {

using namespace detail;

static Status to_host(void* dst, const void* src, size_t bytes, Device dev, Stream stream) {
  if (bytes == 0) return Status::ok();
  if (dev == Device::cuda) return copy_to_host_cuda(dst, src, bytes, stream);
  std::copy(static_cast<const uint8_t*>(src), static_cast<const uint8_t*>(src) + bytes, static_cast<uint8_t*>(dst));
  return Status::ok();
}

Status StatsAccumulator::add(const QCopies& c, const bf16* src, Stream stream) {
  // Waits for the training kernels queued so far, so that stats_ms counts this pass only.
  if (c.dev == Device::cuda) device_synchronize();
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t n = c.rows * c.cols;
  const bool nvfp4 = c.spec.fmt == Fmt::nvfp4;
  const size_t data_bytes = size_t(nvfp4 ? n / 2 : n);
  size_t scale_bytes = 0;
  switch (c.spec.fmt) {
    case Fmt::fp8_block128:
    case Fmt::fp8_block128x128:
      scale_bytes = 4 * size_t(fp8::block_scale_count(
                            c.spec.fmt == Fmt::fp8_block128 ? fp8::BlockKind::vec128 : fp8::BlockKind::blk128x128,
                            c.rows, c.cols, false));
      break;
    case Fmt::mxfp8: scale_bytes = size_t(n / 32); break;
    case Fmt::nvfp4: scale_bytes = size_t(n / 16); break;
    default: break;
  }
  std::vector<bf16> x(static_cast<size_t>(n));
  std::vector<uint8_t> data(data_bytes), scales(scale_bytes + 4);
  float state[kStateFloats];
  NB_TRY(to_host(x.data(), src, size_t(n) * sizeof(bf16), c.dev, stream));
  NB_TRY(to_host(data.data(), c.ptr(c.row_data), data_bytes, c.dev, stream));
  NB_TRY(to_host(scales.data(), c.ptr(c.row_scales), scale_bytes, c.dev, stream));
  NB_TRY(to_host(state, c.state_f.data(), sizeof state, c.dev, stream));
  gemm::QOperand op = c.row_operand();
  op.data = data.data();
  op.scales = (c.spec.fmt == Fmt::fp8_e4m3 || c.spec.fmt == Fmt::fp8_e5m2) ? static_cast<const void*>(&state[kScaleInv])
                                                                           : scales.data();
  op.amax = &state[kRowAmax];
  std::vector<double> xhat(static_cast<size_t>(n));
  NB_TRY(gemm::dequantize_operand_ref(op, xhat.data()));
  const double global = nvfp4 ? double(state[kRowAmax]) / (6.0 * 448.0) : 1.0;
  Sums& s = roles_[int(c.role)];
  s.fmt = c.spec.fmt;
  for (int64_t i = 0; i < n; ++i) {
    const double xv = bf16_to_f32(x[size_t(i)]);
    const double qv = xhat[size_t(i)] * global;
    s.sig += xv * xv;
    s.err += (xv - qv) * (xv - qv);
    if (xv != 0) {
      ++s.nonzero;
      if (qv == 0) ++s.flushed;
    }
    uint32_t code = nvfp4 ? (data[size_t(i / 2)] >> (4 * (i % 2))) & 0xFu : data[size_t(i)];
    uint32_t top = c.spec.fmt == Fmt::nvfp4 ? 0x7u : c.spec.fmt == Fmt::fp8_e5m2 ? 0x7Bu : 0x7Eu;
    uint32_t mag = nvfp4 ? code & 0x7u : code & 0x7Fu;
    if (mag == top) ++s.saturated;
  }
  s.n += n;
  ms_ += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  return Status::ok();
}

void StatsAccumulator::take(LinearHealth* out) {
  bool any = false;
  for (int r = 0; r < 3; ++r) {
    Sums& s = roles_[r];
    if (s.n == 0) continue;
    RoleQuantStats& rs = out->roles[r];
    rs.seen = true;
    rs.fmt = s.fmt;
    rs.flushed = s.nonzero ? double(s.flushed) / double(s.nonzero) : 0.0;
    rs.saturated = double(s.saturated) / double(s.n);
    rs.sqnr_db = s.err > 0 ? 10.0 * std::log10(s.sig / s.err) : INFINITY;
    out->flushed = any ? std::max(out->flushed, rs.flushed) : rs.flushed;
    out->saturated = any ? std::max(out->saturated, rs.saturated) : rs.saturated;
    out->sqnr_db = any ? std::min(out->sqnr_db, rs.sqnr_db) : rs.sqnr_db;
    any = true;
    s = Sums{};
  }
  // Several measured micro-batches (collection re-armed within a step): norms over all of them.
  if (wgrad_.measured) {
    out->wgrad = wgrad_;
    out->wgrad.grad_norm = std::sqrt(grad_sq_);
    out->wgrad.noise_norm = std::sqrt(noise_sq_);
    out->wgrad.alt_noise_norm = std::sqrt(alt_sq_);
    any = true;
  }
  out->has_stats = any;
  out->stats_ms = ms_;
  wgrad_ = WgradQuantStats{};
  grad_sq_ = noise_sq_ = alt_sq_ = 0;
  ms_ = 0;
}

}  // namespace nb::recipe
