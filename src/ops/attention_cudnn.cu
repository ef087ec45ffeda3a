// Causal GQA flash attention on CUDA through cuDNN 9's backend graph API: plan cache, workspace and the
// entry points. The graphs themselves are in attention_graphs.cu (design notes in attention_graphs.h).
//
// Built execution plans are cached per (direction, whole rows or packed, graph batch, graph sequence,
// Hq, Hkv, D, device); building one costs milliseconds to seconds. Packed calls key on the segment-slot
// and segment-length buckets, not on the segments, so a run sees few plans. One process-wide workspace
// grows on demand and is freed at exit: the backward's FP32 dQ accumulator and softmax sum (and, packed
// GQA, the per-query-head dK/dV) in front, then for packed calls the per-segment tables that a small
// kernel derives from starts_device on the call's stream (no host synchronization), then cuDNN's own.
// --deterministic-mode (core/determinism.h) builds graphs without the dQ accumulator (attention_graphs.h),
// keyed apart from the default ones, and leaves its bytes out of the workspace.
// Calls are serialised by a mutex; because the workspace is shared, calls must not run concurrently on
// different streams.
#include <cudnn.h>

#include <algorithm>
#include <limits>
#include <map>
#include <string>
#include <memory>
#include <mutex>
#include <tuple>
#include <vector>

#include "core/cuda_check.h"
#include "core/determinism.h"
#include "core/memory_ledger.h"
#include "ops/attention.h"
#include "ops/attention_graphs.h"
#include "ops/attention_workspace.h"
#include "ops/cudnn_graph.h"

namespace nb::ops {
namespace {

using namespace attention_graphs;
using cudnn_graph::error_string;
using cudnn_graph::Graph;

// (backward, packed, graph batch, graph sequence, keys per row, causal, Hq, Hkv, D, device, deterministic)
using Key = std::tuple<bool, bool, int64_t, int64_t, int64_t, bool, int64_t, int64_t, int64_t, int, bool>;

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

Status current_handle(State& st, cudnnHandle_t* out) {
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  auto h = st.handles.find(dev);
  if (h == st.handles.end()) {
    cudnnHandle_t handle = nullptr;
    cudnnStatus_t cs = cudnnCreate(&handle);
    if (cs != CUDNN_STATUS_SUCCESS)
      return errorf("attention: %s; check that libcudnn 9 matches the installed driver",
                    error_string("cudnnCreate", cs).c_str());
    h = st.handles.emplace(dev, handle).first;
  }
  *out = h->second;
  return Status::ok();
}

// cuDNN 9.0 - 9.9 need the padding mask repeated after the Stats subtraction (cudnn-frontend's
// workaround for its bug 4475073) and prefer the lowest float to -inf as the masked score.
bool old_padding_mask_rules() { return cudnnGetVersion() < 91000; }

// Returns the cached (or newly built) plan for this direction and shape; caller holds the mutex.
Status get_plan(State& st, bool backward, const AttentionShape& sh, const Packed* packed, Graph** out) {
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  cudnnHandle_t handle = nullptr;
  NB_TRY(current_handle(st, &handle));
  const int64_t b = packed ? packed->slots : sh.batch, s = packed ? packed->seq : sh.seq;
  const bool det = deterministic_mode();
  Key key{backward,    packed != nullptr, b,   s,  packed ? packed->kv_seq : sh.kv_len(), sh.causal, sh.heads,
          sh.kv_heads, sh.head_dim,       dev, det};
  auto it = st.plans.find(key);
  if (it == st.plans.end()) {
    auto g = std::make_unique<Graph>(handle, backward ? "attention backward" : "attention forward", kFirstVirtual);
    if (backward)
      build_backward(*g, sh, packed, old_padding_mask_rules(), det);
    else
      build_forward(*g, sh, packed, det);
    if (!g->status()) {
      std::string where = strprintf("B=%lld S=%lld Hq=%lld Hkv=%lld D=%lld", (long long)sh.batch, (long long)sh.seq,
                                    (long long)sh.heads, (long long)sh.kv_heads, (long long)sh.head_dim);
      if (!sh.causal) where += strprintf(", a non-causal block of %lld keys", (long long)sh.kv_len());
      if (packed)
        where += strprintf(", packed as %lld slots of up to %lld query and %lld key tokens", (long long)b, (long long)s,
                           (long long)packed->kv_seq);
      return Status(g->status()).context(where);
    }
    it = st.plans.emplace(key, std::move(g)).first;
  }
  *out = it->second.get();
  return Status::ok();
}

Status ensure_workspace(State& st, int64_t bytes) {
  if (bytes <= st.workspace_bytes) return Status::ok();
  if (st.workspace) device_free(st.workspace);  // cudaFree waits for work still using it
  st.workspace = nullptr;
  st.workspace_bytes = 0;
  MemoryScope scope(MemPart::attention_workspace);
  NB_TRY(device_malloc(&st.workspace, size_t(bytes)).context("attention workspace"));
  st.workspace_bytes = bytes;
  return Status::ok();
}

Status execute(State& st, Graph& g, cudaStream_t stream, const std::vector<int64_t>& uids,
               const std::vector<void*>& ptrs, void* workspace) {
  cudnnHandle_t handle = nullptr;
  NB_TRY(current_handle(st, &handle));
  return cudnn_graph::execute(handle, g, stream, uids, ptrs, workspace);
}

using attention_workspace::align256;
using attention_workspace::Tables;
using attention_workspace::tables_at;
int64_t dq_accum_bytes(const AttentionShape& sh) {
  return attention_workspace::dq_accum_bytes(sh, deterministic_mode());
}
int64_t softmax_sum_bytes(const AttentionShape& sh) { return attention_workspace::softmax_sum_bytes(sh); }

// The masked score's value, bound only where a mask uses it: a ring's non-causal block has no mask, and
// cuDNN refuses a variant pack that binds a tensor its graph does not hold.
void bind_mask_value(const AttentionShape& sh, float* neg_inf, std::vector<int64_t>& uids, std::vector<void*>& ptrs) {
  if (!sh.causal) return;
  uids.push_back(kNegInf);
  ptrs.push_back(neg_inf);
}

// ---- Packed segments ----

// The tokens a SegmentPart takes of a segment of `len` from its first token: their start and count.
__device__ int64_t part_start(SegmentPart p, int64_t len) { return p == SegmentPart::second_half ? len / 2 : 0; }
__device__ int64_t part_len(SegmentPart p, int64_t len) { return p == SegmentPart::whole ? len : len / 2; }

// Slot i < count is segment i (its query and key parts); later slots have length 0 and offset T (the end), as
// cuDNN expects.
__global__ void segment_tables_kernel(const int32_t* starts, int64_t count, int64_t slots, SegmentPart q_part,
                                      SegmentPart kv_part, int64_t q_elems, int64_t kv_elems, int64_t stat_elems,
                                      int32_t* len_q, int32_t* len_kv, int64_t* off_q, int64_t* off_kv,
                                      int64_t* off_stats) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i <= slots; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t first = starts[i < count ? i : count], len = i < count ? starts[i + 1] - first : 0;
    const int64_t q0 = first + part_start(q_part, len), kv0 = first + part_start(kv_part, len);
    off_q[i] = q0 * q_elems;
    off_kv[i] = kv0 * kv_elems;
    off_stats[i] = q0 * stat_elems;
    if (i < slots) {
      len_q[i] = int32_t(part_len(q_part, len));
      len_kv[i] = int32_t(part_len(kv_part, len));
    }
  }
}

void write_tables(const AttentionShape& sh, const AttentionSegments& seg, const Packed& pk, char* ws, const Tables& t,
                  cudaStream_t stream) {
  const int threads = 256;
  const int blocks = int(std::min<int64_t>((pk.slots + threads) / threads, 1024));
  segment_tables_kernel<<<blocks, threads, 0, stream>>>(
      seg.starts_device, seg.count, pk.slots, seg.q_part, seg.kv_part, sh.heads * sh.head_dim,
      sh.kv_heads * sh.head_dim, sh.heads, reinterpret_cast<int32_t*>(ws + t.len),
      reinterpret_cast<int32_t*>(ws + t.len_kv), reinterpret_cast<int64_t*>(ws + t.off_q),
      reinterpret_cast<int64_t*>(ws + t.off_kv), reinterpret_cast<int64_t*>(ws + t.off_stats));
  CUDA_CHECK_LAUNCH();
}

Status check_packed_support(const AttentionShape& sh) {
  const size_t version = cudnnGetVersion();
  if (version < 90600)
    return errorf(
        "attention: packed segments need cuDNN 9.6 or newer (ragged softmax stats); this process loaded "
        "cuDNN %zu.%zu.%zu",
        version / 10000, version / 100 % 100, version % 100);
  if (sh.head_dim % 16 != 0)
    return errorf(
        "attention: packed segments need head_dim %% 16 == 0 on cuda (cuDNN's token-sized dQ "
        "accumulator), got %lld",
        (long long)sh.head_dim);
  return Status::ok();
}

// The uids and pointers every packed graph binds besides its I/O tensors.
void bind_tables(char* ws, const Tables& t, std::vector<int64_t>& uids, std::vector<void*>& ptrs) {
  uids.insert(uids.end(), {kSeqLenQ, kSeqLenKV, kOffQ, kOffK, kOffV, kOffO, kOffStats});
  ptrs.insert(ptrs.end(),
              {ws + t.len, ws + t.len_kv, ws + t.off_q, ws + t.off_kv, ws + t.off_kv, ws + t.off_q, ws + t.off_stats});
}

Status forward_packed(State& st, const AttentionShape& sh, const Tensor& q, const Tensor& k, const Tensor& v,
                      const Tensor& out, const Tensor& lse, const AttentionSegments& seg, cudaStream_t stream) {
  NB_TRY(check_packed_support(sh));
  const Packed pk = packed_extents(sh, seg);
  Graph* g = nullptr;
  NB_TRY(get_plan(st, false, sh, &pk, &g));
  const Tables t = tables_at(0, pk.slots);
  NB_TRY(ensure_workspace(st, t.end + g->workspace_bytes()));
  char* ws = static_cast<char*>(st.workspace);
  write_tables(sh, seg, pk, ws, t, stream);
  float scale = sh.scale;
  float neg_inf =
      old_padding_mask_rules() ? std::numeric_limits<float>::lowest() : -std::numeric_limits<float>::infinity();
  std::vector<int64_t> uids{kQ, kK, kV, kO, kStats, kScale, kNegInf};
  std::vector<void*> ptrs{q.data, k.data, v.data, out.data, lse.data, &scale, &neg_inf};
  bind_tables(ws, t, uids, ptrs);
  return execute(st, *g, stream, uids, ptrs, ws + t.end);
}

Status backward_packed(State& st, const AttentionShape& sh, const Tensor* io, const AttentionSegments& seg,
                       cudaStream_t stream) {
  NB_TRY(check_packed_support(sh));
  const Packed pk = packed_extents(sh, seg);
  Graph* g = nullptr;
  NB_TRY(get_plan(st, true, sh, &pk, &g));
  // Token-sized ragged scratch: FP32 dQ accumulator, softmax sum, and for GQA the per-query-head dK and
  // dV (bf16 tensors, but cudnn-frontend reserves 4 bytes per element for them, and so do we).
  const bool gqa = sh.heads != sh.kv_heads, det = deterministic_mode();
  const attention_workspace::PackedLayout lay = attention_workspace::packed_layout(sh, pk.slots, det);
  const int64_t accum = lay.accum, sums = lay.sums, dk_full = lay.dk_full, dv_full = lay.dv_full;
  const Tables& t = lay.tables;
  NB_TRY(ensure_workspace(st, t.end + g->workspace_bytes()));
  char* ws = static_cast<char*>(st.workspace);
  write_tables(sh, seg, pk, ws, t, stream);
  float scale = sh.scale, one = 1.0f;
  float neg_inf =
      old_padding_mask_rules() ? std::numeric_limits<float>::lowest() : -std::numeric_limits<float>::infinity();
  // io: q, k, v, out, dout, lse, dq, dk, dv
  std::vector<int64_t> uids{kQ, kK, kV, kO, kDO, kStats, kDQ, kDK, kDV, kSoftmaxSum, kScale, kNegInf, kOne};
  std::vector<void*> ptrs{io[0].data, io[1].data, io[2].data, io[3].data, io[4].data, io[5].data, io[6].data,
                          io[7].data, io[8].data, ws + sums,  &scale,     &neg_inf,   &one};
  if (!det) {
    uids.push_back(kDQAccum);
    ptrs.push_back(ws + accum);
  }
  if (gqa) {
    uids.insert(uids.end(), {kDKFull, kDVFull});
    ptrs.insert(ptrs.end(), {ws + dk_full, ws + dv_full});
  }
  bind_tables(ws, t, uids, ptrs);
  return execute(st, *g, stream, uids, ptrs, ws + t.end);
}

}  // namespace

Status attention_forward_cudnn(const AttentionShape& sh, const Tensor& q, const Tensor& k, const Tensor& v,
                               const Tensor& out, const Tensor& lse, Stream stream, const AttentionSegments* segments) {
  NB_TRY(attention_check_args(sh, q, k, v, out, lse, nullptr, nullptr, nullptr, nullptr, segments));
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  if (segments) return forward_packed(st, sh, q, k, v, out, lse, *segments, static_cast<cudaStream_t>(stream));
  Graph* g = nullptr;
  NB_TRY(get_plan(st, false, sh, nullptr, &g));
  NB_TRY(ensure_workspace(st, g->workspace_bytes()));
  float scale = sh.scale, neg_inf = -std::numeric_limits<float>::infinity();
  std::vector<int64_t> uids{kQ, kK, kV, kO, kStats, kScale};
  std::vector<void*> ptrs{q.data, k.data, v.data, out.data, lse.data, &scale};
  bind_mask_value(sh, &neg_inf, uids, ptrs);
  return execute(st, *g, static_cast<cudaStream_t>(stream), uids, ptrs, st.workspace);
}

Status attention_backward_cudnn(const AttentionShape& sh, const Tensor& q, const Tensor& k, const Tensor& v,
                                const Tensor& out, const Tensor& dout, const Tensor& lse, const Tensor& dq,
                                const Tensor& dk, const Tensor& dv, Stream stream, const AttentionSegments* segments) {
  NB_TRY(attention_check_args(sh, q, k, v, out, lse, &dout, &dq, &dk, &dv, segments));
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  if (segments) {
    const Tensor io[] = {q, k, v, out, dout, lse, dq, dk, dv};
    return backward_packed(st, sh, io, *segments, static_cast<cudaStream_t>(stream));
  }
  Graph* g = nullptr;
  NB_TRY(get_plan(st, true, sh, nullptr, &g));
  const int64_t accum = dq_accum_bytes(sh), sums = softmax_sum_bytes(sh);
  NB_TRY(ensure_workspace(st, accum + sums + g->workspace_bytes()));
  char* base = static_cast<char*>(st.workspace);
  float scale = sh.scale, neg_inf = -std::numeric_limits<float>::infinity(), one = 1.0f;
  std::vector<int64_t> uids{kQ, kK, kV, kO, kDO, kStats, kDQ, kDK, kDV, kSoftmaxSum, kScale, kOne};
  std::vector<void*> ptrs{q.data,  k.data,  v.data,  out.data,     dout.data, lse.data,
                          dq.data, dk.data, dv.data, base + accum, &scale,    &one};
  bind_mask_value(sh, &neg_inf, uids, ptrs);
  if (accum > 0) {  // the default graph's FP32 dQ accumulator, in front of the softmax sum
    uids.push_back(kDQAccum);
    ptrs.push_back(base);
  }
  return execute(st, *g, static_cast<cudaStream_t>(stream), uids, ptrs, base + accum + sums);
}

int64_t attention_workspace_bytes() {
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  return st.workspace_bytes;
}

}  // namespace nb::ops
