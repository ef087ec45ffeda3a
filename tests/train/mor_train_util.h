// Helpers of the Mixture of Representations training tests (mor_train_test.cpp, mor_ladder_train_test.cpp): a run's
// settings that must be refused before step 1 and the losses under every recompute (the records of a run that carry
// one key: resume_util.h's metrics_records).
#pragma once
#include <gtest/gtest.h>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>
#include "train/resume_util.h"

namespace nb::test {

// MoR's step shares and per-Linear records of a saved run, timings dropped: what every recompute must repeat.
inline std::vector<std::string> mor_telemetry(const std::string& save) {
  std::vector<std::string> out;
  for (nlohmann::json r : metrics_records(save, "lm_loss")) {
    nlohmann::json mor = nlohmann::json::object();
    for (auto& [k, v] : r.items())
      if (k.rfind("mor_", 0) == 0 && k != "mor_decide_ms") mor[k] = v;
    out.push_back(mor.dump());
  }
  for (nlohmann::json r : metrics_records(save, "mor_linear")) out.push_back(r.dump());
  return out;
}

// The run's losses under recompute none, selective and full, which must agree bit for bit, and so must MoR's
// shares and records: a recomputed forward quantizes the same values again, which MoR counts once.
inline void expect_every_recompute_alike(const TrainConfig& base) {
  std::vector<std::vector<double>> losses;
  std::vector<std::vector<std::string>> telemetry;
  const std::string dir = temp_folder("mor_recompute");
  for (const char* rc : {"none", "selective", "full"}) {
    TrainConfig c = base;
    c.recompute = rc;
    c.save = dir + "/" + rc;
    c.log_interval = 1;
    TrainSummary s;
    ASSERT_TRUE(run_training(c, &s).is_ok()) << rc;
    losses.push_back(s.losses);
    telemetry.push_back(mor_telemetry(c.save));
  }
  ASSERT_EQ(losses[0].size(), size_t(base.train_iters));
  EXPECT_EQ(losses[0], losses[1]);
  EXPECT_EQ(losses[0], losses[2]);
  ASSERT_FALSE(telemetry[0].empty());
  EXPECT_EQ(telemetry[0], telemetry[1]) << "selective recompute";
  EXPECT_EQ(telemetry[0], telemetry[2]) << "full recompute";
  std::filesystem::remove_all(dir);
}

struct RefusedSetting {
  std::function<void(TrainConfig*)> set;
  const char* needle;  // in the one-sentence error
};

// Each setting applied to `base` makes run_training fail with its needle (before any step runs).
inline void expect_refused_before_step_one(const TrainConfig& base, const std::vector<RefusedSetting>& settings) {
  for (const RefusedSetting& k : settings) {
    TrainConfig job = base;
    k.set(&job);
    TrainSummary s;
    Status st = run_training(job, &s);
    ASSERT_FALSE(st.is_ok()) << k.needle;
    EXPECT_NE(st.message().find(k.needle), std::string::npos) << st.message();
    EXPECT_TRUE(s.losses.empty()) << k.needle;
  }
}

}  // namespace nb::test
