// Pipeline parallelism's passes over this rank's chunks (LlamaModel::pipeline): a forward and a backward per
// (micro-batch, chunk), apart in time, so each in-flight pair keeps its activations in a slot of its own (an
// arena sized for the largest chunk) from its forward to its backward. The schedule that orders the passes and
// moves the residual stream between stages is the trainer's (train/pipeline_schedule.h).
#include <algorithm>
#include "core/memory_ledger.h"
#include "model/llama_internal.h"
#include "model/llama_pass.h"

namespace nb {

bool LlamaModel::stage_holds_layer(const PipelineStage& s, int64_t l) { return pp::chunk_holding(s.chunks, l) >= 0; }

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
    out.chunk_kept.push_back(kept.bytes);
    out.scratch = std::max(out.scratch, scratch.bytes);
  }
  return out;
}

LlamaModel::StageActivations LlamaModel::stage_activations() const {
  const LoraSpec* lora = lora_enabled_ ? &lora_spec_ : nullptr;
  return plan_stage_activations(cfg_, dev_, shape_, recompute_, llama::scratch_input_layers(cfg_, plan_recipe_, lora),
                                lora, sp_size(), pipeline->chunks, pipeline->last);
}

namespace {

// take_slot's rule over n slots: the free one of the fewest bytes that holds `need` (the lowest index among equals);
// -1: none. bytes(s) and busy(s) read slot s, so the planner's vectors and the model's slots share it.
template <class Bytes, class Busy>
int64_t smallest_fitting(size_t n, const Bytes& bytes, const Busy& busy, int64_t need) {
  int64_t best = -1;
  for (size_t s = 0; s < n; ++s)
    if (!busy(s) && bytes(s) >= need && (best < 0 || bytes(s) < bytes(size_t(best)))) best = int64_t(s);
  return best;
}

int64_t most_in_flight(const std::vector<LlamaModel::PipelinePass>& order) {
  int64_t now = 0, most = 0;
  for (const LlamaModel::PipelinePass& p : order) most = std::max(most, now += p.forward ? 1 : -1);
  return most;
}

}  // namespace

std::vector<int64_t> LlamaModel::plan_slot_bytes(const std::vector<int64_t>& chunk_kept,
                                                 const std::vector<PipelinePass>& order) {
  std::vector<int64_t> bytes;
  std::vector<bool> busy;
  std::vector<std::pair<int64_t, int>> holder;  // each slot's pass in flight: (micro, chunk)
  for (const PipelinePass& p : order) {
    if (!p.forward) {  // its forward's slot comes free
      for (size_t s = 0; s < holder.size(); ++s)
        if (busy[s] && holder[s] == std::pair{p.micro, p.chunk}) busy[s] = false;
      continue;
    }
    const int64_t need = chunk_kept[size_t(p.chunk)];
    int64_t s = smallest_fitting(
        bytes.size(), [&](size_t i) { return bytes[i]; }, [&](size_t i) { return bool(busy[i]); }, need);
    if (s < 0) {
      bytes.push_back(need);
      busy.push_back(false);
      holder.emplace_back();
      s = int64_t(bytes.size()) - 1;
    }
    busy[size_t(s)] = true;
    holder[size_t(s)] = {p.micro, p.chunk};
  }
  // The rule can leave small slots idle while it makes a large one; where that holds more than the most passes in
  // flight each in a slot of the largest chunk's size, those uniform slots are the plan (the same rule picks among
  // equal slots by index, so it replays them too).
  const int64_t largest = *std::max_element(chunk_kept.begin(), chunk_kept.end());
  const int64_t in_flight = most_in_flight(order);
  int64_t planned = 0;
  for (const int64_t b : bytes) planned += b;
  if (planned > largest * in_flight) bytes.assign(size_t(in_flight), largest);
  return bytes;
}

std::vector<int64_t> LlamaModel::chunk_in_flight(int chunks, const std::vector<PipelinePass>& order) {
  std::vector<int64_t> now(size_t(chunks), 0), most(size_t(chunks), 0);
  for (const PipelinePass& p : order) {
    int64_t& n = now[size_t(p.chunk)];
    n += p.forward ? 1 : -1;
    most[size_t(p.chunk)] = std::max(most[size_t(p.chunk)], n);
  }
  return most;
}

int64_t LlamaModel::StageActivations::bytes(const std::vector<int64_t>& slot_bytes) const {
  int64_t n = scratch;
  for (const int64_t b : slot_bytes) n += b;
  return n;
}

int64_t LlamaModel::stage_slots_for_layer(int64_t l) const {
  const int c = pp::chunk_holding(pipeline->chunks, l);
  return c >= 0 ? chunk_in_flight_[size_t(c)] : 1;
}

Status LlamaModel::init_pipeline() {
  NB_CHECK(!pipeline->order.empty() && !pipeline->chunks.empty(),
           "internal: a pipeline stage without chunks or passes");
  const StageActivations& acts = stage_acts_;
  const std::vector<int64_t> slot_bytes = plan_slot_bytes(acts.chunk_kept, pipeline->order);
  activation_bytes_ = acts.bytes(slot_bytes);
  NB_TRY(pipeline_scratch_.reserve(dev_, size_t(std::max<int64_t>(acts.scratch, 256))));
  slots_.clear();
  for (const int64_t bytes : slot_bytes) {
    PipelineSlot slot;
    slot.arena = std::make_unique<Arena>();
    NB_TRY(slot.arena->reserve(dev_, size_t(std::max<int64_t>(bytes, 256))));
    slot.acts = std::make_shared<Acts>();
    slot.bytes = bytes;
    slots_.push_back(std::move(slot));
  }
  chunk_inputs_.clear();
  for (const int64_t n : chunk_in_flight_) chunk_inputs_.emplace_back(size_t(n), false);
  return Status::ok();
}

// A free slot for chunk c by plan_slot_bytes' rule, its arena and the shared scratch emptied for the next forward.
Status LlamaModel::take_slot(int chunk, PipelineSlot** out) {
  const int64_t s = smallest_fitting(
      slots_.size(), [&](size_t i) { return slots_[i].bytes; }, [&](size_t i) { return slots_[i].micro >= 0; },
      stage_acts_.chunk_kept[size_t(chunk)]);
  if (s < 0)
    return errorf("internal: the pipeline schedule keeps more passes of chunk %d in flight than its slots planned",
                  chunk);
  const auto it = slots_.begin() + s;
  it->arena->release(0);
  pipeline_scratch_.release(0);
  *out = &*it;
  return Status::ok();
}

Status LlamaModel::use_input_slot(const PassRange& r, int64_t slot) {
  if (r.end == r.begin || pipeline_input_slots(recipe_, recompute_, lora_enabled_, stage_slots_for_layer(r.begin)) <= 1)
    return Status::ok();
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
  NB_TRY(take_slot(c, &free_slot));
  micro_ = micro_first_ + uint32_t(i) * micro_stride_;  // the micro-batch's keys, whatever order the passes run in
  const PassRange r = chunk_range(c);
  std::vector<bool>& inputs = chunk_inputs_[size_t(c)];  // the chunk's Linears' first free input slot
  const auto free_input = std::find(inputs.begin(), inputs.end(), false);
  if (free_input == inputs.end())
    return errorf("internal: chunk %d has more passes in flight than its %zu input slots", c, inputs.size());
  *free_input = true;
  free_slot->input_slot = free_input - inputs.begin();
  NB_TRY(use_input_slot(r, free_slot->input_slot));
  NB_TRY(MicroBatchPass(*this, i, true, r, free_slot->acts.get(), free_slot->arena.get(), &pipeline_scratch_)
             .run_forward(grad_scale, input, true));
  free_slot->micro = i;
  free_slot->chunk = c;
  if (!r.head) *output = free_slot->acts->resid.back();
  return Status::ok();
}

Status LlamaModel::forward_chunk_only(int64_t i, int c, const Tensor& input, Tensor* output) {
  PipelineSlot* free_slot = nullptr;
  NB_TRY(take_slot(c, &free_slot));
  const PassRange r = chunk_range(c);
  NB_TRY(use_input_slot(r, 0));  // nothing is in flight while forward passes evaluate
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
  NB_TRY(use_input_slot(chunk_range(c), slot->input_slot));
  const Status st = MicroBatchPass(*this, i, true, chunk_range(c), slot->acts.get(), slot->arena.get())
                        .run_backward(output_grad, input_grad);
  slot->micro = -1;  // its memory stays readable until the next forward_chunk takes it
  slot->chunk = -1;
  chunk_inputs_[size_t(c)][size_t(slot->input_slot)] = false;
  return st;
}

}  // namespace nb
