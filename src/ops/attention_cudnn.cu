// Causal GQA flash attention on CUDA through cuDNN 9's backend graph API (cudnn_backend.h).
//
// cuDNN fuses a graph of matmul / pointwise / reduction / reshape operations into one flash-attention
// kernel (the S x S score matrix lives only in registers and shared memory). We describe the graphs the
// way cuDNN's fused SDPA engines recognise them:
//   forward : S = Q K^T * scale; causal select(row >= col, S, -inf); m = max S; e = exp(S - m);
//             l = sum e; Stats = m + log l; P = e / l (bf16); O = P V
//   backward: Dsum = rowsum(dO * O); S as above minus Stats, causal select, P = exp(.)
//             dV = P^T dO; dS = P * (dO V^T - Dsum) * scale; dK = dS^T Q; dQ = dS K (FP32 accumulator)
//             GQA: dK/dV are computed per query head and reduced over the group by a reduction op.
// Layouts: q/out/dout/dq [B,S,Hq,D] and k/v/dk/dv [B,S,Hkv,D] bf16 are given to cuDNN as [B,H,S,D]
// with strides {S*H*D, D, H*D, 1} (no copies); K^T / V^T are the same memory with the last two dims
// swapped. Stats ([B,Hq,S,1] f32, stride {Hq*S,S,1,1}) is nibble's lse [B,Hq,S].
// Built execution plans are cached per (direction, B, S, Hq, Hkv, D, device); building one costs
// milliseconds to seconds. One process-wide workspace (cuDNN's plus the backward's FP32 dQ
// accumulator and softmax sum) grows on demand and is freed at exit. Calls are serialised by a mutex;
// because the workspace is shared, calls must not run concurrently on different streams.
#include <cudnn.h>

#include <array>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "core/cuda_check.h"
#include "ops/attention.h"

namespace nb::ops {
namespace {

// Unique ids of the tensors we bind at execution time; virtual tensors get ids from kFirstVirtual up.
enum Uid : int64_t {
  kQ = 1,
  kK,
  kV,
  kO,
  kStats,
  kDO,
  kDQ,
  kDK,
  kDV,
  kScale,
  kNegInf,
  kDQAccum,
  kSoftmaxSum,
  kOne,
  kFirstVirtual = 100
};

std::string cudnn_error(const char* what, cudnnStatus_t st) {
  char detail[512] = {};
  cudnnGetLastErrorString(detail, sizeof detail);
  return strprintf("%s failed with %s%s%s", what, cudnnGetErrorString(st), detail[0] ? ": " : "", detail);
}

// Owns every backend descriptor of one graph and its plan; the first failure is kept as a Status and
// later calls become no-ops, so graph construction reads as a straight list of operations.
class Graph {
 public:
  Graph(cudnnHandle_t handle, const char* name) : handle_(handle), name_(name) {}
  ~Graph() {
    for (auto d : owned_) cudnnBackendDestroyDescriptor(d);
  }
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;

  const Status& status() const { return status_; }
  cudnnBackendDescriptor_t plan() const { return plan_; }
  int64_t workspace_bytes() const { return workspace_; }

  // A tensor of 4 dims; by-value tensors are host scalars passed in the variant pack.
  cudnnBackendDescriptor_t tensor(int64_t uid, cudnnDataType_t dt, std::array<int64_t, 4> dims,
                                  std::array<int64_t, 4> strides, bool is_virtual, bool by_value = false) {
    auto t = create(CUDNN_BACKEND_TENSOR_DESCRIPTOR, "tensor");
    int64_t align = 16;
    set(t, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid, "tensor uid");
    set(t, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &dt, "tensor data type");
    set(t, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dims.data(), "tensor dims");
    set(t, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, strides.data(), "tensor strides");
    set(t, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &align, "tensor alignment");
    set(t, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &is_virtual, "tensor virtual flag");
    if (by_value) set(t, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &by_value, "tensor by-value flag");
    finalize(t, "tensor");
    return t;
  }
  cudnnBackendDescriptor_t virt(cudnnDataType_t dt, std::array<int64_t, 4> dims, std::array<int64_t, 4> strides) {
    return tensor(next_virtual_++, dt, dims, strides, true);
  }
  cudnnBackendDescriptor_t scalar(int64_t uid) {
    return tensor(uid, CUDNN_DATA_FLOAT, {1, 1, 1, 1}, {1, 1, 1, 1}, false, true);
  }

  // y = mode(x [, b [, t]]); math_prec is the compute type of the op.
  void pointwise(cudnnPointwiseMode_t mode, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t b,
                 cudnnBackendDescriptor_t t, cudnnBackendDescriptor_t y, cudnnDataType_t math_prec = CUDNN_DATA_FLOAT,
                 int64_t axis = -1) {
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

  // c = a @ b over the last two dims, batched over the first two (b broadcasts over GQA groups).
  void matmul(cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t c) {
    auto mm = create(CUDNN_BACKEND_MATMUL_DESCRIPTOR, "matmul");
    cudnnDataType_t comp = CUDNN_DATA_FLOAT;
    set(mm, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp, "matmul compute type");
    finalize(mm, "matmul");
    auto op = create(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR, "matmul op");
    set(op, CUDNN_ATTR_OPERATION_MATMUL_ADESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &a, "matmul a");
    set(op, CUDNN_ATTR_OPERATION_MATMUL_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b, "matmul b");
    set(op, CUDNN_ATTR_OPERATION_MATMUL_CDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &c, "matmul c");
    set(op, CUDNN_ATTR_OPERATION_MATMUL_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &mm, "matmul desc");
    finalize(op, "matmul op");
    ops_.push_back(op);
  }

  // y = reduce(x) over the dims where y has extent 1 (or a smaller extent, for GQA head groups).
  void reduction(cudnnReduceTensorOp_t mode, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
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

  // y is x with other dims/strides over the same elements (used for transposes).
  void reshape(cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
    auto op = create(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR, "reshape op");
    set(op, CUDNN_ATTR_OPERATION_RESHAPE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x, "reshape x");
    set(op, CUDNN_ATTR_OPERATION_RESHAPE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y, "reshape y");
    finalize(op, "reshape op");
    ops_.push_back(op);
  }

  // Finalizes the operation graph and takes the first engine config (heuristics mode A, then the
  // fallback list) whose execution plan finalizes.
  void build_plan() {
    if (!status_) return;
    auto graph = create(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, "operation graph");
    set(graph, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, int64_t(ops_.size()), ops_.data(),
        "graph ops");
    set(graph, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle_, "graph handle");
    finalize(graph, "operation graph");
    std::string tried;
    for (cudnnBackendHeurMode_t mode : {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK}) {
      if (!status_) return;
      auto heur = create(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, "engine heuristics");
      set(heur, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &graph, "heuristics graph");
      set(heur, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode, "heuristics mode");
      cudnnStatus_t st = cudnnBackendFinalize(heur);
      if (st != CUDNN_STATUS_SUCCESS) {
        tried += strprintf(" [heuristics mode %d: %s]", int(mode), cudnn_error("finalize", st).c_str());
        continue;
      }
      int64_t count = 0;
      st = cudnnBackendGetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count,
                                    nullptr);
      if (st != CUDNN_STATUS_SUCCESS || count == 0) {
        tried += strprintf(" [heuristics mode %d: %lld engine configs]", int(mode), (long long)count);
        continue;
      }
      std::vector<cudnnBackendDescriptor_t> cfgs(count);
      for (auto& c : cfgs) c = create(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, "engine config");
      if (!status_) return;
      st = cudnnBackendGetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &count,
                                    cfgs.data());
      if (st != CUDNN_STATUS_SUCCESS) {
        fail(cudnn_error("reading the heuristics results", st));
        return;
      }
      for (int64_t i = 0; i < count; ++i) {
        auto plan = create(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, "execution plan");
        set(plan, CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle_, "plan handle");
        set(plan, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &cfgs[i], "plan config");
        if (!status_) return;
        st = cudnnBackendFinalize(plan);
        if (st != CUDNN_STATUS_SUCCESS) {
          tried += strprintf(" [mode %d config %lld: %s]", int(mode), (long long)i, cudnnGetErrorString(st));
          continue;
        }
        int64_t n = 0;
        st = cudnnBackendGetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &n,
                                      &workspace_);
        if (st != CUDNN_STATUS_SUCCESS) {
          fail(cudnn_error("reading the plan workspace size", st));
          return;
        }
        plan_ = plan;
        return;
      }
    }
    fail("no cuDNN engine can run this graph:" + tried);
  }

 private:
  cudnnBackendDescriptor_t create(cudnnBackendDescriptorType_t type, const char* what) {
    cudnnBackendDescriptor_t d = nullptr;
    if (!status_) return nullptr;
    cudnnStatus_t st = cudnnBackendCreateDescriptor(type, &d);
    if (st != CUDNN_STATUS_SUCCESS) {
      fail(cudnn_error((std::string("creating the ") + what + " descriptor").c_str(), st));
      return nullptr;
    }
    owned_.push_back(d);
    return d;
  }
  void set(cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type,
           int64_t count, const void* value, const char* what) {
    if (!status_) return;
    cudnnStatus_t st = cudnnBackendSetAttribute(d, name, type, count, value);
    if (st != CUDNN_STATUS_SUCCESS) fail(cudnn_error((std::string("setting ") + what).c_str(), st));
  }
  void finalize(cudnnBackendDescriptor_t d, const char* what) {
    if (!status_) return;
    cudnnStatus_t st = cudnnBackendFinalize(d);
    if (st != CUDNN_STATUS_SUCCESS)
      fail(cudnn_error((std::string("finalizing the ") + what + " descriptor").c_str(), st));
  }
  void fail(const std::string& msg) {
    if (!status_) return;
    Status err = Status::error(std::string("cuDNN ") + name_ + ": " + msg);
    std::swap(status_, err);
  }

  cudnnHandle_t handle_;
  const char* name_;
  Status status_;
  std::vector<cudnnBackendDescriptor_t> owned_, ops_;
  cudnnBackendDescriptor_t plan_ = nullptr;
  int64_t workspace_ = 0;
  int64_t next_virtual_ = kFirstVirtual;
};

using Dims = std::array<int64_t, 4>;
// [B,H,S,D] view of a [B,S,H,D] tensor, and its K^T-style transpose [B,H,D,S].
Dims bshd_strides(int64_t S, int64_t H, int64_t D) { return {S * H * D, D, H * D, 1}; }
Dims bshd_t_strides(int64_t S, int64_t H, int64_t D) { return {S * H * D, D, 1, H * D}; }

// Appends the causal mask: y = (row >= col) ? x : -inf, with row/col generated over the score tensor.
cudnnBackendDescriptor_t causal_mask(Graph& g, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t neg_inf,
                                     const Dims& score_dims, const Dims& score_strides) {
  auto row = g.virt(CUDNN_DATA_INT32, score_dims, score_strides);
  auto col = g.virt(CUDNN_DATA_INT32, score_dims, score_strides);
  auto keep = g.virt(CUDNN_DATA_BOOLEAN, score_dims, score_strides);
  auto y = g.virt(CUDNN_DATA_FLOAT, score_dims, score_strides);
  g.pointwise(CUDNN_POINTWISE_GEN_INDEX, x, nullptr, nullptr, row, CUDNN_DATA_FLOAT, 2);
  g.pointwise(CUDNN_POINTWISE_GEN_INDEX, x, nullptr, nullptr, col, CUDNN_DATA_FLOAT, 3);
  g.pointwise(CUDNN_POINTWISE_CMP_GE, row, col, nullptr, keep, CUDNN_DATA_BOOLEAN);
  g.pointwise(CUDNN_POINTWISE_BINARY_SELECT, x, neg_inf, keep, y);
  return y;
}

void build_forward(Graph& g, const AttentionShape& sh) {
  const int64_t B = sh.batch, S = sh.seq, Hq = sh.heads, Hkv = sh.kv_heads, D = sh.head_dim;
  const Dims sdims{B, Hq, S, S}, sstr{Hq * S * S, S * S, S, 1};
  const Dims rdims{B, Hq, S, 1}, rstr{Hq * S, S, 1, 1};
  auto q = g.tensor(kQ, CUDNN_DATA_BFLOAT16, {B, Hq, S, D}, bshd_strides(S, Hq, D), false);
  auto kt = g.tensor(kK, CUDNN_DATA_BFLOAT16, {B, Hkv, D, S}, bshd_t_strides(S, Hkv, D), false);
  auto v = g.tensor(kV, CUDNN_DATA_BFLOAT16, {B, Hkv, S, D}, bshd_strides(S, Hkv, D), false);
  auto o = g.tensor(kO, CUDNN_DATA_BFLOAT16, {B, Hq, S, D}, bshd_strides(S, Hq, D), false);
  auto stats = g.tensor(kStats, CUDNN_DATA_FLOAT, rdims, rstr, false);
  auto scale = g.scalar(kScale);
  auto neg_inf = g.scalar(kNegInf);

  auto s = g.virt(CUDNN_DATA_FLOAT, sdims, sstr);
  g.matmul(q, kt, s);
  auto scaled = g.virt(CUDNN_DATA_FLOAT, sdims, sstr);
  g.pointwise(CUDNN_POINTWISE_MUL, s, scale, nullptr, scaled);
  auto masked = causal_mask(g, scaled, neg_inf, sdims, sstr);
  auto row_max = g.virt(CUDNN_DATA_FLOAT, rdims, rstr);
  g.reduction(CUDNN_REDUCE_TENSOR_MAX, masked, row_max);
  auto shifted = g.virt(CUDNN_DATA_FLOAT, sdims, sstr);
  g.pointwise(CUDNN_POINTWISE_SUB, masked, row_max, nullptr, shifted);
  auto e = g.virt(CUDNN_DATA_FLOAT, sdims, sstr);
  g.pointwise(CUDNN_POINTWISE_EXP, shifted, nullptr, nullptr, e);
  auto row_sum = g.virt(CUDNN_DATA_FLOAT, rdims, rstr);
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, e, row_sum);
  auto log_sum = g.virt(CUDNN_DATA_FLOAT, rdims, rstr);
  g.pointwise(CUDNN_POINTWISE_LOG, row_sum, nullptr, nullptr, log_sum);
  g.pointwise(CUDNN_POINTWISE_ADD, row_max, log_sum, nullptr, stats);
  auto p = g.virt(CUDNN_DATA_BFLOAT16, sdims, sstr);  // the fused engine feeds P to the second GEMM in bf16
  g.pointwise(CUDNN_POINTWISE_DIV, e, row_sum, nullptr, p);
  g.matmul(p, v, o);
  g.build_plan();
}

// Bytes of the backward's own scratch placed in front of cuDNN's workspace.
int64_t dq_accum_bytes(const AttentionShape& sh) { return sh.batch * sh.heads * sh.seq * sh.head_dim * 4; }
int64_t softmax_sum_bytes(const AttentionShape& sh) { return (sh.batch * sh.heads * sh.seq * 4 + 255) / 256 * 256; }

void build_backward(Graph& g, const AttentionShape& sh) {
  const int64_t B = sh.batch, S = sh.seq, Hq = sh.heads, Hkv = sh.kv_heads, D = sh.head_dim;
  const Dims sdims{B, Hq, S, S}, sstr{Hq * S * S, S * S, S, 1}, sstr_t{Hq * S * S, S * S, 1, S};
  const Dims rdims{B, Hq, S, 1}, rstr{Hq * S, S, 1, 1};
  const Dims qdims{B, Hq, S, D}, kvdims{B, Hkv, S, D}, kvt_dims{B, Hkv, D, S};
  auto q = g.tensor(kQ, CUDNN_DATA_BFLOAT16, qdims, bshd_strides(S, Hq, D), false);
  auto kt = g.tensor(kK, CUDNN_DATA_BFLOAT16, kvt_dims, bshd_t_strides(S, Hkv, D), false);
  auto vt = g.tensor(kV, CUDNN_DATA_BFLOAT16, kvt_dims, bshd_t_strides(S, Hkv, D), false);
  auto o = g.tensor(kO, CUDNN_DATA_BFLOAT16, qdims, bshd_strides(S, Hq, D), false);
  auto dout = g.tensor(kDO, CUDNN_DATA_BFLOAT16, qdims, bshd_strides(S, Hq, D), false);
  auto stats = g.tensor(kStats, CUDNN_DATA_FLOAT, rdims, rstr, false);
  auto dq = g.tensor(kDQ, CUDNN_DATA_BFLOAT16, qdims, bshd_strides(S, Hq, D), false);
  auto dk = g.tensor(kDK, CUDNN_DATA_BFLOAT16, kvdims, bshd_strides(S, Hkv, D), false);
  auto dv = g.tensor(kDV, CUDNN_DATA_BFLOAT16, kvdims, bshd_strides(S, Hkv, D), false);
  auto dq_accum = g.tensor(kDQAccum, CUDNN_DATA_FLOAT, qdims, {Hq * S * D, S * D, D, 1}, false);
  auto softmax_sum = g.tensor(kSoftmaxSum, CUDNN_DATA_FLOAT, rdims, rstr, false);
  auto scale = g.scalar(kScale);
  auto neg_inf = g.scalar(kNegInf);
  auto one = g.scalar(kOne);

  // softmax_sum = rowsum(dO * O)
  auto do_o = g.virt(CUDNN_DATA_FLOAT, qdims, {Hq * S * D, S * D, Hq * D, 1});
  g.pointwise(CUDNN_POINTWISE_MUL, dout, o, nullptr, do_o);
  auto do_o_sum = g.virt(CUDNN_DATA_FLOAT, rdims, rstr);
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, do_o, do_o_sum);
  g.pointwise(CUDNN_POINTWISE_MUL, do_o_sum, one, nullptr, softmax_sum);

  // P = exp(mask(Q K^T * scale - Stats))
  auto s = g.virt(CUDNN_DATA_FLOAT, sdims, sstr);
  g.matmul(q, kt, s);
  auto scaled = g.virt(CUDNN_DATA_FLOAT, sdims, sstr);
  g.pointwise(CUDNN_POINTWISE_MUL, s, scale, nullptr, scaled);
  auto centered = g.virt(CUDNN_DATA_FLOAT, sdims, sstr);
  g.pointwise(CUDNN_POINTWISE_SUB, scaled, stats, nullptr, centered);
  auto masked = causal_mask(g, centered, neg_inf, sdims, sstr);
  auto p = g.virt(CUDNN_DATA_FLOAT, sdims, sstr);
  g.pointwise(CUDNN_POINTWISE_EXP, masked, nullptr, nullptr, p);

  // dV = P^T dO (per query head, then summed over the GQA group)
  auto pt = g.virt(CUDNN_DATA_BFLOAT16, sdims, sstr_t);
  g.reshape(p, pt);
  if (Hq == Hkv) {
    g.matmul(pt, dout, dv);
  } else {
    auto dv_full = g.virt(CUDNN_DATA_BFLOAT16, qdims, {Hq * S * D, S * D, D, 1});
    g.matmul(pt, dout, dv_full);
    g.reduction(CUDNN_REDUCE_TENSOR_ADD, dv_full, dv);
  }

  // dS = P * (dO V^T - softmax_sum) * scale
  auto dp = g.virt(CUDNN_DATA_FLOAT, sdims, sstr);
  g.matmul(dout, vt, dp);
  auto dp_centered = g.virt(CUDNN_DATA_FLOAT, sdims, sstr);
  g.pointwise(CUDNN_POINTWISE_SUB, dp, softmax_sum, nullptr, dp_centered);
  auto ds_unscaled = g.virt(CUDNN_DATA_FLOAT, sdims, sstr);
  g.pointwise(CUDNN_POINTWISE_MUL, dp_centered, p, nullptr, ds_unscaled);
  auto ds = g.virt(CUDNN_DATA_FLOAT, sdims, sstr);
  g.pointwise(CUDNN_POINTWISE_MUL, ds_unscaled, scale, nullptr, ds);

  // dK = dS^T Q (summed over the group for GQA)
  auto dst = g.virt(CUDNN_DATA_BFLOAT16, sdims, sstr_t);
  g.reshape(ds, dst);
  if (Hq == Hkv) {
    g.matmul(dst, q, dk);
  } else {
    auto dk_full = g.virt(CUDNN_DATA_BFLOAT16, qdims, {Hq * S * D, S * D, D, 1});
    g.matmul(dst, q, dk_full);
    g.reduction(CUDNN_REDUCE_TENSOR_ADD, dk_full, dk);
  }

  // dQ = dS K, accumulated in FP32 then converted
  auto k = g.virt(CUDNN_DATA_BFLOAT16, kvdims, bshd_strides(S, Hkv, D));
  g.reshape(kt, k);
  g.matmul(ds, k, dq_accum);
  g.pointwise(CUDNN_POINTWISE_IDENTITY, dq_accum, nullptr, nullptr, dq);
  g.build_plan();
}

using Key = std::tuple<bool, int64_t, int64_t, int64_t, int64_t, int64_t, int>;

// Process-wide state: one handle per device, the plan cache and the shared workspace.
struct State {
  std::mutex mu;
  std::map<int, cudnnHandle_t> handles;
  std::map<Key, std::unique_ptr<Graph>> plans;
  void* workspace = nullptr;
  int64_t workspace_bytes = 0;
  ~State() {
    // At exit the CUDA runtime may already be unloading; errors here are harmless and ignored.
    if (workspace) cudaFree(workspace);
    for (auto& [dev, h] : handles) cudnnDestroy(h);
  }
};
State& state() {
  static State s;
  return s;
}

// Returns the cached (or newly built) plan for this direction and shape; caller holds the mutex.
Status get_plan(State& st, bool backward, const AttentionShape& sh, Graph** out) {
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  auto h = st.handles.find(dev);
  if (h == st.handles.end()) {
    cudnnHandle_t handle = nullptr;
    cudnnStatus_t cs = cudnnCreate(&handle);
    if (cs != CUDNN_STATUS_SUCCESS)
      return errorf("attention: %s; check that libcudnn 9 matches the installed driver",
                    cudnn_error("cudnnCreate", cs).c_str());
    h = st.handles.emplace(dev, handle).first;
  }
  Key key{backward, sh.batch, sh.seq, sh.heads, sh.kv_heads, sh.head_dim, dev};
  auto it = st.plans.find(key);
  if (it == st.plans.end()) {
    auto g = std::make_unique<Graph>(h->second, backward ? "attention backward" : "attention forward");
    if (backward)
      build_backward(*g, sh);
    else
      build_forward(*g, sh);
    if (!g->status())
      return Status(g->status())
          .context(strprintf("B=%lld S=%lld Hq=%lld Hkv=%lld D=%lld", (long long)sh.batch, (long long)sh.seq,
                             (long long)sh.heads, (long long)sh.kv_heads, (long long)sh.head_dim));
    it = st.plans.emplace(key, std::move(g)).first;
  }
  *out = it->second.get();
  return Status::ok();
}

Status ensure_workspace(State& st, int64_t bytes) {
  if (bytes <= st.workspace_bytes) return Status::ok();
  if (st.workspace) CUDA_CHECK(cudaFree(st.workspace));  // cudaFree waits for work still using it
  st.workspace = nullptr;
  st.workspace_bytes = 0;
  NB_TRY(device_malloc(&st.workspace, size_t(bytes)).context("attention workspace"));
  st.workspace_bytes = bytes;
  return Status::ok();
}

Status execute(State& st, Graph& g, cudaStream_t stream, const std::vector<int64_t>& uids,
               const std::vector<void*>& ptrs, void* workspace) {
  cudnnHandle_t handle = nullptr;
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  handle = st.handles.at(dev);
  cudnnStatus_t cs = cudnnSetStream(handle, stream);
  if (cs != CUDNN_STATUS_SUCCESS) return errorf("attention: %s", cudnn_error("cudnnSetStream", cs).c_str());
  cudnnBackendDescriptor_t pack = nullptr;
  cs = cudnnBackendCreateDescriptor(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, &pack);
  if (cs != CUDNN_STATUS_SUCCESS) return errorf("attention: %s", cudnn_error("creating the variant pack", cs).c_str());
  std::unique_ptr<void, void (*)(void*)> guard(pack, [](void* d) { cudnnBackendDestroyDescriptor(d); });
  const int64_t n = int64_t(uids.size());
  if ((cs = cudnnBackendSetAttribute(pack, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, n, uids.data())) ||
      (cs = cudnnBackendSetAttribute(pack, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, n,
                                     ptrs.data())) ||
      (cs = cudnnBackendSetAttribute(pack, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &workspace)) ||
      (cs = cudnnBackendFinalize(pack)))
    return errorf("attention: %s", cudnn_error("building the variant pack", cs).c_str());
  cs = cudnnBackendExecute(handle, g.plan(), pack);
  if (cs != CUDNN_STATUS_SUCCESS) return errorf("attention: %s", cudnn_error("cudnnBackendExecute", cs).c_str());
  return Status::ok();
}

}  // namespace

Status attention_forward_cudnn(const AttentionShape& sh, const Tensor& q, const Tensor& k, const Tensor& v,
                               const Tensor& out, const Tensor& lse, Stream stream) {
  NB_TRY(attention_check_args(sh, q, k, v, out, lse, nullptr, nullptr, nullptr, nullptr));
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  Graph* g = nullptr;
  NB_TRY(get_plan(st, false, sh, &g));
  NB_TRY(ensure_workspace(st, g->workspace_bytes()));
  float scale = sh.scale, neg_inf = -std::numeric_limits<float>::infinity();
  return execute(st, *g, static_cast<cudaStream_t>(stream), {kQ, kK, kV, kO, kStats, kScale, kNegInf},
                 {q.data, k.data, v.data, out.data, lse.data, &scale, &neg_inf}, st.workspace);
}

Status attention_backward_cudnn(const AttentionShape& sh, const Tensor& q, const Tensor& k, const Tensor& v,
                                const Tensor& out, const Tensor& dout, const Tensor& lse, const Tensor& dq,
                                const Tensor& dk, const Tensor& dv, Stream stream) {
  NB_TRY(attention_check_args(sh, q, k, v, out, lse, &dout, &dq, &dk, &dv));
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  Graph* g = nullptr;
  NB_TRY(get_plan(st, true, sh, &g));
  const int64_t accum = dq_accum_bytes(sh), sums = softmax_sum_bytes(sh);
  NB_TRY(ensure_workspace(st, accum + sums + g->workspace_bytes()));
  char* base = static_cast<char*>(st.workspace);
  float scale = sh.scale, neg_inf = -std::numeric_limits<float>::infinity(), one = 1.0f;
  return execute(st, *g, static_cast<cudaStream_t>(stream),
                 {kQ, kK, kV, kO, kDO, kStats, kDQ, kDK, kDV, kDQAccum, kSoftmaxSum, kScale, kNegInf, kOne},
                 {q.data, k.data, v.data, out.data, dout.data, lse.data, dq.data, dk.data, dv.data, base, base + accum,
                  &scale, &neg_inf, &one},
                 base + accum + sums);
}

int64_t attention_workspace_bytes() {
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  return st.workspace_bytes;
}

}  // namespace nb::ops
