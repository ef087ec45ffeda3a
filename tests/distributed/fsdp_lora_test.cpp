// LoRA over Megatron-FSDP on the CPU backend (Gloo): with optim_grads_params each rank keeps 1/d of the frozen
// base (BF16 rows, or a quantized weight's chunk of codes and scales) and gathers each unit before its forward
// and its backward; the adapters stay whole and their gradients are all-reduced as in a LoRA DDP run.
//
// Tolerances: as fsdp_test.cpp. The gathered base is the whole base bit for bit (BF16 rows, or byte for byte
// the whole weight's quantized copies), so a sharded run computes what a LoRA DDP run over the same ranks
// computes, exactly; against one rank only the FP32 summation order of the adapters' gradients differs
// (1e-6 relative at step 1; losses 1e-5 later in BF16 bases, 1e-2 in quantized ones, where AdamW's steps
// move a few activations across a rounding boundary; adapter weights within 1e-2 x steps x lr). A rank
// reading another rank's rows, a missing gather or a base quantized with its chunk's own amax moves step 1
// by far more.
#include <gtest/gtest.h>
#include <cmath>
#include "distributed/ddp_util.h"
#include "io/hf_llama.h"
#include "io/peft_adapter.h"
#include "model/llama_model.h"

namespace nb {
namespace {

const std::string kSharded = " --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params";

// The shared tiny job at global batch 8 with 3 layers, the last in BF16 (the quantized bases' tests).
std::string mixed_job() {
  std::string job = kJob;
  job.replace(job.find("--global-batch-size 16"), 22, "--global-batch-size 8");
  job.replace(job.find("--num-layers-at-end-in-bf16 0"), 29, "--num-layers-at-end-in-bf16 1 --num-layers 3");
  return job;
}

// A LoRA run of `job` (the shared tiny job by default); its save folder.
std::string lora_run(const std::string& dir, const std::string& name, int ranks, int iters, const std::string& extra,
                     std::string* out = nullptr, const std::string& job = kJob) {
  const std::string save = dir + "/" + name;
  const test::CliRun r = test::run_nibble(job + "--peft lora --lora-rank 8 --lora-alpha 16 --train-iters " +
                                          std::to_string(iters) + " --save " + save + " --save-interval " +
                                          std::to_string(iters) + " --nproc-per-node " + std::to_string(ranks) + extra);
  EXPECT_EQ(r.code, 0) << r.out;
  if (out) *out = r.out;
  return save;
}

LlamaConfig tiny(int64_t layers) {
  LlamaConfig c;
  EXPECT_TRUE(llama_preset("tiny", &c).is_ok());
  c.layers = layers;
  return c;
}

// The largest difference between two runs' PEFT adapters (A and B of every adapted linear).
double adapter_difference(const std::string& a_save, const std::string& b_save, int iters, int64_t layers) {
  char folder[48];
  std::snprintf(folder, sizeof(folder), "/peft_adapter_iter_%07d", iters);
  LoraAdapter a, b;
  EXPECT_TRUE(read_peft_adapter(a_save + folder, tiny(layers), &a).is_ok()) << a_save;
  EXPECT_TRUE(read_peft_adapter(b_save + folder, tiny(layers), &b).is_ok()) << b_save;
  EXPECT_EQ(a.linears.size(), b.linears.size());
  double worst = 0;
  for (size_t i = 0; i < a.linears.size() && i < b.linears.size(); ++i) {
    EXPECT_EQ(a.linears[i].a.size(), b.linears[i].a.size());
    for (size_t k = 0; k < a.linears[i].a.size() && k < b.linears[i].a.size(); ++k)
      worst = std::max(worst, double(std::fabs(a.linears[i].a[k] - b.linears[i].a[k])));
    for (size_t k = 0; k < a.linears[i].b.size() && k < b.linears[i].b.size(); ++k)
      worst = std::max(worst, double(std::fabs(a.linears[i].b[k] - b.linears[i].b[k])));
  }
  return worst;
}

// Two steps of a sharded-base run: equal to LoRA DDP over the same ranks bit for bit (adapters too) and to
// one rank at step 1 within the reduction-order bound.
void expect_two_steps_match(const std::string& one, const std::string& ddp, const std::string& fsdp, int64_t layers) {
  const auto ref = read_metrics(one), same = read_metrics(ddp), got = read_metrics(fsdp);
  ASSERT_EQ(ref.size(), 2u);
  ASSERT_EQ(got.size(), 2u);
  ASSERT_EQ(same.size(), 2u);
  EXPECT_NEAR(got[0].loss, ref[0].loss, 1e-6 * ref[0].loss);
  EXPECT_NEAR(got[0].grad_norm, ref[0].grad_norm, 1e-6 * ref[0].grad_norm);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(got[i].loss, same[i].loss) << "step " << i + 1;
    EXPECT_EQ(got[i].grad_norm, same[i].grad_norm) << "step " << i + 1;
  }
  EXPECT_EQ(adapter_difference(ddp, fsdp, 2, layers), 0.0);
}

// A frozen base in the FSDP layout keeps no rows of the weights its quantized Linears hold, and exactly 1/d of
// the rest; the estimate of a sharded 70B BF16 base is about half of the whole one.
TEST(FsdpLoraLayout, FrozenBaseShardsAndSkipsQuantizedWeights) {
  const LlamaConfig cfg = tiny(3);
  ParamStore whole, half;
  ASSERT_TRUE(whole.allocate_frozen_fsdp(cfg, Device::cpu, 0, 1, 16, 0, 2).is_ok());
  ASSERT_TRUE(half.allocate_frozen_fsdp(cfg, Device::cpu, 1, 2, 16, 0, 2).is_ok());
  EXPECT_TRUE(half.frozen());
  EXPECT_FALSE(half.has_compute("model.layers.1.mlp.down_proj.weight"));
  EXPECT_TRUE(half.has_compute("model.layers.2.mlp.down_proj.weight"));
  EXPECT_TRUE(half.has_compute("model.layers.1.input_layernorm.weight"));
  int64_t stored = 0;
  for (const ParamStore::Group& g : half.groups()) stored += g.stored ? g.chunk() : 0;
  EXPECT_EQ(half.shard_len(), stored);
  EXPECT_LE(half.shard_len(), whole.shard_len() / 2 + 64 * int64_t(half.groups().size()));
  EXPECT_EQ(half.unit_elems(2), 2 * cfg.hidden) << "a quantized layer's window holds its two norms";
  EXPECT_EQ(half.bytes(), size_t(half.shard_len()) * 4);
  LlamaConfig big;
  ASSERT_TRUE(llama_preset("llama3.1-70b", &big).is_ok());
  LoraSpec spec;
  const double one = double(LlamaModel::lora_parameter_bytes(big, Device::cuda, recipe::Recipe{}, spec, 1));
  const double two = double(LlamaModel::lora_parameter_bytes(big, Device::cuda, recipe::Recipe{}, spec, 2));
  // Half of the base; the adapters whole; one large and two layer windows of BF16.
  const double adapters = 18.0 * double(lora_param_count(big, spec));
  const double windows = 2.0 * double(big.vocab * big.hidden + 2 * (big.linear_params_per_layer() + 2 * big.hidden));
  EXPECT_NEAR(two, (one - adapters) / 2 + adapters + windows, 1e3);
}

// BF16 base: one rank, two ranks of LoRA DDP and two ranks sharding the base. The sharded run equals the DDP
// run bit for bit and one rank within the tolerances above, through its saved PEFT adapter too.
TEST(FsdpLoraCpu, Bf16BaseReproducesOneRank) {
  const std::string dir = test::temp_folder("fsdp_lora_bf16");
  const int kIters = 3;
  const std::string one = lora_run(dir, "one", 1, kIters, "");
  const std::string ddp = lora_run(dir, "ddp", 2, kIters, "");
  std::string log;
  const std::string fsdp = lora_run(dir, "fsdp", 2, kIters, kSharded, &log);
  EXPECT_NE(log.find("the frozen LoRA base sharded (1/2 of every layer per rank, bf16)"), std::string::npos) << log;
  const auto ref = read_metrics(one), same = read_metrics(ddp), got = read_metrics(fsdp);
  ASSERT_EQ(ref.size(), size_t(kIters));
  ASSERT_EQ(got.size(), ref.size());
  ASSERT_EQ(same.size(), ref.size());
  EXPECT_NEAR(got[0].loss, ref[0].loss, 1e-6 * ref[0].loss);
  EXPECT_NEAR(got[0].grad_norm, ref[0].grad_norm, 1e-6 * ref[0].grad_norm);
  for (size_t i = 0; i < ref.size(); ++i) {
    EXPECT_NEAR(got[i].loss, ref[i].loss, 1e-5 * ref[i].loss) << "step " << i + 1;
    EXPECT_EQ(got[i].loss, same[i].loss) << "step " << i + 1;
    EXPECT_EQ(got[i].grad_norm, same[i].grad_norm) << "step " << i + 1;
  }
  EXPECT_LE(adapter_difference(one, fsdp, kIters, 2), 1e-2 * kIters * kLr);
  EXPECT_EQ(adapter_difference(ddp, fsdp, kIters, 2), 0.0);
}

// FP8 and NVFP4 bases (layers 0-1 quantized, layer 2 BF16): the quantized weights' chunks travel as codes and
// scales. Two ranks against one at global batch 8, and against two ranks of LoRA DDP bit for bit.
class FsdpLoraBase : public ::testing::TestWithParam<const char*> {};

TEST_P(FsdpLoraBase, QuantizedBaseMatchesOneRank) {
  const std::string precision = GetParam(), dir = test::temp_folder("fsdp_lora_" + precision);
  const std::string base = " --lora-base-precision " + precision + " --eval-interval 0", job = mixed_job();
  const std::string one = lora_run(dir, "one", 1, 2, base, nullptr, job);
  const std::string ddp = lora_run(dir, "ddp", 2, 2, base, nullptr, job);
  std::string log;
  const std::string fsdp = lora_run(dir, "fsdp", 2, 2, base + kSharded, &log, job);
  EXPECT_NE(log.find("gathers 8 frozen base weights in their stored format"), std::string::npos) << log;
  expect_two_steps_match(one, ddp, fsdp, 3);
  const auto ref = read_metrics(one), got = read_metrics(fsdp);
  ASSERT_EQ(got.size(), 2u);
  EXPECT_NEAR(got[1].loss, ref[1].loss, 1e-2 * ref[1].loss);
}

INSTANTIATE_TEST_SUITE_P(FsdpLoraCpu, FsdpLoraBase, ::testing::Values("fp8", "nvfp4"));

// Four ranks, two micro-batches each, BF16 and NVFP4 bases: the sharded run equals four ranks of LoRA DDP bit
// for bit (adapters too) and one rank at step 1 within the reduction-order bound.
class FsdpLoraFourRanks : public ::testing::TestWithParam<const char*> {};

TEST_P(FsdpLoraFourRanks, ShardedBaseMatchesLoraDdp) {
  const std::string precision = GetParam(), dir = test::temp_folder("fsdp_lora4_" + precision);
  const std::string base = " --lora-base-precision " + precision + " --eval-interval 0";
  const std::string one = lora_run(dir, "one", 1, 2, base);
  const std::string ddp = lora_run(dir, "ddp", 4, 2, base);
  std::string log;
  const std::string fsdp = lora_run(dir, "fsdp", 4, 2, base + kSharded, &log);
  EXPECT_NE(log.find("the frozen LoRA base sharded (1/4 of every layer per rank, " + precision + ")"),
            std::string::npos)
      << log;
  expect_two_steps_match(one, ddp, fsdp, 2);
}

INSTANTIATE_TEST_SUITE_P(FsdpLoraCpu, FsdpLoraFourRanks, ::testing::Values("bf16", "nvfp4"));

// --fsdp-embeddings-per-step over a BF16 base: the embedding and head stay gathered through the step's four
// micro-batches per rank (nothing to reduce: the base is frozen); still LoRA DDP bit for bit, adapters too.
TEST(FsdpLoraCpu, EmbeddingsPerStepEqualLoraDdp) {
  const std::string dir = test::temp_folder("fsdp_lora_eps");
  const std::string one = lora_run(dir, "one", 1, 2, " --eval-interval 0");
  const std::string ddp = lora_run(dir, "ddp", 2, 2, " --eval-interval 0");
  std::string log;
  const std::string fsdp =
      lora_run(dir, "fsdp", 2, 2, " --eval-interval 0 --fsdp-embeddings-per-step" + kSharded, &log);
  EXPECT_NE(log.find("the embedding and output layer gathered once per step (--fsdp-embeddings-per-step)"),
            std::string::npos)
      << log;
  expect_two_steps_match(one, ddp, fsdp, 2);
}

// A base from --load-hf: each rank reads every tensor and keeps its rows; one step equals one rank's.
TEST(FsdpLoraCpu, HfBaseLoadsIntoTheShards) {
  const std::string dir = test::temp_folder("fsdp_lora_hf");
  const LlamaConfig cfg = tiny(2);
  auto source = [](const HfTensor& t, float* dst) {
    const bool norm = t.shape.size() == 1;
    for (int64_t i = 0; i < t.numel; ++i)
      dst[i] = norm ? 1.0f + 0.1f * float(std::sin(0.7 * double(i))) : 0.05f * float(std::sin(0.37 * double(i) + 1.3));
    return Status::ok();
  };
  HfExportOptions opt;
  opt.dtype = "fp32";
  ASSERT_TRUE(write_hf_folder(dir + "/hf", cfg, hf_expected_tensors(cfg), source, opt).is_ok());
  const std::string from = " --load-hf " + dir + "/hf --eval-interval 0";
  const auto ref = read_metrics(lora_run(dir, "one", 1, 1, from));
  const auto got = read_metrics(lora_run(dir, "fsdp", 2, 1, from + kSharded));
  ASSERT_EQ(ref.size(), 1u);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_NEAR(got[0].loss, ref[0].loss, 1e-6 * ref[0].loss);
  EXPECT_NEAR(got[0].grad_norm, ref[0].grad_norm, 1e-6 * ref[0].grad_norm);
}

}  // namespace
}  // namespace nb
