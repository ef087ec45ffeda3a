// Context parallelism's ring attention, run by every rank of a context-parallel group on its own tokens
// (the CPU reference of the algorithm, with every rank in one process, is ops/cp_attention.h).
//
// Each row of S tokens is cut into 2C chunks; rank r holds chunks r and 2C-1-r, so its local row of
// Sl = S/C tokens is [chunk r | chunk 2C-1-r] (h = Sl/2 tokens each). Causal attention of the whole row
// splits into one causal call and C-1 non-causal blocks:
//   step 0      : the local Q over the local K/V, causal (the two chunks are in order within the row);
//   step s >= 1 : the K/V of rank src = (r - s) mod C arrive from the previous rank. src < r: every local
//                 query sees src's first chunk whole (its second chunk lies after all of ours); src > r:
//                 only our second chunk's queries see anything, and they see both of src's chunks whole.
// Each block's partial output and lse merge into the running ones in FP32 (cp::merge_partial's rule),
// and the output is rounded to the activation dtype once. On the CPU the forward keeps the reference's FP64
// values and merges in FP64, so its FP32 out and lse are one rank's bit for bit (an FP32 merge moved their
// last bits, which flipped a quantized code of the next Linear's input now and then). The backward replays the steps
// with the merged out and lse (each block's dQ then sums to the whole row's); dK/dV accumulate in FP32 in a buffer that
// travels round the ring with the K/V it belongs to and takes one more hop home at the end.
// Shapes as ops/attention.h with S = Sl: q/out [B, Sl, Hq, D], k/v [B, Sl, Hkv, D], lse [B, Hq, Sl].
//
// Packed rows (segments): every segment is cut the same way (TransformerEngine's THD layout under context
// parallelism: each sequence padded to a multiple of 2C), so a rank's local segment i is [chunk r | chunk
// 2C-1-r] of segment i, every rank holds the same local segment table, and the steps hold per segment: step 0
// is one segmented causal call; a block against src < r lets all of segment i's local queries see the first
// half of src's local segment i, a block against src > r lets the second half's queries see all of it. The
// blocks are segmented non-causal calls whose halves AttentionSegments' q_part / kv_part pick (no copies);
// lse is token-major ([B * Sl, Hq], ops/attention.h) and queries a block does not reach merge nothing.
#pragma once
#include <cstdint>
#include <vector>
#include "core/tensor.h"
#include "ops/attention.h"

namespace nb::ops::cp {

// The ring's transport: send `send` to the next rank of the group and receive `recv` (same size) from the
// previous one, queued on `stream`. The trainer backs it by the context-parallel communicator.
class RingLink {
 public:
  virtual ~RingLink() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual Status pass(const Tensor& send, const Tensor& recv, Stream stream) = 0;
};

// The global row position of local token i of rank `rank` of `ranks` (for RoPE and the loss).
inline int64_t global_position(int64_t local, int64_t local_seq, int rank, int ranks) {
  const int64_t h = local_seq / 2;
  return local < h ? rank * h + local : (2 * int64_t(ranks) - 1 - rank) * h + (local - h);
}

// Bytes one rank sends per attention call (docs/DISTRIBUTED.md): the forward passes C-1 K|V blocks (2 x B x S/C x
// Hkv x hd activation values each); the backward passes them again plus C FP32 dK|dV blocks (the last hop home).
struct RingTraffic {
  int64_t forward = 0, backward = 0;
};
RingTraffic ring_traffic(const AttentionShape& local, DType act, int ranks);

// The ring of one rank: its scratch (sized by scratch_bytes, allocated by init) and the two directions.
class Ring {
 public:
  // `local`: the attention shape of this rank's tokens (seq = Sl, even). `act`: q/k/v's dtype.
  Status init(const AttentionShape& local, Device dev, DType act, RingLink* link);
  static int64_t scratch_bytes(const AttentionShape& local, DType act);
  // segments: this rank's local segment table (whole segments, each [chunk r | chunk 2C-1-r] of a packed
  // sequence), or nullptr for whole rows.
  Status forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse, Stream stream,
                 const AttentionSegments* segments = nullptr);
  Status backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& dout,
                  const Tensor& lse, const Tensor& dq, const Tensor& dk, const Tensor& dv, Stream stream,
                  const AttentionSegments* segments = nullptr);
  RingLink* link() const { return link_; }

 private:
  struct Views;
  Views views() const;
  Status block_forward(int src, const Views& w, const Tensor& q, const Tensor& lse, Stream stream);
  Status block_backward(int src, const Views& w, const Tensor& q, const Tensor& out, const Tensor& dout,
                        const Tensor& lse, Stream stream);
  AttentionSegments block_segments(int src, const AttentionSegments& local) const;
  Status packed_block_forward(int src, const Views& w, const Tensor& q, const Tensor& lse,
                              const AttentionSegments& local, Stream stream);
  Status packed_block_backward(int src, const Views& w, const Tensor& q, const Tensor& out, const Tensor& dout,
                               const Tensor& lse, const AttentionSegments& local, Stream stream);
  AttentionShape sh_{};
  Device dev_ = Device::cpu;
  DType act_ = DType::f32;
  RingLink* link_ = nullptr;
  Buffer scratch_;
  // CPU: the forward's running out and lse and one block's, in FP64 (the reference's values before it rounds), so
  // the merged output is rounded to FP32 once, as one rank's attention rounds it.
  mutable std::vector<double> f64_;
};

// Kernels of the ring (CPU here, CUDA in cp_ring.cu), over B rows:
// running (out_acc f32 [B, Sl, H, D], lse_acc f32 [B, H, Sl]) merged with a block's (part [B, Sp, H, D] in
// the activation dtype, part_lse f32 [B, H, Sp]) for the local queries [offset, offset + Sp) of each row.
void merge_rows(const Tensor& out_acc, const Tensor& lse_acc, const Tensor& part, const Tensor& part_lse,
                int64_t offset, Stream stream);
// The same over every token of packed rows: out_acc f32 and part [B, Sl, H, D], both lse token-major [B * Sl, H];
// a token whose part_lse is -inf saw no key in the block and keeps its running values.
void merge_tokens(const Tensor& out_acc, const Tensor& lse_acc, const Tensor& part, const Tensor& part_lse,
                  Stream stream);
// acc (f32 [B, Sl, W]) rows [offset, offset + Sp) of each row += part ([B, Sp, W], f32 or the activation dtype).
void add_rows(const Tensor& acc, const Tensor& part, int64_t offset, Stream stream);

namespace detail {
void merge_rows_cuda(const Tensor& out_acc, const Tensor& lse_acc, const Tensor& part, const Tensor& part_lse,
                     int64_t offset, bool token_major, Stream stream);
}  // namespace detail

}  // namespace nb::ops::cp
