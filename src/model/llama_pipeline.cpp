// Pipeline parallelism's passes over this rank's chunks (LlamaModel::pipeline): a forward and a backward per
// (micro-batch, chunk), apart in time, so each in-flight pair keeps its activations in a slot of its own (an
// arena sized for the largest chunk) from its forward to its backward. The schedule that orders the passes and
// moves the residual stream between stages is the trainer's (train/pipeline_schedule.h).
#include <algorithm>
#include "core/memory_ledger.h"
#include "model/llama_internal.h"
#include "model/llama_pass.h"

namespace nb {

bool LlamaModel::stage_holds_layer(const PipelineStage& s, int64_t l) {
  return std::any_of(s.chunks.begin(), s.chunks.end(),
                     [l](const pp::LayerRange& r) { return l >= r.begin && l < r.end; });
}

bool LlamaModel::stage_holds(const PipelineStage& s, const std::string& name) {
  static const std::string kLayer = "model.layers.";
  if (name.rfind(kLayer, 0) == 0) return stage_holds_layer(s, std::stoll(name.substr(kLayer.size())));
  return name == "model.embed_tokens.weight" ? s.first : s.last;  // else the final norm or the LM head
}

bool LlamaModel::holds_layer(int64_t l) const { return !pipeline || stage_holds_layer(*pipeline, l); }
bool LlamaModel::holds_param(const std::string& name) const { return !pipeline || stage_holds(*pipeline, name); }

PassRange LlamaModel::chunk_range(int c) const {
  const pp::LayerRange& r = pipeline->chunks[size_t(c)];
  const int n = int(pipeline->chunks.size());
  return {r.begin, r.end, pipeline->first && c == 0, pipeline->last && c == n - 1};
}

Status LlamaModel::plan_pass_acts(Acts* a, const PassRange& r, Arena* arena, Arena* scratch) const {
  llama::Planner P, S;
  P.arena = arena;
  P.dev = S.dev = dev_;
  S.arena = scratch;
  const LoraSpec* lora = lora_enabled_ ? &lora_spec_ : nullptr;
  LlamaConfig c = cfg_;
  c.layers = r.end - r.begin;
  // Which layers keep quantized inputs is the whole model's rule (BF16 layers are counted from its ends).
  const std::vector<bool> all = llama::scratch_input_layers(cfg_, plan_recipe_, lora);
  const std::vector<bool> mine(all.begin() + r.begin, all.begin() + r.end);
  llama::plan_acts(a, P, c, shape_, recompute_, params_.compute_dtype(), lm_chunk_tokens_, mine, lora, sp_size(),
                   r.head, scratch ? &S : nullptr);
  NB_TRY(P.st);
  return S.st;
}

LlamaModel::StageActivations LlamaModel::plan_stage_activations(
    const LlamaConfig& cfg, Device dev, MicroBatchShape shape, Recompute rc, const std::vector<bool>& quantized,
    const LoraSpec* lora, int sp, const std::vector<pp::LayerRange>& chunks, bool last_stage) {
  StageActivations out;
  for (size_t c = 0; c < chunks.size(); ++c) {
    llama::Planner kept, scratch;
    kept.dev = scratch.dev = dev;
    LlamaConfig chunk = cfg;
    chunk.layers = chunks[c].end - chunks[c].begin;
    const std::vector<bool> mine(quantized.begin() + chunks[c].begin, quantized.begin() + chunks[c].end);
    Acts probe;
    llama::plan_acts(&probe, kept, chunk, shape, rc, dev == Device::cuda ? DType::bf16 : DType::f32,
                     llama::lm_chunk_tokens(cfg, shape), mine, lora, sp, last_stage && c + 1 == chunks.size(),
                     &scratch);
    out.kept = std::max(out.kept, kept.bytes);
    out.scratch = std::max(out.scratch, scratch.bytes);
  }
  return out;
}

Status LlamaModel::init_pipeline() {
  NB_CHECK(pipeline->slots >= 1 && !pipeline->chunks.empty(), "internal: a pipeline stage without chunks or slots");
  const LoraSpec* lora = lora_enabled_ ? &lora_spec_ : nullptr;
  const StageActivations acts =
      plan_stage_activations(cfg_, dev_, shape_, recompute_, llama::scratch_input_layers(cfg_, plan_recipe_, lora),
                             lora, sp_size(), pipeline->chunks, pipeline->last);
  activation_bytes_ = acts.bytes(pipeline->slots);
  NB_TRY(pipeline_scratch_.reserve(dev_, size_t(std::max<int64_t>(acts.scratch, 256))));
  slots_.clear();
  for (int64_t s = 0; s < pipeline->slots; ++s) {
    PipelineSlot slot;
    slot.arena = std::make_unique<Arena>();
    NB_TRY(slot.arena->reserve(dev_, size_t(acts.kept)));
    slot.acts = std::make_shared<Acts>();
    slots_.push_back(std::move(slot));
  }
  return Status::ok();
}

// A free slot, its arena and the shared scratch emptied for the next forward.
Status LlamaModel::take_slot(PipelineSlot** out) {
  auto it = std::find_if(slots_.begin(), slots_.end(), [](const PipelineSlot& s) { return s.micro < 0; });
  if (it == slots_.end())
    return errorf("internal: the pipeline schedule keeps more than %lld passes in flight", (long long)slots_.size());
  it->arena->release(0);
  pipeline_scratch_.release(0);
  *out = &*it;
  return Status::ok();
}

Status LlamaModel::use_input_slot(const PassRange& r, int64_t slot) {
  if (pipeline_input_slots(recipe_, recompute_, lora_enabled_, pipeline->slots) <= 1) return Status::ok();
  for (int64_t l = r.begin; l < r.end; ++l)
    for (recipe::Linear& lin : linears_[size_t(l)]) NB_TRY(lin.use_input_slot(int(slot)));
  return Status::ok();
}

Status LlamaModel::make_boundary(Buffer* out) const {
  return Buffer::allocate(out, params_.compute_dtype(), dev_, {shape_.tokens() / sp_size(), cfg_.hidden});
}

Status LlamaModel::forward_chunk(int64_t i, int c, const Tensor& input, float grad_scale, Tensor* output) {
  NB_CHECK(pipeline && c >= 0 && c < int(pipeline->chunks.size()), "internal: chunk %d of this stage", c);
  PipelineSlot* free_slot = nullptr;
  NB_TRY(take_slot(&free_slot));
  micro_ = micro_first_ + uint32_t(i) * micro_stride_;  // the micro-batch's keys, whatever order the passes run in
  const PassRange r = chunk_range(c);
  NB_TRY(use_input_slot(r, free_slot - slots_.data()));
  NB_TRY(MicroBatchPass(*this, i, true, r, free_slot->acts.get(), free_slot->arena.get(), &pipeline_scratch_)
             .run_forward(grad_scale, input, true));
  free_slot->micro = i;
  free_slot->chunk = c;
  if (!r.head) *output = free_slot->acts->resid.back();
  return Status::ok();
}

Status LlamaModel::forward_chunk_only(int64_t i, int c, const Tensor& input, Tensor* output) {
  PipelineSlot* free_slot = nullptr;
  NB_TRY(take_slot(&free_slot));
  const PassRange r = chunk_range(c);
  NB_TRY(use_input_slot(r, free_slot - slots_.data()));
  NB_TRY(MicroBatchPass(*this, i, false, r, free_slot->acts.get(), free_slot->arena.get(), &pipeline_scratch_)
             .run_forward(0.f, input, true));
  if (!r.head) *output = free_slot->acts->resid.back();
  return Status::ok();
}

Status LlamaModel::backward_chunk(int64_t i, int c, const Tensor& output_grad, Tensor* input_grad) {
  auto slot =
      std::find_if(slots_.begin(), slots_.end(), [&](const PipelineSlot& s) { return s.micro == i && s.chunk == c; });
  if (slot == slots_.end())
    return errorf("internal: the backward of micro-batch %lld, chunk %d, before its forward", (long long)i, c);
  micro_ = micro_first_ + uint32_t(i) * micro_stride_;
  NB_TRY(use_input_slot(chunk_range(c), slot - slots_.begin()));
  const Status st = MicroBatchPass(*this, i, true, chunk_range(c), slot->acts.get(), slot->arena.get())
                        .run_backward(output_grad, input_grad);
  slot->micro = -1;  // its memory stays readable until the next forward_chunk takes it
  slot->chunk = -1;
  return st;
}

}  // namespace nb
