// The attention graphs of attention_graphs.h. One builder per direction serves whole rows and packed
// segments: the packed extras (length and offset tensors, extents, padding mask, ragged strides) are
// added only when a Packed is given, so the whole-row graphs are the same operation list either way.
#include "ops/attention_graphs.h"

#include <algorithm>

namespace nb::ops::attention_graphs {
namespace {

using cudnn_graph::Dims;
using cudnn_graph::Graph;
using cudnn_graph::MatmulOverrides;
using Desc = cudnnBackendDescriptor_t;

// [B,H,S,D] view of a [B,S,H,D] tensor, and its K^T-style transpose [B,H,D,S].
Dims bshd_strides(int64_t S, int64_t H, int64_t D) { return {S * H * D, D, H * D, 1}; }
Dims bshd_t_strides(int64_t S, int64_t H, int64_t D) { return {S * H * D, D, 1, H * D}; }

// The graph-side extents of one call (b rows of s tokens, or b segment slots of at most s tokens) and,
// when packed, the length and ragged-offset tensors the I/O tensors and matmuls refer to.
struct Io {
  Graph& g;
  int64_t b, s, Hq, Hkv, D;
  int64_t skv = s;     // keys per row (context parallelism's ring blocks; packed: s)
  bool causal = true;  // false: every query sees every key (a ring block)
  bool packed = false;
  Desc len_q = nullptr, len_kv = nullptr;
  Desc off_q = nullptr, off_k = nullptr, off_v = nullptr, off_o = nullptr, off_stats = nullptr;

  Dims qdims() const { return {b, Hq, s, D}; }
  Dims kvdims() const { return {b, Hkv, skv, D}; }
  Dims kvt_dims() const { return {b, Hkv, D, skv}; }
  Dims sdims() const { return {b, Hq, s, skv}; }
  Dims sstr() const { return {Hq * s * skv, s * skv, skv, 1}; }
  // P^T and dS^T: the same memory as the scores, viewed [b, Hq, skv, s].
  Dims stdims() const { return {b, Hq, skv, s}; }
  Dims sstr_t() const { return {Hq * s * skv, s * skv, 1, skv}; }
  Dims rdims() const { return {b, Hq, s, 1}; }
  Dims rstr() const { return {Hq * s, s, 1, 1}; }  // virtual row statistics
  // Stats and the softmax sum: [B,Hq,S] for rows, token-major [T,Hq] when packed.
  Dims stat_str() const { return packed ? Dims{s * Hq, 1, Hq, 1} : rstr(); }
  Desc q_like(int64_t uid, cudnnDataType_t dt, Desc off) {
    return g.tensor(uid, dt, qdims(), bshd_strides(s, Hq, D), false, false, off);
  }
  Desc kv_like(int64_t uid, Desc off) {
    return g.tensor(uid, CUDNN_DATA_BFLOAT16, kvdims(), bshd_strides(skv, Hkv, D), false, false, off);
  }
  Desc kv_t(int64_t uid, Desc off) {
    return g.tensor(uid, CUDNN_DATA_BFLOAT16, kvt_dims(), bshd_t_strides(skv, Hkv, D), false, false, off);
  }
  // GQA's per-query-head dK or dV: the keys' rows with the query heads.
  Dims full_kv_dims() const { return {b, Hq, skv, D}; }
  Desc stat(int64_t uid) { return g.tensor(uid, CUDNN_DATA_FLOAT, rdims(), stat_str(), false, false, off_stats); }
  // Per-segment GEMM extents: S = Q K^T and dP = dO V^T are len_q x len_kv; O = P V and dQ = dS K sum
  // over len_kv; dV = P^T dO and dK = dS^T Q are len_kv rows summed over len_q.
  MatmulOverrides scores() const { return {len_q, len_kv, nullptr}; }
  MatmulOverrides by_keys() const { return {len_q, nullptr, len_kv}; }
  MatmulOverrides by_queries() const { return {len_kv, nullptr, len_q}; }
};

Io make_io(Graph& g, const AttentionShape& sh, const Packed* packed) {
  Io io{g, packed ? packed->slots : sh.batch, packed ? packed->seq : sh.seq, sh.heads, sh.kv_heads, sh.head_dim};
  io.skv = packed ? packed->kv_seq : sh.kv_len();
  io.causal = sh.causal;
  if (packed == nullptr) return io;
  io.packed = true;
  const Dims lens{io.b, 1, 1, 1}, offs{io.b + 1, 1, 1, 1}, ones{1, 1, 1, 1};
  io.len_q = g.tensor(kSeqLenQ, CUDNN_DATA_INT32, lens, ones, false);
  io.len_kv = g.tensor(kSeqLenKV, CUDNN_DATA_INT32, lens, ones, false);
  io.off_q = g.tensor(kOffQ, CUDNN_DATA_INT64, offs, ones, false);
  io.off_k = g.tensor(kOffK, CUDNN_DATA_INT64, offs, ones, false);
  io.off_v = g.tensor(kOffV, CUDNN_DATA_INT64, offs, ones, false);
  io.off_o = g.tensor(kOffO, CUDNN_DATA_INT64, offs, ones, false);
  io.off_stats = g.tensor(kOffStats, CUDNN_DATA_INT64, offs, ones, false);
  return io;
}

// Appends the causal mask: y = (row >= col) ? x : -inf, with row/col generated over the score tensor
// (x itself for a ring block, which every query sees whole).
Desc causal_mask(const Io& io, Desc x, Desc neg_inf, const Dims& score_dims, const Dims& score_strides) {
  if (!io.causal) return x;
  Graph& g = io.g;
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

// Packed only (else x itself): y = (row < len_q[b] && col < len_kv[b]) ? x : -inf, cutting each slot to
// its segment's length -- cudnn-frontend's padding_mask, which its ragged graphs require.
Desc padding_mask(Io& io, Desc x, Desc neg_inf) {
  if (!io.packed) return x;
  Graph& g = io.g;
  const Dims d = io.sdims(), st = io.sstr();
  auto row = g.virt(CUDNN_DATA_INT32, d, st);
  auto col = g.virt(CUDNN_DATA_INT32, d, st);
  auto row_in = g.virt(CUDNN_DATA_BOOLEAN, d, st);
  auto col_in = g.virt(CUDNN_DATA_BOOLEAN, d, st);
  auto keep = g.virt(CUDNN_DATA_BOOLEAN, d, st);
  auto y = g.virt(CUDNN_DATA_FLOAT, d, st);
  g.pointwise(CUDNN_POINTWISE_GEN_INDEX, x, nullptr, nullptr, row, CUDNN_DATA_INT32, 2);
  g.pointwise(CUDNN_POINTWISE_GEN_INDEX, x, nullptr, nullptr, col, CUDNN_DATA_INT32, 3);
  g.pointwise(CUDNN_POINTWISE_CMP_LT, row, io.len_q, nullptr, row_in, CUDNN_DATA_BOOLEAN);
  g.pointwise(CUDNN_POINTWISE_CMP_LT, col, io.len_kv, nullptr, col_in, CUDNN_DATA_BOOLEAN);
  g.pointwise(CUDNN_POINTWISE_LOGICAL_AND, row_in, col_in, nullptr, keep, CUDNN_DATA_BOOLEAN);
  g.pointwise(CUDNN_POINTWISE_BINARY_SELECT, x, neg_inf, keep, y);
  return y;
}

// Gradient of a K/V tensor, out = a @ b over the query rows: per query head, then summed over each GQA
// group. Packed, the per-head tensor is a ragged workspace tensor (uid full_uid) that shares out's
// offsets: cuDNN scales them by Hq/Hkv itself, as cudnn-frontend relies on.
void kv_grad(Io& io, Desc a, Desc b, Desc out, int64_t full_uid, Desc off) {
  Graph& g = io.g;
  if (io.Hq == io.Hkv) {
    g.matmul(a, b, out, io.by_queries());
    return;
  }
  auto full = io.packed
                  ? g.tensor(full_uid, CUDNN_DATA_BFLOAT16, io.full_kv_dims(), bshd_strides(io.skv, io.Hq, io.D), false,
                             false, off)
                  : g.virt(CUDNN_DATA_BFLOAT16, io.full_kv_dims(), {io.Hq * io.skv * io.D, io.skv * io.D, io.D, 1});
  g.matmul(a, b, full, io.by_queries());
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, full, out);
}

}  // namespace

Packed packed_extents(const AttentionShape& sh, const AttentionSegments& seg) {
  const int64_t longest = attention_segments_max_len(seg);
  auto bucket = [&](SegmentPart part) {
    const int64_t len = part == SegmentPart::whole ? longest : (longest + 1) / 2;
    int64_t b = 64;
    while (b < len) b *= 2;
    return std::min(b, sh.seq);
  };
  Packed p{32, bucket(seg.q_part), bucket(seg.kv_part)};
  while (p.slots < seg.count) p.slots *= 2;
  return p;
}

void build_forward(Graph& g, const AttentionShape& sh, const Packed* packed, bool deterministic) {
  Io io = make_io(g, sh, packed);
  const Dims sdims = io.sdims(), sstr = io.sstr(), rdims = io.rdims(), rstr = io.rstr();
  auto q = io.q_like(kQ, CUDNN_DATA_BFLOAT16, io.off_q);
  auto kt = io.kv_t(kK, io.off_k);
  auto v = io.kv_like(kV, io.off_v);
  auto o = io.q_like(kO, CUDNN_DATA_BFLOAT16, io.off_o);
  auto stats = io.stat(kStats);
  auto scale = g.scalar(kScale);
  auto neg_inf = g.scalar(kNegInf);

  auto s = g.virt(CUDNN_DATA_FLOAT, sdims, sstr);
  g.matmul(q, kt, s, io.scores());
  auto scaled = g.virt(CUDNN_DATA_FLOAT, sdims, sstr);
  g.pointwise(CUDNN_POINTWISE_MUL, s, scale, nullptr, scaled);
  auto masked = causal_mask(io, padding_mask(io, scaled, neg_inf), neg_inf, sdims, sstr);
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
  g.matmul(p, v, o, io.by_keys());
  g.require_deterministic(deterministic);
  g.build_plan();
}

namespace {

// P = exp(mask(Q K^T * scale - Stats)), the backward's recomputed probabilities.
Desc probabilities(Io& io, Desc q, Desc kt, Desc stats, Desc scale, Desc neg_inf, bool second_padding) {
  Graph& g = io.g;
  const Dims sdims = io.sdims(), sstr = io.sstr();
  auto s = g.virt(CUDNN_DATA_FLOAT, sdims, sstr);
  g.matmul(q, kt, s, io.scores());
  auto scaled = g.virt(CUDNN_DATA_FLOAT, sdims, sstr);
  g.pointwise(CUDNN_POINTWISE_MUL, s, scale, nullptr, scaled);
  auto centered = g.virt(CUDNN_DATA_FLOAT, sdims, sstr);
  g.pointwise(CUDNN_POINTWISE_SUB, padding_mask(io, scaled, neg_inf), stats, nullptr, centered);
  if (second_padding) centered = padding_mask(io, centered, neg_inf);
  auto masked = causal_mask(io, centered, neg_inf, sdims, sstr);
  auto p = g.virt(CUDNN_DATA_FLOAT, sdims, sstr);
  g.pointwise(CUDNN_POINTWISE_EXP, masked, nullptr, nullptr, p);
  return p;
}

// dS = P * (dO V^T - softmax_sum) * scale.
Desc score_grad(Io& io, Desc dout, Desc vt, Desc softmax_sum, Desc p, Desc scale) {
  Graph& g = io.g;
  const Dims sdims = io.sdims(), sstr = io.sstr();
  auto dp = g.virt(CUDNN_DATA_FLOAT, sdims, sstr);
  g.matmul(dout, vt, dp, io.scores());
  auto dp_centered = g.virt(CUDNN_DATA_FLOAT, sdims, sstr);
  g.pointwise(CUDNN_POINTWISE_SUB, dp, softmax_sum, nullptr, dp_centered);
  auto ds_unscaled = g.virt(CUDNN_DATA_FLOAT, sdims, sstr);
  g.pointwise(CUDNN_POINTWISE_MUL, dp_centered, p, nullptr, ds_unscaled);
  auto ds = g.virt(CUDNN_DATA_FLOAT, sdims, sstr);
  g.pointwise(CUDNN_POINTWISE_MUL, ds_unscaled, scale, nullptr, ds);
  return ds;
}

}  // namespace

void build_backward(Graph& g, const AttentionShape& sh, const Packed* packed, bool with_second_padding_mask,
                    bool deterministic) {
  Io io = make_io(g, sh, packed);
  const int64_t Hq = io.Hq, s = io.s, D = io.D;
  auto q = io.q_like(kQ, CUDNN_DATA_BFLOAT16, io.off_q);
  auto kt = io.kv_t(kK, io.off_k);
  auto vt = io.kv_t(kV, io.off_v);
  auto o = io.q_like(kO, CUDNN_DATA_BFLOAT16, io.off_o);
  auto dout = io.q_like(kDO, CUDNN_DATA_BFLOAT16, io.off_o);
  auto stats = io.stat(kStats);
  auto dq = io.q_like(kDQ, CUDNN_DATA_BFLOAT16, io.off_q);
  auto dk = io.kv_like(kDK, io.off_k);
  auto dv = io.kv_like(kDV, io.off_v);
  auto softmax_sum = io.stat(kSoftmaxSum);
  auto scale = g.scalar(kScale);
  auto neg_inf = g.scalar(kNegInf);
  auto one = g.scalar(kOne);

  // softmax_sum = rowsum(dO * O)
  auto do_o = g.virt(CUDNN_DATA_FLOAT, io.qdims(), {Hq * s * D, s * D, Hq * D, 1});
  g.pointwise(CUDNN_POINTWISE_MUL, dout, o, nullptr, do_o);
  auto do_o_sum = g.virt(CUDNN_DATA_FLOAT, io.rdims(), io.rstr());
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, do_o, do_o_sum);
  g.pointwise(CUDNN_POINTWISE_MUL, do_o_sum, one, nullptr, softmax_sum);

  auto p = probabilities(io, q, kt, stats, scale, neg_inf, io.packed && with_second_padding_mask);
  // dV = P^T dO (per query head, then summed over the GQA group)
  auto pt = g.virt(CUDNN_DATA_BFLOAT16, io.stdims(), io.sstr_t());
  g.reshape(p, pt);
  kv_grad(io, pt, dout, dv, kDVFull, io.off_v);
  auto ds = score_grad(io, dout, vt, softmax_sum, p, scale);
  // dK = dS^T Q (summed over the group for GQA)
  auto dst = g.virt(CUDNN_DATA_BFLOAT16, io.stdims(), io.sstr_t());
  g.reshape(ds, dst);
  kv_grad(io, dst, q, dk, kDKFull, io.off_k);
  // dQ = dS K. Default: accumulated in an FP32 workspace tensor, which the key tiles add into with
  // atomics (run-to-run noise), then converted. Deterministic: written straight to dQ, the graph of
  // cudnn-frontend's set_deterministic_algorithm on Hopper (its "dP workspace" variant).
  auto k = g.virt(CUDNN_DATA_BFLOAT16, io.kvdims(), bshd_strides(io.skv, io.Hkv, D), io.off_k);
  g.reshape(kt, k);
  if (deterministic) {
    g.matmul(ds, k, dq, io.by_keys());
  } else {
    auto dq_accum = io.packed ? io.q_like(kDQAccum, CUDNN_DATA_FLOAT, io.off_q)
                              : g.tensor(kDQAccum, CUDNN_DATA_FLOAT, io.qdims(), {Hq * s * D, s * D, D, 1}, false);
    g.matmul(ds, k, dq_accum, io.by_keys());
    g.pointwise(CUDNN_POINTWISE_IDENTITY, dq_accum, nullptr, nullptr, dq);
  }
  g.require_deterministic(deterministic);
  g.build_plan();
}

}  // namespace nb::ops::attention_graphs
