// Megatron-Core's --pipeline-model-parallel-layout (megatron/core/transformer/pipeline_parallel_layer_layout.py):
// one string naming what every virtual stage holds, so that stages may differ by any number of layers under the
// interleaved schedule too (where --decoder-{first,last}-pipeline-num-layers move layers only in multiples of V).
// Stages are separated by '|' in virtual-stage order (stage s runs on pipeline rank s % P as its chunk s / P);
// 'E' is the embedding, 't' a decoder layer, 'L' the final norm, LM head and loss; "x*n" repeats one letter (or
// '|'), "(...)*n" a group, and commas are cosmetic. Example, 8 decoder layers at P 2 V 2 with the LM head's stage
// one layer lighter: "Ettt|tt|tt|tL". Pure text, no devices.
#pragma once
#include <cstdint>
#include <string>
#include <vector>
#include "core/status.h"

namespace nb::pp {

struct LayoutStage {
  int64_t decoder_layers = 0;
  bool embedding = false;  // 'E' opens this stage
  bool loss = false;       // 'L' closes this stage
};

// The stages of `layout` in virtual-stage order. Refused in one sentence naming the flag and what is wrong: a
// letter nibble has no layer for (Megatron's 'm', a multi-token-prediction layer, or any other), a group that is
// nested, unclosed or without its "*n", a repeat without a count, a count below 1, 'E' anywhere but at the start of
// the first stage or 'L' anywhere but at the end of the last, or either missing or given twice.
Status parse_pipeline_layout(const std::string& layout, std::vector<LayoutStage>* stages);

}  // namespace nb::pp
