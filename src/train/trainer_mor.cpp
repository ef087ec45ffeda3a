// Mixture of Representations in the training loop (recipe.h MorSpec, docs/MOR.md). After each step: the shares of
// the decisions that step ran with; after the first step of each decision interval (steps 1, N + 1, 2N + 1, ...: the
// first step decides, so a run never trains N steps on choices no data made), the MoR board's statistics (every Linear
// role's E4M3 error over that step's quantizations, the only step of the interval measured: run_micro_batches)
// summed over the data-parallel ranks, exactly (integers carried in doubles, mor::stat_to_sum), so every rank decides
// every operand alike and as one GPU with the whole global batch would (a weight, the same on every rank, keeps its own
// statistic); then the next interval's decisions, one metrics.jsonl record per Linear, and a cleared board. The board
// comes back in one copy after the step's loss, so the GEMMs never wait on the host: a decision lags the data it reads
// by one interval. Checkpoints carry the decisions and the interval's statistics so far.
#include <chrono>
#include <cmath>
#include "formats/mor/mor.h"
#include "io/json_checked.h"
#include "train/trainer.h"

namespace nb {

namespace {

constexpr const char* kRoles[3] = {"input", "weight", "grad"};

// Operands and GEMMs on `rung` over the MoR Linears (each role is an operand of two GEMMs: input Fprop and Wgrad,
// weight Fprop and Dgrad, grad Dgrad and Wgrad; a GEMM runs on a rung when both its operands are).
void shares(const std::vector<uint8_t>& c, recipe::MorRung rung, double* operands, double* gemms) {
  const size_t n = c.size() / 3;
  double roles = 0, both = 0;
  for (size_t k = 0; k < n; ++k) {
    const auto on = [&](size_t r) { return c[3 * k + r] == uint8_t(rung); };
    const bool in = on(0), w = on(1), g = on(2);
    roles += double(in) + double(w) + double(g);
    both += double(in && w) + double(g && w) + double(g && in);
  }
  *operands = n ? roles / double(3 * n) : 0.0;
  *gemms = n ? both / double(3 * n) : 0.0;
}

// One role's record: the rung chosen and the statistics that chose it (E4M3's; the ladder's NVFP4 one too).
nlohmann::json role_json(recipe::MorRung rung, const mor::ErrorStat& e4m3, const mor::ErrorStat* nvfp4) {
  nlohmann::json j = {{"format", recipe::mor_rung_name(rung)},
                      {"error", mor_error_json(e4m3)},
                      {"nonzero", e4m3.nonzero},
                      {"nonfinite", e4m3.nonfinite || (nvfp4 && nvfp4->nonfinite)}};
  if (nvfp4) j["nvfp4_error"] = mor_error_json(*nvfp4);
  return j;
}

// --mor-channel-statistic's fields of one role's record (the per-row scaled E4M3 statistic, which decides nothing);
// true when that statistic would have chosen E4M3 at the rule's threshold.
bool add_channel_fields(const mor::ErrorStat& channel, double threshold, nlohmann::json* role) {
  (*role)["channel_error"] = mor_error_json(channel);
  (*role)["channel_nonfinite"] = channel.nonfinite;
  return mor::decide_from_stat(channel, threshold).choice == mor::Choice::fp8_e4m3;
}

// A decision's summary record: the next steps' shares; channel_share >= 0: the share of operands per-row scaling would
// have kept E4M3 (--mor-channel-statistic).
nlohmann::json decision_summary(int64_t done, const recipe::MorSpec& spec, const std::vector<uint8_t>& choices,
                                double decide_ms, double channel_share) {
  double next_operands = 0, next_gemms = 0;
  shares(choices, recipe::MorRung::fp8, &next_operands, &next_gemms);
  nlohmann::json summary = {{"iteration", done},
                            {"mor_threshold", spec.threshold},
                            {"mor_next_fp8_operands", next_operands},
                            {"mor_next_fp8_gemms", next_gemms},
                            {"mor_decide_ms", decide_ms}};
  if (spec.ladder) {
    shares(choices, recipe::MorRung::nvfp4, &next_operands, &next_gemms);
    summary["mor_nvfp4_threshold"] = spec.nvfp4_threshold;
    summary["mor_next_nvfp4_operands"] = next_operands;
    summary["mor_next_nvfp4_gemms"] = next_gemms;
  }
  if (channel_share >= 0) summary["mor_channel_fp8_operands"] = channel_share;
  return summary;
}

// The rule: the ladder takes NVFP4 while its error is below its threshold, then E4M3 likewise, then BF16; a
// non-finite element keeps the operand BF16 (decide_from_stat).
recipe::MorRung decide_rung(const recipe::MorSpec& spec, const mor::ErrorStat& e4m3, const mor::ErrorStat* nvfp4) {
  const auto below = [](const mor::ErrorStat& s, double t) {
    return mor::decide_from_stat(s, t).choice == mor::Choice::fp8_e4m3;
  };
  if (nvfp4 && below(*nvfp4, spec.nvfp4_threshold)) return recipe::MorRung::nvfp4;
  return below(e4m3, spec.threshold) ? recipe::MorRung::fp8 : recipe::MorRung::bf16;
}

// The E4M3 tensor rule's cells from `from` to `to` per Linear (3 or 6: without or with --mor-channel-statistic), so
// a checkpoint written either way resumes either way: the per-row cells only measure (and a step boundary's board is
// empty, since only a decision step measures and its decision clears it), so they start at zero or are dropped.
std::vector<mor::StatCell> with_cells_per_linear(const std::vector<mor::StatCell>& cells, size_t from, size_t to) {
  std::vector<mor::StatCell> out;
  for (size_t k = 0; k < cells.size() / from; ++k)
    for (size_t i = 0; i < to; ++i) out.push_back(i < from ? cells[k * from + i] : mor::StatCell{});
  return out;
}

}  // namespace

nlohmann::json mor_error_json(const mor::ErrorStat& s) {
  return s.nonzero ? nlohmann::json(s.mean()) : nlohmann::json(nullptr);
}

Status Trainer::mor_after_step(StepFigures* f) {
  const std::vector<uint8_t> in_effect = whole_mor_choices();  // the whole model's (trainer_pp_mor.cpp)
  if (in_effect.empty()) return Status::ok();                  // no MoR, or annealed to a recipe without it
  if (recipe_.mor.blocks) return mor_blocks_after_step(f);     // decided inside the quantizations: counts only
  shares(in_effect, recipe::MorRung::fp8, &f->mor_fp8_operands, &f->mor_fp8_gemms);
  if (recipe_.mor.ladder) shares(in_effect, recipe::MorRung::nvfp4, &f->mor_nvfp4_operands, &f->mor_nvfp4_gemms);
  if (!mor_decision_step(iteration_)) return Status::ok();
  const int64_t done = iteration_ + 1;               // steps run once this one ends
  const auto t0 = std::chrono::steady_clock::now();  // the decision's host time: copy, sum over ranks, rule
  std::vector<mor::StatCell> cells;
  NB_TRY(model_.mor_board(&cells));
  if (recipe_.mor.decide_now) return model_.clear_mor_board();  // each quantization decided itself (CPU, no lag)
  std::vector<double> sums(cells.size() * 4);
  for (size_t i = 0; i < cells.size(); ++i) {
    const std::array<double, 4> s = mor::stat_to_sum(mor::stat_of(cells[i]));
    std::copy(s.begin(), s.end(), sums.begin() + int64_t(4 * i));
  }
  // Tensor parallelism: each rank quantized its shard with the whole tensor's amax, so the shards' statistics sum to
  // the whole tensor's. A tensor every rank holds whole (a column-parallel input, a row-parallel gradient) is counted
  // once per rank, errors and non-zeros alike: its mean, and so its decision, is unchanged.
  if (tp_size() > 1) {
    settle_collectives();
    NB_TRY(tp_comm_->all_reduce_host(sums.data(), int(sums.size()), dist::ReduceOp::sum));
  }
  const std::vector<double> own = sums;
  NB_TRY(sum_over_ranks(sums.data(), int(sums.size())));
  // A weight is whole and the same on every data-parallel rank (DDP, the distributed optimizer's gathered copy,
  // Megatron-FSDP's BF16 gathers): its own statistic is one GPU's; summed it would count each element once per rank.
  // Cells per Linear: E4M3's input, weight, grad, then (the ladder) NVFP4's or (--mor-channel-statistic) the per-row
  // scaled E4M3 statistic's; i = 1, 4, 7, ... is every weight cell either way.
  const auto per = size_t(model_.mor_cells_per_linear());
  for (size_t i = 1; i < cells.size(); i += 3)
    std::copy_n(own.begin() + int64_t(4 * i), 4, sums.begin() + int64_t(4 * i));
  // Under pipeline parallelism every stage takes the whole model's sums and decides every Linear alike.
  NB_TRY(gather_mor_over_stages(&sums, 4 * per));
  const auto summed = [&](size_t i) {
    return mor::stat_from_sum({sums[4 * i], sums[4 * i + 1], sums[4 * i + 2], sums[4 * i + 3]});
  };
  const std::vector<std::string> names = whole_mor_names();  // for the records, at a decision only
  NB_CHECK(sums.size() == names.size() * per * 4, "internal: %zu MoR sums for %zu Linears", sums.size(), names.size());
  std::vector<uint8_t> choices(names.size() * 3);
  nlohmann::json records = nlohmann::json::array();
  size_t channel_fp8 = 0;  // operands per-row scaling would have kept E4M3
  for (size_t k = 0; k < names.size(); ++k) {
    nlohmann::json rec = {{"iteration", done}, {"mor_linear", names[k]}};
    for (size_t r = 0; r < 3; ++r) {
      const mor::ErrorStat e4m3 = summed(per * k + r);
      mor::ErrorStat nv;
      const mor::ErrorStat* nvfp4 = nullptr;
      if (recipe_.mor.ladder) nvfp4 = &(nv = summed(per * k + 3 + r));
      const recipe::MorRung rung = decide_rung(recipe_.mor, e4m3, nvfp4);
      choices[3 * k + r] = uint8_t(rung);
      rec[kRoles[r]] = role_json(rung, e4m3, nvfp4);
      if (recipe_.mor.channel_stat)
        channel_fp8 += add_channel_fields(summed(per * k + 3 + r), recipe_.mor.threshold, &rec[kRoles[r]]);
    }
    records.push_back(std::move(rec));
  }
  NB_TRY(model_.set_mor_choices(own_mor_slice(choices, 3)));
  if (pp_size() > 1) mor_in_effect_ = choices;
  NB_TRY(model_.clear_mor_board());
  const double decide_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  if (!jsonl_) return Status::ok();
  const double channel_share = !recipe_.mor.channel_stat ? -1.0
                               : names.empty()           ? 0.0
                                                         : double(channel_fp8) / double(3 * names.size());
  jsonl_ << decision_summary(done, recipe_.mor, choices, decide_ms, channel_share).dump() << "\n";
  for (const auto& rec : records) jsonl_ << rec.dump() << "\n";
  jsonl_ << std::flush;
  return Status::ok();
}

nlohmann::json Trainer::mor_state() const {
  if (pp_size() > 1) return pipeline_mor_;  // the stages' (a save gathers them)
  if (model_.mor_choices().empty()) return nullptr;
  std::vector<mor::StatCell> cells;
  Status st = model_.mor_board(&cells);
  NB_CHECK(st.is_ok(), "%s", st.message().c_str());
  nlohmann::json stats = nlohmann::json::array();
  for (const mor::StatCell& c : cells) stats.push_back({c.err_fixed, c.nonzero, c.nonfinite});
  return {{"choices", model_.mor_choices()}, {"stats", stats}};
}

Status Trainer::load_mor_state(const nlohmann::json& s) {
  if (whole_mor_linears() == 0) return Status::ok();
  if (!s.contains("mor") || s["mor"].is_null())
    return errorf(
        "the checkpoint was not written by a Mixture of Representations run, so it holds no MoR decisions to "
        "resume; resume with its own recipe, or pass --finetune to start MoR afresh from these weights");
  const nlohmann::json& m = s["mor"];
  std::vector<mor::StatCell> cells;
  for (const auto& c : json_field(m, "stats")) {
    if (!c.is_array() || c.size() != 3)
      return errorf("trainer_state.json: a MoR statistic is not [error, nonzero, nonfinite]");
    cells.push_back({c[0].get<uint64_t>(), c[1].get<uint64_t>(), c[2].get<uint32_t>(), 0});
  }
  const auto choices = json_field(m, "choices").get<std::vector<uint8_t>>();
  const size_t whole = whole_mor_linears(), per = size_t(model_.recipe().mor.cells_per_linear());
  const recipe::MorSpec& spec = model_.recipe().mor;
  const size_t other_per = per == 3 ? 6 : 3;  // the tensor rule without or with --mor-channel-statistic
  if (!spec.ladder && !spec.blocks && cells.size() == other_per * whole)
    cells = with_cells_per_linear(cells, other_per, per);
  if (choices.size() != 3 * whole || cells.size() != per * whole)
    return errorf(
        "trainer_state.json holds MoR decisions for %zu Linear roles and %zu statistics, but this model's %zu MoR "
        "Linears take %zu and %zu; resume with the checkpoint's model and recipe, or pass --finetune",
        choices.size(), cells.size(), whole, 3 * whole, per * whole);
  NB_TRY(model_.set_mor_choices(own_mor_slice(choices, 3)).context("resuming MoR"));
  if (pp_size() > 1) mor_in_effect_ = choices;
  return model_.set_mor_board(own_mor_slice(cells, per)).context("resuming MoR");
}

}  // namespace nb
