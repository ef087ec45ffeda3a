// `nibble train --tensorboard-dir` through the real binary on the CPU: every scalar of the event file,
// at every logged step, equals the figure metrics.jsonl holds for it (rounded to float), validation loss
// and --quant-stats included, and nothing else is in the file; a folder that cannot be written is
// refused before any work with one sentence naming the flag and the path.
#include <gtest/gtest.h>
#include <unistd.h>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>
#include "common/nibble_binary.h"
#include "common/tensorboard_events.h"

using nb::test::run_nibble;
using Json = nlohmann::json;

namespace {

// The tag of each figure of a metrics.jsonl step record, and the divisor from its unit to the tag's
// (Megatron's tags keep Megatron's seconds). The spec of docs/TENSORBOARD.md, written out again here.
struct StepTag {
  const char* tag;
  const char* key;
  double divisor;
};
const StepTag kStepTags[] = {
    {"lm loss", "lm_loss", 1},
    {"learning-rate", "lr", 1},
    {"grad-norm", "grad_norm", 1},
    {"batch-size", "global_batch_size", 1},
    {"consumed-samples", "consumed_samples", 1},
    {"iteration-time", "step_ms", 1000},
    {"throughput", "tflops_per_gpu", 1},
    {"throughput/tokens_per_sec_per_gpu", "tokens_per_s_per_gpu", 1},
    {"throughput/mfu", "mfu", 1},
    {"mem/peak_gib", "peak_mem_gib", 1},
    {"skipped-iterations", "skipped_iterations", 1},
    {"nan-iterations", "nan_iterations", 1},
    {"optimizer-time", "optimizer_ms", 1000},
    {"data-wait-time", "data_wait_ms", 1000},
};

using Key = std::pair<int64_t, std::string>;  // (step, tag)

std::string tb_fresh_dir(const std::string& name) {
  auto dir = std::filesystem::temp_directory_path() / ("nibble_tb_" + name + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  return dir.string();
}

// A --quant-stats record's numbers under their TensorBoard tags: nested keys joined by '/'.
void flatten(const Json& j, const std::string& prefix, int64_t step, std::map<Key, double>* out) {
  for (const auto& [k, v] : j.items()) {
    if (v.is_object())
      flatten(v, prefix + k + "/", step, out);
    else if (v.is_number())
      (*out)[{step, prefix + k}] = v.get<double>();
  }
}

struct Expected {
  std::map<Key, double> exact;       // float(value) must equal the scalar
  std::map<Key, double> six_digits;  // validation: the JSONL prints 6 significant digits
  std::map<Key, bool> nonfinite;     // JSONL null: the scalar must be NaN or infinite
};

// What the event file must hold, from metrics.jsonl: step figures at the TensorBoard steps, validation
// at every evaluation, --quant-stats at every statistics step.
Expected expected_from_jsonl(const std::string& path, int64_t interval, int64_t last) {
  Expected e;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    Json r = Json::parse(line);
    const int64_t it = r["iteration"].get<int64_t>();
    if (r.contains("lm_loss")) {
      EXPECT_EQ(r.size(), std::size(kStepTags) + 1) << "a JSONL figure without a TensorBoard tag: " << line;
      if (it % interval != 0 && it != last) continue;
      for (const StepTag& t : kStepTags) {
        const Json& v = r[t.key];
        if (v.is_null())
          e.nonfinite[{it, t.tag}] = true;
        else
          e.exact[{it, t.tag}] = v.get<double>() / t.divisor;
      }
    } else if (r.contains("val_loss")) {
      e.six_digits[{it, "lm loss validation"}] = r["val_loss"].get<double>();
      e.six_digits[{it, "lm loss validation ppl"}] = r["val_ppl"].get<double>();
    } else if (r.contains("quant_worst_sqnr_db")) {
      for (const auto& [k, v] : r.items())
        if (k != "iteration" && v.is_number()) e.exact[{it, "quant/" + k.substr(6)}] = v.get<double>();
    } else if (r.contains("quant_stats")) {
      const std::string linear = r["quant_stats"];
      for (const char* k : {"iteration", "quant_stats", "layer"}) r.erase(k);
      flatten(r, "quant/" + linear + "/", it, &e.exact);
    }
  }
  return e;
}

}  // namespace

TEST(TensorBoardTrain, EveryScalarEqualsMetricsJsonl) {
  const std::string tb = tb_fresh_dir("events"), save = tb_fresh_dir("save");
  auto r = run_nibble(
      "train --model tiny --device cpu --train-iters 5 --seq-length 32 --micro-batch-size 2 --global-batch-size 4 "
      "--recipe bf16_with_nvfp4_mixed --num-layers-at-start-in-bf16 0 --num-layers-at-end-in-bf16 0 --quant-stats "
      "--eval-interval 2 --eval-iters 1 --tensorboard-log-interval 2 --tensorboard-dir " +
      tb + " --save " + save);
  ASSERT_EQ(r.code, 0) << r.out;
  const std::vector<std::string> files = nb::test::event_files(tb);
  ASSERT_EQ(files.size(), 1u);
  nb::test::TbFile f;
  ASSERT_EQ(nb::test::parse_event_file(files[0], &f), "");
  EXPECT_EQ(f.file_version, "brain.Event:2");

  const Expected want = expected_from_jsonl(save + "/metrics.jsonl", 2, 5);
  std::map<Key, float> got;
  double last_wall = 0;
  for (const nb::test::TbScalar& s : f.scalars) {
    EXPECT_TRUE(got.emplace(Key{s.step, s.tag}, s.value).second) << "twice: " << s.tag << " at " << s.step;
    EXPECT_GE(s.wall_time, last_wall);
    last_wall = s.wall_time;
  }
  EXPECT_GT(last_wall, 1.5e9);  // seconds since 1970
  EXPECT_EQ(got.size(), want.exact.size() + want.six_digits.size() + want.nonfinite.size());
  for (const auto& [k, v] : want.exact) {
    ASSERT_TRUE(got.count(k)) << k.second << " missing at step " << k.first;
    EXPECT_EQ(got[k], float(v)) << k.second << " at step " << k.first;
  }
  for (const auto& [k, v] : want.six_digits) {
    ASSERT_TRUE(got.count(k)) << k.second << " missing at step " << k.first;
    EXPECT_NEAR(got[k], v, 1e-5 * std::fabs(v)) << k.second << " at step " << k.first;
  }
  for (const auto& [k, v] : want.nonfinite) EXPECT_FALSE(std::isfinite(got[k])) << k.second << " at " << k.first;
  // The run's shape: step figures at 2, 4 and the last step 5; evaluations at 2, 4 and the end; statistics
  // at every step (--quant-stats-interval defaults to --log-interval 1).
  for (int64_t step : {2, 4, 5}) EXPECT_TRUE(got.count({step, "lm loss"})) << step;
  EXPECT_FALSE(got.count({1, "lm loss"}) || got.count({3, "lm loss"}));
  for (int64_t step : {2, 4, 5}) EXPECT_TRUE(got.count({step, "lm loss validation"})) << step;
  for (int64_t step = 1; step <= 5; ++step) EXPECT_TRUE(got.count({step, "quant/max_flushed"})) << step;
  EXPECT_EQ(got[Key(5, "batch-size")], 4.0f);
  EXPECT_EQ(got[Key(5, "consumed-samples")], 20.0f);
  std::filesystem::remove_all(tb);
  std::filesystem::remove_all(save);
}

TEST(TensorBoardTrain, RefusesAFolderItCannotWrite) {
  const std::string dir = tb_fresh_dir("refused");
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/file") << "a file, not a folder";
  const std::string bad = dir + "/file/tb", tiny = "train --model tiny --device cpu --train-iters 1 --seq-length 32 ";
  auto r = run_nibble(tiny + "--tensorboard-dir " + bad);
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("nibble train: --tensorboard-dir: cannot create the folder " + bad), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("resolved configuration"), std::string::npos) << "refused only after setup:\n" << r.out;
  r = run_nibble(tiny + "--tensorboard-log-interval 0 --tensorboard-dir " + dir + "/tb");
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("--tensorboard-log-interval must be positive"), std::string::npos) << r.out;
  std::filesystem::remove_all(dir);
}
