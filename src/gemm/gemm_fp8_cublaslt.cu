// cuBLASLt backend of the quantized GEMMs: FP8 operands with per-tensor (SCALAR_32F), 1x128
// (VEC128_32F) or 128x128 (BLK128x128_32F) FP32 dequantization scales, and the BF16 GEMM of the
// MXFP8/NVFP4 emulation (alpha and beta optionally read from device memory, so no host sync).
//
// Row-major through a column-major library, as in gemm_cublaslt.cu: row-major C[M,N] = A . B^T is
// the column-major C^T = B . A^T. cuBLASLt's first operand ("A") is our B, its second ("B") our A;
// its m, n, k are our N, M, K. A K-major operand [rows, K] read column-major is K x rows, so the TN
// form (cuBLASLt A transposed, B not) is exactly "both K-major", the only FP8 layout Hopper runs.
// Scales: cuBLASLt's A scale is our B's, its B scale our A's. The block scale layouts the fp8_block
// quantizer writes (TE's GEMM-ready layouts) are passed unchanged:
//   VEC128     operand [rows, K]: FP32 [K/128, round4(rows)], rows contiguous -- read column-major
//              this is the rows x K/128 scale matrix with leading dimension round4(rows)
//   BLK128x128 operand [rows, K]: FP32 [rows/128, round4(K/128)], K-blocks contiguous -- column-major
//              the K/128 x rows/128 matrix with leading dimension round4(K/128)
// Both were verified against an FP64 reference by tests/qgemm/gpu (H200, sm_90, cuBLAS 13.0), as was
// cuBLASLt's refusal of E5M2 x E5M2 and of 128x128 x 128x128 ("not supported").
//
// Plans (descriptor, layouts, algorithm) are cached per (device, shape, types, layouts, scale modes,
// C type and ld, beta == 0, fast accumulation, pointer mode, alignments, deterministic mode); the scale
// pointers are set on the cached descriptor at each call under the backend lock, which is held through
// the launch.
// The plan cache, the handle, the 32 MiB workspace per device and the algorithm choice are shared with the
// BF16 backend (cublaslt_common.h).
#include <cublasLt.h>
#include <mutex>
#include <tuple>
#include "core/cuda_check.h"
#include "core/determinism.h"
#include "gemm/cublaslt_common.h"
#include "gemm/gemm_quantized.h"

namespace nb::gemm::detail {
namespace {

using lt::kWorkspaceBytes;
using lt::Plan;

const char* elem_name(ElemType t) { return t == ElemType::e4m3 ? "e4m3" : t == ElemType::e5m2 ? "e5m2" : "bf16"; }
const char* scale_name(ScaleMode s) {
  switch (s) {
    case ScaleMode::none: return "none";
    case ScaleMode::tensor: return "per-tensor";
    case ScaleMode::vec128: return "1x128";
    case ScaleMode::blk128x128: return "128x128";
  }
  return "?";
}

Status cublas_error(cublasStatus_t s, const char* what, const LtProblem& p) {
  return errorf("cuBLASLt %s failed for quantized GEMM M=%lld,N=%lld,K=%lld (%s/%s x %s/%s): %s (%s)", what,
                (long long)p.m, (long long)p.n, (long long)p.k, elem_name(p.a.type), scale_name(p.a.scale_mode),
                elem_name(p.b.type), scale_name(p.b.scale_mode), cublasLtGetStatusName(s), cublasLtGetStatusString(s));
}

#define NB_LT_TRY(expr, what, problem)                                               \
  do {                                                                               \
    cublasStatus_t nb_cs_ = (expr);                                                  \
    if (nb_cs_ != CUBLAS_STATUS_SUCCESS) return cublas_error(nb_cs_, what, problem); \
  } while (0)

cudaDataType_t cuda_type(ElemType t) {
  return t == ElemType::e4m3 ? CUDA_R_8F_E4M3 : t == ElemType::e5m2 ? CUDA_R_8F_E5M2 : CUDA_R_16BF;
}

int32_t cublas_scale_mode(ScaleMode s) {
  return s == ScaleMode::vec128       ? int32_t(CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F)
         : s == ScaleMode::blk128x128 ? int32_t(CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F)
                                      : int32_t(CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F);
}

struct PlanKey {
  int device;
  int64_t m, n, k, ldc;
  ElemType ta, tb;
  bool a_kmajor, b_kmajor;
  ScaleMode sa, sb;
  DType c_dtype;
  bool beta_zero, fast_accum, device_scalars;
  uint32_t align_a, align_b, align_c;
  bool deterministic;  // --deterministic-mode: no split-K
  auto tie() const {
    return std::tie(device, m, n, k, ldc, ta, tb, a_kmajor, b_kmajor, sa, sb, c_dtype, beta_zero, fast_accum,
                    device_scalars, align_a, align_b, align_c, deterministic);
  }
  bool operator<(const PlanKey& o) const { return tie() < o.tie(); }
};

using Backend = lt::Backend<PlanKey>;

template <typename T>
cublasStatus_t set_attr(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr, const T& v) {
  return cublasLtMatmulDescSetAttribute(d, attr, &v, sizeof v);
}

Status build_plan(cublasLtHandle_t handle, const LtProblem& p, const PlanKey& key, Plan* plan) {
  // cuBLASLt A = our B: K-major [N,K] is column-major K x N, used transposed.
  const cublasOperation_t op_first = p.b.k_major ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_second = p.a.k_major ? CUBLAS_OP_N : CUBLAS_OP_T;
  NB_LT_TRY(cublasLtMatmulDescCreate(&plan->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "matmul descriptor", p);
  NB_LT_TRY(set_attr(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, op_first), "TRANSA attribute", p);
  NB_LT_TRY(set_attr(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, op_second), "TRANSB attribute", p);
  const bool fp8 = p.a.type != ElemType::bf16;
  if (fp8) {
    const int8_t fast = p.fast_accum ? 1 : 0;
    NB_LT_TRY(set_attr(plan->desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, fast), "FAST_ACCUM attribute", p);
    if (p.b.scale_mode != ScaleMode::tensor)
      NB_LT_TRY(set_attr(plan->desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, cublas_scale_mode(p.b.scale_mode)),
                "A_SCALE_MODE attribute", p);
    if (p.a.scale_mode != ScaleMode::tensor)
      NB_LT_TRY(set_attr(plan->desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, cublas_scale_mode(p.a.scale_mode)),
                "B_SCALE_MODE attribute", p);
    // Heuristics with block scale modes want the scale pointers set; the call sets the real ones.
    NB_LT_TRY(set_attr(plan->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, static_cast<const void*>(p.b.scale)),
              "A_SCALE_POINTER attribute", p);
    NB_LT_TRY(set_attr(plan->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, static_cast<const void*>(p.a.scale)),
              "B_SCALE_POINTER attribute", p);
  }
  if (p.device_alpha_beta) {
    const int32_t mode = CUBLASLT_POINTER_MODE_DEVICE;
    NB_LT_TRY(set_attr(plan->desc, CUBLASLT_MATMUL_DESC_POINTER_MODE, mode), "POINTER_MODE attribute", p);
  }
  const uint64_t a_rows = p.b.k_major ? p.k : p.n, a_cols = p.b.k_major ? p.n : p.k;
  const uint64_t b_rows = p.a.k_major ? p.k : p.m, b_cols = p.a.k_major ? p.m : p.k;
  NB_LT_TRY(cublasLtMatrixLayoutCreate(&plan->a, cuda_type(p.b.type), a_rows, a_cols, int64_t(a_rows)), "layout of B",
            p);
  NB_LT_TRY(cublasLtMatrixLayoutCreate(&plan->b, cuda_type(p.a.type), b_rows, b_cols, int64_t(b_rows)), "layout of A",
            p);
  NB_LT_TRY(cublasLtMatrixLayoutCreate(&plan->c, p.c.dtype == DType::bf16 ? CUDA_R_16BF : CUDA_R_32F, uint64_t(p.n),
                                       uint64_t(p.m), p.c.ld),
            "layout of C", p);

  // Split-K only with FP32 partial sums, none in deterministic mode (cublaslt_common.h).
  const lt::AlgoChoice choice =
      lt::choose_algorithm(handle, plan, key.align_a, key.align_b, key.align_c, key.deterministic);
  if (choice.failed_step) return cublas_error(choice.status, choice.failed_step, p);
  if (choice.found) return Status::ok();
  const cublasStatus_t hs = choice.status;
  return errorf(
      "no cuBLASLt algorithm for the quantized GEMM M=%lld,N=%lld,K=%lld: A %s (%s scales%s) x B %s (%s "
      "scales%s) -> %s%s%s%s; this GPU/cuBLASLt may not support the combination (FP8 needs sm_89+, block "
      "scales need CUDA >= 12.9 on sm_90), or the operands are not 16-byte aligned",
      (long long)p.m, (long long)p.n, (long long)p.k, elem_name(p.a.type), scale_name(p.a.scale_mode),
      p.a.k_major ? "" : ", transposed storage", elem_name(p.b.type), scale_name(p.b.scale_mode),
      p.b.k_major ? "" : ", transposed storage", p.c.dtype == DType::bf16 ? "bf16" : "f32",
      p.fast_accum ? ", fast accumulation" : "", hs == CUBLAS_STATUS_SUCCESS ? "" : ": ",
      hs == CUBLAS_STATUS_SUCCESS ? "" : cublasLtGetStatusString(hs));
}

}  // namespace

Status lt_matmul(const LtProblem& p, Stream stream) {
  PlanKey key{};
  CUDA_CHECK(cudaGetDevice(&key.device));
  key.m = p.m;
  key.n = p.n;
  key.k = p.k;
  key.ldc = p.c.ld;
  key.ta = p.a.type;
  key.tb = p.b.type;
  key.a_kmajor = p.a.k_major;
  key.b_kmajor = p.b.k_major;
  key.sa = p.a.scale_mode;
  key.sb = p.b.scale_mode;
  key.c_dtype = p.c.dtype;
  key.beta_zero = p.device_alpha_beta ? false : p.beta == 0.f;
  key.fast_accum = p.fast_accum;
  key.device_scalars = p.device_alpha_beta != nullptr;
  key.align_a = lt::alignment_of(p.a.data);
  key.align_b = lt::alignment_of(p.b.data);
  key.align_c = lt::alignment_of(p.c.data);
  key.deterministic = deterministic_mode();

  Backend& be = Backend::get();
  std::lock_guard<std::mutex> lock(be.mu);  // held through the launch: the scale pointers live in the plan
  void* workspace = nullptr;
  NB_TRY(be.ready(key.device, "allocating the 32 MiB quantized-GEMM workspace", &workspace));
  Plan* found = nullptr;
  NB_TRY(be.plan_for(
      key, [&](cublasLtHandle_t handle, Plan* fresh) { return build_plan(handle, p, key, fresh); }, &found));
  Plan& plan = *found;
  if (p.a.type != ElemType::bf16) {
    NB_LT_TRY(set_attr(plan.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, static_cast<const void*>(p.b.scale)),
              "A_SCALE_POINTER attribute", p);
    NB_LT_TRY(set_attr(plan.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, static_cast<const void*>(p.a.scale)),
              "B_SCALE_POINTER attribute", p);
  }
  const float alpha = p.alpha, beta = p.beta;
  const void* alpha_ptr = p.device_alpha_beta ? static_cast<const void*>(p.device_alpha_beta) : &alpha;
  const void* beta_ptr = p.device_alpha_beta ? static_cast<const void*>(p.device_alpha_beta + 1) : &beta;
  NB_LT_TRY(
      cublasLtMatmul(be.handle, plan.desc, alpha_ptr, p.b.data, plan.a, p.a.data, plan.b, beta_ptr, p.c.data, plan.c,
                     p.c.data, plan.c, &plan.algo, workspace, kWorkspaceBytes, static_cast<cudaStream_t>(stream)),
      "matmul", p);
  return Status::ok();
}

size_t lt_plan_count() {
  Backend& be = Backend::get();
  std::lock_guard<std::mutex> lock(be.mu);
  return be.plans.size();
}

}  // namespace nb::gemm::detail
