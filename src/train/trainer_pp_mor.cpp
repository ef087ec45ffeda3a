// Mixture of Representations under pipeline parallelism (trainer.h, trainer_mor.cpp). Each stage holds its own
// Linears' MoR state. Every stage knows the whole model's MoR Linears from the recipe (every Linear outside the BF16
// layers), so values laid out per whole-model Linear are gathered by one sum over the stages: each stage fills its
// own entries and leaves the rest zero, and the sum is exact (each value is a small integer or one of stat_to_sum's
// exact parts, carried in doubles and added to zeros). Every stage then holds the whole model's statistics, decides
// every Linear alike, keeps its own decisions and the whole list (the shares of every step, with no collective); rank 0
// (the first stage) logs the whole model's shares and records, and a checkpoint holds the whole model's decisions and
// statistics, so any P resumes any other.
#include <algorithm>
#include "train/trainer.h"

namespace nb {

namespace {

// The whole model's MoR Linears as layer * 4 + index, ascending (LlamaModel::mor_slots' numbering).
std::vector<int64_t> whole_mor_slots(const recipe::Recipe& r, int64_t layers) {
  std::vector<int64_t> out;
  if (!r.mor.on) return out;
  for (int64_t l = 0; l < layers; ++l)
    if (!r.layer_in_bf16(l, layers))
      for (int64_t i = 0; i < 4; ++i) out.push_back(l * 4 + i);
  return out;
}

// A StatCell as five doubles, each exact: the error's and the count's 32-bit halves, the non-finite count.
constexpr size_t kCellDoubles = 5;
void push_cell(const mor::StatCell& c, std::vector<double>* out) {
  for (uint64_t v : {c.err_fixed, c.nonzero}) {
    out->push_back(double(v >> 32));
    out->push_back(double(v & 0xFFFFFFFFu));
  }
  out->push_back(double(c.nonfinite));
}
nlohmann::json cell_json(const double* d) {
  const auto join = [](double hi, double lo) { return (uint64_t(hi) << 32) | uint64_t(lo); };
  return {join(d[0], d[1]), join(d[2], d[3]), uint32_t(d[4])};
}

}  // namespace

size_t Trainer::whole_mor_linears() const { return whole_mor_slots(model_.recipe(), model_cfg_.layers).size(); }

std::vector<size_t> Trainer::mor_positions() const {
  const std::vector<int64_t> whole = whole_mor_slots(model_.recipe(), model_cfg_.layers);
  std::vector<size_t> out;
  for (int64_t s : model_.mor_slots()) {
    const auto it = std::lower_bound(whole.begin(), whole.end(), s);
    NB_CHECK(it != whole.end() && *it == s, "internal: MoR Linear %lld is not one of the whole model's", (long long)s);
    out.push_back(size_t(it - whole.begin()));
  }
  return out;
}

std::vector<std::string> Trainer::whole_mor_names() const {
  std::vector<std::string> out;
  for (int64_t s : whole_mor_slots(model_.recipe(), model_cfg_.layers))
    out.push_back(LlamaModel::linear_name(s / 4, int(s % 4)));
  return out;
}

Status Trainer::gather_mor_over_stages(std::vector<double>* values, size_t width) {
  if (pp_size() == 1) return Status::ok();
  const std::vector<size_t> pos = mor_positions();
  NB_CHECK(values->size() == pos.size() * width, "internal: %zu MoR values for %zu Linears of %zu", values->size(),
           pos.size(), width);
  std::vector<double> whole(whole_mor_linears() * width, 0.0);
  if (whole.empty()) return Status::ok();  // no MoR on any stage (the recipe says so on every one)
  for (size_t k = 0; k < pos.size(); ++k)
    std::copy_n(values->begin() + int64_t(k * width), width, whole.begin() + int64_t(pos[k] * width));
  NB_TRY(reduce_over_pipeline(whole.data(), int(whole.size())));
  *values = std::move(whole);
  return Status::ok();
}

std::vector<uint8_t> Trainer::whole_mor_choices() {
  if (pp_size() == 1) return model_.mor_choices();
  const size_t n = whole_mor_linears();
  if (n == 0) return {};  // no MoR, or annealed to a recipe without it
  if (mor_in_effect_.size() != 3 * n)
    mor_in_effect_.assign(3 * n, uint8_t(model_.recipe().mor.ladder ? recipe::MorRung::nvfp4 : recipe::MorRung::fp8));
  return mor_in_effect_;
}

Status Trainer::gather_pipeline_mor() {
  pipeline_mor_ = nullptr;
  if (pp_size() == 1 || whole_mor_linears() == 0) return Status::ok();
  const std::vector<uint8_t> choices = whole_mor_choices();
  std::vector<mor::StatCell> cells;
  NB_TRY(model_.mor_board(&cells));
  std::vector<double> v;
  for (const mor::StatCell& c : cells) push_cell(c, &v);
  const auto per = size_t(model_.recipe().mor.cells_per_linear());
  NB_TRY(gather_mor_over_stages(&v, per * kCellDoubles));
  nlohmann::json stats = nlohmann::json::array();
  for (size_t i = 0; i < v.size(); i += kCellDoubles) stats.push_back(cell_json(v.data() + i));
  pipeline_mor_ = {{"choices", choices}, {"stats", stats}};
  return Status::ok();
}

}  // namespace nb
