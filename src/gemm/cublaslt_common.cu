// The shared part of the cuBLASLt backends (cublaslt_common.h): plan teardown and the algorithm choice.
#include <type_traits>
#include "gemm/cublaslt_common.h"

namespace nb::gemm::lt {
namespace {

constexpr int kHeuristicCandidates = 8;

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

using PreferenceOwner =
    std::unique_ptr<std::remove_pointer_t<cublasLtMatmulPreference_t>, decltype(&cublasLtMatmulPreferenceDestroy)>;

// The preference: the workspace limit, the alignments and the reduction schemes allowed. Returns the name of
// the step that failed (nullptr when none did) and its status in *status.
const char* set_preferences(cublasLtMatmulPreference_t pref, const uint32_t (&aligns)[4], bool deterministic,
                            cublasStatus_t* status) {
  const uint64_t ws = kWorkspaceBytes;
  *status = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
  if (*status != CUBLAS_STATUS_SUCCESS) return "workspace preference";
  const cublasLtMatmulPreferenceAttributes_t align_attrs[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  for (int i = 0; i < 4; ++i) {
    *status = cublasLtMatmulPreferenceSetAttribute(pref, align_attrs[i], &aligns[i], sizeof aligns[i]);
    if (*status != CUBLAS_STATUS_SUCCESS) return "alignment preference";
  }
  const uint32_t reduction_mask =
      deterministic ? uint32_t(CUBLASLT_REDUCTION_SCHEME_NONE)
                    : uint32_t(CUBLASLT_REDUCTION_SCHEME_NONE | CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE);
  *status = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &reduction_mask,
                                                 sizeof reduction_mask);
  return *status == CUBLAS_STATUS_SUCCESS ? nullptr : "reduction scheme preference";
}

}  // namespace

uint32_t alignment_of(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  uint32_t align = 256;
  while (align > 1 && (a % align) != 0) align >>= 1;
  return align;
}

Plan::~Plan() {
  if (a) cublasLtMatrixLayoutDestroy(a);
  if (b) cublasLtMatrixLayoutDestroy(b);
  if (c) cublasLtMatrixLayoutDestroy(c);
  if (desc) cublasLtMatmulDescDestroy(desc);
}

AlgoChoice choose_algorithm(cublasLtHandle_t handle, Plan* plan, uint32_t align_a, uint32_t align_b, uint32_t align_c,
                            bool deterministic) {
  AlgoChoice choice;
  cublasLtMatmulPreference_t pref = nullptr;
  choice.status = cublasLtMatmulPreferenceCreate(&pref);
  if (choice.status != CUBLAS_STATUS_SUCCESS) {
    choice.failed_step = "preference";
    return choice;
  }
  const PreferenceOwner owner(pref, cublasLtMatmulPreferenceDestroy);
  const uint32_t aligns[4] = {align_b, align_a, align_c, align_c};  // cuBLASLt's A, B, C, D
  choice.failed_step = set_preferences(pref, aligns, deterministic, &choice.status);
  if (choice.failed_step) return choice;

  cublasLtMatmulHeuristicResult_t results[kHeuristicCandidates] = {};
  int returned = 0;
  choice.status = cublasLtMatmulAlgoGetHeuristic(handle, plan->desc, plan->a, plan->b, plan->c, plan->c, pref,
                                                 kHeuristicCandidates, results, &returned);
  for (int i = 0; choice.status == CUBLAS_STATUS_SUCCESS && i < returned; ++i) {
    if (results[i].state != CUBLAS_STATUS_SUCCESS || results[i].workspaceSize > kWorkspaceBytes) continue;
    if (!split_k_allowed(results[i].algo, deterministic)) continue;  // in case the mask was not honoured
    plan->algo = results[i].algo;
    choice.found = true;
    return choice;
  }
  return choice;
}

}  // namespace nb::gemm::lt
