// Shared by the CPU and GPU quantized-GEMM tests: random BF16 sources, the quantized copies of one
// source in every format (buffers sized per the format headers), the QOperand views of the row-wise
// and column-wise copies, and the independent reference: each copy dequantized with the FORMAT's own
// dequantize_ref (FP32 x_hat, not the GEMM's decoder), then products summed in FP64.
//
// Sources: x[r][c] = u * 2^(er[r] + ec[c]) with u uniform in [-1, 1] and er, ec in [-3, 3], so both
// row-wise and column-wise blocks see different scales: a scale applied to the wrong block changes
// the result by about the size of the result itself, far above the tolerances.
#pragma once
#include <cmath>
#include <cstdint>
#include <vector>
#include "core/bf16.h"
#include "formats/fp8/fp8.h"
#include "formats/fp8/fp8_block.h"
#include "formats/mxfp8/mxfp8.h"
#include "formats/nvfp4/nvfp4.h"
#include "gemm/gemm_quantized.h"

namespace nb::gemm::testing {

struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 1) {}
  uint32_t next() {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return uint32_t(s >> 32);
  }
  float uniform() { return float(next() >> 8) / 8388608.f - 1.f; }  // [-1, 1)
};

inline std::vector<bf16> make_source(int64_t rows, int64_t cols, uint64_t seed) {
  Rng rng(seed);
  std::vector<int> er(static_cast<size_t>(rows)), ec(static_cast<size_t>(cols));
  for (auto& e : er) e = int(rng.next() % 7) - 3;
  for (auto& e : ec) e = int(rng.next() % 7) - 3;
  std::vector<bf16> x(size_t(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      x[size_t(r * cols + c)] = f32_to_bf16(std::ldexp(rng.uniform(), er[size_t(r)] + ec[size_t(c)]));
  return x;
}

// Buffer slots of one quantized source: 0 row data, 1 row scales, 2 col data, 3 col scales,
// 4 row amax (fp8 per-tensor: amax; scale_inv is slot 1), 5 col amax (nvfp4).
enum Slot { kRowData, kRowScales, kColData, kColScales, kRowAmax, kColAmax, kSlots };

inline void slot_bytes(QFormat f, int64_t r, int64_t c, size_t out[kSlots]) {
  const size_t n = size_t(r * c);
  for (int i = 0; i < kSlots; ++i) out[i] = 4;
  switch (f) {
    case QFormat::fp8_e4m3:
    case QFormat::fp8_e5m2: out[kRowData] = out[kColData] = n; break;
    case QFormat::fp8_block128:
    case QFormat::fp8_block128x128: {
      const auto kind = f == QFormat::fp8_block128 ? fp8::BlockKind::vec128 : fp8::BlockKind::blk128x128;
      out[kRowData] = out[kColData] = n;
      out[kRowScales] = 4 * size_t(fp8::block_scale_count(kind, r, c, false));
      out[kColScales] = 4 * size_t(fp8::block_scale_count(kind, r, c, true));
      break;
    }
    case QFormat::mxfp8:
      out[kRowData] = out[kColData] = n;
      out[kRowScales] = out[kColScales] = n / 32;
      break;
    case QFormat::nvfp4:
      out[kRowData] = out[kColData] = n / 2;
      out[kRowScales] = out[kColScales] = n / 16;
      break;
    case QFormat::bf16: break;  // not a quantizer's output (bf16_operand below)
  }
}

// Runs the format's quantizer (host or device pointers in p[]); `cuda` picks *_cuda over *_ref.
inline Status quantize_source(QFormat f, const bf16* x, int64_t r, int64_t c, void* const p[kSlots], bool cuda) {
  auto u8 = [&](int i) { return static_cast<uint8_t*>(p[i]); };
  auto f32 = [&](int i) { return static_cast<float*>(p[i]); };
  switch (f) {
    case QFormat::fp8_e4m3:
    case QFormat::fp8_e5m2: {
      const auto fmt = f == QFormat::fp8_e4m3 ? fp8::Format::e4m3 : fp8::Format::e5m2;
      fp8::TensorView v{r, c, u8(kRowData), u8(kColData), f32(kRowScales), f32(kRowAmax), nullptr};
      return cuda ? fp8::quantize_current_cuda(x, fmt, false, v) : fp8::quantize_current_ref(x, fmt, false, v);
    }
    case QFormat::fp8_block128:
    case QFormat::fp8_block128x128: {
      fp8::BlockOptions o;
      o.kind = f == QFormat::fp8_block128 ? fp8::BlockKind::vec128 : fp8::BlockKind::blk128x128;
      fp8::BlockView v{r, c, u8(kRowData), f32(kRowScales), u8(kColData), f32(kColScales), nullptr};
      return cuda ? fp8::quantize_block_cuda(x, o, v) : fp8::quantize_block_ref(x, o, v);
    }
    case QFormat::mxfp8: {
      mxfp8::QuantizedView v{r, c, u8(kRowData), u8(kRowScales), u8(kColData), u8(kColScales), nullptr};
      return cuda ? mxfp8::quantize_cuda(x, {}, v) : mxfp8::quantize_ref(x, {}, v);
    }
    case QFormat::nvfp4: {
      nvfp4::QuantizedView v{
          r, c, u8(kRowData), u8(kRowScales), u8(kColData), u8(kColScales), f32(kRowAmax), f32(kColAmax), nullptr};
      return cuda ? nvfp4::quantize_cuda(x, {}, v, nullptr) : nvfp4::quantize_ref(x, {}, v);
    }
    case QFormat::bf16: break;
  }
  return errorf("unknown format");
}

// The GEMM operand of the row-wise copy ([r, K=c]) or the column-wise copy ([c, K=r]).
inline QOperand operand_view(QFormat f, int64_t r, int64_t c, void* const p[kSlots], bool col) {
  QOperand q;
  q.format = f;
  q.rows = col ? c : r;
  q.k = col ? r : c;
  q.data = p[col ? kColData : kRowData];
  const bool per_tensor = f == QFormat::fp8_e4m3 || f == QFormat::fp8_e5m2;
  q.scales = p[per_tensor ? kRowScales : (col ? kColScales : kRowScales)];
  if (f == QFormat::nvfp4) q.amax = static_cast<const float*>(p[col ? kColAmax : kRowAmax]);
  if (f == QFormat::mxfp8 && col) q.k_major = false;  // MXFP8 keeps its column-wise copy un-transposed
  return q;
}

// x_hat of the operand, [rows, K] row-major (K-major), from host buffers, with the format's decoder.
inline std::vector<float> operand_xhat(QFormat f, int64_t r, int64_t c, void* const h[kSlots], bool col) {
  std::vector<float> out(size_t(r * c));
  auto u8 = [&](int i) { return static_cast<const uint8_t*>(h[i]); };
  auto f32 = [&](int i) { return *static_cast<const float*>(h[i]); };
  switch (f) {
    case QFormat::fp8_e4m3:
    case QFormat::fp8_e5m2:
      fp8::dequantize_ref(u8(col ? kColData : kRowData), r * c,
                          f == QFormat::fp8_e4m3 ? fp8::Format::e4m3 : fp8::Format::e5m2, f32(kRowScales), out.data());
      break;
    case QFormat::fp8_block128:
    case QFormat::fp8_block128x128:
      fp8::dequantize_block_ref(
          u8(col ? kColData : kRowData), static_cast<const float*>(h[col ? kColScales : kRowScales]),
          f == QFormat::fp8_block128 ? fp8::BlockKind::vec128 : fp8::BlockKind::blk128x128, r, c, col, out.data());
      break;
    case QFormat::mxfp8:
      if (!col) {
        mxfp8::dequantize_ref(u8(kRowData), u8(kRowScales), r, c, false, out.data());
      } else {
        std::vector<float> stored(size_t(r * c));
        mxfp8::dequantize_ref(u8(kColData), u8(kColScales), r, c, true, stored.data());
        for (int64_t i = 0; i < r; ++i)
          for (int64_t j = 0; j < c; ++j) out[size_t(j * r + i)] = stored[size_t(i * c + j)];
      }
      break;
    case QFormat::nvfp4:
      if (!col)
        nvfp4::dequantize_ref(u8(kRowData), u8(kRowScales), f32(kRowAmax), r, c, out.data());
      else
        nvfp4::dequantize_ref(u8(kColData), u8(kColScales), f32(kColAmax), c, r, out.data());
      break;
    case QFormat::bf16: break;  // bf16_xhat below
  }
  return out;
}

// Reference of one output element: FP64 sum of x_hat products; also S = sum |products|.
inline double ref_dot(const float* a_row, const float* b_row, int64_t k, double* abs_sum) {
  double acc = 0.0, s = 0.0;
  for (int64_t i = 0; i < k; ++i) {
    const double prod = double(a_row[i]) * double(b_row[i]);
    acc += prod;
    s += std::fabs(prod);
  }
  *abs_sum = s;
  return acc;
}

// A BF16 operand (Mixture of Representations' fallback) over `values`: [rows, k], or stored [k, rows] when
// !k_major; and its values as [rows, k] floats (x_hat of a BF16 operand is the operand itself).
inline QOperand bf16_operand(const bf16* values, int64_t rows, int64_t k, bool k_major) {
  QOperand op;
  op.format = QFormat::bf16;
  op.rows = rows;
  op.k = k;
  op.data = values;
  op.k_major = k_major;
  return op;
}
inline std::vector<float> bf16_xhat(const std::vector<bf16>& v, int64_t rows, int64_t k, bool k_major) {
  std::vector<float> out(size_t(rows * k));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t kk = 0; kk < k; ++kk)
      out[size_t(r * k + kk)] = bf16_to_f32(k_major ? v[size_t(r * k + kk)] : v[size_t(kk * rows + r)]);
  return out;
}

}  // namespace nb::gemm::testing
