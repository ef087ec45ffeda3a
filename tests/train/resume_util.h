// Bit-exact resume check shared by the CPU and CUDA tests: N steps uninterrupted to 2N versus N steps,
// save and exit (--exit-interval), resume, N more steps. Losses (train and validation) must be equal as
// doubles and the final checkpoints' master weights and AdamW state equal byte for byte.
// Data: a Megatron .bin/.idx dataset of random documents written here, so the GPT sampler, its
// shuffles and the validation split all have to continue where they stopped.
#pragma once
#include <gtest/gtest.h>
#include <unistd.h>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <fstream>
#include <iterator>
#include <random>
#include <nlohmann/json.hpp>
#include <string>
#include "data/indexed_dataset.h"
#include "train/trainer.h"

namespace nb::test {

// Removes `path` when this test program exits with every test passed (a failure keeps its folders to look at;
// NIBBLE_KEEP_TEST_FOLDERS=1 keeps them always). Runs and checkpoints of a few hundred MB each otherwise pile up in
// the temp folder, one set per test process. Only the process that made a folder removes it (a forked child exits
// through _exit anyway).
inline void remove_at_exit(const std::string& path) {
  static std::vector<std::string> folders;
  static const pid_t owner = ::getpid();
  static const bool registered = [] {
    std::atexit([] {
      if (::getpid() != owner || std::getenv("NIBBLE_KEEP_TEST_FOLDERS")) return;
      if (!::testing::UnitTest::GetInstance()->Passed()) return;
      std::error_code ec;
      for (const std::string& f : folders) std::filesystem::remove_all(f, ec);
    });
    return true;
  }();
  (void)registered;
  folders.push_back(path);
}

inline std::string temp_folder(const std::string& name) {
  auto p = std::filesystem::temp_directory_path() / ("nibble_" + name + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(p);
  std::filesystem::create_directories(p);
  remove_at_exit(p.string());
  return p.string();
}

// 400 documents of 20..200 random tokens below `vocab`.
inline std::string write_random_dataset(const std::string& dir, int64_t vocab) {
  const std::string prefix = dir + "/docs_text_document";
  std::unique_ptr<IndexedDatasetWriter> w;
  EXPECT_TRUE(IndexedDatasetWriter::create(prefix, IndexedDtype::i32, &w).is_ok());
  std::mt19937 rng(7);
  for (int d = 0; d < 400; ++d) {
    std::vector<int32_t> doc(20 + rng() % 181);
    for (auto& t : doc) t = int32_t(rng() % uint32_t(vocab - 1));
    doc.back() = int32_t(vocab - 1);  // eod
    EXPECT_TRUE(w->add_document(doc.data(), int64_t(doc.size())).is_ok());
  }
  EXPECT_TRUE(w->finalize().is_ok());
  return prefix;
}

// The records of a run's metrics.jsonl that hold `key` (a step's "lm_loss", MoR's "mor_linear", ...), in order.
inline std::vector<nlohmann::json> metrics_records(const std::string& save, const char* key) {
  std::vector<nlohmann::json> out;
  std::ifstream in(save + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_object() && j.contains(key)) out.push_back(std::move(j));
  }
  return out;
}

inline std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// The tiny model, every layer in `recipe`, 6 steps of 4 sequences of 64 tokens on mock data.
inline TrainConfig tiny_job(const std::string& device, const std::string& recipe) {
  TrainConfig c;
  c.device = device;
  c.model = "tiny";
  c.recipe = recipe;
  c.train_iters = 6;
  c.lr = 3e-3;
  c.min_lr = 3e-4;
  c.lr_warmup_iters = 1;
  c.micro_batch_size = 2;
  c.global_batch_size = 4;
  c.seq_length = 64;
  c.log_interval = 100;
  c.num_layers_at_start_in_bf16 = 0;
  c.num_layers_at_end_in_bf16 = 0;  // every layer quantized (SR included)
  return c;
}

// tiny_job on real data with a validation split, evaluated every 2 steps.
inline TrainConfig resume_job(const std::string& device, const std::string& recipe, const std::string& data_prefix) {
  TrainConfig c = tiny_job(device, recipe);
  c.mock_data = false;
  c.data_path = data_prefix;
  c.split = "90,10,0";
  c.eval_interval = 2;
  c.eval_iters = 1;
  return c;
}

// Runs the comparison; `dir` is a fresh folder holding the dataset. tweak (optional) adjusts every run's job.
inline void expect_bit_exact_resume(const std::string& device, const std::string& recipe, const std::string& dir,
                                    const std::string& data_prefix,
                                    const std::function<void(TrainConfig*)>& tweak = {}) {
  const std::string a = dir + "/" + recipe + "_whole", b = dir + "/" + recipe + "_halves";
  auto resume_job = [&](const std::string& d, const std::string& rc, const std::string& data) {
    TrainConfig c = test::resume_job(d, rc, data);
    if (tweak) tweak(&c);
    return c;
  };
  TrainConfig whole = resume_job(device, recipe, data_prefix);
  whole.save = a;
  whole.save_interval = 6;
  TrainSummary sw;
  Status st = run_training(whole, &sw);
  ASSERT_TRUE(st.is_ok()) << st.message();
  TrainConfig first = resume_job(device, recipe, data_prefix);
  first.save = b;
  first.save_interval = 6;
  first.exit_interval = 3;
  TrainSummary s1, s2;
  st = run_training(first, &s1);
  ASSERT_TRUE(st.is_ok()) << st.message();
  ASSERT_EQ(s1.end_iteration, 3);
  TrainConfig second = resume_job(device, recipe, data_prefix);
  second.save = b;
  second.load = b;
  second.save_interval = 6;
  st = run_training(second, &s2);
  ASSERT_TRUE(st.is_ok()) << st.message();
  ASSERT_EQ(s2.start_iteration, 3);
  ASSERT_EQ(sw.losses.size(), 6u);
  std::vector<double> joined = s1.losses;
  joined.insert(joined.end(), s2.losses.begin(), s2.losses.end());
  EXPECT_EQ(joined, sw.losses) << recipe << " on " << device;  // exact double equality
  EXPECT_EQ(s2.final_val_loss, sw.final_val_loss) << recipe;
  for (const char* f : {"model.safetensors", "optimizer.safetensors"}) {
    const std::string x = file_bytes(a + "/iter_0000006/" + f), y = file_bytes(b + "/iter_0000006/" + f);
    ASSERT_FALSE(x.empty()) << f;
    EXPECT_TRUE(x == y) << recipe << ": " << f << " differs between the whole run and the resumed one";
  }
}

}  // namespace nb::test
