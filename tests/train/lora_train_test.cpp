// `--peft lora` through the trainer on the CPU backend: a run stopped and resumed equals an uninterrupted
// one bit for bit (NVFP4 base, LoRA dropout on), checkpoints hold the adapters only and the run ends with
// a PEFT adapter folder; a base from --load-hf starts exactly where full training from it starts (B = 0);
// settings a LoRA run cannot honour are refused in one sentence.
#include <gtest/gtest.h>
#include <filesystem>
#include "io/hf_llama.h"
#include "io/peft_adapter.h"
#include "io/safetensors.h"
#include "resume_util.h"

using namespace nb;

namespace {

TrainConfig lora_job(const std::string& data_prefix) {
  TrainConfig c = test::resume_job("cpu", "bf16_mixed", data_prefix);
  c.num_layers = 6;
  c.peft = "lora";
  c.lora_rank = 8;
  c.lora_alpha = 16;
  c.lora_dropout = 0.1;
  c.lora_base_precision = "nvfp4";
  c.num_layers_at_start_in_bf16 = -1;
  c.num_layers_at_end_in_bf16 = -1;  // the recipe's: layers 2-5 BF16, 0-1 NVFP4
  c.lr = 1e-2;
  return c;
}

}  // namespace

TEST(LoraTrainCpu, ResumesBitExactlyAndWritesAPeftAdapter) {
  const std::string dir = test::temp_folder("lora_resume");
  const std::string prefix = test::write_random_dataset(dir, 256);
  TrainConfig whole = lora_job(prefix), first = lora_job(prefix), second = lora_job(prefix);
  whole.save = dir + "/whole";
  first.save = second.save = second.load = dir + "/halves";
  whole.save_interval = first.save_interval = second.save_interval = 6;
  first.exit_interval = 3;
  TrainSummary sw, s1, s2;
  Status st = run_training(whole, &sw);
  ASSERT_TRUE(st.is_ok()) << st.message();
  ASSERT_TRUE((st = run_training(first, &s1)).is_ok()) << st.message();
  ASSERT_TRUE((st = run_training(second, &s2)).is_ok()) << st.message();
  ASSERT_EQ(s2.start_iteration, 3);
  std::vector<double> joined = s1.losses;
  joined.insert(joined.end(), s2.losses.begin(), s2.losses.end());
  EXPECT_EQ(joined, sw.losses);
  EXPECT_EQ(s2.final_val_loss, sw.final_val_loss);
  // The checkpoint holds the adapters only: 2 matrices x 4 targets x 6 layers.
  SafeTensorsFile model;
  ASSERT_TRUE(read_safetensors(whole.save + "/iter_0000006/model.safetensors", &model).is_ok());
  EXPECT_EQ(model.tensors.size(), 48u);
  for (const auto& [name, t] : model.tensors) EXPECT_NE(name.find(".lora_"), std::string::npos) << name;
  // The PEFT folder reads back (as PeftModel.from_pretrained would) with the run's spec and trained B.
  LlamaConfig cfg;
  ASSERT_TRUE(llama_preset("tiny", &cfg).is_ok());
  cfg.layers = 6;
  LoraAdapter ad;
  st = read_peft_adapter(whole.save + "/peft_adapter_iter_0000006", cfg, &ad);
  ASSERT_TRUE(st.is_ok()) << st.message();
  EXPECT_EQ(ad.spec.rank, 8);
  EXPECT_EQ(ad.spec.alpha, 16.0);
  EXPECT_EQ(ad.spec.dropout, 0.1);
  double b_sum = 0;
  for (const LoraLinear& L : ad.linears)
    for (float v : L.b) b_sum += std::fabs(v);
  EXPECT_GT(b_sum, 0.0);
  std::filesystem::remove_all(dir);
}

// B = 0: the first step's loss of LoRA on an HF base is the base model's loss, i.e. full training's
// first loss from the same folder (same data order, bf16_mixed: the same GEMMs).
TEST(LoraTrainCpu, HfBaseStartsWhereFullTrainingStarts) {
  const std::string dir = test::temp_folder("lora_hf");
  const std::string prefix = test::write_random_dataset(dir, 256);
  TrainConfig plain = test::resume_job("cpu", "bf16_mixed", prefix);
  plain.train_iters = 1;
  plain.save = dir + "/plain";
  plain.save_interval = 1;
  plain.lr = 0.5;  // the exported weights differ from any seed's init
  TrainSummary s0;
  Status st = run_training(plain, &s0);
  ASSERT_TRUE(st.is_ok()) << st.message();
  // Export the trained checkpoint as an HF folder through its model file.
  LlamaConfig cfg;
  ASSERT_TRUE(llama_preset("tiny", &cfg).is_ok());
  HfCheckpointReader r;
  ASSERT_TRUE(r.open_file(plain.save + "/iter_0000001/model.safetensors").is_ok());
  auto source = [&r](const HfTensor& t, float* dst) { return r.read_f32(t.name, dst); };
  HfExportOptions opt;
  opt.dtype = "fp32";
  ASSERT_TRUE(write_hf_folder(dir + "/hf", cfg, hf_expected_tensors(cfg), source, opt).is_ok());
  TrainConfig full = test::resume_job("cpu", "bf16_mixed", prefix), lora = full;
  full.train_iters = lora.train_iters = 2;
  full.load_hf = lora.load_hf = dir + "/hf";
  full.eval_interval = lora.eval_interval = 0;
  full.seed = lora.seed = 99;
  lora.peft = "lora";
  TrainSummary sf, sl;
  ASSERT_TRUE((st = run_training(full, &sf)).is_ok()) << st.message();
  ASSERT_TRUE((st = run_training(lora, &sl)).is_ok()) << st.message();
  EXPECT_EQ(sf.losses[0], sl.losses[0]);
  EXPECT_NE(sf.losses[1], sl.losses[1]);  // then they train different parameters
  std::filesystem::remove_all(dir);
}

TEST(LoraTrainCpu, RefusesWhatALoraRunCannotHonour) {
  TrainConfig c;
  c.device = "cpu";
  c.peft = "lora";
  c.recipe = "bf16_with_fp8_current_scaling_mixed";
  TrainSummary s;
  Status st = run_training(c, &s);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("--lora-base-precision"), std::string::npos) << st.message();
  c.recipe = "bf16_mixed";
  c.lora_target = "linear_qkv,q_proj";
  st = run_training(c, &s);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("--lora-target"), std::string::npos) << st.message();
  c.lora_target = "all-linear";
  c.lora_dropout = 1.0;
  st = run_training(c, &s);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("--lora-dropout"), std::string::npos) << st.message();
}
