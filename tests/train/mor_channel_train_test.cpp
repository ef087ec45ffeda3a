// --mor-channel-statistic in training (CPU): the E4M3 tensor rule also measures each operand with per-row scaling and
// reports it (each mor_linear role's channel_error, the summary's mor_channel_fp8_operands) while every decision, share
// and loss stays bit for bit the run's without it; its board of six cells per Linear saves and resumes, and a
// checkpoint written with or without it resumes with the other; a LoRA base refuses it.
#include <gtest/gtest.h>
#include <string>
#include <vector>
#include "train/mor_train_util.h"

using namespace nb;

namespace {

constexpr double kThreshold = 0.0226;  // inside the tiny model's spread of errors: both formats

TrainConfig channel_job(const std::string& save, bool channel) {
  TrainConfig c = test::tiny_job("cpu", "bf16_with_mor_fp8_mixed");
  c.mor_threshold = kThreshold;
  c.mor_channel_stat = channel;
  c.train_iters = 4;
  c.save = save;
  c.save_interval = 100;
  return c;
}

}  // namespace

TEST(MorChannelTrainCpu, MeasuresPerRowScalingAndDecidesExactlyAsWithout) {
  const std::string dir = test::temp_folder("mor_channel");
  TrainSummary plain, measured;
  ASSERT_TRUE(run_training(channel_job(dir + "/plain", false), &plain).is_ok());
  ASSERT_TRUE(run_training(channel_job(dir + "/channel", true), &measured).is_ok());
  EXPECT_EQ(measured.losses, plain.losses);
  const auto shares_plain = test::metrics_records(dir + "/plain", "mor_fp8_operands");
  const auto shares_measured = test::metrics_records(dir + "/channel", "mor_fp8_operands");
  ASSERT_EQ(shares_measured.size(), 4u);
  for (size_t i = 0; i < shares_plain.size(); ++i)
    EXPECT_EQ(shares_measured[i]["mor_fp8_operands"], shares_plain[i]["mor_fp8_operands"]) << i;
  const auto a = test::metrics_records(dir + "/plain", "mor_linear");
  const auto b = test::metrics_records(dir + "/channel", "mor_linear");
  ASSERT_EQ(b.size(), 4u * 8u);  // 4 decisions, 2 layers of 4 Linears
  ASSERT_EQ(a.size(), b.size());
  std::vector<int> channel_fp8(4, 0), errors_below(4, 0);  // per decision
  for (size_t i = 0; i < b.size(); ++i)
    for (const char* role : {"input", "weight", "grad"}) {
      const auto &x = a[i][role], &y = b[i][role];
      EXPECT_EQ(y["format"], x["format"]) << b[i].dump();
      EXPECT_EQ(y["error"], x["error"]) << b[i].dump();
      EXPECT_EQ(y["nonzero"], x["nonzero"]) << b[i].dump();
      EXPECT_FALSE(x.contains("channel_error"));
      ASSERT_TRUE(y["channel_error"].is_number()) << b[i].dump();
      EXPECT_FALSE(y["channel_nonfinite"].get<bool>());
      const double ch = y["channel_error"], e = y["error"];
      EXPECT_GT(ch, 0.0);
      EXPECT_LE(ch, e * 1.05) << "per-row scaling errs about as little as per-tensor or less: " << b[i].dump();
      channel_fp8[i / 8] += ch < kThreshold;
    }
  const auto summary_plain = test::metrics_records(dir + "/plain", "mor_next_fp8_operands");
  const auto summary = test::metrics_records(dir + "/channel", "mor_next_fp8_operands");
  ASSERT_EQ(summary.size(), 4u);
  for (size_t d = 0; d < summary.size(); ++d) {
    EXPECT_FALSE(summary_plain[d].contains("mor_channel_fp8_operands"));
    EXPECT_EQ(summary[d]["mor_next_fp8_operands"], summary_plain[d]["mor_next_fp8_operands"]);
    ASSERT_TRUE(summary[d].contains("mor_channel_fp8_operands")) << summary[d].dump();
    const double share = summary[d]["mor_channel_fp8_operands"];
    EXPECT_DOUBLE_EQ(share, channel_fp8[d] / 24.0) << summary[d].dump();
    EXPECT_GE(share, summary[d]["mor_next_fp8_operands"].get<double>()) << summary[d].dump();
  }
  std::filesystem::remove_all(dir);
}

// Decided every 4 steps and saved after step 3: the six-cell board travels in the checkpoint. Then across the flag: a
// run stopped without it resumes with it (and the other way round), continuing the uninterrupted run's losses.
TEST(MorChannelTrainCpu, ResumesBitExactlyAndAcrossTheFlag) {
  const std::string dir = test::temp_folder("mor_channel_resume");
  const std::string prefix = test::write_random_dataset(dir, 256);
  test::expect_bit_exact_resume("cpu", "bf16_with_mor_fp8_mixed", dir, prefix, [](TrainConfig* c) {
    c->mor_threshold = kThreshold;
    c->mor_interval = 4;
    c->mor_channel_stat = true;
  });
  auto job = [&](const std::string& save, bool channel) {
    TrainConfig c = test::resume_job("cpu", "bf16_with_mor_fp8_mixed", prefix);
    c.mor_threshold = kThreshold;
    c.mor_interval = 2;
    c.mor_channel_stat = channel;
    c.save = save;
    c.save_interval = 6;
    return c;
  };
  TrainSummary whole;
  ASSERT_TRUE(run_training(job(dir + "/whole", false), &whole).is_ok());
  for (bool first_channel : {false, true}) {
    const std::string save = dir + (first_channel ? "/from_channel" : "/to_channel");
    TrainConfig first = job(save, first_channel), second = job(save, !first_channel);
    first.exit_interval = 3;
    second.load = save;
    TrainSummary s1, s2;
    Status st = run_training(first, &s1);
    ASSERT_TRUE(st.is_ok()) << st.message();
    ASSERT_TRUE((st = run_training(second, &s2)).is_ok()) << st.message();
    std::vector<double> joined = s1.losses;
    joined.insert(joined.end(), s2.losses.begin(), s2.losses.end());
    EXPECT_EQ(joined, whole.losses) << (first_channel ? "stopped with the flag" : "stopped without it");
  }
  std::filesystem::remove_all(dir);
}

TEST(MorChannelTrainCpu, RefusedWhereItCannotMeasure) {
  TrainConfig base = channel_job("", true);
  base.save_interval = TrainConfig{}.save_interval;  // no --save: nothing to write
  test::expect_refused_before_step_one(
      base, {{[](TrainConfig* c) { c->mor_granularity = "block"; }, "block rule"},
             {[](TrainConfig* c) { c->recipe = "bf16_with_mor_nvfp4_mixed"; }, "NVFP4 ladder"},
             {[](TrainConfig* c) { c->mor_decide_now = true; }, "mor-decide-now"},
             {[](TrainConfig* c) {
                c->recipe = "bf16_mixed";  // the base precision chooses the recipe
                c->peft = "lora";
                c->lora_base_precision = "mor_fp8";
              },
              "LoRA base"}});
}
