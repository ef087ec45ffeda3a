// matmul_quantized(): validation of the operands against their format's layout rules, the exact CPU
// reference (FP64 dequantization and accumulation), and dispatch to the CUDA paths (cuBLASLt FP8 in
// gemm_fp8_cublaslt.cu, the BF16 emulation of MXFP8/NVFP4 in gemm_emulated.cu). On a CPU-only build
// the CUDA entry points answer with a Status.
#include "gemm/gemm_quantized.h"
#include <algorithm>
#include <atomic>
#include <cmath>
#include <string>
#include <vector>
#include "core/bf16.h"
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

// The value of element (r, kk) of an operand, exactly (FP64 holds every code x scale product).
struct RefDecoder {
  const QOperand& op;
  const uint8_t* bytes() const { return static_cast<const uint8_t*>(op.data); }
  double operator()(int64_t r, int64_t kk) const {
    switch (op.format) {
      case QFormat::fp8_e4m3:
        return double(e4m3_to_f32(bytes()[r * op.k + kk])) * double(*static_cast<const float*>(op.scales));
      case QFormat::fp8_e5m2:
        return double(e5m2_to_f32(bytes()[r * op.k + kk])) * double(*static_cast<const float*>(op.scales));
      case QFormat::fp8_block128: {
        const float* s = static_cast<const float*>(op.scales);
        return double(e4m3_to_f32(bytes()[r * op.k + kk])) * double(s[(kk / 128) * round4(op.rows) + r]);
      }
      case QFormat::fp8_block128x128: {
        const float* s = static_cast<const float*>(op.scales);
        return double(e4m3_to_f32(bytes()[r * op.k + kk])) * double(s[(r / 128) * round4(op.k / 128) + kk / 128]);
      }
      case QFormat::mxfp8: {
        const uint8_t* s = static_cast<const uint8_t*>(op.scales);
        if (op.k_major)
          return double(e4m3_to_f32(bytes()[r * op.k + kk])) * double(e8m0_to_f32(s[r * (op.k / 32) + kk / 32]));
        return double(e4m3_to_f32(bytes()[kk * op.rows + r])) * double(e8m0_to_f32(s[(kk / 32) * op.rows + r]));
      }
      case QFormat::nvfp4: {
        // Stored [outer, inner]: K-major [rows, K], else [K, rows]; 16-blocks along inner.
        const int64_t o = op.k_major ? r : kk, i = op.k_major ? kk : r, inner = op.k_major ? op.k : op.rows;
        const uint8_t byte = bytes()[o * (inner / 2) + i / 2];
        const uint32_t code = (i & 1) ? (byte >> 4) : (byte & 0xFu);
        const uint8_t scale = static_cast<const uint8_t*>(op.scales)[o * (inner / 16) + i / 16];
        return double(e2m1_to_f32(code)) * double(e4m3_to_f32(scale));
      }
      case QFormat::bf16: {
        const auto* v = static_cast<const bf16*>(op.data);
        return double(bf16_to_f32(op.k_major ? v[r * op.k + kk] : v[kk * op.rows + r]));
      }
    }
    return 0.0;
  }
};

Status matmul_quantized_cpu(const QOperand& a, const QOperand& b, const detail::CView& c, float beta) {
  const int64_t m = a.rows, n = b.rows, k = a.k;
  std::vector<double> da(size_t(m * k)), db(size_t(n * k));
  NB_TRY(dequantize_operand_ref(a, da.data()));
  NB_TRY(dequantize_operand_ref(b, db.data()));
  // NVFP4's global scales (the decoder gives code x block scale); a mixed pair's NVFP4 operand alone, exactly.
  double alpha = 1.0;
  if (a.format == QFormat::nvfp4 && b.format == QFormat::nvfp4)
    alpha = double(nvfp4_global_alpha(*a.amax, *b.amax, a.nvfp4_4over6, b.nvfp4_4over6));
  else if (a.format == QFormat::nvfp4 || b.format == QFormat::nvfp4) {
    const QOperand& q = a.format == QFormat::nvfp4 ? a : b;
    alpha = double(*q.amax) / (6.0 * (q.nvfp4_4over6 ? 256.0 : 448.0));
  }
  float* cp = static_cast<float*>(c.data);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      const double* ar = &da[size_t(i * k)];
      const double* br = &db[size_t(j * k)];
      double acc = 0.0;
      for (int64_t kk = 0; kk < k; ++kk) acc += ar[kk] * br[kk];
      double v = alpha * acc;
      if (beta != 0.f) v += double(beta) * double(cp[i * c.ld + j]);
      cp[i * c.ld + j] = float(v);
    }
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
  return 6.0f * 6.0f * (four_over_six_a ? 256.0f : 448.0f) * (four_over_six_b ? 256.0f : 448.0f);  // exact
}

float nvfp4_global_alpha(float amax_a, float amax_b, bool four_over_six_a, bool four_over_six_b) {
  return (amax_a * amax_b) / nvfp4_alpha_denominator(four_over_six_a, four_over_six_b);
}

Status dequantize_operand_ref(const QOperand& op, double* out) {
  NB_TRY(check_operand(op, "operand"));
  RefDecoder dec{op};
  for (int64_t r = 0; r < op.rows; ++r)
    for (int64_t kk = 0; kk < op.k; ++kk) out[r * op.k + kk] = dec(r, kk);
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
