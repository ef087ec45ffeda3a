// Megatron-FSDP on the CPU backend (Gloo): the layout every rank agrees on, each strategy against one
// rank in every recipe, checkpoints across ranks and strategies, and the configurations it refuses.
//
// Tolerances: as ddp_test.cpp. FSDP reduce-scatters each micro-batch's gradients and adds them into the
// shard, where one rank accumulates all micro-batches in one buffer: only the FP32 summation order
// differs (k <= 16 summands here, below 1e-6 relative at step 1). Later steps amplify it through AdamW's
// division by sqrt(v) + eps (weights within 1e-2 x steps x lr, losses 1e-5 relative in FP32) and, in
// quantized recipes, a few weights rounding the other way (losses 1e-2 relative). A strategy that reads a
// window before it is gathered, drops a unit's reduction or adds one twice moves step 1 by far more.
#include <gtest/gtest.h>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include "common/nibble_binary.h"
#include "distributed/ddp_util.h"
#include "model/params.h"

namespace nb {
namespace {

LlamaConfig tiny() {
  LlamaConfig c;
  EXPECT_TRUE(llama_preset("tiny", &c).is_ok());
  return c;
}

// Every group's padded rows are split into equal chunks, one per rank, that tile the group exactly; every
// parameter lies inside its group (q, k, v back to back); units add up; chunks are whole blocks of rows.
TEST(FsdpLayout, RankChunksTileEveryGroup) {
  const LlamaConfig cfg = tiny();
  for (int ranks : {1, 2, 3, 4}) {
    std::vector<std::vector<ParamStore::Slice>> slices(static_cast<size_t>(ranks));
    int64_t shard_len = -1;
    ParamStore first;
    for (int r = 0; r < ranks; ++r) {
      ParamStore P;
      ASSERT_TRUE(P.allocate_fsdp(cfg, Device::cpu, r, ranks, true, 16).is_ok());
      slices[size_t(r)] = P.own_slices();
      if (r == 0) shard_len = P.shard_len();
      EXPECT_EQ(P.shard_len(), shard_len) << "every rank keeps as much";
      if (r == 0) first = std::move(P);
    }
    const auto& groups = first.groups();
    int64_t covered = 0;
    std::vector<int64_t> unit_sum(size_t(first.unit_count()), 0);
    for (size_t g = 0; g < groups.size(); ++g) {
      const ParamStore::Group& G = groups[g];
      EXPECT_EQ(G.rows_per_rank % 16, 0) << "whole 16-row blocks";
      EXPECT_GE(G.rows_per_rank * ranks, G.rows);
      for (int r = 0; r < ranks; ++r) {
        const ParamStore::Slice s = slices[size_t(r)][g];
        EXPECT_EQ(s.begin, G.begin + r * G.chunk());
        EXPECT_EQ(s.end - s.begin, G.chunk());
      }
      covered += G.chunk() * ranks;
      unit_sum[size_t(G.unit)] += G.chunk() * ranks;
    }
    EXPECT_EQ(covered, first.total());
    for (int u = 0; u < first.unit_count(); ++u) EXPECT_EQ(unit_sum[size_t(u)], first.unit_elems(u)) << "unit " << u;
    for (const ParamInfo& p : first.params()) {
      const std::string& n = p.name;
      int g = 0;
      while (g + 1 < int(groups.size()) && groups[size_t(g) + 1].begin <= p.offset) ++g;
      EXPECT_LE(p.offset + p.numel, groups[size_t(g)].begin + groups[size_t(g)].rows * groups[size_t(g)].cols) << n;
      EXPECT_EQ(first.unit_of(n), groups[size_t(g)].unit) << n;
    }
    const ParamInfo &q = first.info("model.layers.1.self_attn.q_proj.weight"),
                    &k = first.info("model.layers.1.self_attn.k_proj.weight"),
                    &v = first.info("model.layers.1.self_attn.v_proj.weight");
    EXPECT_EQ(k.offset, q.offset + q.numel);
    EXPECT_EQ(v.offset, k.offset + k.numel);
    EXPECT_EQ(first.unit_of("model.layers.1.mlp.down_proj.weight"), 2);
    EXPECT_EQ(first.unit_of("model.norm.weight"), int(cfg.layers) + 1);
  }
}

// The memory estimate's windows (LlamaModel::fsdp_window_bytes): --fsdp-embeddings-per-step keeps the
// embedding's and the untied head's windows through the step, one more large window of each kind it holds:
// FP32 gradients always, compute-type weights under optim_grads_params, BF16 weights only for a LoRA base.
TEST(FsdpLayout, EmbeddingsPerStepEstimateAddsOneLargeWindowOfEachKind) {
  LlamaConfig cfg;
  ASSERT_TRUE(llama_preset("llama3.1-8b", &cfg).is_ok());
  ASSERT_FALSE(cfg.tied_embeddings);
  const int64_t large = cfg.vocab * cfg.hidden;
  const auto bytes = [&](const LlamaConfig& c, LlamaModel::Fsdp fsdp, bool per_step) {
    return LlamaModel::parameter_bytes(c, Device::cuda, recipe::Recipe{}, 2, {}, fsdp, per_step);
  };
  using F = LlamaModel::Fsdp;
  EXPECT_EQ(bytes(cfg, F::optim_grads, true) - bytes(cfg, F::optim_grads, false), large * 4);
  EXPECT_EQ(bytes(cfg, F::optim_grads_params, true) - bytes(cfg, F::optim_grads_params, false), large * (4 + 2));
  LoraSpec spec;
  EXPECT_EQ(LlamaModel::lora_parameter_bytes(cfg, Device::cuda, recipe::Recipe{}, spec, 2, true) -
                LlamaModel::lora_parameter_bytes(cfg, Device::cuda, recipe::Recipe{}, spec, 2, false),
            large * 2);
  LlamaConfig tied;
  ASSERT_TRUE(llama_preset("llama3.2-1b", &tied).is_ok());
  ASSERT_TRUE(tied.tied_embeddings);
  EXPECT_EQ(bytes(tied, F::optim_grads_params, true), bytes(tied, F::optim_grads_params, false))
      << "a tied embedding is one unit: nothing more to hold";
}

// A parameter's compute and gradient views point into its unit's window while one is bound.
TEST(FsdpLayout, ViewsResolveToTheBoundWindow) {
  ParamStore P;
  ASSERT_TRUE(P.allocate_fsdp(tiny(), Device::cpu, 1, 2, true, 1).is_ok());
  const int u = P.unit_of("model.layers.0.mlp.gate_up_proj.weight");
  std::vector<float> compute(size_t(P.unit_elems(u))), grad(compute.size());
  P.bind_compute(u, compute.data());
  P.bind_grad(u, grad.data());
  const std::string n = "model.layers.0.mlp.gate_up_proj.weight";
  const Tensor c = P.compute(n), g = P.grad(n);
  EXPECT_EQ(c.shape[0], 2 * tiny().ffn);
  for (const ParamStore::Group& G : P.groups())
    if (G.unit == u && G.begin <= P.info(n).offset && P.info(n).offset < G.begin + G.chunk() * 2) {
      EXPECT_EQ(static_cast<float*>(c.data), compute.data() + G.unit_offset + (P.info(n).offset - G.begin));
      EXPECT_EQ(static_cast<float*>(g.data), grad.data() + G.unit_offset + (P.info(n).offset - G.begin));
    }
  P.bind_compute(u, nullptr);
  EXPECT_FALSE(P.compute_bound(u));
}

std::string fsdp(const std::string& strategy) {
  return "--use-megatron-fsdp --data-parallel-sharding-strategy " + strategy;
}

TEST(FsdpCpu, StrategiesReproduceOneRank) {
  const std::string dir = test::temp_folder("fsdp_ranks");
  const int kIters = 4;
  const std::string one = train(dir, "bf16_mixed", 1, kIters);
  const auto ref = read_metrics(one);
  for (const auto& [ranks, strategy] : std::vector<std::pair<int, std::string>>{
           {2, "optim_grads_params"}, {4, "optim_grads_params"}, {2, "optim_grads"}}) {
    const std::string save = dir + "/" + strategy + "_" + std::to_string(ranks);
    const test::CliRun r = test::run_nibble(kJob + "--recipe bf16_mixed --train-iters 4 --save-interval 4 --save " +
                                            save + " --nproc-per-node " + std::to_string(ranks) + " " + fsdp(strategy));
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_NE(r.out.find("Megatron-FSDP " + strategy + " over " + std::to_string(ranks)), std::string::npos) << r.out;
    const auto got = read_metrics(save);
    ASSERT_EQ(got.size(), ref.size());
    EXPECT_NEAR(got[0].loss, ref[0].loss, 1e-6 * ref[0].loss) << strategy;
    EXPECT_NEAR(got[0].grad_norm, ref[0].grad_norm, 1e-6 * ref[0].grad_norm) << strategy;
    for (size_t i = 0; i < ref.size(); ++i)
      EXPECT_NEAR(got[i].loss, ref[i].loss, 1e-5 * ref[i].loss) << strategy << " step " << i + 1;
    EXPECT_LE(max_weight_difference(one, save, kIters), 1e-2 * kIters * kLr) << strategy << ", " << ranks;
  }
}

// metrics.jsonl's fsdp_gathered_bytes and fsdp_reduced_bytes, per step.
std::vector<std::pair<double, double>> moved_bytes(const std::string& save) {
  std::vector<std::pair<double, double>> out;
  std::ifstream in(save + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_object() && j.contains("lm_loss"))
      out.emplace_back(j.value("fsdp_gathered_bytes", -1.0), j.value("fsdp_reduced_bytes", -1.0));
  }
  return out;
}

// What a unit of the tiny model moves per gather or reduction at 2 ranks (CPU: FP32 windows, half of each
// received from the other rank), and the micro-batches per rank of kJob's step.
struct UnitBytes {
  double embedding = 0, head = 0, layers = 0, first_layer = 0;
  double a = 16.0 / 2 / 2;  // global batch 16, micro-batch 2, 2 ranks
};
UnitBytes unit_bytes() {
  const LlamaConfig cfg = tiny();
  ParamStore P;
  EXPECT_TRUE(P.allocate_fsdp(cfg, Device::cpu, 0, 2, true, 1).is_ok());
  const auto received = [&](int u) { return double(P.unit_elems(u)) * 4 / 2; };
  UnitBytes b;
  b.embedding = received(0);
  b.head = received(int(cfg.layers) + 1);
  b.first_layer = received(1);
  for (int u = 1; u <= int(cfg.layers); ++u) b.layers += received(u);
  return b;
}

// What optim_grads_params moves in a step of a micro-batches per rank: every unit gathered before its
// forward, the layers again before their backward (the last one while the head computes), except that with
// another micro-batch to follow the first layer stays gathered and the embedding is gathered during its
// backward; every unit's gradient reduced every micro-batch. A unit gathered twice, or read from a window
// that was not gathered for it, changes the count.
TEST(FsdpCpu, GathersEachUnitAsThePassReadsIt) {
  const std::string save = test::temp_folder("fsdp_gathers");
  const test::CliRun r = test::run_nibble(kJob + "--recipe bf16_mixed --train-iters 2 --save " + save +
                                          " --nproc-per-node 2 " + fsdp("optim_grads_params"));
  ASSERT_EQ(r.code, 0) << r.out;
  const UnitBytes b = unit_bytes();
  const double gathered = b.a * (b.embedding + b.head) + 2 * b.a * b.layers - (b.a - 1) * b.first_layer;
  const auto steps = moved_bytes(save);
  ASSERT_EQ(steps.size(), 2u);
  for (size_t i = 0; i < steps.size(); ++i) {
    EXPECT_EQ(steps[i].first, gathered) << "step " << i + 1;
    EXPECT_EQ(steps[i].second, b.a * (b.embedding + b.head + b.layers)) << "step " << i + 1;
  }
}

// --fsdp-embeddings-per-step: the embedding and head gathered once and reduced once per step (their
// gradients accumulate over the micro-batches as on one rank), the layers as before; the steps still
// reproduce one rank (step 1 to the reduction-order tolerance; fewer FP32 additions than without the flag).
TEST(FsdpCpu, EmbeddingsPerStepMoveOnceAndMatchOneRank) {
  const std::string dir = test::temp_folder("fsdp_embeddings_per_step");
  const auto ref = read_metrics(train(dir, "bf16_mixed", 1, 2));
  const UnitBytes b = unit_bytes();
  for (const std::string strategy : {"optim_grads_params", "optim_grads"}) {
    const std::string save = dir + "/" + strategy;
    const test::CliRun r = test::run_nibble(kJob + "--recipe bf16_mixed --train-iters 2 --save " + save +
                                            " --nproc-per-node 2 --fsdp-embeddings-per-step " + fsdp(strategy));
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_NE(r.out.find("gathered once per step"), std::string::npos) << r.out;
    const auto steps = moved_bytes(save);
    const auto got = read_metrics(save);
    ASSERT_EQ(steps.size(), 2u);
    ASSERT_EQ(got.size(), ref.size());
    for (size_t i = 0; i < steps.size(); ++i) {
      if (strategy == "optim_grads_params") {
        EXPECT_EQ(steps[i].first, b.embedding + b.head + 2 * b.a * b.layers - (b.a - 1) * b.first_layer) << i + 1;
      }
      EXPECT_EQ(steps[i].second, b.embedding + b.head + b.a * b.layers) << strategy << " step " << i + 1;
      EXPECT_NEAR(got[i].loss, ref[i].loss, 1e-5 * ref[i].loss) << strategy << " step " << i + 1;
    }
    EXPECT_NEAR(got[0].loss, ref[0].loss, 1e-6 * ref[0].loss) << strategy;
    EXPECT_NEAR(got[0].grad_norm, ref[0].grad_norm, 1e-6 * ref[0].grad_norm) << strategy;
  }
}

// --grad-reduce-in-bf16 under Megatron-FSDP: half the bytes reduced, and with one micro-batch per rank each
// gradient element is the distributed optimizer's BF16 reduction exactly (cast, a + b in BF16 at two ranks,
// cast back; FSDP adds it into a zeroed shard), so step 1 matches it to the gradient norm's slice order and
// the weights to the clipping factor's ulps; it must differ from FSDP's FP32 reduction (else nothing ran in
// BF16). Cut into pieces of 1,000 elements per rank (the last one partial) it is bit-identical to whole groups.
TEST(FsdpCpu, Bf16ReductionMatchesTheDistributedOptimizersAndHalvesTheBytes) {
  const std::string dir = test::temp_folder("fsdp_bf16");
  std::string job = kJob;  // one micro-batch of 2 per rank
  job.replace(job.find("--global-batch-size 16"), 22, "--global-batch-size 4");
  const auto run = [&](const std::string& name, const std::string& flags) {
    const std::string save = dir + "/" + name;
    const test::CliRun r = test::run_nibble(job + "--recipe bf16_mixed --train-iters 2 --save-interval 2 --save " +
                                            save + " --nproc-per-node 2 " + flags);
    EXPECT_EQ(r.code, 0) << r.out;
    return save;
  };
  const std::string distopt = run("distopt", "--use-distributed-optimizer --grad-reduce-in-bf16");
  const std::string f32 = run("f32", fsdp("optim_grads_params"));
  const std::string b16 = run("bf16", fsdp("optim_grads_params") + " --grad-reduce-in-bf16");
  setenv("NIBBLE_FSDP_BF16_PIECE", "1000", 1);
  const std::string pieces = run("pieces", fsdp("optim_grads_params") + " --grad-reduce-in-bf16");
  unsetenv("NIBBLE_FSDP_BF16_PIECE");
  const auto ref = read_metrics(distopt), full = read_metrics(f32), got = read_metrics(b16), cut = read_metrics(pieces);
  ASSERT_EQ(ref.size(), 2u);
  ASSERT_EQ(got.size(), 2u);
  ASSERT_EQ(cut.size(), 2u);
  EXPECT_EQ(got[0].loss, ref[0].loss);
  EXPECT_NEAR(got[0].grad_norm, ref[0].grad_norm, 1e-6 * ref[0].grad_norm);
  EXPECT_NE(got[0].grad_norm, full[0].grad_norm) << "FSDP's BF16 reduction left the gradients in FP32";
  EXPECT_LE(max_weight_difference(distopt, b16, 2), 1e-4 * 2 * kLr);
  EXPECT_GT(max_weight_difference(f32, b16, 2), 0.0);
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(cut[i].loss, got[i].loss) << "step " << i + 1;
    EXPECT_EQ(cut[i].grad_norm, got[i].grad_norm) << "step " << i + 1;
  }
  EXPECT_EQ(max_weight_difference(b16, pieces, 2), 0.0);
  const auto bytes_f32 = moved_bytes(f32), bytes_b16 = moved_bytes(b16), bytes_cut = moved_bytes(pieces);
  ASSERT_EQ(bytes_b16.size(), 2u);
  for (size_t i = 0; i < bytes_b16.size(); ++i) {
    EXPECT_EQ(bytes_b16[i].second, bytes_f32[i].second / 2) << "step " << i + 1;
    EXPECT_EQ(bytes_cut[i].second, bytes_b16[i].second) << "step " << i + 1;
  }
}

// One recipe per test (so CTest runs them side by side), at global batch 8: 4 micro-batches on one rank,
// 2 per rank on two, with the weights gathered in their training format and in BF16.
class FsdpRecipe : public ::testing::TestWithParam<const char*> {};

TEST_P(FsdpRecipe, MatchesOneRankAtStepOne) {
  const std::string recipe = GetParam(), dir = test::temp_folder("fsdp_recipe_" + recipe);
  std::string job = kJob;
  job.replace(job.find("--global-batch-size 16"), 22, "--global-batch-size 8");
  // One rank; two ranks gathering the quantized weights as codes and scales (the default); two gathering BF16.
  const char* gathers[3] = {"", " --fsdp-param-gather training", " --fsdp-param-gather bf16"};
  std::vector<StepLog> logs[3];
  for (int i = 0; i < 3; ++i) {
    const int ranks = i == 0 ? 1 : 2;
    const std::string save = dir + "/" + std::to_string(i);
    const test::CliRun r = test::run_nibble(
        job + "--recipe " + recipe + " --train-iters 2 --save " + save + " --nproc-per-node " + std::to_string(ranks) +
        (ranks > 1 ? " " + fsdp("optim_grads_params") + gathers[i] : std::string()));
    ASSERT_EQ(r.code, 0) << r.out;
    if (i == 1) {
      EXPECT_NE(r.out.find("quantized linear weights in their training format"), std::string::npos) << r.out;
    }
    logs[i] = read_metrics(save);
  }
  // The training-format gather hands every rank the bytes that quantizing the gathered BF16 weight gives:
  // both runs compute the same numbers, bit for bit.
  ASSERT_EQ(logs[2].size(), 2u);
  for (size_t s = 0; s < 2 && s < logs[1].size(); ++s) {
    EXPECT_EQ(logs[1][s].loss, logs[2][s].loss) << "step " << s + 1;
    EXPECT_EQ(logs[1][s].grad_norm, logs[2][s].grad_norm) << "step " << s + 1;
  }
  const auto &ref = logs[0], &got = logs[1];
  ASSERT_EQ(ref.size(), 2u);
  ASSERT_EQ(got.size(), 2u);
  EXPECT_NEAR(got[0].loss, ref[0].loss, 1e-6 * ref[0].loss);
  EXPECT_NEAR(got[0].grad_norm, ref[0].grad_norm, 1e-6 * ref[0].grad_norm);
  EXPECT_NEAR(got[1].loss, ref[1].loss, 1e-2 * ref[1].loss);
}

INSTANTIATE_TEST_SUITE_P(FsdpCpu, FsdpRecipe,
                         ::testing::Values("bf16_with_fp8_current_scaling_mixed", "bf16_with_fp8_delayed_scaling_mixed",
                                           "bf16_with_fp8_subchannel_scaling_mixed", "bf16_with_mxfp8_mixed",
                                           "bf16_with_nvfp4_mixed"));

// Saved at 2 ranks with optim_grads_params after 2 steps; continued at the same layout (bit for bit the
// uninterrupted run), at 1 rank, and at 4 ranks with the distributed optimizer (loss curves continue).
TEST(FsdpCpu, CheckpointsLoadAtAnyLayout) {
  const std::string dir = test::temp_folder("fsdp_layouts");
  const std::string common = kJob + "--recipe bf16_mixed --save-interval 4 ";
  const std::string sharded = " --nproc-per-node 2 " + fsdp("optim_grads_params");
  const std::string whole = dir + "/whole";
  ASSERT_EQ(test::run_nibble(common + "--train-iters 4 --save " + whole + sharded).code, 0);
  const auto ref = read_metrics(whole);
  ASSERT_EQ(ref.size(), 4u);
  for (const std::string& later :
       {sharded, std::string(" --nproc-per-node 1"), " --nproc-per-node 4 " + fsdp("optim")}) {
    const std::string save = dir + "/resumed_" + std::to_string(std::hash<std::string>{}(later) % 1000);
    ASSERT_EQ(test::run_nibble(common + "--train-iters 4 --exit-interval 2 --save " + save + sharded).code, 0);
    const test::CliRun r = test::run_nibble(common + "--train-iters 4 --load " + save + " --save " + save + later);
    ASSERT_EQ(r.code, 0) << r.out;
    const auto got = read_metrics(save);
    ASSERT_EQ(got.size(), 4u) << later;
    for (size_t i = 0; i < 4; ++i) {
      if (later == sharded) {
        EXPECT_EQ(got[i].loss, ref[i].loss) << "same layout, step " << i + 1;
        EXPECT_EQ(got[i].grad_norm, ref[i].grad_norm) << "same layout, step " << i + 1;
      } else {
        EXPECT_NEAR(got[i].loss, ref[i].loss, 1e-5 * ref[i].loss) << later << ", step " << i + 1;
      }
    }
  }
}

TEST(FsdpCpu, UnsupportedCombinationsGetOneSentence) {
  const std::string base = " train --model tiny --device cpu --train-iters 1 ";
  struct Case {
    std::string flags, says;
  };
  for (const Case& c : std::vector<Case>{
           {"--data-parallel-sharding-strategy optim_grads", "add --use-megatron-fsdp"},
           {fsdp("optim_grads_params") + " --peft lora --lora-base-precision nvfp4 --fsdp-param-gather bf16",
            "keeps no BF16 copy"},
           {"--use-megatron-fsdp --data-parallel-sharding-strategy zero3", "zero3"},
           {"--use-distributed-optimizer --fsdp-embeddings-per-step", "optim_grads or optim_grads_params"},
           {fsdp("optim_grads") + " --peft lora --fsdp-embeddings-per-step", "runs as LoRA DDP"}}) {
    const test::CliRun r = test::run_nibble(base + c.flags);
    EXPECT_NE(r.code, 0) << c.flags;
    EXPECT_NE(r.out.find(c.says), std::string::npos) << c.flags << "\n" << r.out;
  }
}

}  // namespace
}  // namespace nb
