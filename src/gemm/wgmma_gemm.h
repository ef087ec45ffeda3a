// A Hopper GEMM that dequantizes its A operand inside the main loop: the design study of the
// performance work (docs/PERFORMANCE.md, "In-loop dequantization"). Not used by training; `nibble bench
// gemm --in-loop` times it against cuBLASLt and against the emulation's dequantize-then-cuBLASLt path.
//
//   C[M,N] (BF16) = alpha * dequant(A)[M,K] . B[N,K]^T, FP32 accumulation, both operands K-major.
//   A:  bf16   [M,K] BF16 (the kernel's own ceiling: the same pipeline with nothing to dequantize)
//       mxfp8  [M,K] E4M3 codes, E8M0 scales [M, K/32] (the MXFP8 row copy)
//       nvfp4  [M,K/2] packed E2M1 (low nibble first), E4M3 scales [M, K/16] (the NVFP4 row copy;
//              its global scale goes into alpha, as in the emulation)
//   B:  BF16 [N,K] (e.g. a weight dequantized once per step, --emulated-weight-cache)
//   alpha: a device FP32 scalar, or null for 1.
// Dequantized values equal dequantize_operand_cuda's bit for bit; only the FP32 summation order differs
// from cuBLASLt's.
//
// Design (sm_90a): one 128x256 tile of C per CTA, K in steps of 64; three warpgroups. The producer's
// one thread streams A (BF16 tile, or the raw codes: 1/2 or 1/4 of the bytes) and B through a 4-stage ring
// of shared memory with TMA, B in the 128-byte swizzle wgmma reads. Each of the two consumer warpgroups
// owns 64 rows and issues 8 wgmma m64n128k16 per K step: from shared memory for a BF16 A; for a quantized
// A each thread converts its own A fragment (codes from shared memory, block scales from global a step
// ahead) straight into registers, and the wgmma reads A from there (three fragment buffers, so the
// conversion of step k+1 overlaps the MMAs of k-1 and k). Measured against the emulation in
// docs/PERFORMANCE.md ("In-loop dequantization"): correct and bit-exact, but not yet faster.
// Requires M % 128 == 0, N % 256 == 0, K % 64 == 0, 16-byte aligned A, B, C and 4-byte aligned scales;
// else an error.
#pragma once
#include <cstdint>
#include "core/bf16.h"
#include "core/status.h"
#include "core/stream.h"

namespace nb::gemm {

enum class InLoopFormat : uint8_t { bf16, mxfp8, nvfp4 };
const char* in_loop_format_name(InLoopFormat f);

struct InLoopOperand {
  InLoopFormat format = InLoopFormat::bf16;
  const void* data = nullptr;
  const uint8_t* scales = nullptr;  // mxfp8, nvfp4
};

Status in_loop_gemm_cuda(const InLoopOperand& a, const bf16* b, bf16* c, int64_t m, int64_t n, int64_t k,
                         const float* alpha, Stream stream);

}  // namespace nb::gemm
