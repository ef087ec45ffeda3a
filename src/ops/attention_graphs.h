// The cuDNN operation graphs of causal GQA flash attention (forward and backward), over whole rows or
// over packed segments, and the unique ids their tensors are bound by. CUDA-only (included from .cu).
//
// cuDNN fuses a graph of matmul / pointwise / reduction / reshape operations into one flash-attention
// kernel (the S x S score matrix lives only in registers and shared memory). We describe the graphs the
// way cuDNN's fused SDPA engines recognise them (the patterns of cudnn-frontend's SDPA nodes):
//   forward : S = Q K^T * scale; causal select(row >= col, S, -inf); m = max S; e = exp(S - m);
//             l = sum e; Stats = m + log l; P = e / l (bf16); O = P V
//   backward: Dsum = rowsum(dO * O); S as above minus Stats, causal select, P = exp(.)
//             dV = P^T dO; dS = P * (dO V^T - Dsum) * scale; dK = dS^T Q; dQ = dS K (FP32 accumulator,
//             or, in deterministic mode, written directly)
//             GQA: dK/dV are computed per query head and reduced over the group by a reduction op.
// Whole rows: q/out/dout/dq [B,S,Hq,D] and k/v/dk/dv [B,S,Hkv,D] bf16 are given to cuDNN as [B,H,S,D]
// with strides {S*H*D, D, H*D, 1} (no copies); K^T / V^T are the same memory with the last two dims
// swapped. Stats ([B,Hq,S,1] f32, stride {Hq*S,S,1,1}) is nibble's lse [B,Hq,S].
//
// Packed segments (cudnn-frontend's padding mask + ragged offsets, the "THD" layout TransformerEngine
// uses for packed sequences): the graph batch is `slots` segments of at most `seq` tokens. Every I/O
// tensor has a ragged offset tensor (int64 [slots+1,1,1,1], element offsets of each segment's first
// token, used instead of the batch stride), the matmuls take their M/N/K extents per segment from the
// int32 length tensors [slots,1,1,1], and a padding mask (row < len_q && col < len_kv) precedes the
// causal one, whose GEN_INDEX row/col then count from the segment start. Stats is ragged too:
// [slots,Hq,seq,1] with strides {seq*Hq, 1, Hq, 1}, i.e. nibble's token-major lse [T, Hq] (cuDNN >= 9.6).
// Slots past the last segment have length 0 and offset T. The backward's FP32 dQ accumulator, softmax
// sum and (GQA) per-query-head dK/dV are ragged workspace tensors sized by tokens, as cudnn-frontend
// does with max_total_seq_len set; unpacked ones would be sized slots * seq.
// Context parallelism's ring blocks over packed rows (AttentionSegments' q_part / kv_part, no causal mask)
// give Q and K/V their own tables: a slot's queries may be its segment's second half and its keys the first
// half or the whole, so len_q != len_kv, the offsets of Q/O/Stats and of K/V differ, and the ragged tensors
// have gaps between slots (cuDNN reads and writes only each slot's len rows from its offset).
#pragma once
#include "ops/attention.h"
#include "ops/cudnn_graph.h"

namespace nb::ops::attention_graphs {

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
  // Packed segments only.
  kSeqLenQ,
  kSeqLenKV,
  kOffQ,
  kOffK,
  kOffV,
  kOffO,
  kOffStats,
  kDKFull,
  kDVFull,
  kFirstVirtual = 100
};

// Graph extents of a packed call: segment slots (the segment count rounded up to a power of two, at
// least 32, so that a run builds few plans) and the longest query and key parts of a segment rounded up to
// a power of two (at least 64, at most the row length S).
struct Packed {
  int64_t slots = 0, seq = 0, kv_seq = 0;
};
Packed packed_extents(const AttentionShape& sh, const AttentionSegments& seg);

// Tokens the packed backward's ragged workspace tensors are sized for: T plus one 128-row tile, so a
// tile that starts in the last segment stays inside them.
inline int64_t packed_workspace_tokens(const AttentionShape& sh) { return sh.batch * sh.seq + 128; }

// Appends the forward / backward graph of `sh` to g and builds its plan; packed == nullptr: whole rows.
// with_second_padding_mask (backward, packed): repeat the padding mask after the Stats subtraction, the
// cudnn-frontend workaround for cuDNN 9.0 - 9.9. deterministic (--deterministic-mode): the backward has
// no FP32 dQ accumulator (kDQAccum is then not part of the graph) and both directions avoid engines cuDNN
// notes as nondeterministic.
void build_forward(cudnn_graph::Graph& g, const AttentionShape& sh, const Packed* packed, bool deterministic);
void build_backward(cudnn_graph::Graph& g, const AttentionShape& sh, const Packed* packed,
                    bool with_second_padding_mask, bool deterministic);

}  // namespace nb::ops::attention_graphs
