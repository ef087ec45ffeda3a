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
// (core/determinism.h, part of the plan key) keeps only candidates that do not split K. One cublasLt
// handle per process and one 32 MiB workspace per device are created on first use and deliberately
// never destroyed (tearing them down after the CUDA runtime has unloaded at exit would crash).
#include <cublasLt.h>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include "core/cuda_check.h"
#include "core/determinism.h"
#include "gemm/gemm_problem.h"

namespace nb::gemm {
namespace {

constexpr size_t kWorkspaceBytes = size_t(32) << 20;
constexpr int kHeuristicCandidates = 8;

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

// Largest power of two (up to 256) dividing the address: cuBLASLt picks vectorized kernels from it.
uint32_t alignment_of(const void* p) {
  uintptr_t a = reinterpret_cast<uintptr_t>(p);
  uint32_t align = 256;
  while (align > 1 && (a % align) != 0) align >>= 1;
  return align;
}

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

struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;  // cuBLASLt's A (our B), B (our A), C = D
  cublasLtMatmulAlgo_t algo{};
  ~Plan() {
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

struct Backend {
  std::mutex mu;
  cublasLtHandle_t handle = nullptr;
  std::map<int, void*> workspace;  // per device
  std::map<PlanKey, std::unique_ptr<Plan>> plans;
};

Backend& backend() {
  static Backend* b = new Backend();  // leaked on purpose, see the file comment
  return *b;
}

// True unless the algorithm splits K and adds the partial sums in the output type, or splits K at all in
// deterministic mode. cuBLASLt documents every reduction scheme as ordered (INPLACE uses counters "to
// guarantee the sequentiality"), so split-K is not known to vary between runs; deterministic mode still
// keeps one dot product per output element so that no ordering of partial sums is left to a library.
bool split_k_allowed(const cublasLtMatmulAlgo_t& algo, bool deterministic) {
  int32_t split_k = 1;
  uint32_t scheme = CUBLASLT_REDUCTION_SCHEME_NONE;
  size_t written = 0;
  if (cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &split_k, sizeof split_k,
                                           &written) != CUBLAS_STATUS_SUCCESS)
    return true;  // no split-K information: nothing to object to
  if (split_k <= 1) return true;
  if (deterministic) return false;
  if (cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &scheme, sizeof scheme,
                                           &written) != CUBLAS_STATUS_SUCCESS)
    return false;
  return scheme == CUBLASLT_REDUCTION_SCHEME_NONE || scheme == CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
}

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

  cublasLtMatmulPreference_t pref = nullptr;
  NB_CUBLAS_TRY(cublasLtMatmulPreferenceCreate(&pref), "preference", p);
  std::unique_ptr<std::remove_pointer_t<cublasLtMatmulPreference_t>, decltype(&cublasLtMatmulPreferenceDestroy)>
      pref_owner(pref, cublasLtMatmulPreferenceDestroy);
  const uint64_t ws = kWorkspaceBytes;
  NB_CUBLAS_TRY(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws),
                "workspace preference", p);
  // cuBLASLt's A/B are our B/A; tell it the real alignments so it never picks a kernel that
  // assumes more than the pointers give.
  const uint32_t aligns[4] = {key.align_b, key.align_a, key.align_c, key.align_c};
  const cublasLtMatmulPreferenceAttributes_t align_attrs[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  for (int i = 0; i < 4; ++i)
    NB_CUBLAS_TRY(cublasLtMatmulPreferenceSetAttribute(pref, align_attrs[i], &aligns[i], sizeof aligns[i]),
                  "alignment preference", p);

  // Split-K is allowed only with partial sums kept in FP32 (the compute type). The in-place and
  // output-type schemes add the partial sums in C's type, which for a bf16 C would be a BF16
  // accumulation (a known cuBLASLt heuristic pitfall on some GPUs); FP32 accumulation is promised.
  // --deterministic-mode allows no split-K (see split_k_allowed).
  const uint32_t reduction_mask =
      key.deterministic ? uint32_t(CUBLASLT_REDUCTION_SCHEME_NONE)
                        : uint32_t(CUBLASLT_REDUCTION_SCHEME_NONE | CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE);
  NB_CUBLAS_TRY(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &reduction_mask,
                                                     sizeof reduction_mask),
                "reduction scheme preference", p);

  cublasLtMatmulHeuristicResult_t results[kHeuristicCandidates] = {};
  int returned = 0;
  cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(handle, plan->desc, plan->a, plan->b, plan->c, plan->c, pref,
                                                     kHeuristicCandidates, results, &returned);
  for (int i = 0; hs == CUBLAS_STATUS_SUCCESS && i < returned; ++i) {
    if (results[i].state != CUBLAS_STATUS_SUCCESS || results[i].workspaceSize > kWorkspaceBytes) continue;
    if (!split_k_allowed(results[i].algo, key.deterministic)) continue;  // in case the mask above was not honoured
    plan->algo = results[i].algo;
    return Status::ok();
  }
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
  key.align_a = alignment_of(p.a.data);
  key.align_b = alignment_of(p.b.data);
  key.align_c = alignment_of(p.c.data);
  key.deterministic = deterministic_mode();

  Backend& be = backend();
  std::lock_guard<std::mutex> lock(be.mu);
  if (!be.handle) NB_CUBLAS_TRY(cublasLtCreate(&be.handle), "handle creation", p);
  auto ws = be.workspace.find(key.device);
  if (ws == be.workspace.end()) {
    void* mem = nullptr;
    NB_TRY(device_malloc(&mem, kWorkspaceBytes).context("allocating the 32 MiB cuBLASLt workspace"));
    ws = be.workspace.emplace(key.device, mem).first;
  }
  *workspace = ws->second;
  auto it = be.plans.find(key);
  if (it == be.plans.end()) {
    auto fresh = std::make_unique<Plan>();
    NB_TRY(build_plan(be.handle, p, key, fresh.get()));
    it = be.plans.emplace(key, std::move(fresh)).first;
  }
  *plan = it->second.get();  // plans are never evicted, so the pointer stays valid
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
  NB_CUBLAS_TRY(cublasLtMatmul(backend().handle, plan->desc, &alpha, p.b.data, plan->a, p.a.data, plan->b, &beta,
                               p.c.data, plan->c, p.c.data, plan->c, &plan->algo, workspace, kWorkspaceBytes,
                               static_cast<cudaStream_t>(stream)),
                "matmul", p);
  return Status::ok();
}

size_t cuda_plan_count() {
  Backend& be = backend();
  std::lock_guard<std::mutex> lock(be.mu);
  return be.plans.size();
}

}  // namespace nb::gemm
