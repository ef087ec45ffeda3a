// Boolean flags of `nibble train` as people type them, through the real binary on the CPU: bare
// (followed by another flag, or last on the line), `--flag true|false` and `--flag=value`. The
// resolved configuration the run writes to --save DIR/config.toml is what the flags must have set.
// Each run is one iteration of the tiny preset (about a second).
#include <gtest/gtest.h>
#include <unistd.h>
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include "common/nibble_binary.h"

using nb::test::CliRun;
using nb::test::run_nibble;

namespace {

// An NVFP4 recipe, because the fp4 switches are refused where they would do nothing.
const std::string kTiny =
    "train --model tiny --device cpu --train-iters 1 --seq-length 32 --recipe bf16_with_nvfp4_mixed ";

// Per-process folder: CTest may run the cases of this file in parallel processes.
std::string fresh_dir(const std::string& name) {
  auto dir = std::filesystem::temp_directory_path() / ("nibble_cli_flags_" + name + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  return dir.string();
}

// The value of `key` (underscored, as in TOML) in DIR/config.toml; "" when absent.
std::string config_value(const std::string& dir, const std::string& key) {
  std::ifstream f(dir + "/config.toml");
  const std::string prefix = key + " = ";
  for (std::string line; std::getline(f, line);)
    if (line.rfind(prefix, 0) == 0) return line.substr(prefix.size());
  return "";
}

// Runs tiny training with `flags` and --save DIR placed before or after them; expects success.
std::string train_ok(const std::string& name, const std::string& flags, bool save_first = false) {
  const std::string dir = fresh_dir(name);
  const std::string save = " --save " + dir + " ";
  CliRun r = run_nibble(kTiny + (save_first ? save + flags : flags + save));
  EXPECT_EQ(r.code, 0) << flags << "\n" << r.out;
  return dir;
}

}  // namespace

TEST(TrainCliFlags, BareFlagFollowedByAnotherFlag) {
  const std::string dir = train_ok("bare_then_flag", "--disable-fp4 --fp4-disable-sr --quant-stats");
  EXPECT_EQ(config_value(dir, "disable_fp4"), "true");
  EXPECT_EQ(config_value(dir, "fp4_disable_sr"), "true");
  EXPECT_EQ(config_value(dir, "quant_stats"), "true");
  EXPECT_EQ(config_value(dir, "save"), "\"" + dir + "\"");   // --save after the bare flags kept its value
  EXPECT_EQ(config_value(dir, "fp4_disable_rht"), "false");  // untouched keys keep their defaults
  std::filesystem::remove_all(dir);
}

TEST(TrainCliFlags, BareFlagLastOnTheLine) {
  const std::string dir = train_ok("bare_last", "--fp4-disable-2d", /*save_first=*/true);
  EXPECT_EQ(config_value(dir, "fp4_disable_2d"), "true");
  std::filesystem::remove_all(dir);
}

TEST(TrainCliFlags, ExplicitTrueAndEqualsForm) {
  std::string dir = train_ok("explicit_true", "--disable-fp4 true --fp4-disable-rht=true");
  EXPECT_EQ(config_value(dir, "disable_fp4"), "true");
  EXPECT_EQ(config_value(dir, "fp4_disable_rht"), "true");
  std::filesystem::remove_all(dir);
}

// `false` must override a true from the config file, so the test sees the flag and not the default.
TEST(TrainCliFlags, ExplicitFalseOverridesTheConfigFile) {
  const std::string toml = fresh_dir("explicit_false") + ".toml";
  std::ofstream(toml) << "disable_fp4 = true\nquant_stats = true\n";
  const std::string dir = train_ok("explicit_false", "--config " + toml + " --disable-fp4 false --quant-stats=false");
  EXPECT_EQ(config_value(dir, "disable_fp4"), "false");
  EXPECT_EQ(config_value(dir, "quant_stats"), "false");
  std::filesystem::remove_all(dir);
  std::filesystem::remove(toml);
}

TEST(TrainCliFlags, BadBooleanValueIsOneSentence) {
  const std::string dir = fresh_dir("bad_value");
  CliRun r = run_nibble(kTiny + "--disable-fp4 maybe --save " + dir);
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("--disable-fp4 expects true or false, got 'maybe'"), std::string::npos) << r.out;
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << r.out;
  EXPECT_FALSE(std::filesystem::exists(dir + "/config.toml"));
}

// The precision-annealing keys, the bare flag followed by --save (two steps: the switch comes after step 1).
TEST(TrainCliFlags, AnnealKeys) {
  const std::string dir = fresh_dir("anneal");
  CliRun r = run_nibble(
      "train --model tiny --device cpu --train-iters 2 --seq-length 32 --recipe bf16_with_nvfp4_mixed "
      "--anneal-start-fraction 0.5 --anneal-recipe bf16_mixed --anneal-fprop-only --save " +
      dir);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("precision annealing: step 2 onwards runs bf16_mixed (fprop only)"), std::string::npos) << r.out;
  EXPECT_EQ(config_value(dir, "anneal_start_fraction"), "0.5");
  EXPECT_EQ(config_value(dir, "anneal_recipe"), "\"bf16_mixed\"");
  EXPECT_EQ(config_value(dir, "anneal_fprop_only"), "true");
  std::filesystem::remove_all(dir);
}

// Keys of other types are unchanged: a value is required, so one left last on the line is an error.
TEST(TrainCliFlags, NonBooleanKeysStillNeedAValue) {
  CliRun r = run_nibble(kTiny + "--disable-fp4 --save");
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("--save"), std::string::npos) << r.out;
}

// 4/6's error metric (MAE unless asked, as TransformerEngine: recipe_test) is kept in config.toml like the
// other recipe keys, here from the config file.
TEST(TrainCliFlags, FourOverSixErrModeIsSavedInTheConfig) {
  const std::string toml = fresh_dir("fos_toml") + ".toml";
  std::ofstream(toml) << "fp4_4over6 = \"weights\"\nfp4_4over6_err_mode = \"mse\"\n";
  const std::string dir = train_ok("fos_toml", "--config " + toml);
  EXPECT_EQ(config_value(dir, "fp4_4over6"), "\"weights\"");
  EXPECT_EQ(config_value(dir, "fp4_4over6_err_mode"), "\"mse\"");
  std::filesystem::remove_all(dir);
  std::filesystem::remove(toml);
  CliRun r = run_nibble(kTiny + "--fp4-4over6-err-mode mse");  // 4/6 off: the metric would do nothing
  EXPECT_NE(r.code, 0) << r.out;
}

// --deterministic-mode (Megatron's flag) is a bare boolean like the others, printed in the resolved
// configuration and kept in config.toml; the CPU backend, deterministic anyway, accepts it.
TEST(TrainCliFlags, DeterministicModeIsPrintedAndSaved) {
  const std::string dir = fresh_dir("deterministic");
  CliRun r = run_nibble(kTiny + "--deterministic-mode --save " + dir);
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("deterministic_mode = true"), std::string::npos) << r.out;
  EXPECT_EQ(config_value(dir, "deterministic_mode"), "true");
  std::filesystem::remove_all(dir);
  const std::string plain = train_ok("not_deterministic", "");
  EXPECT_EQ(config_value(plain, "deterministic_mode"), "false");
  std::filesystem::remove_all(plain);
}
