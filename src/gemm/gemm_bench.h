// Ceiling measurements of the GPU: BF16 GEMM throughput through the engine's own matmul() and
// device-to-device copy bandwidth. They feed `nibble info`/`bench` (the roofline that kernels and
// MFU are judged against); the CLI wiring lives elsewhere.
//
// Method (both): inputs allocated and filled once, warm-up runs, then `iters` timed runs, each
// bracketed by its own pair of CUDA events on one stream and preceded (outside the events) by writing
// twice the L2 size, so that every timed run starts from a cold L2 as it would inside a training step;
// the median run time is reported, so a stray slow run (clock ramp, another process) does not move the result.
#pragma once
#include <cstddef>
#include <cstdint>
#include "core/dtype.h"
#include "core/status.h"
#include "gemm/gemm.h"
#include "gemm/gemm_call.h"

namespace nb::gemm {

// C[M,N] = A[M,K] @ B[N,K]^T in BF16 with FP32 accumulation and a BF16 C (the Fprop layout of a
// linear layer), random non-zero inputs in [-1, 1]. tflops = 2*M*N*K / median time / 1e12.
Status measure_gemm_tflops(int64_t m, int64_t n, int64_t k, int iters, double* tflops);

// Any layout: C[M,N] (c_dtype bf16 or f32) = op(A) @ op(B) + beta * C with A, B bf16 stored as `args`
// says (e.g. the Dgrad and Wgrad layouts of a linear layer). tflops = 2*M*N*K / median time / 1e12.
Status measure_matmul_tflops(int64_t m, int64_t n, int64_t k, const GemmArgs& args, DType c_dtype, int iters,
                             double* tflops);

// The in-loop dequantizing GEMM (wgmma_gemm.h) against what training runs today, C[M,N] = A . B^T with
// a BF16 B [N,K] (a weight dequantized once per step) and A [M,K] in each format, TFLOP/s each:
// cuBLASLt BF16; the in-loop kernel with a BF16 A (its own ceiling); for MXFP8 and NVFP4 A the
// emulation (dequantize_operand_cuda into BF16, then cuBLASLt) and the in-loop kernel.
struct InLoopTflops {
  double cublaslt_bf16 = 0, in_loop_bf16 = 0;
  double emulated_mxfp8 = 0, in_loop_mxfp8 = 0;
  double emulated_nvfp4 = 0, in_loop_nvfp4 = 0;
};
Status measure_in_loop_gemms(int64_t m, int64_t n, int64_t k, int iters, InLoopTflops* out);

// The call `call` describes (gemm_call.h: formats, layouts, beta, C's type) replayed on random operands of the
// same layout (codes without NaN, positive scales); tflops = 2*M*N*K / median time / 1e12. The ceiling the
// step profiler reads each GEMM of a run against, and `nibble bench gemm --format`'s figures.
Status measure_gemm_call_tflops(const GemmCall& call, int iters, double* tflops);

// cudaMemcpyAsync device-to-device of `bytes`; gbps = 2 * bytes (read + written) / median time / 1e9.
Status measure_copy_bandwidth(size_t bytes, int iters, double* gbps);

}  // namespace nb::gemm
