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

// Operands and GEMMs in FP8 over the MoR Linears (each role is an operand of two GEMMs: input Fprop and Wgrad,
// weight Fprop and Dgrad, grad Dgrad and Wgrad; a GEMM runs FP8 when both operands are).
void shares(const std::vector<uint8_t>& c, double* operands, double* gemms) {
  const size_t n = c.size() / 3;
  double fp8_roles = 0, fp8_gemms = 0;
  for (size_t k = 0; k < n; ++k) {
    const bool in = c[3 * k] != 0, w = c[3 * k + 1] != 0, g = c[3 * k + 2] != 0;
    fp8_roles += double(in) + double(w) + double(g);
    fp8_gemms += double(in && w) + double(g && w) + double(g && in);
  }
  *operands = n ? fp8_roles / double(3 * n) : 0.0;
  *gemms = n ? fp8_gemms / double(3 * n) : 0.0;
}

nlohmann::json role_json(const mor::TensorDecision& d) {
  return {{"format", d.choice == mor::Choice::fp8_e4m3 ? "e4m3" : "bf16"},
          {"error", d.stat.nonzero ? nlohmann::json(d.stat.mean()) : nlohmann::json(nullptr)},
          {"nonzero", d.stat.nonzero},
          {"nonfinite", d.stat.nonfinite}};
}

}  // namespace

Status Trainer::mor_after_step(StepFigures* f) {
  const std::vector<uint8_t> in_effect = model_.mor_choices();
  if (in_effect.empty()) return Status::ok();  // no MoR, or annealed to a recipe without it
  shares(in_effect, &f->mor_fp8_operands, &f->mor_fp8_gemms);
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
  NB_TRY(sum_over_ranks(sums.data(), int(sums.size())));
  // A weight is whole and the same on every data-parallel rank (DDP, the distributed optimizer's gathered copy,
  // Megatron-FSDP's BF16 gathers): its own statistic is one GPU's; summed it would count each element once per rank.
  for (size_t k = 0; 3 * k + 1 < cells.size(); ++k) {
    const std::array<double, 4> own = mor::stat_to_sum(mor::stat_of(cells[3 * k + 1]));
    std::copy(own.begin(), own.end(), sums.begin() + int64_t(4 * (3 * k + 1)));
  }
  const std::vector<std::string> names = model_.mor_names();  // for the records, at a decision only
  std::vector<uint8_t> choices(cells.size());
  nlohmann::json records = nlohmann::json::array();
  for (size_t k = 0; k < names.size(); ++k) {
    nlohmann::json rec = {{"iteration", done}, {"mor_linear", names[k]}};
    for (size_t r = 0; r < 3; ++r) {
      const size_t i = 3 * k + r;
      const std::array<double, 4> s{sums[4 * i], sums[4 * i + 1], sums[4 * i + 2], sums[4 * i + 3]};
      const mor::TensorDecision d = mor::decide_from_stat(mor::stat_from_sum(s), recipe_.mor.threshold);
      choices[i] = d.choice == mor::Choice::fp8_e4m3 ? 1 : 0;
      rec[kRoles[r]] = role_json(d);
    }
    records.push_back(std::move(rec));
  }
  NB_TRY(model_.set_mor_choices(choices));
  NB_TRY(model_.clear_mor_board());
  const double decide_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  if (!jsonl_) return Status::ok();
  double next_operands = 0, next_gemms = 0;
  shares(choices, &next_operands, &next_gemms);
  jsonl_ << nlohmann::json({{"iteration", done},
                            {"mor_threshold", recipe_.mor.threshold},
                            {"mor_next_fp8_operands", next_operands},
                            {"mor_next_fp8_gemms", next_gemms},
                            {"mor_decide_ms", decide_ms}})
                .dump()
         << "\n";
  for (const auto& rec : records) jsonl_ << rec.dump() << "\n";
  jsonl_ << std::flush;
  return Status::ok();
}

nlohmann::json Trainer::mor_state() const {
  if (model_.mor_choices().empty()) return nullptr;
  std::vector<mor::StatCell> cells;
  Status st = model_.mor_board(&cells);
  NB_CHECK(st.is_ok(), "%s", st.message().c_str());
  nlohmann::json stats = nlohmann::json::array();
  for (const mor::StatCell& c : cells) stats.push_back({c.err_fixed, c.nonzero, c.nonfinite});
  return {{"choices", model_.mor_choices()}, {"stats", stats}};
}

Status Trainer::load_mor_state(const nlohmann::json& s) {
  if (model_.mor_choices().empty()) return Status::ok();
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
  NB_TRY(model_.set_mor_choices(json_field(m, "choices").get<std::vector<uint8_t>>()).context("resuming MoR"));
  return model_.set_mor_board(cells).context("resuming MoR");
}

}  // namespace nb
