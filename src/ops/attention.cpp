// Causal GQA attention: argument checks, backend dispatch and the CPU reference (the spec).
//
// Reference math for one sequence (a row, or a packed segment: positions i, j count from its first
// token), query head h (K/V head g = h / (Hq/Hkv)), query position i, keys j <= i (when not causal: every key
// of the row's kv_seq, or of the segment's key part for the queries of its query part):
//   s_ij = scale * q_i . k_j            lse_i = log sum_{j<=i} exp(s_ij)      p_ij = exp(s_ij - lse_i)
//   out_i = sum_j p_ij v_j
// Backward with D_i = dout_i . out_i (= sum_j p_ij dp_ij):
//   dp_ij = dout_i . v_j      ds_ij = p_ij (dp_ij - D_i)
//   dq_i = scale * sum_j ds_ij k_j      dk_j += scale * ds_ij q_i      dv_j += p_ij dout_i
// dk/dv sum over every query head of the group. All sums run in FP64; results are stored as FP32.
// Work is split over (sequence, query head); the backward keeps per-head FP64 dk/dv partials and sums each
// group in head order, so threads never share output and the result does not depend on thread timing.
// A segment therefore gets exactly the arithmetic it would get as a row of its own.
#include "ops/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <thread>
#include <vector>

namespace nb::ops {
namespace {

Status check_tensor(const char* name, const Tensor* t, Device dev, DType dt, std::initializer_list<int64_t> dims) {
  if (t == nullptr) return Status::ok();
  std::vector<int64_t> want(dims);
  bool same = t->ndim == int(want.size());
  for (int i = 0; same && i < t->ndim; ++i) same = t->shape[i] == want[i];
  std::string want_str = "[";
  for (size_t i = 0; i < want.size(); ++i) want_str += (i ? "," : "") + std::to_string(want[i]);
  want_str += "]";
  if (!same)
    return errorf("attention: tensor '%s' has shape %s but the attention shape needs %s", name, t->shape_str().c_str(),
                  want_str.c_str());
  if (t->device != dev)
    return errorf("attention: tensor '%s' is on %s but q is on %s; put all attention tensors on one device", name,
                  device_name(t->device), device_name(dev));
  if (t->dtype != dt)
    return errorf("attention: tensor '%s' is %s but must be %s on %s", name, std::string(dtype_name(t->dtype)).c_str(),
                  std::string(dtype_name(dt)).c_str(), device_name(dev));
  if (!t->is_contiguous() || t->data == nullptr)
    return errorf("attention: tensor '%s' must be contiguous with data", name);
  return Status::ok();
}

// Runs fn(item) for item in [0, n) on up to hardware_concurrency threads.
template <typename Fn>
void parallel_for(int64_t n, Fn fn) {
  int64_t workers = std::min<int64_t>(n, std::max(1u, std::thread::hardware_concurrency()));
  if (workers <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::vector<std::thread> pool;
  for (int64_t w = 0; w < workers; ++w)
    pool.emplace_back([&, w] {
      for (int64_t i = w; i < n; i += workers) fn(i);
    });
  for (auto& t : pool) t.join();
}

double dot(const float* a, const float* b, int64_t n) {
  double s = 0.0;
  for (int64_t d = 0; d < n; ++d) s += double(a[d]) * double(b[d]);
  return s;
}

// One causal sequence: `len` consecutive tokens from token t0 of the [T, H, D] tensors (a row of
// whole-row attention, or a packed segment).
struct Seq {
  int64_t t0, len;
  int64_t kv0 = 0, kv_len = 0;  // its keys: kv_len tokens from kv0 (a causal sequence: its own tokens)
};

// The tensors of one call and their index helpers; token t = b * S + s. lse is [B, Hq, S], or [T, Hq]
// (token_major) for packed segments.
struct Ref {
  int64_t S, Hq, Hkv, D, group;
  double scale;
  bool token_major;
  const float *Q, *K, *V;
  int64_t q(int64_t t, int64_t h) const { return (t * Hq + h) * D; }
  int64_t kv(int64_t t, int64_t g) const { return (t * Hkv + g) * D; }
  int64_t stat(int64_t t, int64_t h) const { return token_major ? t * Hq + h : ((t / S) * Hq + h) * S + t % S; }
};

Ref make_ref(const AttentionShape& sh, const Tensor& q, const Tensor& k, const Tensor& v, bool token_major) {
  return {sh.seq,           sh.heads,    sh.kv_heads,    sh.head_dim,    sh.heads / sh.kv_heads,
          double(sh.scale), token_major, q.ptr<float>(), k.ptr<float>(), v.ptr<float>()};
}

// The tokens [*first, *first + *n) that `part` takes of the segment [t0, t0 + len).
void segment_part(SegmentPart part, int64_t t0, int64_t len, int64_t* first, int64_t* n) {
  *first = t0 + (part == SegmentPart::second_half ? len / 2 : 0);
  *n = part == SegmentPart::whole ? len : len / 2;
}

// The sequences of a call: each row, or each segment (its queries and keys the parts the call asks for).
std::vector<Seq> sequences_of(const AttentionShape& sh, const AttentionSegments* seg) {
  std::vector<Seq> seqs;
  if (seg == nullptr) {
    for (int64_t b = 0; b < sh.batch; ++b) seqs.push_back({b * sh.seq, sh.seq, b * sh.kv_len(), sh.kv_len()});
    return seqs;
  }
  for (int64_t i = 0; i < seg->count; ++i) {
    const int64_t t0 = seg->starts[i], len = int64_t(seg->starts[i + 1]) - seg->starts[i];
    Seq sq{};
    segment_part(seg->q_part, t0, len, &sq.t0, &sq.len);
    segment_part(seg->kv_part, t0, len, &sq.kv0, &sq.kv_len);
    seqs.push_back(sq);
  }
  return seqs;
}

// Which keys some sequence reads (dk/dv are written there only): every one, unless a ring block takes halves.
std::vector<char> keys_read(const std::vector<Seq>& seqs, int64_t Tkv) {
  std::vector<char> read(size_t(Tkv), 0);
  for (const Seq& sq : seqs) std::fill(read.begin() + sq.kv0, read.begin() + sq.kv0 + sq.kv_len, char(1));
  return read;
}

// The keys query i of a sequence sees: 0..i when causal, else all of them.
int64_t keys_seen(const AttentionShape& sh, const Seq& sq, int64_t i) { return sh.causal ? i + 1 : sq.kv_len; }

// Forward of query head h over one sequence; s and acc are scratch of at least len and D entries.
void forward_sequence(const AttentionShape& sh, const Ref& r, Seq sq, int64_t h, float* O, float* LSE, double* O64,
                      double* LSE64, std::vector<double>& s, std::vector<double>& acc) {
  const int64_t g = h / r.group, D = r.D;
  for (int64_t i = 0; i < sq.len; ++i) {
    const int64_t t = sq.t0 + i, n = keys_seen(sh, sq, i);
    double m = -std::numeric_limits<double>::infinity();
    for (int64_t j = 0; j < n; ++j) {
      s[j] = r.scale * dot(r.Q + r.q(t, h), r.K + r.kv(sq.kv0 + j, g), D);
      m = std::max(m, s[j]);
    }
    double sum = 0.0;
    for (int64_t j = 0; j < n; ++j) sum += std::exp(s[j] - m);
    const double log_sum = m + std::log(sum);
    std::fill(acc.begin(), acc.end(), 0.0);
    for (int64_t j = 0; j < n; ++j) {
      const double p = std::exp(s[j] - log_sum);
      const float* vj = r.V + r.kv(sq.kv0 + j, g);
      for (int64_t d = 0; d < D; ++d) acc[d] += p * double(vj[d]);
    }
    for (int64_t d = 0; d < D; ++d) O[r.q(t, h) + d] = float(acc[d]);
    LSE[r.stat(t, h)] = float(log_sum);
    if (O64) {
      std::copy(acc.begin(), acc.begin() + D, O64 + r.q(t, h));
      LSE64[r.stat(t, h)] = log_sum;
    }
  }
}

// Backward of query head h over one sequence: writes dq and adds this head's dk/dv terms to its FP64
// partials, laid out per query head ([Tkv, Hq, D], Tkv = B * kv_len).
void backward_sequence(const AttentionShape& sh, const Ref& r, Seq sq, int64_t h, const float* O, const float* dO,
                       const float* LSE, float* dQ, double* dk_part, double* dv_part, std::vector<double>& dq_acc) {
  const int64_t g = h / r.group, D = r.D;
  for (int64_t i = 0; i < sq.len; ++i) {
    const int64_t t = sq.t0 + i, n = keys_seen(sh, sq, i);
    const float* qi = r.Q + r.q(t, h);
    const float* doi = dO + r.q(t, h);
    const double Di = dot(doi, O + r.q(t, h), D);
    const double lse_i = LSE[r.stat(t, h)];
    std::fill(dq_acc.begin(), dq_acc.end(), 0.0);
    for (int64_t j = 0; j < n; ++j) {
      const float* kj = r.K + r.kv(sq.kv0 + j, g);
      const float* vj = r.V + r.kv(sq.kv0 + j, g);
      const double p = std::exp(r.scale * dot(qi, kj, D) - lse_i);
      const double ds = p * (dot(doi, vj, D) - Di);
      double* dk_j = dk_part + r.q(sq.kv0 + j, h);
      double* dv_j = dv_part + r.q(sq.kv0 + j, h);
      for (int64_t d = 0; d < D; ++d) {
        dq_acc[d] += ds * double(kj[d]);
        dk_j[d] += ds * double(qi[d]);
        dv_j[d] += p * double(doi[d]);
      }
    }
    for (int64_t d = 0; d < D; ++d) dQ[r.q(t, h) + d] = float(r.scale * dq_acc[d]);
  }
}

// The ring's key blocks: rows of their own key length (kv_seq), or segment halves (one token table for Q and
// K/V), both without the causal mask.
Status check_key_rows(const AttentionShape& sh, const AttentionSegments* segments) {
  if (sh.kv_seq < 0) return errorf("attention: kv_seq %lld must be 0 (= seq) or positive", (long long)sh.kv_seq);
  if (sh.causal && sh.kv_len() != sh.seq)
    return errorf("attention: a causal call needs as many keys as queries (kv_seq %lld, seq %lld)",
                  (long long)sh.kv_seq, (long long)sh.seq);
  if (segments == nullptr) return Status::ok();
  if (sh.kv_len() != sh.seq)
    return errorf("attention: packed segments index q and k/v by one token table, so kv_seq must equal seq");
  if (sh.causal && (segments->q_part != SegmentPart::whole || segments->kv_part != SegmentPart::whole))
    return errorf("attention: causal segmented attention takes whole segments; halves are for non-causal ring blocks");
  return Status::ok();
}

// True when lse is the token-major [B, S, Hq] view of a segmented call (else it must be [B, Hq, S]).
bool lse_is_token_major(const AttentionShape& sh, const Tensor& lse, const AttentionSegments* seg) {
  return seg != nullptr && lse.ndim == 3 && lse.shape[0] == sh.batch && lse.shape[1] == sh.seq &&
         lse.shape[2] == sh.heads;
}

}  // namespace

// The rules of AttentionSegments; each refusal names the rule and the offending segment.
Status attention_check_segments(const AttentionShape& sh, const AttentionSegments& seg, Device dev) {
  const int64_t T = sh.batch * sh.seq, S = sh.seq;
  if (T > std::numeric_limits<int32_t>::max())
    return errorf("attention: %lld tokens do not fit the int32 segment starts; use fewer tokens per micro-batch",
                  (long long)T);
  if (seg.count < 1 || seg.count > T)
    return errorf("attention: %lld segments given for %lld tokens; a packed micro-batch has 1 to B*S segments",
                  (long long)seg.count, (long long)T);
  if (dev == Device::cpu && seg.starts == nullptr)
    return errorf("attention: segments on the cpu need the host array 'starts'");
  if (dev != Device::cpu && seg.starts_device == nullptr)
    return errorf("attention: segments on %s need 'starts_device', a device copy of the starts", device_name(dev));
  if (seg.max_len < 0 || seg.max_len > S)
    return errorf("attention: segment max_len %lld must lie in [1, S=%lld] (or be 0: computed from the starts)",
                  (long long)seg.max_len, (long long)S);
  if (seg.starts == nullptr) {
    if (seg.max_len == 0) return errorf("attention: segments without host starts need max_len, the longest segment");
    return Status::ok();
  }
  if (seg.starts[0] != 0 || seg.starts[seg.count] != T)
    return errorf("attention: segment starts run from %d to %d but must tile the B*S = %lld tokens from 0 to %lld",
                  seg.starts[0], seg.starts[seg.count], (long long)T, (long long)T);
  int64_t longest = 0;
  for (int64_t i = 0; i < seg.count; ++i) {
    const int64_t s0 = seg.starts[i], s1 = seg.starts[i + 1];
    if (s1 <= s0)
      return errorf("attention: segment %lld is empty or reversed (starts %lld then %lld); starts must increase",
                    (long long)i, (long long)s0, (long long)s1);
    if (s0 / S != (s1 - 1) / S)
      return errorf(
          "attention: segment %lld (tokens %lld..%lld) crosses the end of row %lld (S=%lld tokens); "
          "a segment must lie inside one row",
          (long long)i, (long long)s0, (long long)s1 - 1, (long long)(s0 / S), (long long)S);
    if ((seg.q_part != SegmentPart::whole || seg.kv_part != SegmentPart::whole) && (s1 - s0) % 2 != 0)
      return errorf("attention: segment %lld has %lld tokens, which do not split into the halves the call takes",
                    (long long)i, (long long)(s1 - s0));
    longest = std::max(longest, s1 - s0);
  }
  if (seg.max_len > 0 && seg.max_len < longest)
    return errorf("attention: segment max_len %lld is shorter than the longest segment (%lld tokens)",
                  (long long)seg.max_len, (long long)longest);
  return Status::ok();
}

int64_t attention_segments_max_len(const AttentionSegments& seg) {
  if (seg.max_len > 0 || seg.starts == nullptr) return seg.max_len;
  int64_t longest = 0;
  for (int64_t i = 0; i < seg.count; ++i) longest = std::max<int64_t>(longest, seg.starts[i + 1] - seg.starts[i]);
  return longest;
}

Status attention_check_args(const AttentionShape& sh, const Tensor& q, const Tensor& k, const Tensor& v,
                            const Tensor& out, const Tensor& lse, const Tensor* dout, const Tensor* dq,
                            const Tensor* dk, const Tensor* dv, const AttentionSegments* segments) {
  if (sh.batch <= 0 || sh.seq <= 0 || sh.heads <= 0 || sh.kv_heads <= 0 || sh.head_dim <= 0)
    return errorf("attention: every dimension must be positive (B=%lld S=%lld Hq=%lld Hkv=%lld D=%lld)",
                  (long long)sh.batch, (long long)sh.seq, (long long)sh.heads, (long long)sh.kv_heads,
                  (long long)sh.head_dim);
  if (sh.heads % sh.kv_heads != 0)
    return errorf("attention: query heads (%lld) must be a multiple of K/V heads (%lld)", (long long)sh.heads,
                  (long long)sh.kv_heads);
  if (!(sh.scale > 0.0f) || !std::isfinite(sh.scale))
    return errorf("attention: softmax scale %g must be positive and finite (usually 1/sqrt(head_dim))", sh.scale);
  NB_TRY(check_key_rows(sh, segments));
  const Device dev = q.device;
  const DType act = dev == Device::cpu ? DType::f32 : DType::bf16;
  const auto B = sh.batch, S = sh.seq, Skv = sh.kv_len(), Hq = sh.heads, Hkv = sh.kv_heads, D = sh.head_dim;
  NB_TRY(check_tensor("q", &q, dev, act, {B, S, Hq, D}));
  NB_TRY(check_tensor("k", &k, dev, act, {B, Skv, Hkv, D}));
  NB_TRY(check_tensor("v", &v, dev, act, {B, Skv, Hkv, D}));
  NB_TRY(check_tensor("out", &out, dev, act, {B, S, Hq, D}));
  if (lse_is_token_major(sh, lse, segments))
    NB_TRY(check_tensor("lse", &lse, dev, DType::f32, {B, S, Hq}));
  else
    NB_TRY(check_tensor("lse", &lse, dev, DType::f32, {B, Hq, S}));
  NB_TRY(check_tensor("dout", dout, dev, act, {B, S, Hq, D}));
  NB_TRY(check_tensor("dq", dq, dev, act, {B, S, Hq, D}));
  NB_TRY(check_tensor("dk", dk, dev, act, {B, Skv, Hkv, D}));
  NB_TRY(check_tensor("dv", dv, dev, act, {B, Skv, Hkv, D}));
  if (segments != nullptr) NB_TRY(attention_check_segments(sh, *segments, dev));
  return Status::ok();
}

Status attention_forward_ref(const AttentionShape& sh, const Tensor& q, const Tensor& k, const Tensor& v,
                             const Tensor& out, const Tensor& lse, const AttentionSegments* segments) {
  return attention_forward_ref(sh, q, k, v, out, lse, segments, nullptr, nullptr);
}

Status attention_forward_ref(const AttentionShape& sh, const Tensor& q, const Tensor& k, const Tensor& v,
                             const Tensor& out, const Tensor& lse, const AttentionSegments* segments, double* out64,
                             double* lse64) {
  NB_TRY(attention_check_args(sh, q, k, v, out, lse, nullptr, nullptr, nullptr, nullptr, segments));
  if (q.device != Device::cpu) return errorf("attention_forward_ref: tensors must be on the cpu");
  const Ref r = make_ref(sh, q, k, v, segments != nullptr);
  const std::vector<Seq> seqs = sequences_of(sh, segments);
  float *O = out.ptr<float>(), *LSE = lse.ptr<float>();
  parallel_for(int64_t(seqs.size()) * sh.heads, [&](int64_t item) {
    const Seq sq = seqs[size_t(item / sh.heads)];
    std::vector<double> s(size_t(std::max(sq.len, sq.kv_len))), acc(size_t(sh.head_dim));
    forward_sequence(sh, r, sq, item % sh.heads, O, LSE, out64, lse64, s, acc);
  });
  return Status::ok();
}

Status attention_backward_ref(const AttentionShape& sh, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& out, const Tensor& dout, const Tensor& lse, const Tensor& dq,
                              const Tensor& dk, const Tensor& dv, const AttentionSegments* segments) {
  NB_TRY(attention_check_args(sh, q, k, v, out, lse, &dout, &dq, &dk, &dv, segments));
  if (q.device != Device::cpu) return errorf("attention_backward_ref: tensors must be on the cpu");
  const Ref r = make_ref(sh, q, k, v, segments != nullptr);
  const std::vector<Seq> seqs = sequences_of(sh, segments);
  const int64_t Tkv = sh.batch * sh.kv_len(), D = sh.head_dim;
  const float *O = out.ptr<float>(), *dO = dout.ptr<float>(), *LSE = lse.ptr<float>();
  float *dK = dk.ptr<float>(), *dV = dv.ptr<float>();
  // Per query head FP64 partial dk/dv, summed over each group in head order afterwards (deterministic).
  std::vector<double> dk_part(size_t(Tkv * sh.heads * D)), dv_part(dk_part.size());
  parallel_for(int64_t(seqs.size()) * sh.heads, [&](int64_t item) {
    std::vector<double> dq_acc(static_cast<size_t>(D));
    backward_sequence(sh, r, seqs[size_t(item / sh.heads)], item % sh.heads, O, dO, LSE, dq.ptr<float>(),
                      dk_part.data(), dv_part.data(), dq_acc);
  });
  const std::vector<char> read = keys_read(seqs, Tkv);
  parallel_for(Tkv, [&](int64_t t) {
    if (!read[size_t(t)]) return;  // a key no query of this call sees keeps its dk/dv
    for (int64_t g = 0; g < sh.kv_heads; ++g)
      for (int64_t d = 0; d < D; ++d) {
        double sk = 0.0, sv = 0.0;
        for (int64_t h = g * r.group; h < (g + 1) * r.group; ++h) {
          sk += dk_part[size_t(r.q(t, h) + d)];
          sv += dv_part[size_t(r.q(t, h) + d)];
        }
        dK[r.kv(t, g) + d] = float(r.scale * sk);
        dV[r.kv(t, g) + d] = float(sv);
      }
  });
  return Status::ok();
}

Status attention_forward(const AttentionShape& sh, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                         const Tensor& lse, Stream stream, const AttentionSegments* segments) {
  if (q.device == Device::cpu) return attention_forward_ref(sh, q, k, v, out, lse, segments);
  return attention_forward_cudnn(sh, q, k, v, out, lse, stream, segments);
}

Status attention_backward(const AttentionShape& sh, const Tensor& q, const Tensor& k, const Tensor& v,
                          const Tensor& out, const Tensor& dout, const Tensor& lse, const Tensor& dq, const Tensor& dk,
                          const Tensor& dv, Stream stream, const AttentionSegments* segments) {
  if (q.device == Device::cpu) return attention_backward_ref(sh, q, k, v, out, dout, lse, dq, dk, dv, segments);
  return attention_backward_cudnn(sh, q, k, v, out, dout, lse, dq, dk, dv, stream, segments);
}

#if !defined(NIBBLE_HAVE_CUDA)
Status attention_forward_cudnn(const AttentionShape&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                               const Tensor&, Stream, const AttentionSegments*) {
  return errorf("attention: CUDA tensors given, but this nibble was built without CUDA; rebuild with nvcc present");
}
Status attention_backward_cudnn(const AttentionShape&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, Stream,
                                const AttentionSegments*) {
  return errorf("attention: CUDA tensors given, but this nibble was built without CUDA; rebuild with nvcc present");
}
int64_t attention_workspace_bytes() { return 0; }
#endif

}  // namespace nb::ops
