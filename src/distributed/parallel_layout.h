// How a world of ranks splits into tensor-, context-, data- and pipeline-parallel groups, in Megatron-Core's
// order "tp-cp-dp-pp" (initialize_model_parallel(order="tp-cp-ep-dp-pp") without expert parallelism): the
// tensor-parallel index varies fastest, the pipeline stage slowest. World = T x C x D x P. The gradient
// reductions and the distributed optimizer's shards run over the combined data x context group (context-
// parallel ranks hold the same weights). Pure arithmetic: the communicators are built from these rank
// lists. check_model_fits_layout refuses, in one sentence each, a model or sequence the sizes cannot split.
// Context parallelism uses it (train/trainer_cp.cpp); tensor and pipeline parallelism are still to come.
#pragma once
#include <string>
#include <vector>
#include "core/status.h"
#include "model/llama_config.h"

namespace nb::dist {

struct ParallelSizes {
  int tensor = 1, context = 1, pipeline = 1;
};

// One rank's coordinates and the ranks of each of its groups (global ranks, in group-rank order).
struct ParallelLayout {
  ParallelSizes sizes;
  int world = 1, data = 1;
  int rank = 0, tp = 0, cp = 0, dp = 0, pp = 0;
  std::vector<int> tp_group, cp_group, dp_group, dp_cp_group, pp_group;
};

// The layout of `rank` in a world of `world` ranks; refused when the sizes do not divide the world.
Status make_parallel_layout(int world, int rank, const ParallelSizes& sizes, ParallelLayout* out);

// The model and sequence under the sizes: attention heads, KV heads (query groups) and the FFN divide by T;
// the sequence by 2 x C (the causal load balance's chunks). The vocabulary is padded instead
// (tp::padded_vocab in model/tensor_parallel.h).
Status check_model_fits_layout(const LlamaConfig& model, int64_t seq_length, const ParallelSizes& sizes);

}  // namespace nb::dist
