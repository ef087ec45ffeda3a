// The memory estimate against what a model really allocates: the tiny model is built on the CPU backend
// (which allocates the same layouts in host memory) for every recipe, recompute mode, micro-batch and LoRA,
// and each part the ledger recorded (core/memory_ledger.h) must equal the estimate's row for it, byte for
// byte. Also: the ledger itself (parts, peaks, frees) and the advice's promise (each suggestion fits).
#include <gtest/gtest.h>
#include <vector>
#include "core/memory_ledger.h"
#include "infer/generator.h"
#include "infer/weights.h"
#include "model/llama_model.h"
#include "recipe/recipe.h"
#include "train/memory_estimate.h"

using namespace nb;

namespace {

struct EstimateCase {
  std::string recipe;
  Recompute rc;
  int64_t micro_batch;
  bool lora;
};

std::string case_name(const ::testing::TestParamInfo<EstimateCase>& i) {
  const char* rc[] = {"none", "selective", "full"};
  return i.param.recipe + "_" + rc[int(i.param.rc)] + "_mbs" + std::to_string(i.param.micro_batch) +
         (i.param.lora ? "_lora" : "");
}

class EstimateMatchesAllocations : public ::testing::TestWithParam<EstimateCase> {};

TEST_P(EstimateMatchesAllocations, PartByPart) {
  const EstimateCase& k = GetParam();
  LlamaConfig c;
  ASSERT_TRUE(llama_preset("tiny", &c).is_ok());
  c.layers = 4;
  recipe::Recipe r;
  ASSERT_TRUE(recipe::recipe_preset(k.recipe, &r).is_ok());
  recipe::RecipeKnobs knobs;
  knobs.layers_at_start_bf16 = 0;
  knobs.layers_at_end_bf16 = 1;  // one BF16 layer beside three quantized ones
  if (r.quantized()) { ASSERT_TRUE(recipe::apply_knobs(knobs, &r).is_ok()); }
  MemoryJob j;
  j.model = c;
  j.dev = Device::cpu;
  j.recipe = j.params_plan = j.acts_plan = r;
  j.micro_batch = k.micro_batch;
  j.seq = 128;
  j.global_batch = 2 * k.micro_batch;  // two micro-batches staged per step
  j.recompute = k.rc;
  j.lora = k.lora;
  if (k.lora) j.lora_spec.rank = 8;
  MemoryEstimate e;
  ASSERT_TRUE(estimate_memory(j, &e).is_ok());

  const LedgerSnapshot before = ledger_snapshot(Device::cpu);
  LlamaModel m;
  if (k.lora) m.set_lora(j.lora_spec, nullptr);
  ASSERT_TRUE(m.init(c, Device::cpu, {j.micro_batch, j.seq}, k.rc, 7, r).is_ok());
  std::vector<int32_t> tokens(size_t(2 * j.micro_batch * j.seq), 1);
  ASSERT_TRUE(m.stage_batches(tokens.data(), tokens.data(), 2).is_ok());
  const LedgerSnapshot after = ledger_snapshot(Device::cpu);

  for (MemPart p : {MemPart::params, MemPart::activations, MemPart::quantized_copies, MemPart::linear_workspace,
                    MemPart::weight_stage, MemPart::step_inputs, MemPart::lora}) {
    const size_t held = after.parts[size_t(p)].current - before.parts[size_t(p)].current;
    EXPECT_EQ(double(held), e.part(p)) << mem_part_name(p);
  }
}

std::vector<EstimateCase> estimate_cases() {
  std::vector<EstimateCase> out;
  for (const std::string& r : recipe::recipe_names())
    for (Recompute rc : {Recompute::none, Recompute::selective, Recompute::full}) out.push_back({r, rc, 1, false});
  for (const char* r : {"bf16_mixed", "bf16_with_fp8_current_scaling_mixed", "bf16_with_nvfp4_mixed"}) {
    out.push_back({r, Recompute::none, 2, false});
    out.push_back({r, Recompute::none, 1, true});
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Plans, EstimateMatchesAllocations, ::testing::ValuesIn(estimate_cases()), case_name);

// The training samples' generator: what it allocates for a prompt and a context, against planned_bytes (the
// estimate's row), with a quantized store whose linear weights have no compute copy (cast through a stage).
TEST(MemoryEstimateSamples, GeneratorAllocatesWhatItsPlanSays) {
  LlamaConfig c;
  ASSERT_TRUE(llama_preset("tiny", &c).is_ok());
  c.layers = 3;
  for (const char* name : {"bf16_mixed", "bf16_with_fp8_current_scaling_mixed"}) {
    recipe::Recipe r;
    ASSERT_TRUE(recipe::recipe_preset(name, &r).is_ok());
    recipe::RecipeKnobs knobs;
    knobs.layers_at_start_bf16 = knobs.layers_at_end_bf16 = 0;
    if (r.quantized()) { ASSERT_TRUE(recipe::apply_knobs(knobs, &r).is_ok()); }
    LlamaModel m;
    ASSERT_TRUE(m.init(c, Device::cpu, {1, 128}, Recompute::none, 3, r).is_ok());
    const std::vector<int32_t> prompt = {1, 2, 3, 4, 5, 6, 7};
    const int64_t context = int64_t(prompt.size()) + 9;
    const size_t before = ledger_snapshot(Device::cpu).parts[size_t(MemPart::samples)].current;
    MemoryScope scope(MemPart::samples);
    infer::ModelWeights w;
    ASSERT_TRUE(infer::weights_from_store(m.params(), c, &w).is_ok());
    infer::Generator gen;
    ASSERT_TRUE(gen.init(c, w, Device::cpu, 1, context).is_ok());
    infer::GenerateOptions o;
    o.max_new_tokens = 9;
    infer::GenerateResult res;
    ASSERT_TRUE(gen.generate({prompt}, o, &res).is_ok());
    const size_t held = ledger_snapshot(Device::cpu).parts[size_t(MemPart::samples)].current - before;
    EXPECT_EQ(int64_t(held),
              infer::Generator::planned_bytes(c, Device::cpu, 1, context, int64_t(prompt.size()), r.quantized()))
        << name;
  }
}

TEST(MemoryLedger, PartsPeaksAndFrees) {
  const LedgerSnapshot base = ledger_snapshot(Device::cpu);
  ledger_reset_peaks(Device::cpu);
  {
    Buffer a, b;
    {
      MemoryScope s(MemPart::samples);
      ASSERT_TRUE(Buffer::allocate(&a, DType::f32, Device::cpu, {1000}).is_ok());  // 4000 -> 4096 bytes
    }
    ASSERT_TRUE(Buffer::allocate(&b, DType::u8, Device::cpu, {1}).is_ok());  // MemPart::other, 256 bytes
    const LedgerSnapshot s = ledger_snapshot(Device::cpu);
    EXPECT_EQ(s.parts[size_t(MemPart::samples)].current - base.parts[size_t(MemPart::samples)].current, 4096u);
    EXPECT_EQ(s.parts[size_t(MemPart::other)].current - base.parts[size_t(MemPart::other)].current, 256u);
    EXPECT_EQ(s.total.current - base.total.current, 4352u);
  }
  const LedgerSnapshot s = ledger_snapshot(Device::cpu);
  EXPECT_EQ(s.total.current, base.total.current);  // both freed
  EXPECT_EQ(s.total.peak, base.total.current + 4352u);
  EXPECT_EQ(s.parts[size_t(MemPart::samples)].peak - s.parts[size_t(MemPart::samples)].current, 4096u);
}

// Every change advise_memory suggests, applied to the job, fits by the estimate; and the suggestions for a
// job whose activations alone overflow the GPU never include the distributed optimizer (it shards only
// optimizer state).
TEST(MemoryAdvice, SuggestionsFitAndActivationsNeedMoreThanTheDistributedOptimizer) {
  MemoryJob j;
  ASSERT_TRUE(llama_preset("llama3.1-8b", &j.model).is_ok());
  j.micro_batch = 1;
  j.seq = 65536;
  j.global_batch = 8;
  j.recompute = Recompute::full;
  j.placement = {1.0, int64_t(64) << 18};
  const double free = 80.0 * 1073741824.0 - kCudaContextBytes, host = 512.0 * 1073741824.0;
  MemoryEstimate e;
  ASSERT_TRUE(estimate_memory(j, &e).is_ok());
  ASSERT_GT(e.device(), free) << "the 64K case must not fit one 80 GiB GPU for this test to mean anything";
  const auto advice = advise_memory(j, free, host, 8);
  ASSERT_FALSE(advice.empty());
  for (const MemoryAdvice& a : advice) {
    EXPECT_LE(a.device_bytes, free) << a.flags;
    EXPECT_EQ(a.flags.find("--use-distributed-optimizer"), std::string::npos) << a.flags;
  }
  EXPECT_NE(advice[0].flags.find("optim_grads"), std::string::npos) << advice[0].flags;
}

}  // namespace

namespace nb {
namespace {

// Context parallelism: a rank's activations, attention workspace and step inputs are those of S / C tokens per
// row (the model is built for them), plus the ring's scratch (ops::cp::Ring::scratch_bytes) and the tokens'
// row positions; weights are sharded over all C x D ranks. And the advice for a sequence whose activations do
// not fit offers --context-parallel-size, whose estimate fits.
TEST(MemoryEstimateContextParallel, ARankHoldsItsShareOfEachRow) {
  MemoryJob whole;
  ASSERT_TRUE(llama_preset("llama3.1-8b", &whole.model).is_ok());
  whole.micro_batch = 1;
  whole.global_batch = 1;
  whole.recompute = Recompute::selective;
  whole.ranks = 4;
  whole.strategy = "optim_grads_params";
  MemoryJob cp = whole;
  whole.seq = 16384;  // what each of 4 context-parallel ranks holds of a 64K row
  cp.seq = 65536;
  cp.context_parallel = 4;
  MemoryEstimate a, b;
  ASSERT_TRUE(estimate_memory(whole, &a).is_ok());
  ASSERT_TRUE(estimate_memory(cp, &b).is_ok());
  EXPECT_EQ(b.part(MemPart::activations), a.part(MemPart::activations));
  EXPECT_EQ(b.part(MemPart::params), a.part(MemPart::params));
  const ops::AttentionShape local{1, 16384, 32, 8, 128, 1.0f};
  EXPECT_EQ(b.part(MemPart::attention_workspace) - a.part(MemPart::attention_workspace),
            double(ops::cp::Ring::scratch_bytes(local, DType::bf16)));
  // RoPE covers the whole row (4 x 16384 rows of 64 cos and 64 sin floats) and each token's position (4 bytes).
  EXPECT_EQ(b.part(MemPart::step_inputs) - a.part(MemPart::step_inputs), 2.0 * 3 * 16384 * 64 * 4 + 16384 * 4);

  MemoryJob one = whole;  // 64K on one GPU: the activations alone exceed it
  one.seq = 65536;
  one.ranks = 1;
  one.strategy = "no_shard";
  const double free = 80.0 * 1073741824.0 - kCudaContextBytes;
  const auto advice = advise_memory(one, free, 512.0 * 1073741824.0, 8, 16);
  bool offered = false;
  for (const MemoryAdvice& m : advice) {
    EXPECT_LE(m.device_bytes, free) << m.flags;
    offered |= m.flags.find("--context-parallel-size") != std::string::npos;
  }
  EXPECT_TRUE(offered) << "no --context-parallel-size among " << advice.size() << " suggestions";
}

}  // namespace
}  // namespace nb
