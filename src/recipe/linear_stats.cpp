// StatsAccumulator (linear_stats.h): host-side flushed / saturated / SQNR of a role's row-wise copy, and
// the report of everything collected (take). The Wgrad measurement is in linear_stats_wgrad.cpp.
#include "recipe/linear_stats.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <vector>
#include "formats/fp8/fp8_block.h"
#include "formats/nvfp4/nvfp4.h"
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

// Rows of a row-wise copy the statistics read: all of them up to kSampleElements elements, beyond that
// every stride-th group of 16 rows (whole rows keep their blocks and scales; groups of 16 keep the
// operand a valid NVFP4 shape, whose rows are a multiple of 16). Reading every element made a
// statistics step of llama-125m cost minutes (host dequantization of every copy of every micro-batch);
// about 64K elements per quantization estimate fractions of a few percent to well under 1% absolute.
// FP8 sub-channel copies are read whole: their 128x128 weight tiles do not split into rows.
constexpr int64_t kSampleElements = int64_t(1) << 16;

static int64_t sample_stride(const QCopies& c) {
  if (c.spec.fmt == Fmt::fp8_block128 || c.spec.fmt == Fmt::fp8_block128x128) return 1;
  const int64_t groups = c.rows / 16, groups_wanted = std::max<int64_t>(1, kSampleElements / (16 * c.cols));
  return std::max<int64_t>(1, (groups + groups_wanted - 1) / groups_wanted);
}

// Bytes per row of the row-wise copy's codes and block scales (formats with per-row layouts), or of the
// whole copy for the FP8 sub-channel formats (read whole, see above).
static void copy_bytes_per_row(const QCopies& c, size_t* data, size_t* scales) {
  const int64_t n = c.rows * c.cols;
  *data = size_t(c.spec.fmt == Fmt::nvfp4 ? c.cols / 2 : c.cols);
  *scales = 0;
  switch (c.spec.fmt) {
    case Fmt::fp8_block128:
    case Fmt::fp8_block128x128:
      *data = size_t(n);
      *scales = 4 * size_t(fp8::block_scale_count(
                        c.spec.fmt == Fmt::fp8_block128 ? fp8::BlockKind::vec128 : fp8::BlockKind::blk128x128, c.rows,
                        c.cols, false));
      break;
    case Fmt::mxfp8: *scales = size_t(c.cols / 32); break;
    case Fmt::nvfp4: *scales = size_t(c.cols / 16); break;
    default: break;
  }
}

// The sampled rows of the BF16 source and of the row-wise copy (codes, scales) on the host.
struct SampledRows {
  int64_t rows = 0;
  std::vector<bf16> x;
  std::vector<uint8_t> data, scales;
};

static Status gather_rows(const QCopies& c, const bf16* src, int64_t stride, SampledRows* out, Stream stream) {
  size_t drow = 0, srow = 0;
  copy_bytes_per_row(c, &drow, &srow);
  if (stride == 1 && (c.spec.fmt == Fmt::fp8_block128 || c.spec.fmt == Fmt::fp8_block128x128)) {
    out->rows = c.rows;
    out->x.resize(size_t(c.rows * c.cols));
    out->data.resize(drow);
    out->scales.resize(srow + 4);
    NB_TRY(to_host(out->x.data(), src, out->x.size() * sizeof(bf16), c.dev, stream));
    NB_TRY(to_host(out->data.data(), c.ptr(c.row_data), drow, c.dev, stream));
    return to_host(out->scales.data(), c.ptr(c.row_scales), srow, c.dev, stream);
  }
  const int64_t groups = (c.rows / 16 + stride - 1) / stride;  // stride counts groups of 16 rows
  out->rows = 16 * groups;
  out->x.resize(size_t(out->rows * c.cols));
  out->data.resize(size_t(out->rows) * drow);
  out->scales.resize(size_t(out->rows) * srow + 4);
  for (int64_t i = 0; i < out->rows; ++i) {
    const int64_t r = (i / 16) * stride * 16 + i % 16;
    NB_TRY(to_host(out->x.data() + i * c.cols, src + r * c.cols, size_t(c.cols) * sizeof(bf16), c.dev, stream));
    NB_TRY(to_host(out->data.data() + size_t(i) * drow, c.ptr(c.row_data) + size_t(r) * drow, drow, c.dev, stream));
    NB_TRY(to_host(out->scales.data() + size_t(i) * srow, c.ptr(c.row_scales) + size_t(r) * srow, srow, c.dev, stream));
  }
  return Status::ok();
}

Status StatsAccumulator::add(const QCopies& c, const bf16* src, Stream stream) {
  // Waits for the training kernels queued so far, so that stats_ms counts this pass only.
  if (c.dev == Device::cuda) device_synchronize();
  const auto t0 = std::chrono::steady_clock::now();
  const bool nvfp4 = c.spec.fmt == Fmt::nvfp4;
  SampledRows rows;
  NB_TRY(gather_rows(c, src, sample_stride(c), &rows, stream));
  const int64_t n = rows.rows * c.cols;
  float state[kStateFloats];
  NB_TRY(to_host(state, c.state_f.data(), sizeof state, c.dev, stream));
  gemm::QOperand op = c.row_operand();
  op.rows = rows.rows;
  op.data = rows.data.data();
  op.scales = (c.spec.fmt == Fmt::fp8_e4m3 || c.spec.fmt == Fmt::fp8_e5m2) ? static_cast<const void*>(&state[kScaleInv])
                                                                           : rows.scales.data();
  op.amax = &state[kRowAmax];
  std::vector<double> xhat(static_cast<size_t>(n));
  NB_TRY(gemm::dequantize_operand_ref(op, xhat.data()));
  const double bound = op.nvfp4_4over6 ? 256.0 : 448.0;  // a 4/6 copy decodes with amax / (6*256)
  const double global = nvfp4 ? double(state[kRowAmax]) / (6.0 * bound) : 1.0;
  Sums& s = roles_[int(c.role)];
  s.fmt = c.spec.fmt;
  const uint32_t top = c.spec.fmt == Fmt::nvfp4 ? 0x7u : c.spec.fmt == Fmt::fp8_e5m2 ? 0x7Bu : 0x7Eu;
  for (int64_t i = 0; i < n; ++i) {
    const double xv = bf16_to_f32(rows.x[size_t(i)]);
    const double qv = xhat[size_t(i)] * global;
    s.sig += xv * xv;
    s.err += (xv - qv) * (xv - qv);
    if (xv != 0) {
      ++s.nonzero;
      if (qv == 0) ++s.flushed;
    }
    const uint32_t code = nvfp4 ? (rows.data[size_t(i / 2)] >> (4 * (i % 2))) & 0xFu : rows.data[size_t(i)];
    if ((nvfp4 ? code & 0x7u : code & 0x7Fu) == top) ++s.saturated;
  }
  s.n += n;
  // The 16 rows of each sampled group are 16 consecutive tokens: whole column-wise (Wgrad) blocks.
  if (nvfp4 && c.role != Role::weight) nvfp4::add_column_block_crests(rows.x.data(), rows.rows, c.cols, &s.crest);
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
    if (s.crest.blocks > 0) {
      rs.has_crest = true;
      rs.crest = s.crest.plain / double(s.crest.blocks);
      rs.crest_rht = s.crest.rht / double(s.crest.blocks);
    }
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
