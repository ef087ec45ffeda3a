// The cuBLASLt backend of matmul(): BF16 A and B, BF16 or FP32 C, FP32 accumulation and scaling.
//
// Row-major through a column-major library: a row-major [r, c] array with row stride ld is, read
// column-major, the c x r matrix X^T with the same ld. So row-major C = op(A) op(B) is computed as
// the column-major product C^T = op(B)^T op(A)^T: cuBLASLt's first operand is our B (its transpose
// flag is our trans_b), its second is our A (flag trans_a), and its m, n, k are our N, M, K.
// Each layout describes the stored array as seen column-major: rows = our cols, cols = our rows.
//
// Plans: the matmul descriptor, the four layouts and the algorithm picked by
// cublasLtMatmulAlgoGetHeuristic are built once per (device, M, N, K, transposes, row strides,
// dtypes, beta == 0 or not, pointer alignments) and cached; alpha and beta values are passed per
// call. The heuristic is asked for several candidates; the first one that succeeds, fits the
// workspace and (if it splits K) adds its partial sums in FP32 is kept; --deterministic-mode
// (core/determinism.h, part of the plan key) keeps only candidates that do not split K. The plan cache,
// the handle, the 32 MiB workspace per device and that choice are shared with the quantized backend
// (cublaslt_common.h).
#include <cublasLt.h>
#include <mutex>
#include <tuple>
#include "core/cuda_check.h"
#include "core/determinism.h"
#include "gemm/cublaslt_common.h"
#include "gemm/gemm_problem.h"

namespace nb::gemm {
namespace {

using lt::kWorkspaceBytes;
using lt::Plan;

Status cublas_error(cublasStatus_t s, const char* what, const GemmProblem& p) {
  return errorf("cuBLASLt %s failed for M=%lld,N=%lld,K=%lld: %s (%s)", what, (long long)p.m, (long long)p.n,
                (long long)p.k, cublasLtGetStatusName(s), cublasLtGetStatusString(s));
}

#define NB_CUBLAS_TRY(expr, what, problem)                                           \
  do {                                                                               \
    cublasStatus_t nb_cs_ = (expr);                                                  \
    if (nb_cs_ != CUBLAS_STATUS_SUCCESS) return cublas_error(nb_cs_, what, problem); \
  } while (0)

cudaDataType_t cuda_type(DType t) { return t == DType::bf16 ? CUDA_R_16BF : CUDA_R_32F; }

struct PlanKey {
  int device;
  int64_t m, n, k, lda, ldb, ldc;
  bool trans_a, trans_b, beta_zero;
  DType c_dtype;
  uint32_t align_a, align_b, align_c;
  bool deterministic;  // --deterministic-mode: no split-K
  auto tie() const {
    return std::tie(device, m, n, k, lda, ldb, ldc, trans_a, trans_b, beta_zero, c_dtype, align_a, align_b, align_c,
                    deterministic);
  }
  bool operator<(const PlanKey& o) const { return tie() < o.tie(); }
};

using Backend = lt::Backend<PlanKey>;

Status build_plan(cublasLtHandle_t handle, const GemmProblem& p, const PlanKey& key, Plan* plan) {
  const cublasOperation_t op_first = p.args.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;   // our B
  const cublasOperation_t op_second = p.args.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;  // our A
  NB_CUBLAS_TRY(cublasLtMatmulDescCreate(&plan->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "matmul descriptor", p);
  NB_CUBLAS_TRY(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_first, sizeof op_first),
                "TRANSA attribute", p);
  NB_CUBLAS_TRY(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_second, sizeof op_second),
                "TRANSB attribute", p);
  // Column-major views of the stored row-major arrays: rows = stored cols, cols = stored rows.
  NB_CUBLAS_TRY(cublasLtMatrixLayoutCreate(&plan->a, CUDA_R_16BF, uint64_t(p.b.cols), uint64_t(p.b.rows), p.b.ld),
                "layout of B", p);
  NB_CUBLAS_TRY(cublasLtMatrixLayoutCreate(&plan->b, CUDA_R_16BF, uint64_t(p.a.cols), uint64_t(p.a.rows), p.a.ld),
                "layout of A", p);
  NB_CUBLAS_TRY(
      cublasLtMatrixLayoutCreate(&plan->c, cuda_type(p.c.dtype), uint64_t(p.c.cols), uint64_t(p.c.rows), p.c.ld),
      "layout of C", p);

  const lt::AlgoChoice choice =
      lt::choose_algorithm(handle, plan, key.align_a, key.align_b, key.align_c, key.deterministic);
  if (choice.failed_step) return cublas_error(choice.status, choice.failed_step, p);
  if (choice.found) return Status::ok();
  const cublasStatus_t hs = choice.status;
  return errorf(
      "no cuBLASLt algorithm for M=%lld,N=%lld,K=%lld bf16 x bf16 -> %s (trans_a=%d, trans_b=%d, "
      "lda=%lld, ldb=%lld, ldc=%lld)%s%s; check the shapes and the 16-byte alignment of the operands",
      (long long)p.m, (long long)p.n, (long long)p.k, p.c.dtype == DType::bf16 ? "bf16" : "f32", int(p.args.trans_a),
      int(p.args.trans_b), (long long)p.a.ld, (long long)p.b.ld, (long long)p.c.ld,
      hs == CUBLAS_STATUS_SUCCESS ? "" : ": ", hs == CUBLAS_STATUS_SUCCESS ? "" : cublasLtGetStatusString(hs));
}

// Finds or builds the plan and the device's workspace; holds the backend lock only while looking up.
Status get_plan(const GemmProblem& p, const Plan** plan, void** workspace) {
  PlanKey key{};
  CUDA_CHECK(cudaGetDevice(&key.device));
  key.m = p.m;
  key.n = p.n;
  key.k = p.k;
  key.lda = p.a.ld;
  key.ldb = p.b.ld;
  key.ldc = p.c.ld;
  key.trans_a = p.args.trans_a;
  key.trans_b = p.args.trans_b;
  key.beta_zero = p.args.beta == 0.f;
  key.c_dtype = p.c.dtype;
  key.align_a = lt::alignment_of(p.a.data);
  key.align_b = lt::alignment_of(p.b.data);
  key.align_c = lt::alignment_of(p.c.data);
  key.deterministic = deterministic_mode();

  Backend& be = Backend::get();
  std::lock_guard<std::mutex> lock(be.mu);
  NB_TRY(be.ready(key.device, "allocating the 32 MiB cuBLASLt workspace", workspace));
  Plan* found = nullptr;
  NB_TRY(be.plan_for(
      key, [&](cublasLtHandle_t handle, Plan* fresh) { return build_plan(handle, p, key, fresh); }, &found));
  *plan = found;  // plans are never evicted, so the pointer stays valid
  return Status::ok();
}

}  // namespace

Status matmul_cuda(const GemmProblem& p, Stream stream) {
  if (p.k == 0)
    return errorf("matmul on cuda: K = 0 (M=%lld, N=%lld) is not supported; skip the call or scale C instead",
                  (long long)p.m, (long long)p.n);
  const Plan* plan = nullptr;
  void* workspace = nullptr;
  NB_TRY(get_plan(p, &plan, &workspace));
  const float alpha = p.args.alpha, beta = p.args.beta;
  NB_CUBLAS_TRY(cublasLtMatmul(Backend::get().handle, plan->desc, &alpha, p.b.data, plan->a, p.a.data, plan->b, &beta,
                               p.c.data, plan->c, p.c.data, plan->c, &plan->algo, workspace, kWorkspaceBytes,
                               static_cast<cudaStream_t>(stream)),
                "matmul", p);
  return Status::ok();
}

size_t cuda_plan_count() {
  Backend& be = Backend::get();
  std::lock_guard<std::mutex> lock(be.mu);
  return be.plans.size();
}

}  // namespace nb::gemm
