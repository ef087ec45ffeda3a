// The cuDNN backend-graph builder and plan runner (see cudnn_graph.h). Every descriptor a Graph creates
// is owned by it and destroyed with it; execution builds a variant pack per call (cheap next to the
// kernels) so that plans stay stateless and can be cached by shape. In deterministic mode the plan
// skips engines whose numerical notes say nondeterministic (what cudnn-frontend's deselect_numeric_notes
// does).
#include "ops/cudnn_graph.h"

#include <memory>
#include <utility>

#include "core/log.h"

namespace nb::ops::cudnn_graph {

std::string error_string(const char* what, cudnnStatus_t st) {
  char detail[512] = {};
  cudnnGetLastErrorString(detail, sizeof detail);
  return strprintf("%s failed with %s%s%s", what, cudnnGetErrorString(st), detail[0] ? ": " : "", detail);
}

Graph::Graph(cudnnHandle_t handle, const char* name, int64_t first_virtual_uid)
    : handle_(handle), name_(name), next_virtual_(first_virtual_uid) {}

Graph::~Graph() {
  for (auto d : owned_) cudnnBackendDestroyDescriptor(d);
}

cudnnBackendDescriptor_t Graph::tensor(int64_t uid, cudnnDataType_t dt, Dims dims, Dims strides, bool is_virtual,
                                       bool by_value, cudnnBackendDescriptor_t ragged_offset) {
  auto t = create(CUDNN_BACKEND_TENSOR_DESCRIPTOR, "tensor");
  int64_t align = 16;
  set(t, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid, "tensor uid");
  set(t, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &dt, "tensor data type");
  set(t, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dims.data(), "tensor dims");
  set(t, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, strides.data(), "tensor strides");
  set(t, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &align, "tensor alignment");
  set(t, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &is_virtual, "tensor virtual flag");
  if (by_value) set(t, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &by_value, "tensor by-value flag");
  if (ragged_offset)
    set(t, CUDNN_ATTR_TENSOR_RAGGED_OFFSET_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &ragged_offset,
        "tensor ragged offset");
  finalize(t, "tensor");
  return t;
}

void Graph::pointwise(cudnnPointwiseMode_t mode, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t b,
                      cudnnBackendDescriptor_t t, cudnnBackendDescriptor_t y, cudnnDataType_t math_prec, int64_t axis) {
  auto pw = create(CUDNN_BACKEND_POINTWISE_DESCRIPTOR, "pointwise");
  set(pw, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode, "pointwise mode");
  set(pw, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &math_prec, "pointwise math precision");
  if (axis >= 0) set(pw, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis, "pointwise axis");
  finalize(pw, "pointwise");
  auto op = create(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR, "pointwise op");
  set(op, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &pw, "pointwise op mode");
  set(op, CUDNN_ATTR_OPERATION_POINTWISE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x, "pointwise x");
  if (b) set(op, CUDNN_ATTR_OPERATION_POINTWISE_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b, "pointwise b");
  if (t) set(op, CUDNN_ATTR_OPERATION_POINTWISE_TDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &t, "pointwise t");
  set(op, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y, "pointwise y");
  finalize(op, "pointwise op");
  ops_.push_back(op);
}

void Graph::matmul(cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t c,
                   const MatmulOverrides& extents) {
  auto mm = create(CUDNN_BACKEND_MATMUL_DESCRIPTOR, "matmul");
  cudnnDataType_t comp = CUDNN_DATA_FLOAT;
  set(mm, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp, "matmul compute type");
  finalize(mm, "matmul");
  auto op = create(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR, "matmul op");
  set(op, CUDNN_ATTR_OPERATION_MATMUL_ADESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &a, "matmul a");
  set(op, CUDNN_ATTR_OPERATION_MATMUL_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b, "matmul b");
  set(op, CUDNN_ATTR_OPERATION_MATMUL_CDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &c, "matmul c");
  set(op, CUDNN_ATTR_OPERATION_MATMUL_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &mm, "matmul desc");
  if (extents.m)
    set(op, CUDNN_ATTR_OPERATION_MATMUL_GEMM_M_OVERRIDE_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &extents.m,
        "matmul M override");
  if (extents.n)
    set(op, CUDNN_ATTR_OPERATION_MATMUL_GEMM_N_OVERRIDE_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &extents.n,
        "matmul N override");
  if (extents.k)
    set(op, CUDNN_ATTR_OPERATION_MATMUL_GEMM_K_OVERRIDE_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &extents.k,
        "matmul K override");
  finalize(op, "matmul op");
  ops_.push_back(op);
}

void Graph::reduction(cudnnReduceTensorOp_t mode, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
  auto rd = create(CUDNN_BACKEND_REDUCTION_DESCRIPTOR, "reduction");
  cudnnDataType_t comp = CUDNN_DATA_FLOAT;
  set(rd, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &mode, "reduction operator");
  set(rd, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp, "reduction compute type");
  finalize(rd, "reduction");
  auto op = create(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR, "reduction op");
  set(op, CUDNN_ATTR_OPERATION_REDUCTION_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x, "reduction x");
  set(op, CUDNN_ATTR_OPERATION_REDUCTION_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y, "reduction y");
  set(op, CUDNN_ATTR_OPERATION_REDUCTION_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &rd, "reduction desc");
  finalize(op, "reduction op");
  ops_.push_back(op);
}

void Graph::reshape(cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
  auto op = create(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR, "reshape op");
  set(op, CUDNN_ATTR_OPERATION_RESHAPE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x, "reshape x");
  set(op, CUDNN_ATTR_OPERATION_RESHAPE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y, "reshape y");
  finalize(op, "reshape op");
  ops_.push_back(op);
}

void Graph::build_plan() {
  if (!status_) return;
  auto graph = create(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, "operation graph");
  set(graph, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, int64_t(ops_.size()), ops_.data(),
      "graph ops");
  set(graph, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle_, "graph handle");
  finalize(graph, "operation graph");
  std::string tried;
  // Deterministic mode: a first pass without the engines cuDNN notes as nondeterministic, then (only if
  // it passed some over and found nothing) the usual choice with a warning.
  skip_nondeterministic_ = deterministic_;
  skipped_nondeterministic_ = 0;
  for (int pass = 0; pass < 2; ++pass) {
    for (cudnnBackendHeurMode_t mode : {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK}) {
      if (!status_) return;
      if (try_heuristics(graph, mode, tried)) {
        if (pass == 1 && status_)
          NB_LOG_WARN("cuDNN %s: every engine that runs it is noted nondeterministic; --deterministic-mode uses one",
                      name_);
        return;
      }
    }
    if (!skip_nondeterministic_ || skipped_nondeterministic_ == 0) break;
    skip_nondeterministic_ = false;
  }
  fail("no cuDNN engine can run this graph:" + tried);
}

bool Graph::noted_nondeterministic(cudnnBackendDescriptor_t cfg) {
  auto engine = create(CUDNN_BACKEND_ENGINE_DESCRIPTOR, "engine");
  if (!status_) return false;
  int64_t n = 0;
  if (cudnnBackendGetAttribute(cfg, CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &n, &engine) !=
      CUDNN_STATUS_SUCCESS)
    return false;  // no notes to read: nothing to object to
  cudnnBackendNumericalNote_t notes[CUDNN_NUMERICAL_NOTE_TYPE_COUNT] = {};
  n = 0;
  if (cudnnBackendGetAttribute(engine, CUDNN_ATTR_ENGINE_NUMERICAL_NOTE, CUDNN_TYPE_NUMERICAL_NOTE,
                               CUDNN_NUMERICAL_NOTE_TYPE_COUNT, &n, notes) != CUDNN_STATUS_SUCCESS)
    return false;
  for (int64_t i = 0; i < n && i < CUDNN_NUMERICAL_NOTE_TYPE_COUNT; ++i)
    if (notes[i] == CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC) return true;
  return false;
}

// True when it set the plan or failed for good; false (with a note in `tried`) to try the next mode.
bool Graph::try_heuristics(cudnnBackendDescriptor_t graph, cudnnBackendHeurMode_t mode, std::string& tried) {
  auto heur = create(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, "engine heuristics");
  set(heur, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &graph, "heuristics graph");
  set(heur, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode, "heuristics mode");
  if (!status_) return true;
  cudnnStatus_t st = cudnnBackendFinalize(heur);
  if (st != CUDNN_STATUS_SUCCESS) {
    tried += strprintf(" [heuristics mode %d: %s]", int(mode), error_string("finalize", st).c_str());
    return false;
  }
  int64_t count = 0;
  st = cudnnBackendGetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, nullptr);
  if (st != CUDNN_STATUS_SUCCESS || count == 0) {
    tried += strprintf(" [heuristics mode %d: %lld engine configs]", int(mode), (long long)count);
    return false;
  }
  std::vector<cudnnBackendDescriptor_t> cfgs(count);
  for (auto& c : cfgs) c = create(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, "engine config");
  if (!status_) return true;
  st = cudnnBackendGetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &count,
                                cfgs.data());
  if (st != CUDNN_STATUS_SUCCESS) {
    fail(error_string("reading the heuristics results", st));
    return true;
  }
  for (int64_t i = 0; i < count; ++i) {
    if (skip_nondeterministic_ && noted_nondeterministic(cfgs[i])) {
      ++skipped_nondeterministic_;
      tried += strprintf(" [mode %d config %lld: noted nondeterministic]", int(mode), (long long)i);
      continue;
    }
    if (!status_) return true;
    auto plan = create(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, "execution plan");
    set(plan, CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle_, "plan handle");
    set(plan, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &cfgs[i], "plan config");
    if (!status_) return true;
    st = cudnnBackendFinalize(plan);
    if (st != CUDNN_STATUS_SUCCESS) {
      tried += strprintf(" [mode %d config %lld: %s]", int(mode), (long long)i, cudnnGetErrorString(st));
      continue;
    }
    int64_t n = 0;
    st = cudnnBackendGetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &n, &workspace_);
    if (st != CUDNN_STATUS_SUCCESS) {
      fail(error_string("reading the plan workspace size", st));
      return true;
    }
    plan_ = plan;
    return true;
  }
  return false;
}

cudnnBackendDescriptor_t Graph::create(cudnnBackendDescriptorType_t type, const char* what) {
  cudnnBackendDescriptor_t d = nullptr;
  if (!status_) return nullptr;
  cudnnStatus_t st = cudnnBackendCreateDescriptor(type, &d);
  if (st != CUDNN_STATUS_SUCCESS) {
    fail(error_string((std::string("creating the ") + what + " descriptor").c_str(), st));
    return nullptr;
  }
  owned_.push_back(d);
  return d;
}

void Graph::set(cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type,
                int64_t count, const void* value, const char* what) {
  if (!status_) return;
  cudnnStatus_t st = cudnnBackendSetAttribute(d, name, type, count, value);
  if (st != CUDNN_STATUS_SUCCESS) fail(error_string((std::string("setting ") + what).c_str(), st));
}

void Graph::finalize(cudnnBackendDescriptor_t d, const char* what) {
  if (!status_) return;
  cudnnStatus_t st = cudnnBackendFinalize(d);
  if (st != CUDNN_STATUS_SUCCESS)
    fail(error_string((std::string("finalizing the ") + what + " descriptor").c_str(), st));
}

void Graph::fail(const std::string& msg) {
  if (!status_) return;
  Status err = Status::error(std::string("cuDNN ") + name_ + ": " + msg);
  std::swap(status_, err);
}

Status execute(cudnnHandle_t handle, const Graph& g, cudaStream_t stream, const std::vector<int64_t>& uids,
               const std::vector<void*>& ptrs, void* workspace) {
  cudnnStatus_t cs = cudnnSetStream(handle, stream);
  if (cs != CUDNN_STATUS_SUCCESS) return errorf("%s: %s", g.name(), error_string("cudnnSetStream", cs).c_str());
  cudnnBackendDescriptor_t pack = nullptr;
  cs = cudnnBackendCreateDescriptor(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, &pack);
  if (cs != CUDNN_STATUS_SUCCESS)
    return errorf("%s: %s", g.name(), error_string("creating the variant pack", cs).c_str());
  std::unique_ptr<void, void (*)(void*)> guard(pack, [](void* d) { cudnnBackendDestroyDescriptor(d); });
  const int64_t n = int64_t(uids.size());
  if ((cs = cudnnBackendSetAttribute(pack, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, n, uids.data())) ||
      (cs = cudnnBackendSetAttribute(pack, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, n,
                                     ptrs.data())) ||
      (cs = cudnnBackendSetAttribute(pack, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &workspace)) ||
      (cs = cudnnBackendFinalize(pack)))
    return errorf("%s: %s", g.name(), error_string("building the variant pack", cs).c_str());
  cs = cudnnBackendExecute(handle, g.plan(), pack);
  if (cs != CUDNN_STATUS_SUCCESS) return errorf("%s: %s", g.name(), error_string("cudnnBackendExecute", cs).c_str());
  return Status::ok();
}

}  // namespace nb::ops::cudnn_graph
