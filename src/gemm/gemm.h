// The GEMM API, its semantics stated once for the whole engine.
//
// Row-major, PyTorch style:   C[M,N] = alpha * op(A) @ op(B) + beta * C
//   op(A) = A        with A stored [M,K]   (trans_a = false)
//   op(A) = A^T      with A stored [K,M]   (trans_a = true)
//   op(B) = B        with B stored [K,N]   (trans_b = false)
//   op(B) = B^T      with B stored [N,K]   (trans_b = true)
// When beta == 0, C is write-only: its old contents (even NaN) are never read, as in BLAS.
//
// The three GEMMs of a linear layer Y = X W^T, X [T,K], W [N,K]:
//   Fprop  Y  = X W^T       matmul(X, W, Y, {.trans_b = true})
//   Dgrad  dX = dY W        matmul(dY, W, dX, {})
//   Wgrad  dW += dY^T X     matmul(dY, X, dW_f32, {.trans_a = true, .beta = 1})   (FP32 accumulate)
//
// Operands: 2-D tensors whose last dimension is contiguous (stride 1); the row stride may be larger
// than the row length (a column slice of a wider matrix). Contiguous tensors with more than two
// dimensions are viewed as 2-D [prod(leading dims), last dim], e.g. activations [B,S,H] -> [B*S,H].
//
// Backends (chosen by the tensors' device, which must agree):
//   cpu:  A, B, C all f32; cache-blocked multi-threaded reference, sequential FP32 accumulation
//         over k per output element.
//   cuda: A, B bf16; C bf16 or f32 (f32 with beta = 1 is the weight-gradient accumulation).
//         cuBLASLt, FP32 accumulation (CUBLAS_COMPUTE_32F), FP32 alpha/beta, one rounding of the
//         result to C's type. Exception: with a bf16 C and beta != 0, cuBLASLt may round
//         alpha * op(A) @ op(B) to bf16 before adding beta * C, i.e. C = rne(rne(alpha * acc) + beta * C)
//         (measured on H200, cuBLAS 13, beta = 1 with 16-byte-aligned rows) -- the numerics of an
//         unfused "y = residual + linear(x)" in BF16. Use an f32 C where one rounding matters.
//         Plans are cached per problem (see gemm_cublaslt.cu). Calls on one
//         device share one 32 MiB workspace, so GEMMs on different streams of the same device
//         must not run concurrently (the engine issues its GEMMs on one compute stream).
#pragma once
#include <cstddef>
#include <cstdint>
#include "core/status.h"
#include "core/stream.h"
#include "core/tensor.h"

namespace nb::gemm {

// cuBLASLt's workspace per GPU and backend: the BF16 GEMMs have one, the FP8 GEMMs another (cublaslt_common.h),
// so a quantized recipe holds two (the memory estimate counts them).
constexpr size_t kCublasLtWorkspaceBytes = size_t(32) << 20;

struct GemmArgs {
  bool trans_a = false, trans_b = false;
  float alpha = 1.f, beta = 0.f;
};

// C = alpha * op(A) @ op(B) + beta * C on the tensors' device; `stream` is ignored on the CPU.
// Errors (shape or dtype mismatch, no cuBLASLt algorithm, CPU-only build) come back as a Status.
Status matmul(const Tensor& a, const Tensor& b, const Tensor& c, const GemmArgs& args, Stream stream);

// Number of cached cuBLASLt plans on all devices (0 on a CPU-only build); for tests and logs.
size_t cached_plan_count();

}  // namespace nb::gemm
