// The memory estimate's view of what LlamaModel::init allocates besides parameters and activations: the
// Linears' quantized copies and their shared workspace (sized by recipe::Linear's own placement code, run
// dry over the same LinearSpec list build_linears uses), the weight stage, and the emulated GEMMs' scratch
// (gemm::detail::plan_emulation, the function that sizes it at run time).
#include <algorithm>
#include "gemm/gemm_quantized.h"
#include "model/llama_model.h"

namespace nb {

namespace {

// The emulated MXFP8/NVFP4 GEMMs of one Linear (Fprop [T, out, in], Dgrad [T, in, out], Wgrad [out, in, T]):
// the largest scratch any of them asks for. keep: the weight is given dequantized (Recipe::keep_dequantized_
// weights), so Fprop and Dgrad dequantize only the other operand; frozen: no Wgrad.
size_t emulated_need(int64_t tokens, int64_t in, int64_t out, bool keep, bool frozen) {
  using gemm::detail::plan_emulation;
  size_t need = std::max(plan_emulation(tokens, out, in, false, keep).scratch_bytes,
                         plan_emulation(tokens, in, out, false, keep).scratch_bytes);
  if (!frozen) need = std::max(need, plan_emulation(out, in, tokens).scratch_bytes);
  return need;
}

}  // namespace

Status LlamaModel::plan_linear_memory(const LlamaConfig& cfg, Device dev, MicroBatchShape shape, Recompute rc,
                                      const recipe::Recipe& recipe, bool frozen, bool master_only, bool sharded_weights,
                                      LinearMemory* out, int sp_ranks, const std::vector<pp::LayerRange>* stage_chunks,
                                      const std::vector<int64_t>& chunk_input_slots) {
  *out = LinearMemory{};
  if (!recipe.quantized()) return Status::ok();
  recipe::LinearWorkspace ws(dev);  // registers the needs only; never allocated here
  // On cuda (Hopper) the emulated GEMMs' scratch (the CPU backend computes its GEMMs from the dequantized values);
  // MoR's GEMMs with a BF16 operand decode the FP8 one there too.
  const bool emulated = dev == Device::cuda && (recipe.weight.fmt == recipe::Fmt::mxfp8 ||
                                                recipe.weight.fmt == recipe::Fmt::nvfp4 || recipe.mor.on);
  int64_t mor_linears = 0;
  size_t scratch = 0;
  bool any_quantized = false;
  for (const LinearSpec& sp : linear_specs(cfg, recipe, rc)) {
    // The chunk of the stage holding the layer (-1: another stage's; 0: every layer without a stage).
    const int chunk = stage_chunks ? pp::chunk_holding(*stage_chunks, sp.layer) : 0;
    if (chunk < 0) continue;  // another pipeline stage's (as build_linears)
    const int64_t input_slots = size_t(chunk) < chunk_input_slots.size() ? chunk_input_slots[size_t(chunk)] : 1;
    size_t owned = 0, weight = 0;
    NB_TRY(recipe::Linear::plan_bytes(recipe, sp.bf16_layer, shape.tokens(), sp.in, sp.out, dev, &ws, frozen,
                                      sp.input_col_slot, &owned, &weight, int(input_slots)));
    // A sharded weight's copies live in Megatron-FSDP's windows (counted with them), not in the Linear.
    out->owned += int64_t(owned - (sharded_weights ? weight : 0));
    if (sp_ranks > 1 && !frozen)  // as build_linears' set_input_gather and set_grad_gather (a frozen Linear: none)
      ws.reserve(recipe::LinearWorkspace::Slot::gather,
                 sp.index == 0 || sp.index == 2
                     ? recipe::Linear::input_gather_bytes(recipe, sp.bf16_layer, shape.tokens(), sp.in, sp_ranks)
                     : recipe::Linear::grad_gather_bytes(recipe, sp.bf16_layer, shape.tokens(), sp.out, sp_ranks));
    if (sp.bf16_layer) continue;
    any_quantized = true;
    mor_linears += recipe.mor.on ? 1 : 0;
    if (emulated)
      scratch =
          std::max(scratch, emulated_need(shape.tokens(), sp.in, sp.out, recipe.keep_dequantized_weights, frozen));
  }
  // The MoR board: three 24-byte statistic cells per MoR Linear (six on the NVFP4 ladder) in one buffer
  // (llama_mor.cpp).
  if (mor_linears > 0)  // as the allocator holds it
    out->owned += (mor_board_bytes(mor_linears, recipe.mor.cells_per_linear()) + 255) / 256 * 256;
  out->workspace = int64_t(ws.planned_bytes());
  // gemm_emulated.cu grows its scratch to the need plus an eighth (headroom for the next shape).
  if (scratch > 0) out->emulated_scratch = int64_t((scratch + scratch / 8 + 255) / 256 * 256);
  if (any_quantized && (master_only || frozen))
    out->weight_stage = (largest_linear_weight(cfg) * (dev == Device::cuda ? 2 : 4) + 255) / 256 * 256;
  return Status::ok();
}

int64_t LlamaModel::pipeline_input_slots(const recipe::Recipe& recipe, Recompute rc, bool frozen, int64_t slots) {
  return recipe.quantized() && rc != Recompute::full && !frozen ? std::max<int64_t>(slots, 1) : 1;
}

}  // namespace nb
