// CUDA: data past the vocabulary is refused before step 1 (the embedding kernel would read an unknown id
// as a zero row and the loss would drop it: a run that looks healthy), and staging a bad id is an error.
#include <gtest/gtest.h>
#include "common/gpu.h"
#include "model/llama_model.h"
#include "train/vocab_check_util.h"

using namespace nb;

TEST(VocabCheckCuda, OversizedIdsAreRefusedBeforeStepOne) {
  NB_REQUIRE_GPU();
  test::expect_refused_before_step_one("cuda", "vocab_cuda");
}

TEST(VocabCheckCuda, StagingABatchWithAnUnknownIdIsAnError) {
  NB_REQUIRE_GPU();
  LlamaConfig cfg;
  ASSERT_TRUE(llama_preset("tiny", &cfg).is_ok());
  LlamaModel model;
  ASSERT_TRUE(model.init(cfg, Device::cuda, {1, 64}, Recompute::none, 1).is_ok());
  std::vector<int32_t> tokens(64, 3), labels(64, 4);
  tokens[10] = int32_t(cfg.vocab) + 5;
  Status st = model.stage_batches(tokens.data(), labels.data(), 1);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("token id 261"), std::string::npos) << st.message();
}
