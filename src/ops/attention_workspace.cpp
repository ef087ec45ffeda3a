// The attention backward's workspace as attention_cudnn.cu lays it out (attention_workspace.h), compiled in
// every build so the memory estimate can size it without a GPU.
#include "ops/attention_workspace.h"
#include <algorithm>

namespace nb::ops::attention_workspace {

int64_t align256(int64_t bytes) { return (bytes + 255) / 256 * 256; }

int64_t dq_accum_bytes(const AttentionShape& sh, bool deterministic) {
  return deterministic ? 0 : sh.batch * sh.heads * sh.seq * sh.head_dim * 4;
}

int64_t softmax_sum_bytes(const AttentionShape& sh) { return align256(sh.batch * sh.heads * sh.seq * 4); }

Tables tables_at(int64_t base, int64_t slots) {
  Tables t;
  t.len = base;
  t.len_kv = t.len + align256(slots * 4);
  t.off_q = t.len_kv + align256(slots * 4);
  t.off_kv = t.off_q + align256((slots + 1) * 8);
  t.off_stats = t.off_kv + align256((slots + 1) * 8);
  t.end = t.off_stats + align256((slots + 1) * 8);
  return t;
}

PackedLayout packed_layout(const AttentionShape& sh, int64_t slots, bool deterministic) {
  PackedLayout p;
  const int64_t tokens = sh.batch * sh.seq + 128;  // T plus one 128-row tile (attention_graphs.h)
  const int64_t per_head = align256(tokens * sh.heads * sh.head_dim * 4);
  const bool gqa = sh.heads != sh.kv_heads;
  p.accum = 0;
  p.sums = p.accum + (deterministic ? 0 : per_head);
  p.dk_full = p.sums + align256(tokens * sh.heads * 4);
  p.dv_full = p.dk_full + (gqa ? per_head : 0);
  p.tables = tables_at(p.dv_full + (gqa ? per_head : 0), slots);
  return p;
}

// cuDNN's own part is the one figure nibble does not decide: measured on H100 with cuDNN 9 (docs/MEMORY.md):
// whole rows ask for 4 bytes per query element, and in deterministic mode 2 bytes per (query, key) pair of
// every head besides; packed segments ask for nothing beyond nibble's own scratch.
int64_t cudnn_backward_bytes(const AttentionShape& sh, bool packed, bool deterministic) {
  if (packed) return 0;
  const int64_t q = sh.batch * sh.heads * sh.seq * sh.head_dim * 4;
  return deterministic ? q + sh.batch * sh.heads * sh.seq * sh.kv_len() * 2 : q;
}

int64_t backward_bytes(const AttentionShape& sh, bool packed, bool deterministic) {
  int64_t nibble = 0;
  if (packed) {
    // At most one segment per token: the slot count is a power of two from 32 (packed_extents).
    int64_t slots = 32;
    while (slots < sh.batch * sh.seq) slots *= 2;
    nibble = packed_layout(sh, slots, deterministic).tables.end;
  } else {
    nibble = dq_accum_bytes(sh, deterministic) + softmax_sum_bytes(sh);
  }
  return align256(nibble + cudnn_backward_bytes(sh, packed, deterministic));
}

}  // namespace nb::ops::attention_workspace
