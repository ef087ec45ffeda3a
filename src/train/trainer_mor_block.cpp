// MoR's block rule in the training loop (recipe.h MorSpec::blocks, docs/MOR.md): every 128x128 block was decided
// inside its quantization, from the data it quantized, so the host decides nothing. After every step the board comes
// back in one copy with the loss: per Linear role, the E4M3 statistic of all its blocks and its blocks per choice
// (the ladder per block: and the NVFP4 statistic of all its blocks).
// They are summed over the data-parallel ranks (a weight, the same on every rank, keeps its own), gathered over the
// pipeline stages, turned into the step's shares for the log line, and every log interval into one metrics.jsonl
// record per Linear; then the board is cleared.
#include <array>
#include "formats/mor/mor_block.h"
#include "train/trainer.h"

namespace nb {

namespace {

constexpr const char* kBlockRoles[3] = {"input", "weight", "grad"};
constexpr size_t kWidth = 5;  // doubles per cell in the sums

// Per Linear: the roles' E4M3 statistics (cells 0-2), their BlockCounts (3-5), (the ladder) their NVFP4 statistics
// (6-8).
bool is_counts(size_t cell, size_t per) { return cell % per >= 3 && cell % per < 6; }

// kWidth doubles per cell that a sum over ranks adds exactly: a statistic as mor::stat_to_sum, counts as they are.
std::array<double, kWidth> cell_to_sum(const mor::StatCell& c, bool counts) {
  if (!counts) {
    const std::array<double, 4> s = mor::stat_to_sum(mor::stat_of(c));
    return {s[0], s[1], s[2], s[3], 0.0};
  }
  const mor::BlockCounts b = mor::block_counts_of(c);
  return {double(b.e4m3), double(b.e5m2), double(b.nvfp4), double(b.bf16), double(b.nonfinite)};
}

mor::ErrorStat stat_at(const double* sum) { return mor::stat_from_sum({sum[0], sum[1], sum[2], sum[3]}); }

// nvfp4: the role's NVFP4 statistic (the ladder per block), else null.
nlohmann::json role_record(const double* stat, const double* counts, const double* nvfp4) {
  const mor::ErrorStat e4m3 = stat_at(stat);
  nlohmann::json rec = {{"format", "blocks"},
                        {"e4m3_blocks", int64_t(counts[0])},
                        {"e5m2_blocks", int64_t(counts[1])},
                        {"bf16_blocks", int64_t(counts[3])},
                        {"nonfinite_blocks", int64_t(counts[4])},
                        {"error", mor_error_json(e4m3)},
                        {"nonzero", e4m3.nonzero}};
  if (nvfp4) {
    rec["nvfp4_blocks"] = int64_t(counts[2]);
    rec["nvfp4_error"] = mor_error_json(stat_at(nvfp4));
  }
  return rec;
}

}  // namespace

Status Trainer::mor_blocks_after_step(StepFigures* f) {
  std::vector<mor::StatCell> cells;
  NB_TRY(model_.mor_board(&cells));
  const auto per = size_t(recipe_.mor.cells_per_linear());
  NB_CHECK(cells.size() % per == 0, "internal: %zu MoR block cells", cells.size());
  std::vector<double> sums(cells.size() * kWidth);
  for (size_t i = 0; i < cells.size(); ++i) {
    const std::array<double, kWidth> s = cell_to_sum(cells[i], is_counts(i, per));
    std::copy(s.begin(), s.end(), sums.begin() + int64_t(kWidth * i));
  }
  const std::vector<double> own = sums;
  NB_TRY(sum_over_ranks(sums.data(), int(sums.size())));
  for (size_t i = 0; i < cells.size(); ++i)  // a weight's cells (role 1 of each group of three): its own, once
    if (i % per % 3 == 1) std::copy_n(own.begin() + int64_t(kWidth * i), kWidth, sums.begin() + int64_t(kWidth * i));
  NB_TRY(gather_mor_over_stages(&sums, kWidth * per));
  NB_TRY(model_.clear_mor_board());
  double fp8 = 0, e5m2 = 0, nvfp4 = 0, all = 0;
  for (size_t i = 0; i < sums.size() / kWidth; ++i) {
    if (!is_counts(i, per)) continue;
    const double* c = &sums[kWidth * i];
    fp8 += c[0] + c[1];
    e5m2 += c[1];
    nvfp4 += c[2];
    all += c[0] + c[1] + c[2] + c[3];
  }
  f->mor_fp8_blocks = all > 0 ? fp8 / all : 0.0;
  f->mor_e5m2_blocks = all > 0 ? e5m2 / all : 0.0;
  if (recipe_.mor.ladder) f->mor_nvfp4_blocks = all > 0 ? nvfp4 / all : 0.0;
  const int64_t done = iteration_ + 1;
  if (!jsonl_ || done % std::max<int64_t>(1, cfg_.log_interval) != 0) return Status::ok();
  const std::vector<std::string> names = whole_mor_names();
  NB_CHECK(sums.size() == names.size() * per * kWidth, "internal: %zu MoR sums for %zu Linears", sums.size(),
           names.size());
  for (size_t k = 0; k < names.size(); ++k) {
    nlohmann::json rec = {{"iteration", done}, {"mor_linear", names[k]}};
    const double* lin = &sums[kWidth * per * k];
    for (size_t r = 0; r < 3; ++r)
      rec[kBlockRoles[r]] =
          role_record(lin + kWidth * r, lin + kWidth * (3 + r), per > 6 ? lin + kWidth * (6 + r) : nullptr);
    jsonl_ << rec.dump() << "\n";
  }
  jsonl_ << std::flush;
  return Status::ok();
}

}  // namespace nb
