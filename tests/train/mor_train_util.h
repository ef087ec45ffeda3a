// Helpers of the Mixture of Representations training tests (mor_train_test.cpp, mor_ladder_train_test.cpp): a run's
// settings that must be refused before step 1 and the losses under every recompute (the records of a run that carry
// one key: resume_util.h's metrics_records).
#pragma once
#include <gtest/gtest.h>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>
#include "train/resume_util.h"

namespace nb::test {

// The run's losses under recompute none, selective and full, which must agree bit for bit.
inline void expect_every_recompute_alike(const TrainConfig& base) {
  std::vector<std::vector<double>> losses;
  for (const char* rc : {"none", "selective", "full"}) {
    TrainConfig c = base;
    c.recompute = rc;
    TrainSummary s;
    ASSERT_TRUE(run_training(c, &s).is_ok()) << rc;
    losses.push_back(s.losses);
  }
  ASSERT_EQ(losses[0].size(), size_t(base.train_iters));
  EXPECT_EQ(losses[0], losses[1]);
  EXPECT_EQ(losses[0], losses[2]);
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
