// Internal to the gemm layer: a matmul call resolved into plain matrices (pointer, dtype, rows,
// cols, row stride) after validation, shared by the CPU reference and the cuBLASLt backend.
// Rows/cols are those of the stored (row-major) matrix, before op() is applied.
#pragma once
#include <cstdint>
#include "core/status.h"
#include "core/stream.h"
#include "core/tensor.h"
#include "gemm/gemm.h"

namespace nb::gemm {

struct MatrixView {
  void* data = nullptr;
  DType dtype = DType::f32;
  int64_t rows = 0, cols = 0;
  int64_t ld = 0;  // elements between the starts of consecutive rows (>= cols)
};

struct GemmProblem {
  MatrixView a, b, c;
  int64_t m = 0, n = 0, k = 0;
  GemmArgs args;
};

// Checks devices, dtypes and shapes of a matmul call and fills `out`.
Status resolve_problem(const Tensor& a, const Tensor& b, const Tensor& c, const GemmArgs& args, GemmProblem* out);

// Backends; both expect a problem that resolve_problem accepted, with m, n >= 1.
Status matmul_cpu(const GemmProblem& p);
Status matmul_cuda(const GemmProblem& p, Stream stream);  // cuBLASLt; an error on a CPU-only build
size_t cuda_plan_count();

}  // namespace nb::gemm
