// Greedy and seeded top-k / top-p sampling on the host (see sampler.h). The nucleus is found without
// sorting the whole vocabulary: the k most likely tokens are selected for growing k (64, 512, ...) until
// their mass reaches top_p, which is exact because the selection is by the same total order.
#include "infer/sampler.h"
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>
#include "core/philox.h"

namespace nb::infer {

Status validate(const SamplingParams& p) {
  if (!(p.temperature >= 0.f) || !std::isfinite(p.temperature))
    return errorf("--temperature %g must be a finite number >= 0 (0 = greedy)", double(p.temperature));
  if (p.top_k < 0) return errorf("--top-k %lld must be >= 0 (0 = off)", (long long)p.top_k);
  if (!(p.top_p > 0.f && p.top_p <= 1.f)) return errorf("--top-p %g must be in (0, 1] (1 = off)", double(p.top_p));
  return Status::ok();
}

namespace {

int32_t argmax(const float* x, int64_t V) {
  int64_t best = 0;
  for (int64_t i = 1; i < V; ++i)
    if (x[i] > x[best]) best = i;
  return int32_t(best);
}

// A uniform number in [0, 1) from 24 random bits of the (seed, step, row) Philox block.
double uniform(uint64_t seed, uint32_t step, uint32_t row) {
  const Philox4x32 r = philox_block(RngKey{seed, step, row}, 0);
  return double(r.v[0] >> 8) * (1.0 / 16777216.0);
}

}  // namespace

int32_t sample_token(const float* logits, int64_t V, const SamplingParams& p, uint32_t step, uint32_t row) {
  if (p.greedy() || p.top_k == 1) return argmax(logits, V);
  const double inv_t = 1.0 / double(p.temperature);
  const double mx = double(logits[argmax(logits, V)]) * inv_t;
  std::vector<double> w(static_cast<size_t>(V));  // unnormalized probabilities exp(l / T - max / T)
  for (int64_t i = 0; i < V; ++i) w[size_t(i)] = std::isnan(logits[i]) ? 0.0 : std::exp(double(logits[i]) * inv_t - mx);
  auto before = [&](int32_t a, int32_t b) {
    return w[size_t(a)] > w[size_t(b)] || (w[size_t(a)] == w[size_t(b)] && a < b);
  };
  std::vector<int32_t> ids(static_cast<size_t>(V));
  std::iota(ids.begin(), ids.end(), 0);
  if (p.top_k > 0 && p.top_k < V) {  // the k best, in no particular order yet
    std::nth_element(ids.begin(), ids.begin() + p.top_k, ids.end(), before);
    ids.resize(size_t(p.top_k));
  }
  double mass = 0;
  for (int32_t i : ids) mass += w[size_t(i)];
  const int64_t n = int64_t(ids.size());
  int64_t keep = n;  // the nucleus: the first `keep` of ids once sorted (all of them without top-p)
  if (p.top_p < 1.f) {
    const double target = double(p.top_p) * mass;
    for (int64_t k = std::min<int64_t>(64, n);; k = std::min(k * 8, n)) {
      std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), before);
      double prefix = 0;
      int64_t j = 0;
      while (j < k && prefix < target) prefix += w[size_t(ids[size_t(j++)])];
      if (prefix >= target || k == n) {
        keep = std::max<int64_t>(j, 1);
        break;
      }
    }
    mass = 0;
    for (int64_t j = 0; j < keep; ++j) mass += w[size_t(ids[size_t(j)])];
  }
  const double target = uniform(p.seed, step, row) * mass;
  double cum = 0;
  for (int64_t j = 0; j < keep; ++j) {
    cum += w[size_t(ids[size_t(j)])];
    if (cum > target) return ids[size_t(j)];
  }
  return ids[size_t(keep - 1)];
}

}  // namespace nb::infer
