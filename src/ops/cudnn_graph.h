// A small builder over cuDNN 9's backend graph API (cudnn_backend.h): tensors, pointwise / matmul /
// reduction / reshape operations, plan selection, and execution. CUDA-only (included from .cu files);
// the attention graphs (attention_graphs.cu) are written with it.
#pragma once
#include <cuda_runtime.h>
#include <cudnn.h>

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"

namespace nb::ops::cudnn_graph {

using Dims = std::array<int64_t, 4>;

// "what failed with STATUS: cuDNN's last error text".
std::string error_string(const char* what, cudnnStatus_t st);

// Per-batch GEMM extents read at run time from int32 tensors [b,1,1,1] (variable sequence lengths in
// padded or ragged attention); nullptr keeps the static extent.
struct MatmulOverrides {
  cudnnBackendDescriptor_t m = nullptr, n = nullptr, k = nullptr;
};

// Owns every backend descriptor of one graph and its plan; the first failure is kept as a Status and
// later calls become no-ops, so graph construction reads as a straight list of operations.
class Graph {
 public:
  // Virtual tensors get unique ids from first_virtual_uid up.
  Graph(cudnnHandle_t handle, const char* name, int64_t first_virtual_uid);
  ~Graph();
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;

  const char* name() const { return name_; }
  const Status& status() const { return status_; }
  cudnnBackendDescriptor_t plan() const { return plan_; }
  int64_t workspace_bytes() const { return workspace_; }

  // A tensor of 4 dims; by-value tensors are host scalars passed in the variant pack. ragged_offset (an
  // int32/int64 tensor [b+1,1,1,1] of element offsets) replaces the batch stride: packed sequences.
  cudnnBackendDescriptor_t tensor(int64_t uid, cudnnDataType_t dt, Dims dims, Dims strides, bool is_virtual,
                                  bool by_value = false, cudnnBackendDescriptor_t ragged_offset = nullptr);
  cudnnBackendDescriptor_t virt(cudnnDataType_t dt, Dims dims, Dims strides,
                                cudnnBackendDescriptor_t ragged_offset = nullptr) {
    return tensor(next_virtual_++, dt, dims, strides, true, false, ragged_offset);
  }
  cudnnBackendDescriptor_t scalar(int64_t uid) {
    return tensor(uid, CUDNN_DATA_FLOAT, {1, 1, 1, 1}, {1, 1, 1, 1}, false, true);
  }

  // y = mode(x [, b [, t]]); math_prec is the compute type of the op.
  void pointwise(cudnnPointwiseMode_t mode, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t b,
                 cudnnBackendDescriptor_t t, cudnnBackendDescriptor_t y, cudnnDataType_t math_prec = CUDNN_DATA_FLOAT,
                 int64_t axis = -1);
  // c = a @ b over the last two dims, batched over the first two (b broadcasts over GQA groups).
  void matmul(cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t c,
              const MatmulOverrides& extents = {});
  // y = reduce(x) over the dims where y has extent 1 (or a smaller extent, for GQA head groups).
  void reduction(cudnnReduceTensorOp_t mode, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y);
  // y is x with other dims/strides over the same elements (used for transposes).
  void reshape(cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y);

  // Finalizes the operation graph and takes the first engine config (heuristics mode A, then the
  // fallback list) whose execution plan finalizes. With require_deterministic set, configs whose engine
  // cuDNN notes as nondeterministic are passed over (--deterministic-mode); if that leaves none, the first
  // usable one is taken with a warning, and the run's own bit-for-bit check is the judge.
  void build_plan();
  void require_deterministic(bool on) { deterministic_ = on; }

 private:
  // Reads the heuristics results of one mode and keeps the first plan that finalizes; false if none.
  bool try_heuristics(cudnnBackendDescriptor_t graph, cudnnBackendHeurMode_t mode, std::string& tried);
  // True when cuDNN notes the config's engine as nondeterministic (CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC).
  bool noted_nondeterministic(cudnnBackendDescriptor_t cfg);
  cudnnBackendDescriptor_t create(cudnnBackendDescriptorType_t type, const char* what);
  void set(cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type,
           int64_t count, const void* value, const char* what);
  void finalize(cudnnBackendDescriptor_t d, const char* what);
  void fail(const std::string& msg);

  cudnnHandle_t handle_;
  const char* name_;
  Status status_;
  std::vector<cudnnBackendDescriptor_t> owned_, ops_;
  cudnnBackendDescriptor_t plan_ = nullptr;
  int64_t workspace_ = 0;
  int64_t next_virtual_;
  bool deterministic_ = false;
  bool skip_nondeterministic_ = false;  // during build_plan's first pass in deterministic mode
  int64_t skipped_nondeterministic_ = 0;
};

// Runs g's plan on `stream` with the tensors bound by uid (one pointer per uid; by-value tensors point
// at host scalars) and `workspace` of at least g.workspace_bytes().
Status execute(cudnnHandle_t handle, const Graph& g, cudaStream_t stream, const std::vector<int64_t>& uids,
               const std::vector<void*>& ptrs, void* workspace);

}  // namespace nb::ops::cudnn_graph
