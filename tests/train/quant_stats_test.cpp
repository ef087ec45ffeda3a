// --quant-stats on the CPU backend: the per-Linear records in metrics.jsonl (docs/RECIPES.md,
// "Quantization telemetry"), --quant-stats-interval, and training numerics that stay bit-identical
// whether statistics are collected or not.
#include <gtest/gtest.h>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>
#include "train/quant_stats.h"
#include "train/trainer.h"

using namespace nb;

namespace {

TrainConfig tiny_nvfp4_job() {
  TrainConfig c;
  c.device = "cpu";
  c.model = "tiny";
  c.recipe = "bf16_with_nvfp4_mixed";
  c.train_iters = 4;
  c.lr = 3e-3;
  c.min_lr = 3e-4;
  c.lr_warmup_iters = 1;
  c.micro_batch_size = 2;
  c.global_batch_size = 4;  // two micro-batches: only the first is measured
  c.seq_length = 64;
  c.log_interval = 100;
  c.num_layers_at_start_in_bf16 = 0;
  c.num_layers_at_end_in_bf16 = 0;  // every layer quantized
  return c;
}

std::string temp_folder(const std::string& name) {
  auto p = std::filesystem::temp_directory_path() / ("nibble_" + name + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(p);
  std::filesystem::create_directories(p);
  return p.string();
}

std::vector<nlohmann::json> read_jsonl(const std::string& path) {
  std::vector<nlohmann::json> out;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) out.push_back(nlohmann::json::parse(line));
  return out;
}

bool is_number_or_null(const nlohmann::json& j) { return j.is_number() || j.is_null(); }

}  // namespace

TEST(QuantStats, IntervalDefaultsToTheLogInterval) {
  TrainConfig c = tiny_nvfp4_job();
  c.train_iters = 10;
  c.log_interval = 4;
  EXPECT_FALSE(quant_stats_step(c, 3));  // off without --quant-stats
  c.quant_stats = true;
  std::vector<int64_t> steps;
  for (int64_t it = 0; it < c.train_iters; ++it)
    if (quant_stats_step(c, it)) steps.push_back(it + 1);
  EXPECT_EQ(steps, (std::vector<int64_t>{4, 8, 10}));  // and the last step
  c.quant_stats_interval = 3;
  steps.clear();
  for (int64_t it = 0; it < c.train_iters; ++it)
    if (quant_stats_step(c, it)) steps.push_back(it + 1);
  EXPECT_EQ(steps, (std::vector<int64_t>{3, 6, 9, 10}));
  c.quant_stats_interval = -1;
  TrainSummary s;
  EXPECT_FALSE(run_training(c, &s).is_ok());
}

TEST(QuantStats, PerLinearRecordsInMetricsJsonl) {
  TrainConfig c = tiny_nvfp4_job();
  c.save = temp_folder("quant_stats_records");
  c.quant_stats = true;
  c.quant_stats_interval = 2;
  TrainSummary s;
  Status st = run_training(c, &s);
  ASSERT_TRUE(st.is_ok()) << st.message();
  std::map<int64_t, int> per_iteration, summaries;
  for (const nlohmann::json& r : read_jsonl(c.save + "/metrics.jsonl")) {
    if (r.contains("quant_worst_sqnr_db")) {
      summaries[r["iteration"].get<int64_t>()]++;
      EXPECT_TRUE(is_number_or_null(r["quant_min_wgrad_snr"]));
      EXPECT_TRUE(r["quant_max_flushed"].is_number());
    }
    if (!r.contains("quant_stats")) continue;
    per_iteration[r["iteration"].get<int64_t>()]++;
    const std::string name = r["quant_stats"];
    EXPECT_EQ(name.rfind("model.layers.", 0), 0u) << name;
    const int64_t layer = r["layer"];
    EXPECT_EQ(name.rfind("model.layers." + std::to_string(layer) + ".", 0), 0u) << name;
    for (const char* role : {"input", "weight", "grad"}) {
      ASSERT_TRUE(r["roles"].contains(role)) << name << " " << role;
      const nlohmann::json& j = r["roles"][role];
      EXPECT_EQ(j["fmt"], "nvfp4");
      EXPECT_TRUE(j["flushed"].is_number() && j["saturated"].is_number());
      EXPECT_TRUE(is_number_or_null(j["sqnr_db"]));
    }
    const nlohmann::json& w = r["wgrad"];
    EXPECT_GT(w["grad_norm"].get<double>(), 0.0) << name;
    EXPECT_GT(w["noise_norm"].get<double>(), 0.0) << name;
    EXPECT_NEAR(w["snr"].get<double>() * w["rel_err"].get<double>(), 1.0, 1e-12) << name;
    const nlohmann::json& alt = r["wgrad_alt"];
    EXPECT_EQ(alt["rht"], false);  // the preset's Wgrad uses RHT: the alternative has none
    EXPECT_GT(alt["noise_norm"].get<double>(), 0.0) << name;
    EXPECT_TRUE(r["stats_ms"].is_number());
  }
  // tiny: 2 layers x 4 Linears, at iterations 2 and 4 only.
  EXPECT_EQ(per_iteration, (std::map<int64_t, int>{{2, 8}, {4, 8}}));
  EXPECT_EQ(summaries, (std::map<int64_t, int>{{2, 1}, {4, 1}}));
  std::filesystem::remove_all(c.save);
}

TEST(QuantStats, TrainingNumericsAreBitIdentical) {
  for (const char* recompute : {"none", "full"}) {
    TrainConfig off = tiny_nvfp4_job();
    off.train_iters = 5;
    off.recompute = recompute;
    TrainConfig on = off;
    on.quant_stats = true;
    on.quant_stats_interval = 1;  // every step
    TrainSummary s_off, s_on;
    ASSERT_TRUE(run_training(off, &s_off).is_ok());
    ASSERT_TRUE(run_training(on, &s_on).is_ok());
    EXPECT_EQ(s_on.losses, s_off.losses) << recompute;  // as doubles, bit for bit
    EXPECT_EQ(s_on.losses.size(), 5u);
  }
}
