// LlamaModel::step_amax_views: the FP8 delayed-scaling step amaxes of every Linear, for data parallelism
// to reduce over ranks before begin_step records them (recipe/amax_gather.h, train/amax_reduce.h).
#include "model/llama_model.h"

namespace nb {

// Layer by layer, Linear by Linear (qkv, o, gate_up, down), roles in order: the same list on every rank.
void LlamaModel::step_amax_views(std::vector<Tensor>* out) const {
  out->clear();
  for (const auto& layer : linears_)
    for (const recipe::Linear& lin : layer) lin.step_amax_views(out);
}

}  // namespace nb
