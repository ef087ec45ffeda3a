// FP8 delayed scaling under pipeline parallelism: each stage keeps its own Linears' amax histories (the step amaxes
// are reduced over the stage's data x context ranks, and over its tensor-parallel ranks, as without stages), but a
// checkpoint holds every Linear's. Before rank 0 writes trainer_state.json the stages' states are summed into one
// array laid out by the whole model's (layer, Linear, role): each stage fills its own records and leaves the others
// zero, so the sum is every stage's record exactly (one all-reduce of doubles; FP32 values are exact in them).
#include <algorithm>
#include "train/trainer.h"

namespace nb {

namespace {

// One role's record: present, has_history, used_in_step, scale, step_amax, then the history.
constexpr int64_t kRecordHead = 5;

int64_t record_index(int64_t layer, int linear, int role) { return (layer * 4 + linear) * 3 + role; }

}  // namespace

Status Trainer::gather_pipeline_scaling() {
  pipeline_scaling_.clear();
  if (pp_size() == 1 || recipe_.fp8_scaling != recipe::Fp8Scaling::delayed) return Status::ok();
  const int64_t H = recipe_.amax_history_len, width = kRecordHead + H, layers = model_cfg_.layers;
  std::vector<LlamaModel::LinearScaling> mine;
  NB_TRY(model_.scaling_states(&mine));
  std::vector<double> records(size_t(layers * 4 * 3 * width), 0.0);
  for (const LlamaModel::LinearScaling& ls : mine) {
    const int64_t l = ls.layer;
    const int i = ls.index;
    NB_CHECK(l >= 0 && l < layers && i >= 0 && i < 4, "internal: a delayed-scaling state of '%s'", ls.linear.c_str());
    for (const recipe::ScalingState& r : ls.roles) {
      NB_CHECK(int64_t(r.history.size()) == H, "internal: '%s' keeps %zu amaxes, not %lld", ls.linear.c_str(),
               r.history.size(), (long long)H);
      double* rec = records.data() + record_index(l, i, r.role) * width;
      rec[0] = 1, rec[1] = r.has_history, rec[2] = r.used_in_step, rec[3] = r.scale, rec[4] = r.step_amax;
      std::copy(r.history.begin(), r.history.end(), rec + kRecordHead);
    }
  }
  NB_TRY(reduce_over_pipeline(records.data(), int(records.size())));
  for (int64_t l = 0; l < layers; ++l)
    for (int i = 0; i < 4; ++i) {
      LlamaModel::LinearScaling ls{LlamaModel::linear_name(l, i), {}, l, i};
      for (int role = 0; role < 3; ++role) {
        const double* rec = records.data() + record_index(l, i, role) * width;
        if (rec[0] == 0) continue;
        recipe::ScalingState r{role, rec[1] != 0, rec[2] != 0, float(rec[3]), float(rec[4]), {}};
        r.history.assign(rec + kRecordHead, rec + width);
        ls.roles.push_back(std::move(r));
      }
      if (!ls.roles.empty()) pipeline_scaling_.push_back(std::move(ls));
    }
  return Status::ok();
}

}  // namespace nb
