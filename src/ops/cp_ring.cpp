// Context parallelism's ring attention (cp_ring.h): the steps of one rank, its scratch, and the CPU side of
// its two kernels. Every block is an ops::attention call (cuDNN on CUDA, the FP64 reference on the CPU), so
// the ring adds no attention arithmetic of its own: only the FP32 merge and the FP32 gradient sums.
#include "ops/cp_ring.h"
#include <algorithm>
#include <cmath>
#include <limits>
#include "core/memory_ledger.h"
#include "ops/cp_attention.h"
#include "ops/elementwise.h"
#include "ops/ops_common.h"

namespace nb::ops::cp {

namespace {

int64_t elems(const AttentionShape& sh, int64_t heads) { return sh.batch * sh.seq * heads * sh.head_dim; }

// A [n...] view of `bytes` at `at` (advanced past it).
Tensor carve(char** at, DType dt, Device dev, std::initializer_list<int64_t> dims) {
  Tensor t = Tensor::make(*at, dt, dev, dims);
  *at += (t.bytes() + 255) / 256 * 256;
  return t;
}

// K or V (which = 0, 1) of a K|V buffer [2B, S, Hkv, D] (K's B rows, then V's).
Tensor half_of(const Tensor& kv, int which) {
  const int64_t n = kv.numel() / 2;
  return Tensor::make(static_cast<char*>(kv.data) + n * dtype_bytes(kv.dtype, 1) * which, kv.dtype, kv.device,
                      {kv.shape[0] / 2, kv.shape[1], kv.shape[2], kv.shape[3]});
}

// The first or second half of each row of src [B, S, ...] into dst [B, S/2, ...] (the same dtype).
Status halves(const Tensor& src, const Tensor& dst, bool second, Stream stream) {
  const size_t row = size_t(src.bytes() / src.shape[0]), half = row / 2;
  return copy_2d_async(dst.data, half, static_cast<const char*>(src.data) + (second ? half : 0), row, half,
                       size_t(src.shape[0]), src.device, stream);
}

// The second half of each (row, head) of lse [B, H, S] into dst [B, H, S/2].
Status lse_halves(const Tensor& lse, const Tensor& dst, Stream stream) {
  const size_t row = size_t(lse.shape[2]) * 4, half = row / 2;
  return copy_2d_async(dst.data, half, static_cast<const char*>(lse.data) + half, row, half,
                       size_t(lse.shape[0] * lse.shape[1]), lse.device, stream);
}

Status copy_into(const Tensor& dst, const Tensor& src, Stream stream) {
  return copy_bytes_async(dst.data, dst.device, src.data, src.device, size_t(src.bytes()), stream);
}

// A [B, n, H, D] view of the first elements of a [B, S, H, D] scratch tensor (a block of n < S queries).
Tensor first_rows(const Tensor& t, int64_t n) {
  return Tensor::make(t.data, t.dtype, t.device, {t.shape[0], n, t.shape[2], t.shape[3]});
}

}  // namespace

// The scratch's tensors, in one allocation: K|V double buffers (activation dtype) and their FP32 gradient
// twins that travel with them, the FP32 accumulator of out (forward) or dQ (backward), one block's outputs,
// and the half-row copies a block reads.
struct Ring::Views {
  Tensor kv[2], dkv[2], acc, part, part_lse, part_dkv, q_half, o_half, do_half, lse_half, kv_half;
  // CPU forward (f64_): the running out [B, Sl, H, D] and lse (lse's layout), a block's out and lse (part's and
  // part_lse's layouts); null on CUDA.
  double *acc64 = nullptr, *lse64 = nullptr, *part64 = nullptr, *part_lse64 = nullptr;
};

namespace {

// merge_cpu in FP64: the block's Sp queries from `offset` of each of the B rows of S local tokens.
void merge64(double* acc64, double* lse64, const double* part64, const double* part_lse64, int64_t B, int64_t S,
             int64_t H, int64_t D, int64_t Sp, int64_t offset, bool token_major) {
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < Sp; ++i)
      for (int64_t hd = 0; hd < H; ++hd) {
        const int64_t acc_stat = token_major ? (b * S + offset + i) * H + hd : (b * H + hd) * S + offset + i;
        const int64_t part_stat = token_major ? (b * Sp + i) * H + hd : (b * H + hd) * Sp + i;
        merge_partial<double>(acc64 + ((b * S + offset + i) * H + hd) * D, lse64 + acc_stat,
                              part64 + ((b * Sp + i) * H + hd) * D, part_lse64[part_stat], D);
      }
}

}  // namespace

RingTraffic ring_traffic(const AttentionShape& sh, DType act, int ranks) {
  const int64_t kv = 2 * elems(sh, sh.kv_heads);
  if (ranks <= 1) return {};
  return {(ranks - 1) * dtype_bytes(act, kv), (ranks - 1) * dtype_bytes(act, kv) + ranks * kv * 4};
}

int64_t Ring::scratch_bytes(const AttentionShape& sh, DType act) {
  const int64_t q = elems(sh, sh.heads), kv = elems(sh, sh.kv_heads), a = dtype_bytes(act, 1);
  auto al = [](int64_t b) { return (b + 255) / 256 * 256; };
  const int64_t stats = sh.batch * sh.heads * sh.seq * 4;
  return 2 * al(2 * kv * a) + 2 * al(2 * kv * 4) + al(q * 4) + al(q * a) + al(stats) + al(2 * kv * a) +
         3 * al(q / 2 * a) + al(stats / 2) + al(kv * a);
}

Status Ring::init(const AttentionShape& local, Device dev, DType act, RingLink* link) {
  if (local.seq % 2 != 0)
    return errorf("context parallelism: a rank's %lld tokens per row do not split into its two chunks",
                  (long long)local.seq);
  sh_ = local;
  dev_ = dev;
  act_ = act;
  link_ = link;
  if (link->size() == 1) return Status::ok();
  if (dev == Device::cpu)
    f64_.assign(size_t(2 * (elems(local, local.heads) + local.batch * local.seq * local.heads)), 0.0);
  MemoryScope scope(MemPart::attention_workspace);
  return Buffer::allocate(&scratch_, DType::u8, dev, {scratch_bytes(local, act)}).context("context-parallel ring");
}

Status Ring::forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                     Stream stream, const AttentionSegments* segments) {
  const int C = link_->size(), r = link_->rank();
  if (C == 1 || dev_ != Device::cpu) NB_TRY(attention_forward(sh_, q, k, v, out, lse, stream, segments));
  if (C == 1) return Status::ok();
  const Views w = views();
  if (w.acc64) NB_TRY(attention_forward_ref(sh_, q, k, v, out, lse, segments, w.acc64, w.lse64));
  NB_TRY(copy_into(half_of(w.kv[0], 0), k, stream));
  NB_TRY(copy_into(half_of(w.kv[0], 1), v, stream));
  if (!w.acc64) cast(out, w.acc, stream);
  for (int s = 1; s < C; ++s) {
    NB_TRY(link_->pass(w.kv[(s - 1) % 2], w.kv[s % 2], stream));
    Views step = w;
    step.kv[0] = w.kv[s % 2];
    if (segments)
      NB_TRY(packed_block_forward((r - s + C) % C, step, q, lse, *segments, stream));
    else
      NB_TRY(block_forward((r - s + C) % C, step, q, lse, stream));
  }
  if (!w.acc64) {
    cast(w.acc, out, stream);
    return Status::ok();
  }
  float *o = out.ptr<float>(), *l = lse.ptr<float>();
  for (int64_t i = 0; i < out.numel(); ++i) o[i] = float(w.acc64[i]);
  for (int64_t i = 0; i < lse.numel(); ++i) l[i] = float(w.lse64[i]);
  return Status::ok();
}

// One block of the forward against the K/V of rank src (in w.kv[0]).
Status Ring::block_forward(int src, const Views& w, const Tensor& q, const Tensor& lse, Stream stream) {
  const int64_t h = sh_.seq / 2;
  AttentionShape b = sh_;
  b.causal = false;
  const Tensor K = half_of(w.kv[0], 0), V = half_of(w.kv[0], 1);
  if (src < link_->rank()) {  // every local query sees src's first chunk
    b.kv_seq = h;
    const Tensor Kh = half_of(w.kv_half, 0), Vh = half_of(w.kv_half, 1);
    NB_TRY(halves(K, Kh, false, stream));
    NB_TRY(halves(V, Vh, false, stream));
    if (w.acc64) {
      NB_TRY(attention_forward_ref(b, q, Kh, Vh, w.part, w.part_lse, nullptr, w.part64, w.part_lse64));
      merge64(w.acc64, w.lse64, w.part64, w.part_lse64, sh_.batch, sh_.seq, sh_.heads, sh_.head_dim, sh_.seq, 0, false);
      return Status::ok();
    }
    NB_TRY(attention_forward(b, q, Kh, Vh, w.part, w.part_lse, stream));
    merge_rows(w.acc, lse, w.part, w.part_lse, 0, stream);
    return Status::ok();
  }
  b.seq = h;  // only our second chunk's queries see src, both of its chunks
  b.kv_seq = sh_.seq;
  NB_TRY(halves(q, w.q_half, true, stream));
  const Tensor part = first_rows(w.part, h);
  const Tensor part_lse = Tensor::make(w.part_lse.data, DType::f32, dev_, {sh_.batch, sh_.heads, h});
  if (w.acc64) {
    NB_TRY(attention_forward_ref(b, w.q_half, K, V, part, part_lse, nullptr, w.part64, w.part_lse64));
    merge64(w.acc64, w.lse64, w.part64, w.part_lse64, sh_.batch, sh_.seq, sh_.heads, sh_.head_dim, h, h, false);
    return Status::ok();
  }
  NB_TRY(attention_forward(b, w.q_half, K, V, part, part_lse, stream));
  merge_rows(w.acc, lse, part, part_lse, h, stream);
  return Status::ok();
}

Status Ring::backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& dout,
                      const Tensor& lse, const Tensor& dq, const Tensor& dk, const Tensor& dv, Stream stream,
                      const AttentionSegments* segments) {
  NB_TRY(attention_backward(sh_, q, k, v, out, dout, lse, dq, dk, dv, stream, segments));
  const int C = link_->size(), r = link_->rank();
  if (C == 1) return Status::ok();
  const Views w = views();
  NB_TRY(copy_into(half_of(w.kv[0], 0), k, stream));
  NB_TRY(copy_into(half_of(w.kv[0], 1), v, stream));
  cast(dq, w.acc, stream);
  cast(dk, half_of(w.dkv[0], 0), stream);
  cast(dv, half_of(w.dkv[0], 1), stream);
  for (int s = 1; s < C; ++s) {
    NB_TRY(link_->pass(w.kv[(s - 1) % 2], w.kv[s % 2], stream));
    NB_TRY(link_->pass(w.dkv[(s - 1) % 2], w.dkv[s % 2], stream));
    Views step = w;
    step.kv[0] = w.kv[s % 2];
    step.dkv[0] = w.dkv[s % 2];
    if (segments)
      NB_TRY(packed_block_backward((r - s + C) % C, step, q, out, dout, lse, *segments, stream));
    else
      NB_TRY(block_backward((r - s + C) % C, step, q, out, dout, lse, stream));
  }
  // The last block's dK/dV belong to the next rank: one more hop takes every buffer home.
  NB_TRY(link_->pass(w.dkv[(C - 1) % 2], w.dkv[C % 2], stream));
  cast(w.acc, dq, stream);
  cast(half_of(w.dkv[C % 2], 0), dk, stream);
  cast(half_of(w.dkv[C % 2], 1), dv, stream);
  return Status::ok();
}

// One block of the backward against the K/V of rank src (w.kv[0]), its gradients added to w.dkv[0].
Status Ring::block_backward(int src, const Views& w, const Tensor& q, const Tensor& out, const Tensor& dout,
                            const Tensor& lse, Stream stream) {
  const int64_t h = sh_.seq / 2;
  AttentionShape b = sh_;
  b.causal = false;
  const Tensor K = half_of(w.kv[0], 0), V = half_of(w.kv[0], 1);
  const Tensor dK = half_of(w.dkv[0], 0), dV = half_of(w.dkv[0], 1);
  if (src < link_->rank()) {
    b.kv_seq = h;
    const Tensor Kh = half_of(w.kv_half, 0), Vh = half_of(w.kv_half, 1);
    const Tensor dKh = first_rows(half_of(w.part_dkv, 0), h), dVh = first_rows(half_of(w.part_dkv, 1), h);
    NB_TRY(halves(K, Kh, false, stream));
    NB_TRY(halves(V, Vh, false, stream));
    NB_TRY(attention_backward(b, q, Kh, Vh, out, dout, lse, w.part, dKh, dVh, stream));
    add_rows(w.acc, w.part, 0, stream);
    add_rows(dK, dKh, 0, stream);
    add_rows(dV, dVh, 0, stream);
    return Status::ok();
  }
  b.seq = h;
  b.kv_seq = sh_.seq;
  const Tensor lse_h = Tensor::make(w.lse_half.data, DType::f32, dev_, {sh_.batch, sh_.heads, h});
  NB_TRY(halves(q, w.q_half, true, stream));
  NB_TRY(halves(out, w.o_half, true, stream));
  NB_TRY(halves(dout, w.do_half, true, stream));
  NB_TRY(lse_halves(lse, lse_h, stream));
  const Tensor dq_part = first_rows(w.part, h), dKp = half_of(w.part_dkv, 0), dVp = half_of(w.part_dkv, 1);
  NB_TRY(attention_backward(b, w.q_half, K, V, w.o_half, w.do_half, lse_h, dq_part, dKp, dVp, stream));
  add_rows(w.acc, dq_part, h, stream);
  add_rows(dK, dKp, 0, stream);
  add_rows(dV, dVp, 0, stream);
  return Status::ok();
}

// A block's segment table over packed rows: src < r, every local query of segment i sees the first half of
// src's local segment i (src's chunk src, all before ours); src > r, only our second half (chunk 2C-1-r) sees
// anything, and it sees all of src's segment i (chunks src and 2C-1-src lie between our two chunks).
AttentionSegments Ring::block_segments(int src, const AttentionSegments& local) const {
  AttentionSegments b = local;
  const bool earlier = src < link_->rank();
  b.q_part = earlier ? SegmentPart::whole : SegmentPart::second_half;
  b.kv_part = earlier ? SegmentPart::first_half : SegmentPart::whole;
  return b;
}

// One block of the forward over packed rows, against the K/V of rank src (w.kv[0]). Queries outside the block's
// parts are not written: their part_lse is set to -inf first so the merge passes them by.
Status Ring::packed_block_forward(int src, const Views& w, const Tensor& q, const Tensor& lse,
                                  const AttentionSegments& local, Stream stream) {
  AttentionShape b = sh_;
  b.causal = false;
  const AttentionSegments seg = block_segments(src, local);
  if (w.acc64) {
    std::fill(w.part_lse64, w.part_lse64 + w.part_lse.numel(), -std::numeric_limits<double>::infinity());
    NB_TRY(attention_forward_ref(b, q, half_of(w.kv[0], 0), half_of(w.kv[0], 1), w.part, w.part_lse, &seg, w.part64,
                                 w.part_lse64));
    merge64(w.acc64, w.lse64, w.part64, w.part_lse64, sh_.batch, sh_.seq, sh_.heads, sh_.head_dim, sh_.seq, 0, true);
    return Status::ok();
  }
  if (seg.q_part != SegmentPart::whole) fill(w.part_lse, -std::numeric_limits<float>::infinity(), stream);
  NB_TRY(attention_forward(b, q, half_of(w.kv[0], 0), half_of(w.kv[0], 1), w.part, w.part_lse, stream, &seg));
  merge_tokens(w.acc, lse, w.part, w.part_lse, stream);
  return Status::ok();
}

// One block of the backward over packed rows; the gradients of tokens outside its parts are not written, so
// those buffers start at zero.
Status Ring::packed_block_backward(int src, const Views& w, const Tensor& q, const Tensor& out, const Tensor& dout,
                                   const Tensor& lse, const AttentionSegments& local, Stream stream) {
  AttentionShape b = sh_;
  b.causal = false;
  const AttentionSegments seg = block_segments(src, local);
  const Tensor dKp = half_of(w.part_dkv, 0), dVp = half_of(w.part_dkv, 1);
  if (seg.q_part != SegmentPart::whole) fill(w.part, 0.0f, stream);
  if (seg.kv_part != SegmentPart::whole) fill(w.part_dkv, 0.0f, stream);
  NB_TRY(attention_backward(b, q, half_of(w.kv[0], 0), half_of(w.kv[0], 1), out, dout, lse, w.part, dKp, dVp, stream,
                            &seg));
  add_rows(w.acc, w.part, 0, stream);
  add_rows(half_of(w.dkv[0], 0), dKp, 0, stream);
  add_rows(half_of(w.dkv[0], 1), dVp, 0, stream);
  return Status::ok();
}

Ring::Views Ring::views() const {
  const int64_t B = sh_.batch, S = sh_.seq, h = S / 2, Hq = sh_.heads, Hkv = sh_.kv_heads, D = sh_.head_dim;
  char* at = static_cast<char*>(scratch_.data());
  Views w;
  for (Tensor& t : w.kv) t = carve(&at, act_, dev_, {2 * B, S, Hkv, D});
  for (Tensor& t : w.dkv) t = carve(&at, DType::f32, dev_, {2 * B, S, Hkv, D});
  w.acc = carve(&at, DType::f32, dev_, {B, S, Hq, D});
  w.part = carve(&at, act_, dev_, {B, S, Hq, D});
  w.part_lse = carve(&at, DType::f32, dev_, {B, Hq, S});
  w.part_dkv = carve(&at, act_, dev_, {2 * B, S, Hkv, D});
  w.q_half = carve(&at, act_, dev_, {B, h, Hq, D});
  w.o_half = carve(&at, act_, dev_, {B, h, Hq, D});
  w.do_half = carve(&at, act_, dev_, {B, h, Hq, D});
  w.lse_half = carve(&at, DType::f32, dev_, {B, Hq, h});
  w.kv_half = carve(&at, act_, dev_, {2 * B, h, Hkv, D});
  if (!f64_.empty()) {
    double* p = f64_.data();
    w.acc64 = p;
    w.lse64 = p + B * S * Hq * D;
    w.part64 = w.lse64 + B * S * Hq;
    w.part_lse64 = w.part64 + B * S * Hq * D;
  }
  return w;
}

namespace {

// merge_rows and merge_tokens on the CPU: lse [B, H, S] (rows) or [B * S, H] (token_major).
void merge_cpu(const Tensor& out_acc, const Tensor& lse_acc, const Tensor& part, const Tensor& part_lse, int64_t offset,
               bool token_major) {
  const int64_t B = out_acc.shape[0], S = out_acc.shape[1], H = out_acc.shape[2], D = out_acc.shape[3];
  const int64_t Sp = part.shape[1];
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < Sp; ++i)
      for (int64_t hd = 0; hd < H; ++hd) {
        const int64_t acc_stat = token_major ? (b * S + offset + i) * H + hd : (b * H + hd) * S + offset + i;
        const int64_t part_stat = token_major ? (b * Sp + i) * H + hd : (b * H + hd) * Sp + i;
        merge_partial(out_acc.ptr<float>() + ((b * S + offset + i) * H + hd) * D, lse_acc.ptr<float>() + acc_stat,
                      part.ptr<float>() + ((b * Sp + i) * H + hd) * D, part_lse.ptr<float>()[part_stat], D);
      }
}

}  // namespace

void merge_rows(const Tensor& out_acc, const Tensor& lse_acc, const Tensor& part, const Tensor& part_lse,
                int64_t offset, [[maybe_unused]] Stream stream) {
  if (out_acc.device == Device::cuda)
    NB_OPS_CUDA("cp::merge_rows", detail::merge_rows_cuda(out_acc, lse_acc, part, part_lse, offset, false, stream));
  merge_cpu(out_acc, lse_acc, part, part_lse, offset, false);
}

void merge_tokens(const Tensor& out_acc, const Tensor& lse_acc, const Tensor& part, const Tensor& part_lse,
                  [[maybe_unused]] Stream stream) {
  if (out_acc.device == Device::cuda)
    NB_OPS_CUDA("cp::merge_tokens", detail::merge_rows_cuda(out_acc, lse_acc, part, part_lse, 0, true, stream));
  merge_cpu(out_acc, lse_acc, part, part_lse, 0, true);
}

void add_rows(const Tensor& acc, const Tensor& part, int64_t offset, Stream stream) {
  const int64_t B = acc.shape[0], S = acc.shape[1], Sp = part.shape[1], W = acc.numel() / (B * S);
  for (int64_t b = 0; b < B; ++b) {
    const Tensor a = Tensor::make(acc.ptr<float>() + (b * S + offset) * W, DType::f32, acc.device, {Sp * W});
    const Tensor p = Tensor::make(static_cast<char*>(part.data) + b * Sp * W * dtype_bytes(part.dtype, 1), part.dtype,
                                  part.device, {Sp * W});
    add_inplace(a, p, stream);
  }
}

}  // namespace nb::ops::cp
