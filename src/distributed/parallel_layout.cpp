// The tp-cp-dp-pp rank layout (parallel_layout.h): rank = tp + T * (cp + C * (dp + D * pp)).
#include "distributed/parallel_layout.h"
#include <string>
#include <utility>

namespace nb::dist {

namespace {

int rank_of(const ParallelLayout& l, int tp, int cp, int dp, int pp) {
  const ParallelSizes& s = l.sizes;
  return tp + s.tensor * (cp + s.context * (dp + l.data * pp));
}

}  // namespace

Status make_parallel_layout(int world, int rank, const ParallelSizes& s, ParallelLayout* out) {
  if (s.tensor < 1 || s.context < 1 || s.pipeline < 1)
    return errorf("parallel sizes must be at least 1 (tensor %d, context %d, pipeline %d)", s.tensor, s.context,
                  s.pipeline);
  const int model = s.tensor * s.context * s.pipeline;
  if (world % model != 0) {
    std::string flags;  // the sizes above 1, as the flags that set them
    const std::pair<const char*, int> named[] = {{"--tensor-model-parallel-size", s.tensor},
                                                 {"--context-parallel-size", s.context},
                                                 {"--pipeline-model-parallel-size", s.pipeline}};
    for (const auto& [flag, n] : named)
      if (n > 1) flags += (flags.empty() ? "" : " x ") + strprintf("%s %d", flag, n);
    return errorf(
        "%s does not divide the %d ranks of this job; the world must be a multiple of %d (the rest is data "
        "parallelism)",
        flags.c_str(), world, model);
  }
  if (rank < 0 || rank >= world) return errorf("rank %d is outside a world of %d ranks", rank, world);
  ParallelLayout l;
  l.sizes = s;
  l.world = world;
  l.data = world / model;
  l.rank = rank;
  l.tp = rank % s.tensor;
  l.cp = rank / s.tensor % s.context;
  l.dp = rank / (s.tensor * s.context) % l.data;
  l.pp = rank / (s.tensor * s.context * l.data);
  for (int t = 0; t < s.tensor; ++t) l.tp_group.push_back(rank_of(l, t, l.cp, l.dp, l.pp));
  for (int c = 0; c < s.context; ++c) l.cp_group.push_back(rank_of(l, l.tp, c, l.dp, l.pp));
  for (int d = 0; d < l.data; ++d) l.dp_group.push_back(rank_of(l, l.tp, l.cp, d, l.pp));
  for (int d = 0; d < l.data; ++d)  // ascending global rank: context index fastest
    for (int c = 0; c < s.context; ++c) l.dp_cp_group.push_back(rank_of(l, l.tp, c, d, l.pp));
  for (int p = 0; p < s.pipeline; ++p) l.pp_group.push_back(rank_of(l, l.tp, l.cp, l.dp, p));
  *out = std::move(l);
  return Status::ok();
}

Status check_model_fits_layout(const LlamaConfig& m, int64_t seq, const ParallelSizes& s) {
  const int64_t T = s.tensor;
  const struct {
    const char* what;
    int64_t n;
  } split[] = {{"attention heads", m.heads}, {"KV heads (query groups)", m.kv_heads}, {"FFN size", m.ffn}};
  for (const auto& x : split)
    if (x.n % T != 0)
      return errorf("tensor parallelism %lld splits the %s, but %s has %lld; use a tensor-parallel size dividing %lld",
                    (long long)T, x.what, m.name.c_str(), (long long)x.n, (long long)x.n);
  if (seq % (2 * int64_t(s.context)) != 0)
    return errorf(
        "--seq-length %lld does not split into 2 x --context-parallel-size = %d chunks (each rank holds two, for "
        "the causal load balance): it is not a multiple of %d",
        (long long)seq, 2 * s.context, 2 * s.context);
  return Status::ok();
}

}  // namespace nb::dist
