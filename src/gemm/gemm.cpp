// matmul(): validation of a GEMM call (devices, dtypes, shapes, strides) and dispatch to the CPU
// reference or the cuBLASLt backend. On a CPU-only build the CUDA entry points answer with a Status.
#include "gemm/gemm.h"
#include <string>
#include "gemm/gemm_call.h"
#include "gemm/gemm_problem.h"

namespace nb::gemm {
namespace {

// A tensor as a row-major matrix: 2-D with unit column stride, or contiguous N-D flattened to 2-D.
Status as_matrix(const Tensor& t, const char* name, MatrixView* out) {
  if (t.data == nullptr && t.numel() != 0) return errorf("matmul: operand %s has no data pointer", name);
  if (t.ndim < 2)
    return errorf(
        "matmul: operand %s has shape %s; a GEMM operand needs at least 2 dimensions (reshape it to "
        "[rows, cols])",
        name, t.shape_str().c_str());
  MatrixView m;
  m.data = t.data;
  m.dtype = t.dtype;
  m.cols = t.shape[t.ndim - 1];
  if (t.ndim == 2) {
    m.rows = t.shape[0];
    if (m.cols > 1 && t.stride[1] != 1)
      return errorf(
          "matmul: operand %s %s has column stride %lld; the last dimension must be contiguous "
          "(make a contiguous copy first)",
          name, t.shape_str().c_str(), (long long)t.stride[1]);
    m.ld = m.rows > 1 ? t.stride[0] : m.cols;
    if (m.ld < m.cols)
      return errorf("matmul: operand %s %s has row stride %lld smaller than its row length", name,
                    t.shape_str().c_str(), (long long)m.ld);
  } else {
    if (!t.is_contiguous())
      return errorf("matmul: operand %s %s is not contiguous; only 2-D operands may have a row stride", name,
                    t.shape_str().c_str());
    m.rows = t.numel() / (m.cols == 0 ? 1 : m.cols);
    if (m.cols == 0) m.rows = 1;
    m.ld = m.cols;
  }
  if (m.ld < 1) m.ld = 1;
  *out = m;
  return Status::ok();
}

}  // namespace

Status resolve_problem(const Tensor& a, const Tensor& b, const Tensor& c, const GemmArgs& args, GemmProblem* out) {
  if (a.device != b.device || a.device != c.device)
    return errorf("matmul: operands are on different devices (A %s, B %s, C %s); move them to one device",
                  device_name(a.device), device_name(b.device), device_name(c.device));
  GemmProblem p;
  p.args = args;
  NB_TRY(as_matrix(a, "A", &p.a));
  NB_TRY(as_matrix(b, "B", &p.b));
  NB_TRY(as_matrix(c, "C", &p.c));
  const int64_t a_m = args.trans_a ? p.a.cols : p.a.rows, a_k = args.trans_a ? p.a.rows : p.a.cols;
  const int64_t b_k = args.trans_b ? p.b.cols : p.b.rows, b_n = args.trans_b ? p.b.rows : p.b.cols;
  if (a_k != b_k || p.c.rows != a_m || p.c.cols != b_n)
    return errorf(
        "matmul: shapes do not match: op(A) is [%lld,%lld] (A %s%s), op(B) is [%lld,%lld] (B %s%s), "
        "C is %s; need op(A) [M,K], op(B) [K,N], C [M,N]",
        (long long)a_m, (long long)a_k, a.shape_str().c_str(), args.trans_a ? " transposed" : "", (long long)b_k,
        (long long)b_n, b.shape_str().c_str(), args.trans_b ? " transposed" : "", c.shape_str().c_str());
  p.m = a_m;
  p.n = b_n;
  p.k = a_k;
  if (a.device == Device::cpu) {
    if (a.dtype != DType::f32 || b.dtype != DType::f32 || c.dtype != DType::f32)
      return errorf("matmul on cpu needs f32 A, B and C, got %s, %s, %s; convert the operands to f32",
                    std::string(dtype_name(a.dtype)).c_str(), std::string(dtype_name(b.dtype)).c_str(),
                    std::string(dtype_name(c.dtype)).c_str());
  } else {
    if (a.dtype != DType::bf16 || b.dtype != DType::bf16 || (c.dtype != DType::bf16 && c.dtype != DType::f32))
      return errorf("matmul on cuda needs bf16 A and B and a bf16 or f32 C, got %s, %s, %s",
                    std::string(dtype_name(a.dtype)).c_str(), std::string(dtype_name(b.dtype)).c_str(),
                    std::string(dtype_name(c.dtype)).c_str());
  }
  *out = p;
  return Status::ok();
}

Status matmul(const Tensor& a, const Tensor& b, const Tensor& c, const GemmArgs& args, Stream stream) {
  GemmProblem p;
  NB_TRY(resolve_problem(a, b, c, args, &p));
  if (p.m == 0 || p.n == 0) return Status::ok();
  if (a.device == Device::cpu) return matmul_cpu(p);
  const ProfiledGemm profiled(p.m, p.n, p.k, args, c.dtype);  // a timed sub-interval while profiling
  return matmul_cuda(p, stream);
}

size_t cached_plan_count() { return cuda_plan_count(); }

#if !defined(NIBBLE_HAVE_CUDA)
Status matmul_cuda(const GemmProblem&, Stream) {
  return errorf("matmul on cuda: this nibble was built without the CUDA backend; rebuild with a CUDA toolkit");
}
size_t cuda_plan_count() { return 0; }
#endif

}  // namespace nb::gemm
