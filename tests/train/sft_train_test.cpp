// SFT through the whole trainer on the CPU backend: packed rows of prompt/answer samples, the loss
// averaged over answer tokens, training and validation answer-loss falling, and the errors for SFT
// options that cannot work.
#include <gtest/gtest.h>
#include <fstream>
#include "common/nibble_binary.h"
#include "train/resume_util.h"
#include "train/sft_reverse_data.h"
#include "train/trainer.h"

namespace nb {
namespace {

// 400 samples, prompts of 3..12 tokens (sft_reverse_data.h).
std::string write_sft_data(const std::string& dir) { return test::write_reverse_sft_data(dir, 3, 3, 10); }

TrainConfig sft_job(const std::string& prefix, const std::string& save) {
  TrainConfig c;
  c.device = "cpu";
  c.model = "tiny";
  test::use_reverse_sft(&c, prefix);
  c.train_iters = 40;
  c.lr = 3e-3;
  c.min_lr = 3e-4;
  c.lr_warmup_iters = 2;
  c.eval_interval = 10;
  c.eval_iters = 2;
  c.log_interval = 100;
  c.save = save;
  return c;
}

std::vector<double> val_losses(const std::string& save) {
  std::ifstream in(save + "/metrics.jsonl");
  std::vector<double> out;
  for (std::string line; std::getline(in, line);) {
    auto p = line.find("\"val_loss\":");
    if (p != std::string::npos) out.push_back(std::stod(line.substr(p + 11)));
  }
  return out;
}

TEST(SftTrainCpu, PackedAnswerLossFallsOnTrainAndValidation) {
  const std::string dir = test::temp_folder("sft_train");
  const std::string prefix = write_sft_data(dir);
  TrainSummary s;
  Status st = run_training(sft_job(prefix, dir + "/run"), &s);
  ASSERT_TRUE(st.is_ok()) << st.message();
  // The answer tokens start near ln(vocab); 40 steps learn at least which tokens answers use.
  EXPECT_LT(s.final_loss, s.first_loss - 1.0) << s.first_loss << " -> " << s.final_loss;
  const auto val = val_losses(dir + "/run");
  ASSERT_GE(val.size(), 3u);
  // Held-out answers: far below the untrained loss (the first step's, about ln 256 on the same kind of
  // samples) and still falling between the first evaluation (iteration 10) and the last.
  EXPECT_LT(val.back(), s.first_loss - 1.0) << s.first_loss << " -> " << val.back();
  EXPECT_LT(val.back(), val.front()) << val.front() << " -> " << val.back();
  std::filesystem::remove_all(dir);
}

TEST(SftTrainCpu, FinetuneCommandReportsPackingAndRefusesBadInput) {
  const std::string dir = test::temp_folder("sft_cli");
  const std::string prefix = write_sft_data(dir);
  auto r = test::run_nibble("finetune --model tiny --device cpu --data-path " + prefix +
                            " --seq-length 64 --micro-batch-size 2 --global-batch-size 2 --train-iters 2");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("packing efficiency"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("sft = true"), std::string::npos) << r.out;
  r = test::run_nibble("finetune --model tiny --device cpu --train-iters 2");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("--data-path"), std::string::npos) << r.out;
  r = test::run_nibble("finetune --model tiny --device cpu --train-iters 2 --data-path " + dir + "/missing");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("preprocess --sft"), std::string::npos) << r.out;
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace nb
