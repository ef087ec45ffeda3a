// Data that does not fit the model's vocabulary never trains: refused before step 1 with the file, the
// id and the vocabulary named; the range scan is cached; a bad id handed to the model directly (a future
// data path that skips the scan) stops at staging instead of becoming a zero row.
#include <gtest/gtest.h>
#include <filesystem>
#include "data/token_check.h"
#include "model/llama_model.h"
#include "train/vocab_check_util.h"

using namespace nb;

TEST(VocabCheck, OversizedIdsAreRefusedBeforeStepOneOnTheCpu) {
  test::expect_refused_before_step_one("cpu", "vocab_cpu");
}

TEST(VocabCheck, TheRangeIsScannedOnceAndThenCached) {
  const std::string dir = test::temp_folder("vocab_cache");
  const std::string prefix = test::write_oversized_dataset(dir);
  TokenRange a, b;
  ASSERT_TRUE(dataset_token_range(prefix, dir + "/cache", &a).is_ok());
  ASSERT_TRUE(dataset_token_range(prefix, dir + "/cache", &b).is_ok());
  EXPECT_FALSE(a.cached);
  EXPECT_TRUE(b.cached);
  EXPECT_EQ(a.min_id, 0);
  EXPECT_EQ(a.max_id, 300);
  EXPECT_EQ(b.max_id, 300);
  EXPECT_TRUE(check_dataset_vocab(prefix, dir + "/cache", 301, "m").is_ok());
  EXPECT_FALSE(check_dataset_vocab(prefix, dir + "/cache", 300, "m").is_ok());
}

TEST(VocabCheck, StagingABatchWithAnUnknownIdIsAnError) {
  LlamaConfig cfg;
  ASSERT_TRUE(llama_preset("tiny", &cfg).is_ok());
  LlamaModel model;
  ASSERT_TRUE(model.init(cfg, Device::cpu, {1, 8}, Recompute::none, 1).is_ok());
  std::vector<int32_t> tokens(8, 3), labels(8, 4);
  EXPECT_TRUE(model.stage_batches(tokens.data(), labels.data(), 1).is_ok());
  labels[5] = int32_t(cfg.vocab);
  Status st = model.stage_batches(tokens.data(), labels.data(), 1);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("label id 256 at position 5"), std::string::npos) << st.message();
  labels[5] = 4;
  tokens[0] = -1;
  EXPECT_FALSE(model.stage_batches(tokens.data(), labels.data(), 1).is_ok());
}
