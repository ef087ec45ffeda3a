// matmul_quantized(): validation of the operands against their format's layout rules, the exact CPU
// reference (FP64 dequantization and accumulation), and dispatch to the CUDA paths (cuBLASLt FP8 in
// gemm_fp8_cublaslt.cu, the BF16 emulation of MXFP8/NVFP4 in gemm_emulated.cu). On a CPU-only build
// the CUDA entry points answer with a Status.
#include "gemm/gemm_quantized.h"
#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>
#include "core/bf16.h"
#include "formats/nvfp4/nvfp4_math.h"
#include "formats/scalar_codecs.h"
#include "gemm/gemm_call.h"

namespace nb::gemm {
namespace {

enum class Family { fp8_tensor, fp8_block, mxfp8, nvfp4, bf16 };

Family family_of(QFormat f) {
  switch (f) {
    case QFormat::fp8_e4m3:
    case QFormat::fp8_e5m2: return Family::fp8_tensor;
    case QFormat::fp8_block128:
    case QFormat::fp8_block128x128: return Family::fp8_block;
    case QFormat::mxfp8: return Family::mxfp8;
    case QFormat::nvfp4: return Family::nvfp4;
    case QFormat::bf16: return Family::bf16;
  }
  return Family::fp8_tensor;
}

int64_t round4(int64_t n) { return (n + 3) / 4 * 4; }

// Layout rules of one operand (shapes the quantizers produce and the GEMMs need).
Status check_operand(const QOperand& op, const char* name) {
  const char* fmt = qformat_name(op.format);
  if (op.rows < 0 || op.k <= 0)
    return errorf("matmul_quantized: operand %s (%s) is [%lld, %lld]; need rows >= 0 and K >= 1", name, fmt,
                  (long long)op.rows, (long long)op.k);
  if (op.rows > 0 && (op.data == nullptr || (op.scales == nullptr && op.format != QFormat::bf16)))
    return errorf("matmul_quantized: operand %s (%s) has no data or no scales pointer", name, fmt);
  if (!op.k_major && op.format != QFormat::mxfp8 && op.format != QFormat::nvfp4 && op.format != QFormat::bf16)
    return errorf(
        "matmul_quantized: operand %s (%s) is not K-major; only mxfp8, nvfp4 and bf16 accept an operand "
        "stored [K, rows] -- pass the transposed copy the quantizer writes",
        name, fmt);
  int64_t rows_mult = 1, k_mult = 1;
  switch (op.format) {
    case QFormat::fp8_e4m3:
    case QFormat::fp8_e5m2: k_mult = 16; break;  // cuBLASLt FP8: 16-byte aligned rows
    case QFormat::fp8_block128:
    case QFormat::fp8_block128x128:
      rows_mult = 128;
      k_mult = 128;
      break;
    case QFormat::mxfp8:
      rows_mult = 32;
      k_mult = 32;
      break;
    case QFormat::nvfp4:
      rows_mult = 16;
      k_mult = 32;
      break;  // spec: the GEMM's K is a multiple of 32
    case QFormat::bf16: break;
  }
  if (op.rows % rows_mult != 0 || op.k % k_mult != 0)
    return errorf(
        "matmul_quantized: operand %s (%s) is [%lld, %lld]; this format needs rows a multiple of %lld "
        "and K a multiple of %lld (pad the tensor or use another recipe)",
        name, fmt, (long long)op.rows, (long long)op.k, (long long)rows_mult, (long long)k_mult);
  if (op.dequantized != nullptr && op.format != QFormat::mxfp8 && op.format != QFormat::nvfp4)
    return errorf(
        "matmul_quantized: operand %s (%s) comes with a dequantized BF16 copy, which only the emulated "
        "mxfp8 and nvfp4 GEMMs read; pass it without one",
        name, fmt);
  if (op.format == QFormat::nvfp4 && op.amax == nullptr)
    return errorf("matmul_quantized: nvfp4 operand %s has no amax pointer (the copy's FP32 amax)", name);
  return Status::ok();
}

Status resolve_c(const Tensor& c, int64_t m, int64_t n, detail::CView* out) {
  if (c.ndim != 2 || c.shape[0] != m || c.shape[1] != n)
    return errorf("matmul_quantized: C has shape %s; need [%lld, %lld] (A rows x B rows)", c.shape_str().c_str(),
                  (long long)m, (long long)n);
  if (n > 1 && c.stride[1] != 1)
    return errorf("matmul_quantized: C %s has column stride %lld; the last dimension must be contiguous",
                  c.shape_str().c_str(), (long long)c.stride[1]);
  const int64_t ld = m > 1 ? c.stride[0] : n;
  if (ld < n) return errorf("matmul_quantized: C %s has row stride %lld < N", c.shape_str().c_str(), (long long)ld);
  if (c.device == Device::cpu ? c.dtype != DType::f32 : (c.dtype != DType::f32 && c.dtype != DType::bf16))
    return errorf("matmul_quantized: C on %s is %s; need %s", device_name(c.device),
                  std::string(dtype_name(c.dtype)).c_str(), c.device == Device::cpu ? "f32" : "bf16 or f32");
  if (c.data == nullptr && m * n != 0) return errorf("matmul_quantized: C has no data pointer");
  out->data = c.data;
  out->dtype = c.dtype;
  out->ld = ld < 1 ? 1 : ld;
  return Status::ok();
}

// Decodes an operand's rows exactly (FP64 holds every code x scale product). The element and scale codes go
// through 256-entry tables and the format is chosen once per row, not per element: the CPU recipes' tests spend
// most of their time here and in the product below.
class RefDecoder {
 public:
  explicit RefDecoder(const QOperand& op) : op_(op) {
    for (uint32_t code = 0; code < 256; ++code) {
      switch (op.format) {
        case QFormat::fp8_e5m2: elem_[code] = double(e5m2_to_f32(code)); break;
        case QFormat::nvfp4: elem_[code] = double(e2m1_to_f32(code & 0xFu)); break;
        default: elem_[code] = double(e4m3_to_f32(code)); break;
      }
      scale_[code] = op.format == QFormat::mxfp8 ? double(e8m0_to_f32(code)) : double(e4m3_to_f32(code));
    }
  }

  // Elements (r, 0..K-1) into out[0..K-1].
  void row(int64_t r, double* out) const {
    const int64_t k = op_.k;
    const auto* bytes = static_cast<const uint8_t*>(op_.data);
    const auto* fscales = static_cast<const float*>(op_.scales);
    const auto* bscales = static_cast<const uint8_t*>(op_.scales);
    switch (op_.format) {
      case QFormat::fp8_e4m3:
      case QFormat::fp8_e5m2: {
        const double s = double(*fscales);
        for (int64_t kk = 0; kk < k; ++kk) out[kk] = elem_[bytes[r * k + kk]] * s;
        return;
      }
      case QFormat::fp8_block128:
        for (int64_t kk = 0; kk < k; ++kk)
          out[kk] = elem_[bytes[r * k + kk]] * double(fscales[(kk / 128) * round4(op_.rows) + r]);
        return;
      case QFormat::fp8_block128x128:
        for (int64_t kk = 0; kk < k; ++kk)
          out[kk] = elem_[bytes[r * k + kk]] * double(fscales[(r / 128) * round4(k / 128) + kk / 128]);
        return;
      case QFormat::mxfp8:
        for (int64_t kk = 0; kk < k; ++kk)
          out[kk] = op_.k_major ? elem_[bytes[r * k + kk]] * scale_[bscales[r * (k / 32) + kk / 32]]
                                : elem_[bytes[kk * op_.rows + r]] * scale_[bscales[(kk / 32) * op_.rows + r]];
        return;
      case QFormat::nvfp4:
        for (int64_t kk = 0; kk < k; ++kk) out[kk] = nvfp4_value(r, kk);
        return;
      case QFormat::bf16: {
        const auto* v = static_cast<const bf16*>(op_.data);
        for (int64_t kk = 0; kk < k; ++kk)
          out[kk] = double(bf16_to_f32(op_.k_major ? v[r * k + kk] : v[kk * op_.rows + r]));
        return;
      }
    }
  }

 private:
  // Stored [outer, inner]: K-major [rows, K], else [K, rows]; 16-blocks along inner.
  double nvfp4_value(int64_t r, int64_t kk) const {
    const int64_t o = op_.k_major ? r : kk, i = op_.k_major ? kk : r, inner = op_.k_major ? op_.k : op_.rows;
    const uint8_t byte = static_cast<const uint8_t*>(op_.data)[o * (inner / 2) + i / 2];
    const uint8_t scale = static_cast<const uint8_t*>(op_.scales)[o * (inner / 16) + i / 16];
    return elem_[(i & 1) ? (byte >> 4) : (byte & 0xFu)] * scale_[scale];
  }

  const QOperand& op_;
  std::array<double, 256> elem_{}, scale_{};
};

// Every C element is alpha * (the FP64 sum over kk = 0..K-1, in order, of a(i, kk) * b(j, kk)), plus beta * C,
// rounded once to FP32. A tile of 2 rows x 8 columns of C is summed side by side in two-lane vectors
// (independent sums, none reassociated), reading B transposed, so the result is the plain loop's bit for bit
// (test: CpuQGemm.TiledProductEqualsThePlainLoop).
using F64x2 = double __attribute__((vector_size(16)));
constexpr int64_t kTileCols = 8;

F64x2 load2(const double* p) {
  F64x2 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// Sums the tile at rows (a0, a1) and columns [j0, j0 + 8) of bt [K, n_pad] into out[2][8].
void sum_tile(const double* a0, const double* a1, const double* bt, int64_t n_pad, int64_t j0, int64_t k,
              double out[2][kTileCols]) {
  F64x2 c00{}, c01{}, c02{}, c03{}, c10{}, c11{}, c12{}, c13{};
  for (int64_t kk = 0; kk < k; ++kk) {
    const double* b = bt + kk * n_pad + j0;
    const F64x2 b0 = load2(b), b1 = load2(b + 2), b2 = load2(b + 4), b3 = load2(b + 6);
    const F64x2 x0 = {a0[kk], a0[kk]}, x1 = {a1[kk], a1[kk]};
    c00 += x0 * b0;
    c01 += x0 * b1;
    c02 += x0 * b2;
    c03 += x0 * b3;
    c10 += x1 * b0;
    c11 += x1 * b1;
    c12 += x1 * b2;
    c13 += x1 * b3;
  }
  const F64x2 row0[4] = {c00, c01, c02, c03}, row1[4] = {c10, c11, c12, c13};
  std::memcpy(out[0], row0, sizeof(row0));
  std::memcpy(out[1], row1, sizeof(row1));
}

// The product's two operands dequantized: `rows` [p, K] as stored, `cols` transposed [K, q_pad] (columns past q are
// zeros). Whichever of A and B has fewer rows is the transposed one (the copy costs its size; a weight beside a
// few tokens stays in place); `swapped` says that B is `rows`, so element (p, q) is C's (q, p).
struct DequantizedPair {
  std::vector<double> rows, cols;
  int64_t p = 0, q = 0, q_pad = 0, k = 0;
  bool swapped = false;

  DequantizedPair(const QOperand& a, const QOperand& b) : k(a.k), swapped(b.rows > a.rows) {
    const QOperand& r_op = swapped ? b : a;
    const QOperand& c_op = swapped ? a : b;
    p = r_op.rows;
    q = c_op.rows;
    q_pad = (q + kTileCols - 1) / kTileCols * kTileCols;
    rows.resize(size_t(p * k));
    const RefDecoder dec_r(r_op), dec_c(c_op);
    for (int64_t r = 0; r < p; ++r) dec_r.row(r, &rows[size_t(r * k)]);
    cols.assign(size_t(k * q_pad), 0.0);
    std::vector<double> one(size_t(k), 0.0);
    for (int64_t j = 0; j < q; ++j) {
      dec_c.row(j, one.data());
      for (int64_t kk = 0; kk < k; ++kk) cols[size_t(kk * q_pad + j)] = one[size_t(kk)];
    }
  }
};

// C = alpha * A . B^T + beta * C, tile by tile.
void fp64_product(const DequantizedPair& d, double alpha, float beta, const detail::CView& c) {
  float* cp = static_cast<float*>(c.data);
  double tile[2][kTileCols];
  for (int64_t i = 0; i < d.p; i += 2) {
    const double* a0 = &d.rows[size_t(i * d.k)];
    const double* a1 = i + 1 < d.p ? a0 + d.k : a0;  // an odd last row is summed twice and written once
    for (int64_t j0 = 0; j0 < d.q; j0 += kTileCols) {
      sum_tile(a0, a1, d.cols.data(), d.q_pad, j0, d.k, tile);
      for (int64_t r = 0; r < std::min<int64_t>(2, d.p - i); ++r)
        for (int64_t t = 0; t < std::min(kTileCols, d.q - j0); ++t) {
          const int64_t row = d.swapped ? j0 + t : i + r, col = d.swapped ? i + r : j0 + t;
          float& out = cp[row * c.ld + col];
          double v = alpha * tile[r][t];
          if (beta != 0.f) v += double(beta) * double(out);
          out = float(v);
        }
    }
  }
}

Status matmul_quantized_cpu(const QOperand& a, const QOperand& b, const detail::CView& c, float beta) {
  const DequantizedPair d(a, b);  // operands checked by matmul_quantized
  // NVFP4's global scales (the decoder gives code x block scale); a mixed pair's NVFP4 operand alone, exactly.
  double alpha = 1.0;
  if (a.format == QFormat::nvfp4 && b.format == QFormat::nvfp4)
    alpha = double(nvfp4_global_alpha(*a.amax, *b.amax, a.nvfp4_4over6, b.nvfp4_4over6));
  else if (a.format == QFormat::nvfp4 || b.format == QFormat::nvfp4) {
    const QOperand& q = a.format == QFormat::nvfp4 ? a : b;
    alpha = double(*q.amax) / (6.0 * (q.nvfp4_4over6 ? 256.0 : 448.0));
  }
  fp64_product(d, alpha, beta, c);
  return Status::ok();
}

}  // namespace

const char* qformat_name(QFormat f) {
  switch (f) {
    case QFormat::fp8_e4m3: return "fp8_e4m3";
    case QFormat::fp8_e5m2: return "fp8_e5m2";
    case QFormat::fp8_block128: return "fp8_block128";
    case QFormat::fp8_block128x128: return "fp8_block128x128";
    case QFormat::mxfp8: return "mxfp8";
    case QFormat::nvfp4: return "nvfp4";
    case QFormat::bf16: return "bf16";
  }
  return "?";
}

float nvfp4_alpha_denominator(bool four_over_six_a, bool four_over_six_b) {
  return nvfp4::decode_denominator(four_over_six_a) * nvfp4::decode_denominator(four_over_six_b);  // exact
}

float nvfp4_global_alpha(float amax_a, float amax_b, bool four_over_six_a, bool four_over_six_b) {
  return (amax_a * amax_b) / nvfp4_alpha_denominator(four_over_six_a, four_over_six_b);
}

Status dequantize_operand_ref(const QOperand& op, double* out) {
  NB_TRY(check_operand(op, "operand"));
  const RefDecoder dec(op);
  for (int64_t r = 0; r < op.rows; ++r) dec.row(r, out + r * op.k);
  return Status::ok();
}

Status matmul_quantized(const QOperand& a, const QOperand& b, const Tensor& c, const QGemmOptions& opt, Stream stream) {
  NB_TRY(check_operand(a, "A"));
  NB_TRY(check_operand(b, "B"));
  if (a.k != b.k)
    return errorf("matmul_quantized: A is [%lld, %lld] and B is [%lld, %lld]; both need the same K (A . B^T)",
                  (long long)a.rows, (long long)a.k, (long long)b.rows, (long long)b.k);
  const Family fa = family_of(a.format), fb = family_of(b.format);
  // Mixture of Representations' ladder: NVFP4, per-tensor FP8 and BF16 operands pair with each other ("mixed").
  const auto ladder = [](Family f) { return f == Family::bf16 || f == Family::fp8_tensor || f == Family::nvfp4; };
  const bool mixed = fa != fb || fa == Family::bf16;
  if (mixed && !(ladder(fa) && ladder(fb)))
    return errorf(
        "matmul_quantized: A is %s and B is %s; both operands must come from one recipe (fp8 per-tensor, "
        "fp8 block, mxfp8 or nvfp4), or pair bf16, fp8 per-tensor and nvfp4 with each other",
        qformat_name(a.format), qformat_name(b.format));
  if (fa == Family::fp8_tensor && a.format == QFormat::fp8_e5m2 && b.format == QFormat::fp8_e5m2)
    return errorf(
        "matmul_quantized: E5M2 x E5M2 is not supported by cuBLASLt FP8 GEMMs; quantize one operand "
        "(the weights or activations) as E4M3, as the HYBRID recipe does");
  if (fa == Family::fp8_block && a.format == QFormat::fp8_block128x128 && b.format == QFormat::fp8_block128x128)
    return errorf(
        "matmul_quantized: fp8_block128x128 x fp8_block128x128 is not supported by cuBLASLt (1D x 1D, "
        "1D x 2D and 2D x 1D only); quantize one operand with 1x128 blocks");
  if (opt.fast_accum && (fa != Family::fp8_tensor || mixed))
    return errorf(
        "matmul_quantized: fast_accum is only available for fp8 per-tensor x fp8 per-tensor operands (got %s x %s); "
        "turn it off",
        qformat_name(a.format), qformat_name(b.format));
  detail::CView cv;
  NB_TRY(resolve_c(c, a.rows, b.rows, &cv));
  const int64_t m = a.rows, n = b.rows, k = a.k;
  if (m == 0 || n == 0) return Status::ok();
  if (c.device == Device::cpu) return matmul_quantized_cpu(a, b, cv, opt.beta);
  const ProfiledGemm profiled(a, b, c.dtype, opt);  // a timed sub-interval while profiling

  if (fa == Family::mxfp8 || fa == Family::nvfp4 || mixed)
    return detail::emulated_matmul_cuda(a, b, cv, m, n, k, opt.beta, stream);
  auto lt_operand = [](const QOperand& q) {
    detail::LtOperand o;
    o.data = q.data;
    o.type = q.format == QFormat::fp8_e5m2 ? detail::ElemType::e5m2 : detail::ElemType::e4m3;
    o.k_major = true;
    o.scale_mode = q.format == QFormat::fp8_block128       ? detail::ScaleMode::vec128
                   : q.format == QFormat::fp8_block128x128 ? detail::ScaleMode::blk128x128
                                                           : detail::ScaleMode::tensor;
    o.scale = static_cast<const float*>(q.scales);
    return o;
  };
  detail::LtProblem p;
  p.m = m;
  p.n = n;
  p.k = k;
  p.a = lt_operand(a);
  p.b = lt_operand(b);
  p.c = cv;
  p.fast_accum = opt.fast_accum;
  p.beta = opt.beta;
  return detail::lt_matmul(p, stream);
}

size_t quantized_plan_count() { return detail::lt_plan_count(); }

namespace detail {
namespace {
std::atomic<int64_t> g_emulation_chunk_elements{kDefaultEmulationChunkElements};
size_t align256(size_t v) { return (v + 255) / 256 * 256; }
}  // namespace

int64_t emulation_chunk_elements() { return g_emulation_chunk_elements.load(); }

int64_t set_emulation_chunk_elements(int64_t elements) {
  return g_emulation_chunk_elements.exchange(elements > 0 ? elements : kDefaultEmulationChunkElements);
}

EmulationPlan plan_emulation(int64_t m, int64_t n, int64_t k, bool a_given, bool b_given) {
  EmulationPlan p;
  // The chunked operand: the one with more elements (they share K), A on a tie (contiguous C rows); but
  // an operand given already dequantized is never chunked and takes no scratch.
  p.chunk_b = a_given != b_given ? a_given : n > m;
  const int64_t chunked = p.chunk_b ? n : m, whole = p.chunk_b ? m : n;
  const bool chunked_given = p.chunk_b ? b_given : a_given, whole_given = p.chunk_b ? a_given : b_given;
  p.chunk_rows = chunked;
  const int64_t cap = emulation_chunk_elements();
  if (!chunked_given && chunked * k > cap) {
    // Blocks of 128 rows keep every block's pointers (operand data/scales, C) as aligned as the whole.
    const int64_t rows = std::max<int64_t>(128, cap / k / 128 * 128);
    if (rows < chunked) p.chunk_rows = rows;
  }
  p.chunk_bytes = chunked_given ? 0 : align256(size_t(p.chunk_rows * k) * 2);
  p.whole_bytes = whole_given ? 0 : align256(size_t(whole * k) * 2);
  p.scratch_bytes = p.chunk_bytes + p.whole_bytes + 256;
  return p;
}
}  // namespace detail

#if !defined(NIBBLE_HAVE_CUDA)
namespace detail {
Status lt_matmul(const LtProblem&, Stream) {
  return errorf(
      "matmul_quantized on cuda: this nibble was built without the CUDA backend; rebuild with a CUDA toolkit");
}
size_t lt_plan_count() { return 0; }
Status emulated_matmul_cuda(const QOperand&, const QOperand&, const CView&, int64_t, int64_t, int64_t, float, Stream) {
  return errorf(
      "matmul_quantized on cuda: this nibble was built without the CUDA backend; rebuild with a CUDA toolkit");
}
}  // namespace detail
Status dequantize_operand_cuda(const QOperand&, void*, Stream) {
  return errorf("dequantize_operand_cuda: this nibble was built without the CUDA backend; rebuild with a CUDA toolkit");
}
#endif

}  // namespace nb::gemm
