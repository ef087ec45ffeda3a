// Training configuration: presets, validation errors (each one clear sentence, before any GPU work),
// TOML files with unknown keys, the LR schedules, the FLOP formula, and the NaN stop/skip paths.
#include <gtest/gtest.h>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include "core/determinism.h"
#include "model/llama_config.h"
#include "train/lr_schedule.h"
#include "train/train_config.h"
#include "train/trainer.h"

using namespace nb;

namespace {
std::string message_of(TrainConfig c) {
  LlamaConfig m;
  Status st = resolve_model(c, &m);
  if (st) st = validate_train_config(c, m);
  return st ? "" : st.message();
}
std::string tmp_file(const std::string& name, const std::string& text) {
  auto p = std::filesystem::temp_directory_path() / ("nibble_cfg_" + std::to_string(::getpid()) + "_" + name);
  std::ofstream(p) << text;
  return p.string();
}
}  // namespace

TEST(LlamaConfig, Llama31_8B_FlopsMatchTheProtocol) {
  LlamaConfig c;
  ASSERT_TRUE(llama_preset("llama3.1-8b", &c).is_ok());
  EXPECT_NEAR(c.flops_per_token(4096) / 1e9, 48.25, 0.01);
  EXPECT_NEAR(c.flops_per_token(8192) / 1e9, 51.47, 0.01);
  EXPECT_NEAR(c.total_params() / 1e9, 8.03, 0.01);
  for (const auto& n : preset_names()) {
    ASSERT_TRUE(llama_preset(n, &c).is_ok()) << n;
    EXPECT_TRUE(validate(c).is_ok()) << n;
  }
}

TEST(LlamaConfig, RejectsImpossibleShapes) {
  LlamaConfig c;
  ASSERT_TRUE(llama_preset("tiny", &c).is_ok());
  c.heads = 3;
  EXPECT_NE(validate(c).message().find("heads (3) must divide hidden (256)"), std::string::npos);
  ASSERT_TRUE(llama_preset("tiny", &c).is_ok());
  c.kv_heads = 3;
  EXPECT_NE(validate(c).message().find("kv-heads (3) must divide heads (8)"), std::string::npos);
  EXPECT_NE(llama_preset("llama9", &c).message().find("unknown model preset 'llama9'"), std::string::npos);
}

TEST(TrainConfig, ValidationMessages) {
  TrainConfig c;
  c.micro_batch_size = 3;
  c.global_batch_size = 8;
  EXPECT_NE(message_of(c).find("multiple of micro-batch-size"), std::string::npos) << message_of(c);
  c = TrainConfig{};
  c.model = "nope";
  EXPECT_NE(message_of(c).find("unknown model preset"), std::string::npos);
  c = TrainConfig{};
  c.min_lr = 1.0;
  EXPECT_NE(message_of(c).find("min-lr"), std::string::npos);
  EXPECT_EQ(message_of(TrainConfig{}), "");
  TrainConfig d;
  auto keys = config_keys(d);
  for (auto& k : keys) {
    if (k.name == "recompute") { EXPECT_NE(k.set("most").message().find("none, selective, full"), std::string::npos); }
  }
}

TEST(TrainConfig, TomlFileAndUnknownKeys) {
  TrainConfig c;
  std::string good =
      tmp_file("good.toml", "model = \"tiny\"\n[training]\nmicro_batch_size = 4\nlr = 1e-3\nmock-data = true\n");
  ASSERT_TRUE(apply_config_file(good, c).is_ok());
  EXPECT_EQ(c.micro_batch_size, 4);
  EXPECT_DOUBLE_EQ(c.lr, 1e-3);
  std::string bad = tmp_file("bad.toml", "micro_batch_sise = 4\n");
  Status st = apply_config_file(bad, c);
  EXPECT_NE(st.message().find("unknown key 'micro_batch_sise'"), std::string::npos) << st.message();
  std::string broken = tmp_file("broken.toml", "lr = = 3\n");
  EXPECT_FALSE(apply_config_file(broken, c).is_ok());
  // The printed configuration is itself a valid config file that reproduces the job.
  TrainConfig e;
  e.seq_length = 128;
  std::string round = tmp_file("round.toml", format_config(e));
  TrainConfig f;
  ASSERT_TRUE(apply_config_file(round, f).is_ok());
  EXPECT_EQ(format_config(e), format_config(f));
}

TEST(LrSchedule, WarmupCosineWsd) {
  LrSchedule s;
  s.lr = 1.0;
  s.min_lr = 0.1;
  s.warmup = 10;
  s.decay_iters = 110;
  EXPECT_DOUBLE_EQ(s.at(0), 0.1);
  EXPECT_DOUBLE_EQ(s.at(9), 1.0);
  EXPECT_NEAR(s.at(60), 0.55, 1e-12);  // halfway through the cosine
  EXPECT_DOUBLE_EQ(s.at(200), 0.1);
  s.style = "wsd";
  s.wsd_decay_iters = 20;
  EXPECT_DOUBLE_EQ(s.at(89), 1.0);
  EXPECT_NEAR(s.at(100), 0.55, 1e-12);
}

TEST(Trainer, TinyCpuRunLossFalls) {
  TrainConfig c;
  c.device = "cpu";
  c.model = "tiny";
  c.train_iters = 30;
  c.lr = 3e-3;
  c.min_lr = 3e-4;
  c.lr_warmup_iters = 3;
  c.micro_batch_size = 2;
  c.global_batch_size = 4;
  c.seq_length = 64;
  TrainSummary s;
  Status st = run_training(c, &s);
  ASSERT_TRUE(st.is_ok()) << st.message();
  EXPECT_LT(s.final_loss, s.first_loss - 0.5);
}

// --deterministic-mode reaches the process-wide switch the GEMM and attention plan caches key on, and a
// later run without it switches it back off (one process may train several times, as the tests do).
TEST(Trainer, DeterministicModeSetsAndClearsTheProcessSwitch) {
  TrainConfig c;
  c.device = "cpu";
  c.model = "tiny";
  c.train_iters = 1;
  c.seq_length = 32;
  c.log_interval = 100;
  c.deterministic_mode = true;
  TrainSummary s;
  Status st = run_training(c, &s);
  ASSERT_TRUE(st.is_ok()) << st.message();
  EXPECT_TRUE(deterministic_mode());
  c.deterministic_mode = false;
  st = run_training(c, &s);
  ASSERT_TRUE(st.is_ok()) << st.message();
  EXPECT_FALSE(deterministic_mode());
}

TEST(Trainer, NonFiniteLossStopsOrSkips) {
  TrainConfig c;
  c.device = "cpu";
  c.model = "tiny";
  c.train_iters = 6;
  c.lr = 1e30;
  c.min_lr = 0;
  c.clip_grad = 0;
  c.micro_batch_size = 1;
  c.seq_length = 32;
  TrainSummary s;
  Status st = run_training(c, &s);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("is not finite"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("step "), std::string::npos);
  c.on_nan = "skip";
  st = run_training(c, &s);
  ASSERT_TRUE(st.is_ok()) << st.message();
  EXPECT_GT(s.skipped, 0);
}

TEST(TrainConfig, NonAsciiTextIsRefusedAndNonAsciiValuesRoundTripAsEscapes) {
  TrainConfig c;
  Status st = apply_config_text("model = \"tiny\"\nsave = \"caf\xc3\xa9\"\n", "job.toml", c);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("job.toml line 2: a non-ASCII character"), std::string::npos) << st.message();
  TrainConfig a;
  a.save = "runs/caf\xc3\xa9 \"\\ \xf0\x9f\x98\x80";  // non-ASCII (2 and 4 bytes), a quote, a backslash
  const std::string text = format_config(a);
  for (char ch : text) ASSERT_LT(static_cast<unsigned char>(ch), 0x80) << text;
  TrainConfig b;
  ASSERT_TRUE(apply_config_text(text, "resolved", b).is_ok());
  EXPECT_EQ(b.save, a.save);
}
