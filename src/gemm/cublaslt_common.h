// What the two cuBLASLt backends share (gemm_cublaslt.cu: BF16 x BF16; gemm_fp8_cublaslt.cu: FP8 with scales
// and the emulation's BF16 GEMM): the cached plan, the process-wide handle with one workspace per device, and
// the choice of algorithm. Each backend keeps its own plan key, problem type and error messages.
// CUDA builds only (included by .cu files).
#pragma once
#include <cublasLt.h>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include "core/memory_ledger.h"
#include "core/status.h"
#include "core/tensor.h"
#include "gemm/gemm.h"

namespace nb::gemm::lt {

constexpr size_t kWorkspaceBytes = kCublasLtWorkspaceBytes;  // gemm.h

// Largest power of two (up to 256) dividing the address: cuBLASLt picks vectorized kernels from it.
uint32_t alignment_of(const void* p);

// A matmul descriptor, the layouts of cuBLASLt's A (our B), B (our A) and C = D, and the algorithm chosen.
struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  Plan() = default;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  ~Plan();
};

// One handle per process and one workspace per device, created on first use and deliberately never
// destroyed (tearing them down after the CUDA runtime has unloaded at exit would crash); the plans by Key,
// never evicted, so a plan pointer stays valid. Each Key type is its own backend.
template <typename Key>
struct Backend {
  std::mutex mu;
  cublasLtHandle_t handle = nullptr;
  std::map<int, void*> workspace;  // per device
  std::map<Key, std::unique_ptr<Plan>> plans;

  static Backend& get() {
    static Backend* b = new Backend();  // leaked on purpose, see above
    return *b;
  }
  // The handle and `device`'s workspace of kWorkspaceBytes, made on first use; the caller holds mu. `what`
  // says what an allocation failure was doing.
  Status ready(int device, const char* what, void** ws) {
    if (!handle) {
      const cublasStatus_t s = cublasLtCreate(&handle);
      if (s != CUBLAS_STATUS_SUCCESS)
        return errorf("cuBLASLt handle creation failed: %s (%s)", cublasLtGetStatusName(s), cublasLtGetStatusString(s));
    }
    auto it = workspace.find(device);
    if (it == workspace.end()) {
      void* mem = nullptr;
      MemoryScope scope(MemPart::gemm_workspace);
      NB_TRY(device_malloc(&mem, kWorkspaceBytes).context(what));
      it = workspace.emplace(device, mem).first;
    }
    *ws = it->second;
    return Status::ok();
  }
  // key's plan, built by build(handle, plan) the first time it is asked for; the caller holds mu.
  template <typename Build>
  Status plan_for(const Key& key, Build&& build, Plan** out) {
    auto it = plans.find(key);
    if (it == plans.end()) {
      auto fresh = std::make_unique<Plan>();
      NB_TRY(build(handle, fresh.get()));
      it = plans.emplace(key, std::move(fresh)).first;
    }
    *out = it->second.get();
    return Status::ok();
  }
};

// What choose_algorithm found: a failed cuBLASLt call (failed_step names it, status is its code), or the
// heuristic's status and whether one of its candidates qualified.
struct AlgoChoice {
  cublasStatus_t status = CUBLAS_STATUS_SUCCESS;
  const char* failed_step = nullptr;
  bool found = false;
};

// Sets plan->algo to the first of cuBLASLt's heuristic candidates for plan's descriptor and layouts that
// succeeds, fits the workspace and, if it splits K, adds its partial sums in FP32 (the compute type: the
// in-place and output-type schemes would add them in C's type, a BF16 accumulation for a BF16 C);
// deterministic (--deterministic-mode) allows no split-K at all. align_* are our operands' pointer
// alignments (cuBLASLt's A and B are our B and A), so no kernel assumes more than the pointers give.
AlgoChoice choose_algorithm(cublasLtHandle_t handle, Plan* plan, uint32_t align_a, uint32_t align_b, uint32_t align_c,
                            bool deterministic);

}  // namespace nb::gemm::lt
