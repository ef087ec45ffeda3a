// The CUDA attention backward's workspace layout (attention_cudnn.cu places its own scratch in front of
// cuDNN's workspace) and its size for the memory estimate (train/memory_estimate.h): one definition, used
// by both, so the estimate follows the layout. cuDNN's own part is a rule measured against cuDNN 9.
#pragma once
#include <cstdint>
#include "ops/attention.h"

namespace nb::ops::attention_workspace {

int64_t align256(int64_t bytes);
// Whole rows: the FP32 dQ accumulator (none in deterministic mode) and the softmax sums.
int64_t dq_accum_bytes(const AttentionShape& sh, bool deterministic);
int64_t softmax_sum_bytes(const AttentionShape& sh);
// Byte offsets of the per-slot tables from `base`: query and key lengths (int32 [slots]; they differ in a
// ring block over segment halves) and element offsets (int64 [slots + 1]) of Q/O, K/V and Stats rows.
struct Tables {
  int64_t len = 0, len_kv = 0, off_q = 0, off_kv = 0, off_stats = 0, end = 0;
};
Tables tables_at(int64_t base, int64_t slots);
// Packed segments: the token-sized ragged scratch (FP32 dQ accumulator, softmax sum, GQA's per-query-head
// dK and dV) and then the tables; tables.end is the scratch's size.
struct PackedLayout {
  int64_t accum = 0, sums = 0, dk_full = 0, dv_full = 0;
  Tables tables;
};
PackedLayout packed_layout(const AttentionShape& sh, int64_t slots, bool deterministic);
// cuDNN's own workspace for the backward graph (measured rule; 0 for the forward).
int64_t cudnn_backward_bytes(const AttentionShape& sh, bool packed, bool deterministic);
// The whole workspace the backward holds at its largest: nibble's scratch plus cuDNN's.
int64_t backward_bytes(const AttentionShape& sh, bool packed, bool deterministic);

}  // namespace nb::ops::attention_workspace
