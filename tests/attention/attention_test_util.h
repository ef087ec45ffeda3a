// Host tensors of one attention problem, shared by the CPU attention tests (whole rows and packed segments).
#pragma once
#include <cmath>
#include <initializer_list>
#include <random>
#include <vector>
#include "ops/attention.h"

namespace nb::ops {

struct Host {
  std::vector<float> data;
  Tensor t;
  explicit Host(std::initializer_list<int64_t> dims) {
    int64_t n = 1;
    for (int64_t d : dims) n *= d;
    data.assign(size_t(n), 0.0f);
    t = Tensor::make(data.data(), DType::f32, Device::cpu, dims);
  }
  void randomize(std::mt19937& rng, float lo = -1.0f, float hi = 1.0f) {
    std::uniform_real_distribution<float> u(lo, hi);
    for (float& x : data) x = u(rng);
  }
};

inline AttentionShape make_shape(int64_t B, int64_t S, int64_t Hq, int64_t Hkv, int64_t D) {
  return {B, S, Hq, Hkv, D, float(1.0 / std::sqrt(double(D)))};
}

// q/k/v, out, lse ([B, Hq, S]; its floats are [T, Hq] in segmented calls), the upstream gradient w, and
// dq/dk/dv of one forward + backward.
struct AttentionTensors {
  AttentionShape sh;
  Host q, k, v, out, lse, w, dq, dk, dv;
  explicit AttentionTensors(AttentionShape s)
      : sh(s),
        q({s.batch, s.seq, s.heads, s.head_dim}),
        k({s.batch, s.seq, s.kv_heads, s.head_dim}),
        v({s.batch, s.seq, s.kv_heads, s.head_dim}),
        out({s.batch, s.seq, s.heads, s.head_dim}),
        lse({s.batch, s.heads, s.seq}),
        w({s.batch, s.seq, s.heads, s.head_dim}),
        dq({s.batch, s.seq, s.heads, s.head_dim}),
        dk({s.batch, s.seq, s.kv_heads, s.head_dim}),
        dv({s.batch, s.seq, s.kv_heads, s.head_dim}) {}
  // Scores up to ~|2| so the softmax is far from uniform and far from one-hot.
  void randomize(uint32_t seed) {
    std::mt19937 rng(seed);
    q.randomize(rng, -1.5f, 1.5f);
    k.randomize(rng, -1.5f, 1.5f);
    v.randomize(rng);
    w.randomize(rng);
  }
};

}  // namespace nb::ops
