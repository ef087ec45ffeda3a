// Precision annealing in the model (docs/RECIPES.md, "Precision annealing"): the Linears switch to another
// recipe at a step boundary. What the switch needs is fixed at init (LlamaModel::planned_switch): the
// activation arena is planned for both recipes, and every weight keeps its compute copy, because the
// BF16 GEMMs after the switch read the weight itself (a master-only weight has only its FP32 master).
#include <algorithm>
#include "model/llama_model.h"

namespace nb {

namespace {
// Linear weights of layer `layer` are quantized (and their inputs kept as quantized copies) under `r`.
bool quantized_under(const recipe::Recipe& r, int64_t layer, int64_t layers) {
  return r.quantized() && !r.layer_in_bf16(layer, layers);
}
}  // namespace

recipe::Recipe LlamaModel::activation_plan_recipe(const recipe::Recipe& now, const RecipeSwitch& next) {
  if (next.fprop_only) return now;  // the Linears and their kept copies stay; only Fprop's GEMM changes
  if (!now.quantized() || !next.next.quantized()) return recipe::Recipe{};  // every layer keeps BF16 inputs
  // Quantized layers are one block [start, layers - end): the overlap of two blocks is one block too.
  recipe::Recipe plan = now;
  plan.bf16_layers_at_start = std::max(now.bf16_layers_at_start, next.next.bf16_layers_at_start);
  plan.bf16_layers_at_end = std::max(now.bf16_layers_at_end, next.next.bf16_layers_at_end);
  return plan;
}

Status LlamaModel::check_switch_covered(const recipe::Recipe& r, bool fprop_only) const {
  for (int64_t l = 0; l < cfg_.layers; ++l) {
    if (!holds_layer(l)) continue;  // another pipeline stage's
    const bool quantized_now = quantized_under(recipe_, l, cfg_.layers);
    const bool quantized_after = fprop_only ? quantized_now : quantized_under(r, l, cfg_.layers);
    // The plan shares the BF16 inputs of layers it expects to keep quantized copies: after the switch
    // their backward must still read those copies, not the (overwritten) BF16 input.
    if (quantized_under(plan_recipe_, l, cfg_.layers) && !quantized_after)
      return errorf(
          "layer %lld runs BF16 under recipe '%s' but the activations were planned for it to keep quantized "
          "inputs; set LlamaModel::planned_switch to this recipe before init",
          (long long)l, r.name.c_str());
    const bool reads_weight = fprop_only ? quantized_now : !quantized_after;  // a BF16 GEMM on the weight
    if (reads_weight && !params_.has_compute("model.layers." + std::to_string(l) + ".self_attn.q_proj.weight"))
      return errorf(
          "layer %lld would run BF16 GEMMs under recipe '%s' but its weights have no compute copy (the "
          "master-only range); set LlamaModel::planned_switch before init",
          (long long)l, r.name.c_str());
  }
  return Status::ok();
}

Status LlamaModel::set_recipe(const recipe::Recipe& r, bool fprop_only) {
  if (linears_.empty()) return errorf("LlamaModel::set_recipe before a successful init");
  if (lora_enabled_)
    return errorf("a LoRA base is frozen in its recipe's formats (quantized once at init): its recipe cannot switch");
  if (fprop_only && r.quantized())
    return errorf(
        "an Fprop-only switch runs Fprop in BF16; recipe '%s' would need a second set of quantized copies beside "
        "the ones the backward reads",
        r.name.c_str());
  NB_TRY(check_switch_covered(r, fprop_only));
  if (fprop_only) {
    for (auto& layer : linears_)
      for (auto& lin : layer) NB_TRY(lin.set_fprop_bf16(true));
    fprop_bf16_ = true;
    return Status::ok();
  }
  // Kernels queued earlier may still read the old copies; then they go, before the new ones allocate.
  if (dev_ == Device::cuda) device_synchronize();
  linears_.clear();
  linear_workspace_.reset();
  recipe_ = r;
  fprop_bf16_ = false;
  return build_linears();
}

}  // namespace nb
