// The memory estimate against what a model really allocates: the tiny model is built on the CPU backend
// (which allocates the same layouts in host memory) for every recipe, recompute mode, micro-batch and LoRA,
// and each part the ledger recorded (core/memory_ledger.h) must equal the estimate's row for it, byte for
// byte; at tensor-parallel sizes 2 and 4 too (LoRA at 2), a rank's model built with a group whose collectives do
// nothing (init calls none). Also: the ledger itself (parts, peaks, frees) and the advice's promise (each suggestion
// fits).
#include <gtest/gtest.h>
#include <algorithm>
#include <vector>
#include "core/memory_ledger.h"
#include "infer/generator.h"
#include "infer/weights.h"
#include "model/llama_model.h"
#include "model/tensor_parallel.h"
#include "ops/vocab_parallel_ce.h"
#include "recipe/linear.h"
#include "recipe/linear_workspace.h"
#include "recipe/recipe.h"
#include "train/memory_estimate.h"

using namespace nb;

namespace {

struct EstimateCase {
  std::string recipe;
  Recompute rc;
  int64_t micro_batch;
  bool lora;
  int tensor = 1;   // tensor-parallel size: the estimate and the model are one rank's of T
  bool sp = false;  // sequence parallelism (T > 1)
};

std::string case_name(const ::testing::TestParamInfo<EstimateCase>& i) {
  const char* rc[] = {"none", "selective", "full"};
  return i.param.recipe + "_" + rc[int(i.param.rc)] + "_mbs" + std::to_string(i.param.micro_batch) +
         (i.param.lora ? "_lora" : "") + (i.param.tensor > 1 ? "_tp" + std::to_string(i.param.tensor) : "") +
         (i.param.sp ? "_sp" : "");
}

// Rank 0 of a tensor-parallel group of `size` whose collectives do nothing: enough to size what a rank's
// LlamaModel allocates (init reduces nothing).
class SizingGroup : public ops::tp::ReduceGroup {
 public:
  explicit SizingGroup(int size) : size_(size) {}
  int rank() const override { return 0; }
  int size() const override { return size_; }
  Status max(const Tensor&, Stream) override { return Status::ok(); }
  Status sum(const Tensor&, Stream) override { return Status::ok(); }
  Status reduce_scatter(const Tensor&, const Tensor&, Stream) override { return Status::ok(); }
  Status all_gather(const Tensor&, const Tensor&, Stream) override { return Status::ok(); }

 private:
  int size_;
};

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
  j.tensor_parallel = j.ranks = k.tensor;
  j.sequence_parallel = k.sp;
  MemoryEstimate e;
  ASSERT_TRUE(estimate_memory(j, &e).is_ok());

  const LedgerSnapshot before = ledger_snapshot(Device::cpu);
  SizingGroup group(k.tensor);
  LlamaModel m;
  if (k.tensor > 1) m.tp_group = &group;
  m.sequence_parallel = k.sp;
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
  for (int t : {2, 4})  // the tiny model's heads, KV heads and FFN split in 2 and 4
    for (const char* r :
         {"bf16_mixed", "bf16_with_fp8_current_scaling_mixed", "bf16_with_mxfp8_mixed", "bf16_with_nvfp4_mixed"})
      for (Recompute rc : {Recompute::none, Recompute::full}) out.push_back({r, rc, t == 2 ? 2 : 1, false, t});
  for (Recompute rc : {Recompute::none, Recompute::selective})  // the residual stream on 1/T of the tokens
    for (const char* r : {"bf16_mixed", "bf16_with_nvfp4_mixed"}) out.push_back({r, rc, 1, false, 2, true});
  for (const char* r : {"bf16_mixed", "bf16_with_nvfp4_mixed"}) {  // LoRA's adapters split with their bases
    out.push_back({r, Recompute::none, 1, true, 2});
    out.push_back({r, Recompute::selective, 1, true, 2, true});
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

MemoryJob eight_b(int64_t seq, const char* recipe_name) {
  MemoryJob j;
  EXPECT_TRUE(llama_preset("llama3.1-8b", &j.model).is_ok());
  EXPECT_TRUE(recipe::recipe_preset(recipe_name, &j.recipe).is_ok());
  j.params_plan = j.acts_plan = j.recipe;
  j.micro_batch = 1;
  j.seq = seq;
  j.global_batch = 8;
  return j;
}

const double kH100Free = 80.0 * 1073741824.0 - kCudaContextBytes;

// Tensor parallelism: a rank's parameters, activations, Linears' copies and workspace, weight stage and attention
// workspace are those of the local model (tp::local_config: heads, KV heads, FFN and the padded vocabulary over
// T); its step inputs add the vocabulary-parallel cross-entropy's statistics, f32 [3, LM-head chunk] (the chunk of
// the local vocabulary: all 8192 tokens at T2 and T4). The data-parallel figures count the data x context ranks
// of one tensor-parallel index: the distributed optimizer's shards, the bucket, the accumulation.
TEST(MemoryEstimateTensorParallel, ARankHoldsTheLocalModel) {
  for (const char* name : {"bf16_mixed", "bf16_with_fp8_current_scaling_mixed", "bf16_with_nvfp4_mixed"})
    for (int t : {2, 4}) {
      MemoryJob tp = eight_b(8192, name);
      tp.recompute = Recompute::selective;
      MemoryJob local = tp;
      tp.tensor_parallel = tp.ranks = t;
      local.model = tp::local_config(tp.model, t);
      EXPECT_EQ(local.model.vocab * t, t == 2 ? 128256 : 128512);
      MemoryEstimate a, b;
      ASSERT_TRUE(estimate_memory(local, &a).is_ok());
      ASSERT_TRUE(estimate_memory(tp, &b).is_ok());
      for (MemPart p : {MemPart::params, MemPart::activations, MemPart::quantized_copies, MemPart::linear_workspace,
                        MemPart::weight_stage, MemPart::emulated_scratch, MemPart::attention_workspace,
                        MemPart::gemm_workspace, MemPart::comm_buffers})
        EXPECT_EQ(b.part(p), a.part(p)) << name << " T" << t << " " << mem_part_name(p);
      EXPECT_EQ(b.part(MemPart::step_inputs) - a.part(MemPart::step_inputs), 3.0 * 8192 * 4) << name << " T" << t;
      EXPECT_LT(b.part(MemPart::params), 1.01 * a.part(MemPart::params));
    }

  MemoryJob d2 = eight_b(8192, "bf16_mixed");  // T2 x D2 on four ranks, the distributed optimizer over two
  d2.ranks = 4;
  d2.tensor_parallel = 2;
  d2.strategy = "optim";
  d2.overlap = true;
  EXPECT_EQ(d2.dp_cp_ranks(), 2);
  EXPECT_EQ(d2.shards(), 2);
  EXPECT_EQ(d2.accumulation(), 4);
  EXPECT_EQ(d2.bucket_elems(), 40'000'000);
  MemoryEstimate e;
  ASSERT_TRUE(estimate_memory(d2, &e).is_ok());
  const LlamaConfig local = tp::local_config(d2.model, 2);
  EXPECT_EQ(e.part(MemPart::params), double(LlamaModel::parameter_bytes(local, Device::cuda, d2.params_plan, 2)));
  MemoryJob alone = d2;  // all four ranks split each layer: nothing left to shard
  alone.tensor_parallel = 4;
  EXPECT_EQ(alone.shards(), 1);
  EXPECT_EQ(alone.bucket_elems(), 0);
  EXPECT_EQ(alone.accumulation(), 8);
}

// The 8B at 8K on four H100s: whole on every rank (data parallelism) it needs about 172 GiB a GPU; split over
// the four (T4) it fits, and the advice for the first offers that split, each suggestion fitting by the estimate.
TEST(MemoryEstimateTensorParallel, EightBAtEightKFitsFourH100sAtT4) {
  MemoryJob t1 = eight_b(8192, "bf16_mixed");
  t1.ranks = t1.local_ranks = 4;
  MemoryJob t4 = t1;
  t4.tensor_parallel = 4;
  MemoryEstimate a, b;
  ASSERT_TRUE(estimate_memory(t1, &a).is_ok());
  ASSERT_TRUE(estimate_memory(t4, &b).is_ok());
  EXPECT_GT(a.device(), kH100Free);
  EXPECT_LE(b.device(), kH100Free);
  EXPECT_LT(b.part(MemPart::activations), 0.5 * a.part(MemPart::activations));  // attention and FFN split
  bool offered = false;
  for (const MemoryAdvice& m : advise_memory(t1, kH100Free, 0, 4, 16)) {
    EXPECT_LE(m.device_bytes, kH100Free) << m.flags;
    EXPECT_EQ(m.flags.find("--nproc-per-node"), std::string::npos) << "four GPUs bound the advice: " << m.flags;
    offered |= m.flags.find("--tensor-model-parallel-size 4") != std::string::npos;
  }
  EXPECT_TRUE(offered);
  t4.tensor_parallel = 2;  // T2 x D2: fits only with the distributed optimizer
  ASSERT_TRUE(estimate_memory(t4, &b).is_ok());
  EXPECT_GT(b.device(), kH100Free);
  t4.strategy = "optim";
  ASSERT_TRUE(estimate_memory(t4, &b).is_ok());
  EXPECT_LE(b.device(), kH100Free);
}

// The smallest T x C of one replica that fits a sequence: no split of fewer GPUs fits, and of equal products the
// one needing least memory is named. At 128K the sequence must be split (context parallelism: C4 with full
// recompute, C8 with selective); at 4K T2 holds the 8B on two GPUs (no split of the sequence shrinks the weights).
TEST(MemoryEstimateTensorParallel, SmallestSplitThatFitsASequence) {
  auto split_job = [](MemoryJob j, int t, int c) {  // one replica (the job's)
    j.ranks = j.local_ranks = t * c;
    j.tensor_parallel = t;
    j.context_parallel = c;
    j.strategy = t > 1 ? "optim" : "optim_grads_params";
    return j;
  };
  struct Case {
    int64_t seq;
    Recompute rc;
    int tensor, context;
  };
  for (const Case& k : {Case{131072, Recompute::full, 1, 4}, Case{131072, Recompute::selective, 1, 8},
                        Case{4096, Recompute::selective, 2, 1}}) {
    MemoryJob job = eight_b(k.seq, "bf16_mixed");
    job.recompute = k.rc;
    const ParallelSplit s = smallest_parallel_split(job, kH100Free, 0, 8);
    EXPECT_EQ(s.tensor, k.tensor) << k.seq;
    EXPECT_EQ(s.context, k.context) << k.seq;
    MemoryEstimate e;
    ASSERT_TRUE(estimate_memory(split_job(job, s.tensor, s.context), &e).is_ok());
    EXPECT_EQ(e.device(), s.device_bytes);
    EXPECT_LE(e.device(), kH100Free);
    const int gpus = k.tensor * k.context;
    for (int t = 1; t <= std::min(gpus, 8); t *= 2)
      for (int c = 1; t * c <= gpus; c *= 2) {
        ASSERT_TRUE(estimate_memory(split_job(job, t, c), &e).is_ok());
        if (t * c < gpus) {
          EXPECT_GT(e.device(), kH100Free) << k.seq << ": T" << t << " x C" << c;
        } else if (e.device() <= kH100Free) {
          EXPECT_GE(e.device(), s.device_bytes) << k.seq << ": T" << t << " x C" << c;
        }
      }
  }
  MemoryJob row = eight_b(131072, "bf16_mixed");
  row.recompute = Recompute::full;
  const std::string line = parallel_split_line(row, kH100Free, 0, 8);
  EXPECT_EQ(line.rfind("smallest tensor x context parallel split that fits seq 131072: T1 x C4 (", 0), 0u) << line;
  EXPECT_NE(line.find("--context-parallel-size 4"), std::string::npos) << line;
  row.recompute = Recompute::none;  // every layer's activations kept: no split of eight GPUs holds them
  EXPECT_EQ(parallel_split_line(row, kH100Free, 0, 8).rfind("no tensor x context parallel split", 0), 0u);
}

// The 8B at PP2 (1F1B, the even split), selective recompute.
MemoryJob eight_b_pp2(int64_t seq, const char* recipe_name) {
  MemoryJob j = eight_b(seq, recipe_name);
  j.ranks = 2;
  j.pipeline = 2;
  j.recompute = Recompute::selective;
  pp::SplitOptions o;
  o.pipeline = 2;
  EXPECT_TRUE(pp::split_layers(j.model.layers, o, &j.pipeline_stages).is_ok());
  return j;
}

// A quantized stage's Linears: which layers stay BF16 is counted from the whole model's ends (NVFP4's last 4 are on
// the last stage, so the first stage's 16 layers are all quantized), and without full recompute each keeps an input
// slot per pass in flight (1F1B at P2: two on the first stage, one on the last), each slot the input's NVFP4 column
// copy (T x in / 2 codes, T x in / 16 scales) and the state's floats, every piece a 256-byte multiple.
TEST(MemoryEstimatePipeline, QuantizedStagesCountTheirOwnLinearsAndInputSlots) {
  MemoryJob j = eight_b_pp2(4096, "bf16_with_nvfp4_mixed");
  MemoryEstimate first, last;
  MemoryJob r0 = j, r1 = j;
  r0.pipeline_rank = 0;
  r1.pipeline_rank = 1;
  ASSERT_TRUE(estimate_memory(r0, &first).is_ok());
  ASSERT_TRUE(estimate_memory(r1, &last).is_ok());
  const auto a256 = [](int64_t n) { return double((n + 255) / 256 * 256); };
  const int64_t T = 4096, H = j.model.hidden, F = j.model.ffn;
  double layer_copies = 0, layer_slot = 0;  // one quantized layer's owned copies, and one extra input slot of it
  for (const auto& [in, out] : std::vector<std::pair<int64_t, int64_t>>{
           {H, j.model.q_dim() + 2 * j.model.kv_dim()}, {j.model.q_dim(), H}, {H, 2 * F}, {F, H}}) {
    recipe::LinearWorkspace ws(Device::cuda);  // the transients are the shared workspace's, not counted here
    size_t in_ws = 0;
    ASSERT_TRUE(recipe::Linear::plan_bytes(j.recipe, false, T, in, out, Device::cuda, &ws, false, -1, &in_ws).is_ok());
    layer_copies += double(in_ws);
    layer_slot += a256(T * in / 2) + a256(T * in / 16) + a256(5 * 4);
  }
  EXPECT_DOUBLE_EQ(first.part(MemPart::quantized_copies), 16 * (layer_copies + layer_slot));
  EXPECT_DOUBLE_EQ(last.part(MemPart::quantized_copies), 12 * layer_copies);
}

// Pipeline parallelism: each rank's stage holds its own layers (the split's, uneven ones included), the embedding on
// the first stage and the final norm and LM head on the last, and its schedule's passes in flight; the job's
// estimate is the largest stage's. (Measured on two H200s, the 8B at PP2, seq 8192: rank 0 peaked at 93.17 GiB with
// the even split and 98.27 with 17 + 15 layers; these estimates give 93.41 and 98.51.)
TEST(MemoryEstimatePipeline, EachStageHoldsItsOwnLayersAndTheLargestIsTheJobs) {
  MemoryJob j = eight_b_pp2(8192, "bf16_mixed");
  pp::SplitOptions o;
  o.pipeline = 2;
  MemoryEstimate first, last, job;
  MemoryJob r0 = j, r1 = j;
  r0.pipeline_rank = 0;
  r1.pipeline_rank = 1;
  ASSERT_TRUE(estimate_memory(r0, &first).is_ok());
  ASSERT_TRUE(estimate_memory(r1, &last).is_ok());
  ASSERT_TRUE(estimate_memory(j, &job).is_ok());
  // 16 layers each; the last stage's vocabulary matrix is the head, plus the final norm: 18 bytes a parameter.
  EXPECT_DOUBLE_EQ(last.part(MemPart::params) - first.part(MemPart::params), 18.0 * double(j.model.hidden));
  MemoryJob one = j;  // one GPU: every layer, the embedding, the head and the final norm
  one.ranks = 1;
  one.pipeline = 1;
  one.pipeline_stages.clear();
  MemoryEstimate whole;
  ASSERT_TRUE(estimate_memory(one, &whole).is_ok());
  EXPECT_DOUBLE_EQ(whole.part(MemPart::params), 2.0 * first.part(MemPart::params) + 18.0 * double(j.model.hidden));
  // The first stage keeps two passes in flight under 1F1B, the last one, with the LM head's chunk.
  EXPECT_GT(first.part(MemPart::activations), last.part(MemPart::activations));
  EXPECT_EQ(job.pipeline_rank, first.device() >= last.device() ? 0 : 1);
  EXPECT_DOUBLE_EQ(job.device(), std::max(first.device(), last.device()));
  // Every stage's total, printed under the table (the estimate per stage).
  EXPECT_EQ(job.stage_totals, (std::vector<double>{first.device(), last.device()}));
  const std::string table = format_memory_table(job, 0);
  EXPECT_NE(table.find(strprintf("  total by pipeline stage: rank 0 %.2f GiB, rank 1 %.2f GiB\n",
                                 first.device() / 1073741824.0, last.device() / 1073741824.0)),
            std::string::npos)
      << table;
  // 17 + 15 layers: the first stage one layer's worth more.
  o.first_stage_layers = 17;
  ASSERT_TRUE(pp::split_layers(j.model.layers, o, &r0.pipeline_stages).is_ok());
  MemoryEstimate uneven;
  ASSERT_TRUE(estimate_memory(r0, &uneven).is_ok());
  EXPECT_DOUBLE_EQ(uneven.part(MemPart::params) - first.part(MemPart::params),
                   18.0 * double(j.model.total_params() - 2 * j.model.vocab * j.model.hidden - j.model.hidden) /
                       double(j.model.layers));
  EXPECT_GT(uneven.part(MemPart::activations), first.part(MemPart::activations));
}

}  // namespace
}  // namespace nb
