// Context parallelism's attention, the CPU reference (the spec a CUDA ring will be checked against): each
// sequence (a row, or with packed rows each segment) is cut into 2C chunks and rank r of the C context-
// parallel ranks holds chunks r and 2C-1-r, so every rank has the same causal work (TransformerEngine's
// load balance). K/V go round the ring: at step s rank r attends its queries to the K/V rank (r - s) mod C
// holds, and each step's partial output merges into the running one through the softmax log-sum-exp in
// FP32 (lse = max + log1p(exp(min - max)), each output rescaled by exp(lse_part - lse)). The backward
// reuses the merged lse: each step's dQ stays with the queries' rank, its dK/dV go back to the rank that
// owns those K/V (in a real ring, with them). Rank shards are held here as lists of token indices into the
// whole [B*S] sequence, so one process runs the algorithm for every rank, in the ring's order.
// Layouts as ops/attention.h (f32, CPU): q/out [B, S, Hq, D], k/v [B, S, Hkv, D], lse [B, Hq, S].
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>
#include "ops/attention.h"

namespace nb::ops::cp {

// The token indices (into B*S) rank `rank` of `ranks` holds: for each row (or each packed segment) its
// chunks rank and 2*ranks-1-rank, in that order. Refused unless every sequence divides into 2*ranks chunks.
Status shard_tokens(const AttentionShape& sh, const AttentionSegments* segments, int ranks, int rank,
                    std::vector<int64_t>* tokens);

// The forward over `ranks` context-parallel ranks, result scattered back to whole-sequence order: out and
// lse as attention_forward_ref writes them.
Status ring_forward(const AttentionShape& sh, const AttentionSegments* segments, int ranks, const Tensor& q,
                    const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse);

// The backward over `ranks` ranks from the merged out and lse: dq, dk, dv in whole-sequence order.
Status ring_backward(const AttentionShape& sh, const AttentionSegments* segments, int ranks, const Tensor& q,
                     const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& dout, const Tensor& lse,
                     const Tensor& dq, const Tensor& dk, const Tensor& dv);

// Merges a partial (out_b, lse_b) into a running (out_a, lse_a) for one query row of one head (D values),
// in FP32: the rule every CP implementation must follow so results agree across backends. lse = -inf
// stands for "no key seen yet". The CPU ring's forward runs the same rule in FP64 (ops/cp_ring.h).
template <typename T>
void merge_partial(T* out_a, T* lse_a, const T* out_b, T lse_b, int64_t D) {
  const T none = -std::numeric_limits<T>::infinity();
  if (lse_b == none) return;
  if (*lse_a == none) {
    std::copy(out_b, out_b + D, out_a);
    *lse_a = lse_b;
    return;
  }
  const T hi = std::max(*lse_a, lse_b), lo = std::min(*lse_a, lse_b);
  const T lse = hi + std::log1p(std::exp(lo - hi));
  const T wa = std::exp(*lse_a - lse), wb = std::exp(lse_b - lse);
  for (int64_t d = 0; d < D; ++d) out_a[d] = out_a[d] * wa + out_b[d] * wb;
  *lse_a = lse;
}

}  // namespace nb::ops::cp
