// MoR's block rule in the training loop (recipe.h MorSpec::blocks, docs/MOR.md): every 128x128 block was decided
// inside its quantization, from the data it quantized, so the host decides nothing. After every step the board comes
// back in one copy with the loss: per Linear role, the E4M3 statistic of all its blocks and its blocks per choice.
// They are summed over the data-parallel ranks (a weight, the same on every rank, keeps its own), gathered over the
// pipeline stages, turned into the step's shares for the log line, and every log interval into one metrics.jsonl
// record per Linear; then the board is cleared.
#include <array>
#include "formats/mor/mor_block.h"
#include "train/trainer.h"

namespace nb {

namespace {

constexpr const char* kBlockRoles[3] = {"input", "weight", "grad"};
constexpr size_t kCells = 6;  // per Linear: the roles' E4M3 statistics, then their BlockCounts

// Four doubles per cell that a sum over ranks adds exactly: a statistic as mor::stat_to_sum, counts as they are.
std::array<double, 4> cell_to_sum(const mor::StatCell& c, bool counts) {
  if (!counts) return mor::stat_to_sum(mor::stat_of(c));
  const mor::BlockCounts b = mor::block_counts_of(c);
  return {double(b.e4m3), double(b.e5m2), double(b.bf16), double(b.nonfinite)};
}

nlohmann::json role_record(const double* stat, const double* counts) {
  const mor::ErrorStat e4m3 = mor::stat_from_sum({stat[0], stat[1], stat[2], stat[3]});
  return {{"format", "blocks"},
          {"e4m3_blocks", int64_t(counts[0])},
          {"e5m2_blocks", int64_t(counts[1])},
          {"bf16_blocks", int64_t(counts[2])},
          {"nonfinite_blocks", int64_t(counts[3])},
          {"error", e4m3.nonzero ? nlohmann::json(e4m3.mean()) : nlohmann::json(nullptr)},
          {"nonzero", e4m3.nonzero}};
}

}  // namespace

Status Trainer::mor_blocks_after_step(StepFigures* f) {
  std::vector<mor::StatCell> cells;
  NB_TRY(model_.mor_board(&cells));
  NB_CHECK(cells.size() % kCells == 0, "internal: %zu MoR block cells", cells.size());
  std::vector<double> sums(cells.size() * 4), own(cells.size() * 4);
  for (size_t i = 0; i < cells.size(); ++i) {
    const std::array<double, 4> s = cell_to_sum(cells[i], i % kCells >= 3);
    std::copy(s.begin(), s.end(), sums.begin() + int64_t(4 * i));
    std::copy(s.begin(), s.end(), own.begin() + int64_t(4 * i));
  }
  NB_TRY(sum_over_ranks(sums.data(), int(sums.size())));
  for (size_t i = 0; i < cells.size(); ++i)  // a weight's statistic and counts (cells 1 and 4): its own, once
    if (i % kCells == 1 || i % kCells == 4) std::copy_n(own.begin() + int64_t(4 * i), 4, sums.begin() + int64_t(4 * i));
  NB_TRY(gather_mor_over_stages(&sums, 4 * kCells));
  NB_TRY(model_.clear_mor_board());
  double fp8 = 0, e5m2 = 0, all = 0;
  for (size_t i = 0; i < sums.size() / 4; ++i) {
    if (i % kCells < 3) continue;
    const double* c = &sums[4 * i];
    fp8 += c[0] + c[1];
    e5m2 += c[1];
    all += c[0] + c[1] + c[2];
  }
  f->mor_fp8_blocks = all > 0 ? fp8 / all : 0.0;
  f->mor_e5m2_blocks = all > 0 ? e5m2 / all : 0.0;
  const int64_t done = iteration_ + 1;
  if (!jsonl_ || done % std::max<int64_t>(1, cfg_.log_interval) != 0) return Status::ok();
  const std::vector<std::string> names = whole_mor_names();
  NB_CHECK(sums.size() == names.size() * kCells * 4, "internal: %zu MoR sums for %zu Linears", sums.size(),
           names.size());
  for (size_t k = 0; k < names.size(); ++k) {
    nlohmann::json rec = {{"iteration", done}, {"mor_linear", names[k]}};
    for (size_t r = 0; r < 3; ++r)
      rec[kBlockRoles[r]] = role_record(&sums[4 * (kCells * k + r)], &sums[4 * (kCells * k + 3 + r)]);
    jsonl_ << rec.dump() << "\n";
  }
  jsonl_ << std::flush;
  return Status::ok();
}

}  // namespace nb
