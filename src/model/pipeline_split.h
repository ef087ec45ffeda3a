// Pipeline parallelism's split of a Llama's decoder layers over P pipeline ranks of V model chunks each, with
// Megatron-Core's semantics (megatron/core/transformer/transformer_block.py get_num_layers_to_build,
// transformer_layer.py get_transformer_layer_offset, the checks of transformer_config.py __post_init__ and
// megatron/training/arguments.py): an even split; or --account-for-{embedding,loss}-in-pipeline-split, where
// the embedding (the loss) counts as one layer of the first (last) virtual stage; or
// --decoder-{first,last}-pipeline-num-layers, the layers of the first (last) pipeline rank, the rest split
// evenly over the middle ranks, and each rank's layers split evenly over its V chunks; or
// --pipeline-model-parallel-layout, every virtual stage's layers spelled out (model/pipeline_layout.h). Megatron's
// refusals are refused here too, in one sentence naming the flags. Pure arithmetic, no devices.
#pragma once
#include <cstdint>
#include <string>
#include <vector>
#include "core/status.h"

namespace nb::pp {

struct SplitOptions {
  int pipeline = 1;        // P: --pipeline-model-parallel-size
  int virtual_stages = 1;  // V: model chunks per pipeline rank (interleaved schedule)
  bool account_for_embedding = false, account_for_loss = false;  // --account-for-{embedding,loss}-in-pipeline-split
  int64_t first_stage_layers = 0, last_stage_layers = 0;  // --decoder-{first,last}-pipeline-num-layers (0 = even)
  std::string layout;  // --pipeline-model-parallel-layout: every virtual stage's layers (model/pipeline_layout.h)
};

struct LayerRange {
  int64_t begin = 0, end = 0;  // decoder layers [begin, end) in model order
  int64_t count() const { return end - begin; }
};

// The decoder layers of every virtual stage s = 0 .. P*V-1, contiguous and in model order; virtual stage s runs on
// pipeline rank s % P as that rank's model chunk s / P (Megatron's placement: P 4, V 2, 16 layers -> rank 0 holds
// layers 0-1 and 8-9). The embedding belongs to virtual stage 0, the final norm, LM head and loss to stage P*V-1.
// Refused in one sentence (naming the flags and numbers, and what would work) when the split is impossible.
// Only the accounted embedding or loss can leave a stage without decoder layers (stage 0 or P*V-1), as in Megatron,
// or a layout that gives a stage none (it passes the residual stream on unchanged).
// V > 1 needs P > 1 (Megatron's interleaved schedule).
Status split_layers(int64_t layers, const SplitOptions& o, std::vector<LayerRange>* stages);

// The index among `chunks` of the one holding decoder layer l; -1 when none does.
int chunk_holding(const std::vector<LayerRange>& chunks, int64_t l);

// The chunks of pipeline rank `rank`: stages rank, rank + P, rank + 2P, ...
std::vector<LayerRange> rank_chunks(const std::vector<LayerRange>& stages, int rank, int pipeline);

// V from Megatron's two flags (0 = not given): --num-layers-per-virtual-pipeline-stage N (V = layers / (P * N)) or
// --num-virtual-stages-per-pipeline-rank V; giving both, or values that do not divide, is refused; neither: V = 1.
// `layers` is what the split counts: the decoder layers plus one for each of the embedding and loss that
// --account-for-...-in-pipeline-split counts in (Megatron adds them before dividing). Megatron also refuses
// --num-layers-per-virtual-pipeline-stage with --decoder-{first,last}-pipeline-num-layers; the caller checks that.
Status resolve_virtual_stages(int64_t layers, int pipeline, int64_t layers_per_virtual_stage,
                              int64_t virtual_stages_per_rank, int* virtual_stages);

// V from --pipeline-model-parallel-layout: its stages over P pipeline ranks; refused when P does not divide them
// or when a layout of several stages comes without --pipeline-model-parallel-size > 1.
Status layout_virtual_stages(const std::string& layout, int pipeline, int* virtual_stages);

// The pipeline bubble's share of the step by formula: (P - 1) / (V x M) for M micro-batches per rank.
double bubble_fraction(int pipeline, int virtual_stages, int64_t micro_batches);

}  // namespace nb::pp
