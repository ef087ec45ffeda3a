// Context-parallel attention, the CPU reference (cp_attention.h): the ring's steps for every rank, each
// step one partial attention (FP64 inside, FP32 out, as a kernel's) merged or accumulated in FP32.
#include "ops/cp_attention.h"
#include "ops/cp_ring.h"
#include <algorithm>
#include <cmath>
#include <limits>

namespace nb::ops::cp {

namespace {

constexpr float kNoKey = -std::numeric_limits<float>::infinity();

struct Seq {
  int64_t t0, len;
};

std::vector<Seq> sequences(const AttentionShape& sh, const AttentionSegments* seg) {
  std::vector<Seq> out;
  if (!seg) {
    for (int64_t b = 0; b < sh.batch; ++b) out.push_back({b * sh.seq, sh.seq});
    return out;
  }
  for (int64_t i = 0; i < seg->count; ++i)
    out.push_back({seg->starts[i], int64_t(seg->starts[i + 1]) - seg->starts[i]});
  return out;
}

// What every step needs: the layout, each token's sequence start (the mask), and the ranks' shards.
struct AllRanks {
  int64_t T, Hq, Hkv, D, group;
  double scale;
  bool token_major;  // packed segments: lse is [T, Hq] (ops/attention.h)
  std::vector<int64_t> seq_start;
  std::vector<std::vector<int64_t>> shards;
  bool visible(int64_t i, int64_t j) const { return seq_start[size_t(i)] == seq_start[size_t(j)] && j <= i; }
  int64_t q(int64_t t, int64_t h) const { return (t * Hq + h) * D; }
  int64_t kv(int64_t t, int64_t h) const { return (t * Hkv + h / group) * D; }
  int64_t stat(int64_t t, int64_t h, int64_t S) const {
    return token_major ? t * Hq + h : ((t / S) * Hq + h) * S + t % S;
  }
};

Status make_ring(const AttentionShape& sh, const AttentionSegments* seg, int ranks, AllRanks* r) {
  if (ranks < 1) return errorf("context parallelism: %d ranks; need at least 1", ranks);
  *r = AllRanks{sh.batch * sh.seq, sh.heads,       sh.kv_heads, sh.head_dim, sh.heads / sh.kv_heads,
                double(sh.scale),  seg != nullptr, {},          {}};
  r->seq_start.resize(size_t(r->T));
  for (const Seq& s : sequences(sh, seg))
    for (int64_t t = s.t0; t < s.t0 + s.len; ++t) r->seq_start[size_t(t)] = s.t0;
  r->shards.resize(size_t(ranks));
  for (int rank = 0; rank < ranks; ++rank) NB_TRY(shard_tokens(sh, seg, ranks, rank, &r->shards[size_t(rank)]));
  return Status::ok();
}

double dot(const float* a, const float* b, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += double(a[i]) * double(b[i]);
  return s;
}

// One step's partial attention of query token i, head h, over the keys `keys` it may see: out_part (D) and
// its lse; false when it sees none of them.
bool partial(const AllRanks& r, const float* Q, const float* K, const float* V, int64_t i, int64_t h,
             const std::vector<int64_t>& keys, float* out_part, float* lse_part) {
  double m = -std::numeric_limits<double>::infinity();
  std::vector<std::pair<int64_t, double>> s;
  for (int64_t j : keys) {
    if (!r.visible(i, j)) continue;
    s.push_back({j, r.scale * dot(Q + r.q(i, h), K + r.kv(j, h), r.D)});
    m = std::max(m, s.back().second);
  }
  if (s.empty()) return false;
  double sum = 0;
  for (const auto& [j, x] : s) sum += std::exp(x - m);
  const double lse = m + std::log(sum);
  std::vector<double> acc(size_t(r.D), 0.0);
  for (const auto& [j, x] : s) {
    const double p = std::exp(x - lse);
    for (int64_t d = 0; d < r.D; ++d) acc[size_t(d)] += p * double(V[r.kv(j, h) + d]);
  }
  for (int64_t d = 0; d < r.D; ++d) out_part[d] = float(acc[size_t(d)]);
  *lse_part = float(lse);
  return true;
}

}  // namespace

Status shard_tokens(const AttentionShape& sh, const AttentionSegments* seg, int ranks, int rank,
                    std::vector<int64_t>* tokens) {
  tokens->clear();
  const int64_t chunks = int64_t(2) * ranks;
  for (const Seq& s : sequences(sh, seg)) {
    if (s.len % chunks != 0)
      return errorf(
          "context parallelism over %d ranks cuts each sequence into %d chunks, but a sequence of %lld tokens "
          "(at token %lld) is not a multiple of %d; pad it (TransformerEngine pads each to a multiple of 2 x CP)",
          ranks, 2 * ranks, (long long)s.len, (long long)s.t0, 2 * ranks);
    const int64_t local = s.len / ranks;  // chunks rank and 2C-1-rank (cp_ring.h's global_position)
    for (int64_t i = 0; i < local; ++i) tokens->push_back(s.t0 + global_position(i, local, rank, ranks));
  }
  return Status::ok();
}

Status ring_forward(const AttentionShape& sh, const AttentionSegments* seg, int ranks, const Tensor& q, const Tensor& k,
                    const Tensor& v, const Tensor& out, const Tensor& lse) {
  NB_TRY(attention_check_args(sh, q, k, v, out, lse, nullptr, nullptr, nullptr, nullptr, seg));
  if (q.device != Device::cpu) return errorf("cp::ring_forward is the CPU reference: tensors must be on the cpu");
  AllRanks r;
  NB_TRY(make_ring(sh, seg, ranks, &r));
  float* O = out.ptr<float>();
  std::vector<float> lse_tok(size_t(r.T * r.Hq), kNoKey), part(size_t(r.D));
  std::fill(O, O + r.T * r.Hq * r.D, 0.0f);
  for (int rank = 0; rank < ranks; ++rank)
    for (int step = 0; step < ranks; ++step) {  // the K/V of rank (rank - step) mod C arrive at step `step`
      const auto& keys = r.shards[size_t((rank - step + ranks) % ranks)];
      for (int64_t i : r.shards[size_t(rank)])
        for (int64_t h = 0; h < r.Hq; ++h) {
          float part_lse = kNoKey;
          if (partial(r, q.ptr<float>(), k.ptr<float>(), v.ptr<float>(), i, h, keys, part.data(), &part_lse))
            merge_partial(O + r.q(i, h), &lse_tok[size_t(i * r.Hq + h)], part.data(), part_lse, r.D);
        }
    }
  for (int64_t t = 0; t < r.T; ++t)
    for (int64_t h = 0; h < r.Hq; ++h) lse.ptr<float>()[r.stat(t, h, sh.seq)] = lse_tok[size_t(t * r.Hq + h)];
  return Status::ok();
}

Status ring_backward(const AttentionShape& sh, const AttentionSegments* seg, int ranks, const Tensor& q,
                     const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& dout, const Tensor& lse,
                     const Tensor& dq, const Tensor& dk, const Tensor& dv) {
  NB_TRY(attention_check_args(sh, q, k, v, out, lse, &dout, &dq, &dk, &dv, seg));
  if (q.device != Device::cpu) return errorf("cp::ring_backward is the CPU reference: tensors must be on the cpu");
  AllRanks r;
  NB_TRY(make_ring(sh, seg, ranks, &r));
  const float *Q = q.ptr<float>(), *K = k.ptr<float>(), *V = v.ptr<float>(), *dO = dout.ptr<float>();
  float *dQ = dq.ptr<float>(), *dK = dk.ptr<float>(), *dV = dv.ptr<float>();
  std::fill(dQ, dQ + r.T * r.Hq * r.D, 0.0f);
  std::fill(dK, dK + r.T * r.Hkv * r.D, 0.0f);
  std::fill(dV, dV + r.T * r.Hkv * r.D, 0.0f);
  std::vector<double> q_acc(size_t(r.D));
  for (int rank = 0; rank < ranks; ++rank)
    for (int step = 0; step < ranks; ++step) {
      const auto& keys = r.shards[size_t((rank - step + ranks) % ranks)];
      // This step's partial gradients in FP64 (the kernel), added into the FP32 buffers after the step.
      std::vector<double> dk_step(size_t(r.T * r.Hkv * r.D), 0.0), dv_step(dk_step.size(), 0.0);
      for (int64_t i : r.shards[size_t(rank)])
        for (int64_t h = 0; h < r.Hq; ++h) {
          const double lse_i = lse.ptr<float>()[r.stat(i, h, sh.seq)];
          const double Di = dot(dO + r.q(i, h), out.ptr<float>() + r.q(i, h), r.D);
          std::fill(q_acc.begin(), q_acc.end(), 0.0);
          for (int64_t j : keys) {
            if (!r.visible(i, j)) continue;
            const double p = std::exp(r.scale * dot(Q + r.q(i, h), K + r.kv(j, h), r.D) - lse_i);
            const double ds = p * (dot(dO + r.q(i, h), V + r.kv(j, h), r.D) - Di);
            for (int64_t d = 0; d < r.D; ++d) {
              q_acc[size_t(d)] += ds * double(K[r.kv(j, h) + d]);
              dk_step[size_t(r.kv(j, h) + d)] += r.scale * ds * double(Q[r.q(i, h) + d]);
              dv_step[size_t(r.kv(j, h) + d)] += p * double(dO[r.q(i, h) + d]);
            }
          }
          for (int64_t d = 0; d < r.D; ++d) dQ[r.q(i, h) + d] += float(r.scale * q_acc[size_t(d)]);
        }
      for (size_t x = 0; x < dk_step.size(); ++x) {
        dK[x] += float(dk_step[x]);
        dV[x] += float(dv_step[x]);
      }
    }
  return Status::ok();
}

}  // namespace nb::ops::cp
