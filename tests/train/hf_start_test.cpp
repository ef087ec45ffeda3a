// A run started from a Hugging Face folder (--load-hf) trains on exactly its weights: with a zero
// learning rate the checkpoint's FP32 masters equal the folder's BF16 tensors widened, tensor by tensor.
#include <gtest/gtest.h>
#include <cmath>
#include <filesystem>
#include "io/hf_llama.h"
#include "train/resume_util.h"

using namespace nb;

namespace {
std::string fixture() {
  return (std::filesystem::path(__FILE__).parent_path().parent_path() / "io" / "data" / "hf_tiny").string();
}
}  // namespace

TEST(LoadHf, TrainsFromExactlyTheFoldersWeights) {
  const std::string dir = test::temp_folder("load_hf");
  TrainConfig c;
  c.device = "cpu";
  c.load_hf = fixture();
  c.seq_length = 16;
  c.train_iters = 1;
  c.lr = 0;
  c.min_lr = 0;
  c.save = dir + "/run";
  c.save_interval = 1;
  c.log_interval = 100;
  TrainSummary s;
  Status st = run_training(c, &s);
  ASSERT_TRUE(st.is_ok()) << st.message();
  EXPECT_TRUE(std::isfinite(s.final_loss));
  HfCheckpointReader hf, ck;
  ASSERT_TRUE(hf.open(fixture()).is_ok());
  ASSERT_TRUE(ck.open_file(dir + "/run/iter_0000001/model.safetensors").is_ok());
  int compared = 0;
  for (const std::string& name : hf.names()) {
    if (!ck.has(name)) continue;
    int64_t n = 1;
    for (int64_t d : hf.shape(name)) n *= d;
    std::vector<float> a(static_cast<size_t>(n)), b(static_cast<size_t>(n));
    ASSERT_TRUE(hf.read_f32(name, a.data()).is_ok());
    ASSERT_TRUE(ck.read_f32(name, b.data()).is_ok());
    EXPECT_EQ(a, b) << name;
    ++compared;
  }
  EXPECT_EQ(compared, int(ck.names().size()));
  EXPECT_GT(compared, 10);
}

TEST(LoadHf, RefusesAVocabularyThatDisagreesWithTheFolder) {
  TrainConfig c;
  c.device = "cpu";
  c.load_hf = fixture();
  c.seq_length = 16;
  c.train_iters = 1;
  c.vocab_size = 512;
  TrainSummary s;
  Status st = run_training(c, &s);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("--vocab-size 512"), std::string::npos) << st.message();
}
