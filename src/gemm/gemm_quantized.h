// Quantized GEMMs of the precision recipes: C[M,N] = alpha * A . B^T + beta * C with A [M,K] and
// B [N,K] quantized operands, both "K-major" (row-major with the reduction dim last), the TN form of
// every linear-layer GEMM (X [M,K] tokens x in, W [N,K], dY [M,N]):
//   Fprop  Y  = X W^T     a = X row-wise copy,    b = W row-wise copy        (fast_accum on, as TE)
//   Dgrad  dX = dY W      a = dY row-wise copy,   b = W transposed copy      (fast_accum off)
//   Wgrad  dW += dY^T X   a = dY transposed copy, b = X transposed copy, f32 C, beta = 1
// MXFP8 keeps its column-wise copy un-transposed (formats/mxfp8/mxfp8.h), so an MXFP8 operand may
// instead be given as that copy, stored [K, rows] with scales [K/32, rows] (`k_major = false`).
// An NVFP4 operand may be given stored [K, rows] too (`k_major = false`): the Dgrad weight operand of
// a 2D (16x16-tile) NVFP4 weight is its row-wise copy [N, K_in] read as [K = N, rows = K_in] (both
// copies of a 2D weight hold the same values, so the column-wise copy need not exist).
//
// Operand formats (QOperand.data / .scales), the layouts the format quantizers write:
//   fp8_e4m3, fp8_e5m2  data [rows, K] FP8 codes; scales = const float* scale_inv (1 value)
//   fp8_block128        1x128 E4M3 blocks along K; scales FP32 scale_inv [K/128, round4(rows)],
//                       entry (kb, r) at kb*round4(rows) + r (fp8_block.h vec128, either copy)
//   fp8_block128x128    128x128 E4M3 tiles; scales FP32 [rows/128, round4(K/128)] (fp8_block.h)
//   mxfp8               E4M3; scales E8M0 [rows, K/32] (or [K/32, rows] with k_major = false)
//   nvfp4               data [rows, K/2] packed E2M1; scales E4M3 [rows, K/16]; amax = the copy's
//                       FP32 amax (global decode scale amax / (6*448), or amax / (6*256) for a copy
//                       quantized with 4/6: QOperand::nvfp4_4over6); with k_major = false data
//                       [K, rows/2] and scales [K, rows/16] (blocks of 16 consecutive stored elements)
//   bf16                data [rows, K] BF16 values (or [K, rows] with k_major = false), scale 1; scales may
//                       be null. Mixture of Representations (formats/mor/) keeps an operand in BF16 that its
//                       rule did not let quantize, while the GEMM's other operand may be FP8.
// Both operands must share the family (fp8 per-tensor x fp8 per-tensor, fp8 block x fp8 block,
// mxfp8 x mxfp8, nvfp4 x nvfp4), except that bf16, fp8 per-tensor and nvfp4 operands pair with each other
// ("mixed": Mixture of Representations' NVFP4 ladder decides each operand's rung on its own). A mixed pair with one
// nvfp4 operand has alpha = that operand's global decode scale, amax / (6*448) (256 with 4/6).
//
// Backends, chosen by C's device (operand pointers must live on the same side):
//   cpu   the reference: every operand dequantized exactly in FP64 (code value x scale), products
//         accumulated in FP64, then alpha (nvfp4: the FP32 product of the global scales), then
//         + beta * C, rounded once to C (f32 only).
//   cuda  fp8 per-tensor: cuBLASLt FP8 GEMM (scale_inv pointers as A/B scale pointers, FP32
//         compute). Hopper supports E4M3xE4M3, E4M3xE5M2 and E5M2xE4M3; E5M2xE5M2 is an error.
//         fp8 block: cuBLASLt VEC128_32F / BLK128x128_32F scale modes (CUDA >= 12.9, sm_90), the
//         fp8_block quantizer's layouts passed unchanged; no fast accumulation; 128x128 x 128x128
//         is rejected (cuBLASLt supports 1D x 1D, 1D x 2D, 2D x 1D only; measured on H200).
//         mxfp8, nvfp4 (emulated on Hopper): each operand dequantized to BF16 with its block scales
//         only into a workspace owned here, then a BF16 cuBLASLt GEMM with FP32 accumulation and
//         alpha (nvfp4: amax_a * amax_b / (6*6*448*448), 256 for each 4/6 operand's 448, computed on the
//         device, no host sync).
//         The scratch is bounded: an operand of more than emulation_chunk_elements() elements is
//         dequantized a block of rows at a time, one BF16 GEMM per block (rows of A = rows of C,
//         rows of B = columns of C); see plan_emulation(). Each block's GEMM is a smaller cuBLASLt
//         problem, which may pick another algorithm: chunked results stay within the FP32-accumulation
//         bound of the unchunked GEMM but are not promised to be bit-identical to it.
//         NVFP4: e2m1 x E4M3 needs at most 6 significant bits and lies in [2^-10, 2688]: exact in
//         BF16. MXFP8: E4M3 x 2^e is exact in BF16 while the product is in [2^-126, 2^128) or its
//         last bit is >= 2^-133 (BF16 subnormals). Outside that: a product >= 2^128 (possible only
//         with E8M0 codes >= 247) becomes Inf, and blocks with codes <= 2 (block amax below about
//         2^-116) may have elements rounded to nearest even in BF16.
//         An operand with QOperand::dequantized set skips its dequantization (a weight dequantized
//         once per step: --emulated-weight-cache); the GEMM then runs unchunked over that operand.
//         mixed: the fp8 per-tensor operand's codes decoded to BF16 (exact: E4M3 and E5M2 values are BF16
//         values), an nvfp4 operand dequantized as above, a BF16 cuBLASLt GEMM with FP32 accumulation, alpha =
//         the product of the fp8 operands' scale_inv and an nvfp4 operand's global decode scale, read on the
//         device. No fast accumulation.
//         On sm_100 these would be native block-scaled GEMMs; not implemented (use Hopper). Native
//         FP4 tensor cores need both operands K-major, so a native path would need the real
//         column-wise copy of a 2D NVFP4 weight (not the k_major = false row copy).
//   C: bf16 or f32 on cuda, f32 on cpu; 2-D [M,N] with unit column stride (row stride >= N).
//   beta == 0: C is write-only. K must be positive; M, N may be 0 (nothing to do).
// Concurrency: like matmul(), calls on one device share workspaces: issue them on one stream.
#pragma once
#include <cstddef>
#include <cstdint>
#include "core/status.h"
#include "core/stream.h"
#include "core/tensor.h"

namespace nb::gemm {

enum class QFormat : uint8_t { fp8_e4m3, fp8_e5m2, fp8_block128, fp8_block128x128, mxfp8, nvfp4, bf16 };
const char* qformat_name(QFormat f);

struct QOperand {
  QFormat format = QFormat::fp8_e4m3;
  int64_t rows = 0, k = 0;  // logical operand [rows, K]
  const void* data = nullptr;
  const void* scales = nullptr;  // see the header comment per format
  const float* amax = nullptr;   // nvfp4 only
  bool k_major = true;           // false (mxfp8, nvfp4): stored [K, rows], see the header comment
  bool nvfp4_4over6 = false;     // nvfp4: quantized with 4/6 (E4M3 bound 256: decode amax / (6*256))
  // mxfp8, nvfp4 on cuda only: this operand already dequantized to BF16 by dequantize_operand_cuda (same
  // stored layout, block scales applied, nvfp4's global scale not). The emulated GEMM reads it instead of
  // dequantizing data/scales again; a weight used by every micro-batch of a step is dequantized once.
  // data, scales and amax must still describe the operand (validation; nvfp4's alpha reads amax).
  const void* dequantized = nullptr;
};

struct QGemmOptions {
  float beta = 0.f;
  // Hopper FP8 "fast accumulation" (no periodic promotion of the tensor-core partial sums to FP32):
  // TE turns it on for Fprop and off ("split accumulator") for Dgrad/Wgrad. Only for fp8 per-tensor.
  bool fast_accum = false;
};

// C = alpha * A . B^T + beta * C (see the header comment for alpha per format).
Status matmul_quantized(const QOperand& a, const QOperand& b, const Tensor& c, const QGemmOptions& opt, Stream stream);

// Device: the BF16 operand an emulated (mxfp8, nvfp4) GEMM would make of `op`, all of it, in its stored
// layout ([rows, K], or [K, rows] when k_major = false) into `out` (rows x K elements), for
// QOperand::dequantized. The values are exact (see the emulation above). Other formats: an error.
Status dequantize_operand_cuda(const QOperand& op, void* out, Stream stream);

// Host, exact: the dequantized operand [rows, K] (K-major even for k_major = false), block scales
// and per-tensor scale_inv applied, nvfp4 WITHOUT its global scale (see nvfp4_global_alpha).
// Operand pointers must be host pointers.
Status dequantize_operand_ref(const QOperand& op, double* out);
// FP32 alpha of an nvfp4 x nvfp4 product: (amax_a * amax_b) / (6*6*bound_a*bound_b), bound 448, or
// 256 for an operand quantized with 4/6 (as TransformerEngine's 4over6 GEMM alpha). The denominator is
// exact in FP32, so the one rounding is the division's.
float nvfp4_global_alpha(float amax_a, float amax_b, bool four_over_six_a = false, bool four_over_six_b = false);
// Its denominator, 6*6*bound_a*bound_b (exact in FP32).
float nvfp4_alpha_denominator(bool four_over_six_a, bool four_over_six_b);

// Number of cached cuBLASLt plans of the quantized paths (0 on a CPU-only build); for tests.
size_t quantized_plan_count();

// ---- internal: shared by gemm_quantized.cpp and the CUDA files -----------------------------
namespace detail {
enum class ElemType : uint8_t { e4m3, e5m2, bf16 };
enum class ScaleMode : uint8_t { none, tensor, vec128, blk128x128 };
struct LtOperand {
  const void* data = nullptr;
  ElemType type = ElemType::bf16;
  bool k_major = true;  // stored [rows, K]; else [K, rows]
  ScaleMode scale_mode = ScaleMode::none;
  const float* scale = nullptr;  // device scale_inv (tensor/vec128/blk128x128)
};
struct CView {
  void* data = nullptr;
  DType dtype = DType::f32;
  int64_t ld = 0;
};
struct LtProblem {
  int64_t m = 0, n = 0, k = 0;
  LtOperand a, b;
  CView c;
  bool fast_accum = false;
  float alpha = 1.f, beta = 0.f;
  const float* device_alpha_beta = nullptr;  // non-null: alpha, beta read from this device array
};
Status lt_matmul(const LtProblem& p, Stream stream);  // gemm_fp8_cublaslt.cu
size_t lt_plan_count();
Status emulated_matmul_cuda(const QOperand& a, const QOperand& b, const CView& c, int64_t m, int64_t n, int64_t k,
                            float beta, Stream stream);  // gemm_emulated.cu

// Bounded scratch of the emulated MXFP8/NVFP4 GEMM (gemm_emulated.cu). The operand with more elements
// (A on a tie) is "chunked" when it holds more than the cap: dequantized `chunk_rows` rows at a time
// (a multiple of 128, at least 128, the last block the remainder), one GEMM per block.
constexpr int64_t kDefaultEmulationChunkElements = int64_t(64) << 20;  // 128 MiB of BF16
struct EmulationPlan {
  bool chunk_b = false;    // blocks of B's rows (C column blocks) instead of A's (C row blocks)
  int64_t chunk_rows = 0;  // rows of the chunked operand per GEMM (all of its rows when not chunked)
  // The scratch, in this order, each piece 256-byte aligned: one block of the chunked operand (BF16), the
  // other operand whole (BF16), 2 FP32 scalars. A piece of an operand given already dequantized is 0 bytes.
  size_t chunk_bytes = 0, whole_bytes = 0;
  size_t scratch_bytes = 0;  // chunk_bytes + whole_bytes + 256
};
// a_given / b_given: that operand is already dequantized (QOperand::dequantized): it needs no scratch and
// is never chunked; the other operand is then the chunked one (when it holds more than the cap).
EmulationPlan plan_emulation(int64_t m, int64_t n, int64_t k, bool a_given = false, bool b_given = false);
// The cap in elements (default kDefaultEmulationChunkElements); set returns the previous cap, and a
// value <= 0 restores the default. For tests (forcing chunking on small shapes); not thread-safe with
// GEMMs in flight on other threads.
int64_t emulation_chunk_elements();
int64_t set_emulation_chunk_elements(int64_t elements);
}  // namespace detail

}  // namespace nb::gemm
