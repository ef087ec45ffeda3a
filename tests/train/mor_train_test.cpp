// Mixture of Representations in training (CPU): a run records its decisions and shares, resumes bit for bit
// (decisions and an interval's statistics so far in the checkpoint), repeats itself exactly, and the threshold
// really moves operands between E4M3 and BF16 (a threshold below every error gives BF16 everywhere from the first
// decision on, one above every error FP8 everywhere); bad settings are refused before step 1.
#include <gtest/gtest.h>
#include <map>
#include <set>
#include <string>
#include <vector>
#include "train/mor_train_util.h"

using namespace nb;

namespace {

TrainConfig mor_job(double threshold, int64_t interval = 1) {
  TrainConfig c = test::tiny_job("cpu", "bf16_with_mor_fp8_mixed");
  c.mor_threshold = threshold;
  c.mor_interval = interval;
  c.train_iters = 4;  // four decisions: enough to see them change and carry, short for CI
  return c;
}

}  // namespace

// Decided every 4 steps (after steps 1 and 5), saved after step 3, between two decisions: the decisions travel in the
// checkpoint, and the resumed run measures and decides at step 5 as the whole run does.
TEST(MorTrainCpu, ResumesBitExactlyMidInterval) {
  const std::string dir = test::temp_folder("mor_resume");
  test::expect_bit_exact_resume("cpu", "bf16_with_mor_fp8_mixed", dir, test::write_random_dataset(dir, 256),
                                [](TrainConfig* c) {
                                  c->mor_threshold = 0.0226;  // inside the tiny model's spread of errors: both formats
                                  c->mor_interval = 4;
                                });
}

TEST(MorTrainCpu, ThresholdDecidesAndTheRunRecordsIt) {
  const std::string dir = test::temp_folder("mor_threshold");
  struct Case {
    double threshold;
    double share_after_first;  // the share of FP8 operands once the first decision applies
  };
  for (const Case& c : {Case{1e-9, 0.0}, Case{0.999, 1.0}}) {
    TrainConfig job = mor_job(c.threshold);
    job.quant_stats = true;  // its per-Linear records name the format each role's GEMMs read, every step
    job.quant_stats_interval = 1;
    job.save = dir + "/run";
    job.save_interval = 100;
    TrainSummary s;
    ASSERT_TRUE(run_training(job, &s).is_ok());
    const auto steps = test::metrics_records(job.save, "mor_fp8_operands");
    ASSERT_EQ(steps.size(), 4u);
    EXPECT_EQ(steps[0]["mor_fp8_operands"], 1.0) << "before the first decision every operand is FP8";
    for (size_t i = 1; i < steps.size(); ++i) {
      EXPECT_EQ(steps[i]["mor_fp8_operands"], c.share_after_first) << c.threshold << " step " << i + 1;
      EXPECT_EQ(steps[i]["mor_fp8_gemms"], c.share_after_first) << c.threshold << " step " << i + 1;
    }
    const auto quant = test::metrics_records(job.save, "quant_stats");
    ASSERT_EQ(quant.size(), 4u * 4u * 2u);
    for (const auto& rec : quant)
      for (const char* role : {"input", "weight", "grad"}) {
        const bool first = rec["iteration"] == 1;  // step 1 runs before any decision: E4M3 everywhere
        EXPECT_EQ(rec["roles"][role]["mor_format"], first || c.share_after_first == 1.0 ? "fp8_e4m3" : "bf16")
            << rec.dump();
      }
    const auto linears = test::metrics_records(job.save, "mor_linear");
    ASSERT_EQ(linears.size(), 4u * 4u * 2u);  // 4 decisions, 2 layers of 4 Linears
    for (const auto& rec : linears)
      for (const char* role : {"input", "weight", "grad"}) {
        EXPECT_EQ(rec[role]["format"], c.share_after_first == 1.0 ? "e4m3" : "bf16") << rec.dump();
        EXPECT_GT(rec[role]["error"].get<double>(), 0.0) << rec.dump();
        EXPECT_FALSE(rec[role]["nonfinite"].get<bool>());
      }
    std::filesystem::remove_all(job.save);
  }
  std::filesystem::remove_all(dir);
}

TEST(MorTrainCpu, RunsRepeatBitForBit) {
  TrainSummary a, b;
  ASSERT_TRUE(run_training(mor_job(0.0226), &a).is_ok());
  ASSERT_TRUE(run_training(mor_job(0.0226), &b).is_ok());
  EXPECT_EQ(a.losses, b.losses);
  TrainSummary c;  // and the decisions change the run
  ASSERT_TRUE(run_training(mor_job(1e-9), &c).is_ok());
  EXPECT_NE(a.losses, c.losses);
}

// An input that MoR keeps in BF16 is read by its Wgrad. A quantized layer keeps its inputs only as their quantized
// copies (the norms' and SwiGLU's outputs live in scratch that the next layers' forwards overwrite), so without
// recompute its backward must bring them back first. Found under pipeline parallelism: the run without recompute
// differed from selective and full recompute, whose losses it must equal bit for bit (the decisions are alike: full
// recompute's second forward counts each element twice, which leaves the means unchanged).
TEST(MorTrainCpu, Bf16InputsReadTheirOwnValuesUnderEveryRecompute) {
  test::expect_every_recompute_alike(mor_job(0.0226));  // some inputs BF16 from the first decision on
}

TEST(MorTrainCpu, BadSettingsAreRefusedBeforeStepOne) {
  test::expect_refused_before_step_one(
      mor_job(0.05), {{[](TrainConfig* c) { c->mor_threshold = 1.5; }, "outside (0, 1)"},
                      {[](TrainConfig* c) { c->mor_interval = 0; }, "at least 1"},
                      {[](TrainConfig* c) { c->mor_granularity = "row"; }, "mor-granularity"},
                      {[](TrainConfig* c) { c->recipe = "bf16_with_nvfp4_mixed"; }, "no Mixture of Representations"}});
}

// --mor-interval 2: decisions after steps 1 and 3, each from its own step's quantizations only (the counts of one
// step, as an every-step run records them), and the steps between run the decision they inherited.
TEST(MorTrainCpu, AnIntervalMeasuresItsFirstStepOnly) {
  const std::string dir = test::temp_folder("mor_interval");
  std::vector<nlohmann::json> every, second;
  for (int64_t interval : {1, 2}) {
    TrainConfig job = mor_job(0.0226, interval);
    job.save = dir + "/run" + std::to_string(interval);
    job.save_interval = 100;
    TrainSummary s;
    ASSERT_TRUE(run_training(job, &s).is_ok());
    (interval == 1 ? every : second) = test::metrics_records(job.save, "mor_linear");
  }
  ASSERT_EQ(every.size(), 4u * 8u);
  ASSERT_EQ(second.size(), 2u * 8u);
  for (size_t i = 0; i < second.size(); ++i) {
    EXPECT_EQ(second[i]["iteration"].get<int64_t>() % 2, 1) << second[i].dump();
    for (const char* role : {"input", "weight", "grad"})
      EXPECT_EQ(second[i][role]["nonzero"], every[i % 8][role]["nonzero"]) << "one step's count: " << second[i].dump();
  }
  std::filesystem::remove_all(dir);
}

// MoR composes with the optimizer state in host memory (the same run bit for bit: the state's place changes no
// number) and with precision annealing: annealed to bf16_mixed at step 3, the steps after the switch carry no MoR
// decisions (nothing is quantized), the steps before do, and decisions stop with them.
TEST(MorTrainCpu, ComposesWithOffloadAndAnnealsToBf16) {
  const std::string dir = test::temp_folder("mor_compose");
  TrainSummary plain, offloaded;
  ASSERT_TRUE(run_training(mor_job(0.0226), &plain).is_ok());
  TrainConfig off = mor_job(0.0226);
  off.optimizer_cpu_offload = true;
  off.optimizer_offload_fraction = 0.5;
  ASSERT_TRUE(run_training(off, &offloaded).is_ok());
  EXPECT_EQ(offloaded.losses, plain.losses);
  TrainConfig anneal = mor_job(0.0226);
  anneal.anneal_start_fraction = 0.5;
  anneal.anneal_recipe = "bf16_mixed";
  anneal.save = dir + "/anneal";
  anneal.save_interval = 100;
  TrainSummary annealed;
  ASSERT_TRUE(run_training(anneal, &annealed).is_ok());
  ASSERT_EQ(annealed.losses.size(), 4u);
  EXPECT_EQ(annealed.losses[0], plain.losses[0]);
  EXPECT_EQ(annealed.losses[1], plain.losses[1]);
  const auto shares = test::metrics_records(anneal.save, "mor_fp8_operands");
  ASSERT_EQ(shares.size(), 2u) << "steps 1 and 2 ran MoR";
  for (const auto& rec : test::metrics_records(anneal.save, "mor_linear"))
    EXPECT_LE(rec["iteration"].get<int64_t>(), 2) << rec.dump();
  std::filesystem::remove_all(dir);
}

// A MoR run does not resume a checkpoint that carries no MoR decisions (here FP8 current scaling's): refused in one
// sentence; --finetune starts MoR afresh from its weights.
TEST(MorTrainCpu, AResumeWithoutMorStateIsRefusedUnlessFinetune) {
  const std::string dir = test::temp_folder("mor_resume_other");
  TrainConfig first = test::tiny_job("cpu", "bf16_with_fp8_current_scaling_mixed");
  first.train_iters = 2;
  first.save = dir + "/run";
  first.save_interval = 2;
  TrainSummary s;
  ASSERT_TRUE(run_training(first, &s).is_ok());
  TrainConfig resumed = mor_job(0.045);
  resumed.load = first.save;
  resumed.save = dir + "/mor";
  Status st = run_training(resumed, &s);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("--finetune"), std::string::npos) << st.message();
  resumed.finetune = true;
  st = run_training(resumed, &s);
  EXPECT_TRUE(st.is_ok()) << st.message();
  std::filesystem::remove_all(dir);
}

// LoRA on a MoR base (--lora-base-precision mor_fp8): the frozen weights are decided once, from all of each, when the
// base is frozen; inputs and gradients every decision. Every decision's records carry each frozen weight's statistic
// and the same format throughout, and a run stopped and resumed equals the uninterrupted one bit for bit.
TEST(MorTrainCpu, DecidesALoraBaseAndResumesBitExactly) {
  const std::string dir = test::temp_folder("mor_lora");
  const std::string prefix = test::write_random_dataset(dir, 256);
  auto job = [&](const std::string& save) {
    TrainConfig c = test::resume_job("cpu", "bf16_mixed", prefix);
    c.peft = "lora";
    c.lora_rank = 8;
    c.lora_alpha = 16;
    c.lora_base_precision = "mor_fp8";
    c.mor_threshold = 0.0226;  // inside the spread of the tiny model's errors: both formats
    c.mor_interval = 2;
    c.lr = 1e-2;
    c.save = save;
    c.save_interval = 6;
    return c;
  };
  TrainConfig whole = job(dir + "/whole"), first = job(dir + "/halves"), second = job(dir + "/halves");
  first.exit_interval = 3;
  second.load = second.save;
  TrainSummary sw, s1, s2;
  Status st = run_training(whole, &sw);
  ASSERT_TRUE(st.is_ok()) << st.message();
  ASSERT_TRUE((st = run_training(first, &s1)).is_ok()) << st.message();
  ASSERT_TRUE((st = run_training(second, &s2)).is_ok()) << st.message();
  std::vector<double> joined = s1.losses;
  joined.insert(joined.end(), s2.losses.begin(), s2.losses.end());
  EXPECT_EQ(joined, sw.losses);
  const auto records = test::metrics_records(whole.save, "mor_linear");
  ASSERT_FALSE(records.empty());
  std::map<std::string, std::string> weight_format;
  std::set<std::string> formats;
  for (const auto& rec : records) {
    const auto& w = rec["weight"];
    EXPECT_GT(w["nonzero"].get<int64_t>(), 0) << rec.dump();  // the frozen weight's statistic, every decision
    const std::string name = rec["mor_linear"], f = w["format"];
    formats.insert(f);
    if (weight_format.count(name)) { EXPECT_EQ(weight_format[name], f) << "decided once: " << rec.dump(); }
    weight_format[name] = f;
    for (const char* role : {"input", "grad"}) formats.insert(rec[role]["format"].get<std::string>());
  }
  EXPECT_EQ(formats.size(), 2u) << "both formats among the base's operands";
  std::filesystem::remove_all(dir);
}
