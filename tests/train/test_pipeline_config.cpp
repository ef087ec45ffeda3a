// Pipeline parallelism's configuration: its keys (TOML, the printed config, Megatron's bare
// --no-overlap-p2p-communication through the real binary) and validate_train_config's pipeline checks: the sizes,
// the virtual stages, the split, the interleaved schedule's demands, and what is not supported yet with P > 1.
#include <gtest/gtest.h>
#include <unistd.h>
#include <filesystem>
#include <fstream>
#include <string>
#include "common/nibble_binary.h"
#include "model/llama_config.h"
#include "train/pipeline_schedule.h"
#include "train/train_config.h"

using namespace nb;

namespace {

// The tiny preset deepened to 8 layers (untied embeddings), split over P pipeline stages.
TrainConfig pp_tiny(int64_t pipeline, int64_t layers = 8) {
  TrainConfig c;
  c.model = "tiny";
  c.num_layers = layers;
  c.pipeline_model_parallel_size = pipeline;
  return c;
}

// validate_train_config's message for `c` after resolve_model ("" when accepted).
std::string pp_config_message(TrainConfig c) {
  LlamaConfig m;
  Status st = resolve_model(c, &m);
  if (st) st = validate_train_config(c, m);
  return st ? "" : st.message();
}

bool pp_has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

}  // namespace

TEST(PipelineConfig, AcceptsEvenUnevenAndInterleavedSplits) {
  EXPECT_EQ(pp_config_message(pp_tiny(2)), "");
  EXPECT_EQ(pp_config_message(pp_tiny(8)), "");
  TrainConfig c = pp_tiny(4);
  c.num_virtual_stages_per_pipeline_rank = 2;
  c.global_batch_size = 4;  // 4 micro-batches per rank, a multiple of P
  EXPECT_EQ(pp_config_message(c), "");
  c = pp_tiny(2, 7);
  c.decoder_first_pipeline_num_layers = 3;
  EXPECT_EQ(pp_config_message(c), "");
  c = pp_tiny(2, 7);
  c.account_for_embedding_in_pipeline_split = true;
  EXPECT_EQ(pp_config_message(c), "");
  c = pp_tiny(2);
  c.num_layers_per_virtual_pipeline_stage = 2;  // 8 / (2 x 2): V 2
  c.global_batch_size = 2;
  EXPECT_EQ(pp_config_message(c), "");
}

TEST(PipelineConfig, RefusesBadSizesAndSplits) {
  EXPECT_TRUE(pp_has(pp_config_message(pp_tiny(0)), "--pipeline-model-parallel-size must be at least 1"));
  EXPECT_TRUE(pp_has(pp_config_message(pp_tiny(4, 2)), "more stages than the model's 2 decoder layers"));
  const std::string odd = pp_config_message(pp_tiny(2, 9));
  EXPECT_TRUE(pp_has(odd, "--pipeline-model-parallel-size 2 does not divide the 9 decoder layers")) << odd;
  TrainConfig c = pp_tiny(2);
  c.num_layers_per_virtual_pipeline_stage = 3;
  EXPECT_TRUE(pp_has(pp_config_message(c), "--num-layers-per-virtual-pipeline-stage 3 does not divide"))
      << pp_config_message(c);
  c.num_virtual_stages_per_pipeline_rank = 2;
  EXPECT_TRUE(pp_has(pp_config_message(c), "give only one")) << pp_config_message(c);
  c = pp_tiny(4);
  c.num_layers_per_virtual_pipeline_stage = 1;
  c.decoder_last_pipeline_num_layers = 2;
  EXPECT_TRUE(pp_has(pp_config_message(c), "as --num-virtual-stages-per-pipeline-rank instead of"))
      << pp_config_message(c);
  c = pp_tiny(1);
  c.num_virtual_stages_per_pipeline_rank = 2;
  EXPECT_TRUE(pp_has(pp_config_message(c), "needs --pipeline-model-parallel-size > 1")) << pp_config_message(c);
  c = pp_tiny(1);
  c.decoder_first_pipeline_num_layers = 8;
  EXPECT_TRUE(pp_has(pp_config_message(c), "--decoder-first-pipeline-num-layers 8 sets the layers"))
      << pp_config_message(c);
}

// --pipeline-model-parallel-layout sets V (its stages over P) and may leave a stage empty, even with more stages
// than decoder layers; Megatron's virtual-stage flags beside it are refused, and so are the split's own faults.
TEST(PipelineConfig, LayoutSetsTheVirtualStages) {
  TrainConfig c = pp_tiny(2);
  c.pipeline_model_parallel_layout = "Ettt|tt||ttL";  // 7 layers over 4 stages: V 2, one stage empty
  c.num_layers = 7;
  c.global_batch_size = 2;
  EXPECT_EQ(pp_config_message(c), "");
  int V = 0;
  ASSERT_TRUE(c.pipeline_virtual_stages(7, &V).is_ok());
  EXPECT_EQ(V, 2);
  c = pp_tiny(4, 2);
  c.pipeline_model_parallel_layout = "Et|t||L";  // P 4 over a 2-layer model
  EXPECT_EQ(pp_config_message(c), "");
  c.num_virtual_stages_per_pipeline_rank = 1;
  EXPECT_TRUE(pp_has(pp_config_message(c), "sets the virtual stages")) << pp_config_message(c);
  c = pp_tiny(2);
  c.pipeline_model_parallel_layout = "Ettt|ttL";
  EXPECT_TRUE(pp_has(pp_config_message(c), "places 5 decoder layers ('t'); the model has 8")) << pp_config_message(c);
  c.pipeline_model_parallel_layout = "Etttt|tt|ttL";
  EXPECT_TRUE(pp_has(pp_config_message(c), "has 3 stages, not a multiple of --pipeline-model-parallel-size 2"))
      << pp_config_message(c);
  c.pipeline_model_parallel_layout = "Etttt|ttttL";
  c.decoder_first_pipeline_num_layers = 4;
  EXPECT_TRUE(pp_has(pp_config_message(c), "places every layer itself")) << pp_config_message(c);
}

TEST(PipelineConfig, InterleavedScheduleNeedsMicroBatchesInGroupsOfP) {
  TrainConfig c = pp_tiny(2);
  c.num_virtual_stages_per_pipeline_rank = 2;
  c.global_batch_size = 3;
  const std::string msg = pp_config_message(c);
  EXPECT_TRUE(pp_has(msg, "each rank has 3 per step")) << msg;
  EXPECT_TRUE(pp_has(msg, "--global-batch-size that is a multiple of 2")) << msg;
  // Over 2 data-parallel ranks, a global batch of 6 gives each rank 3 micro-batches of 1.
  c.data_parallel = 2;
  c.global_batch_size = 6;
  EXPECT_TRUE(pp_has(pp_config_message(c), "a multiple of 4")) << pp_config_message(c);
  c.global_batch_size = 8;
  EXPECT_EQ(pp_config_message(c), "");
  // Without the interleaved schedule any count of micro-batches runs.
  c = pp_tiny(2);
  c.global_batch_size = 3;
  EXPECT_EQ(pp_config_message(c), "");
}

// Megatron refuses the interleaved schedule at two stages without overlap (torch's batched sends could pair a
// chunk's message with the wrong receive); nibble's message groups post a rank's sends and receives in one order on
// both sides (PipelineSchedule::exchange), so two stages run either way (CPU layouts test, GPU PipelineTwoGpus).
TEST(PipelineConfig, InterleavedAtTwoStagesWithAndWithoutOverlap) {
  TrainConfig c = pp_tiny(2);
  c.num_virtual_stages_per_pipeline_rank = 2;
  c.global_batch_size = 2;
  c.overlap_p2p_communication = false;
  EXPECT_EQ(pp_config_message(c), "");
  c.overlap_p2p_communication = true;
  EXPECT_EQ(pp_config_message(c), "");
  c = pp_tiny(4);
  c.num_virtual_stages_per_pipeline_rank = 2;
  c.global_batch_size = 4;
  c.overlap_p2p_communication = false;
  EXPECT_EQ(pp_config_message(c), "");
}

TEST(PipelineConfig, ComposesWithTensorAndContextParallelism) {
  TrainConfig c = pp_tiny(2);
  c.tensor_model_parallel_size = 2;
  c.sequence_parallel = true;
  c.context_parallel_size = 2;
  EXPECT_EQ(pp_config_message(c), "");
}

TEST(PipelineConfig, RefusesWhatIsNotSupportedYet) {
  struct Case {
    const char* flag;
    void (*set)(TrainConfig&);
  };
  const Case cases[] = {
      {"--sample-interval", [](TrainConfig& c) { c.sample_interval = 5; }},
      {"--quant-stats", [](TrainConfig& c) { c.quant_stats = true; }},
  };
  for (const Case& k : cases) {
    TrainConfig c = pp_tiny(2);
    k.set(c);
    const std::string msg = pp_config_message(c);
    EXPECT_TRUE(pp_has(msg, k.flag)) << k.flag << ": " << msg;
    EXPECT_TRUE(pp_has(msg, "is not supported yet with --pipeline-model-parallel-size > 1")) << msg;
    c.pipeline_model_parallel_size = 1;  // the same job without pipeline parallelism passes these checks
    EXPECT_FALSE(pp_has(pp_config_message(c), "not supported yet")) << k.flag;
  }
  TrainConfig tied;  // llama-125m ties its embedding and LM head
  tied.model = "llama-125m";
  tied.pipeline_model_parallel_size = 2;
  const std::string msg = pp_config_message(tied);
  EXPECT_TRUE(pp_has(msg, "the embedding and LM head share a weight on two stages")) << msg;
  tied.pipeline_model_parallel_size = 1;
  EXPECT_EQ(pp_config_message(tied), "");
  TrainConfig fsdp = pp_tiny(2);  // Megatron-FSDP runs over each stage's data ranks
  fsdp.use_megatron_fsdp = true;
  for (const char* strategy : {"optim_grads", "optim_grads_params"}) {
    fsdp.data_parallel_sharding_strategy = strategy;
    EXPECT_FALSE(pp_has(pp_config_message(fsdp), "not supported yet")) << strategy;
  }
}

TEST(PipelineConfig, KeysReadFromTomlAndPrintOnce) {
  TrainConfig c;
  EXPECT_EQ(c.pipeline_model_parallel_size, 1);
  EXPECT_TRUE(c.overlap_p2p_communication);
  ASSERT_TRUE(apply_config_text("pipeline_model_parallel_size = 4\nnum-virtual-stages-per-pipeline-rank = 2\n"
                                "account_for_loss_in_pipeline_split = true\ndecoder_first_pipeline_num_layers = 6\n"
                                "no_overlap_p2p_communication = true\n"
                                "pipeline-model-parallel-layout = \"Et*3|(tt|)*2,tL\"\n",
                                "pp.toml", c)
                  .is_ok());
  EXPECT_EQ(c.pipeline_model_parallel_size, 4);
  EXPECT_EQ(c.num_virtual_stages_per_pipeline_rank, 2);
  EXPECT_TRUE(c.account_for_loss_in_pipeline_split);
  EXPECT_EQ(c.decoder_first_pipeline_num_layers, 6);
  EXPECT_FALSE(c.overlap_p2p_communication);
  EXPECT_EQ(c.pipeline_model_parallel_layout, "Et*3|(tt|)*2,tL");
  const std::string printed = format_config(c);
  EXPECT_TRUE(pp_has(printed, "\noverlap_p2p_communication = false\n")) << printed;
  EXPECT_FALSE(pp_has(printed, "no_overlap")) << printed;  // the negated spelling is not a second setting
  TrainConfig back;
  ASSERT_TRUE(apply_config_text(printed, "printed", back).is_ok());
  EXPECT_EQ(format_config(back), printed);
  const pp::SplitOptions o = back.pipeline_split_options(2);
  EXPECT_EQ(o.pipeline, 4);
  EXPECT_EQ(o.virtual_stages, 2);
  EXPECT_TRUE(o.account_for_loss);
  EXPECT_FALSE(o.account_for_embedding);
  EXPECT_EQ(o.first_stage_layers, 6);
  EXPECT_EQ(o.last_stage_layers, 0);
  EXPECT_EQ(o.layout, "Et*3|(tt|)*2,tL");
  for (auto& k : config_keys(back)) {
    if (k.name != "no-overlap-p2p-communication") continue;
    EXPECT_TRUE(k.is_flag);
    ASSERT_TRUE(k.set("false").is_ok());
    EXPECT_TRUE(back.overlap_p2p_communication);
    EXPECT_TRUE(pp_has(k.set("maybe").message(), "--no-overlap-p2p-communication expects true or false"));
  }
}

// Megatron's bare `--no-overlap-p2p-communication`, followed by another flag, through the real binary: the run
// records the setting it turned off.
TEST(PipelineConfig, BareNoOverlapFlagTurnsTheOverlapOff) {
  const auto dir = std::filesystem::temp_directory_path() / ("nibble_pp_no_overlap_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  const test::CliRun r = test::run_nibble(
      "train --model tiny --device cpu --train-iters 1 --seq-length 32 --no-overlap-p2p-communication --save " +
      dir.string());
  ASSERT_EQ(r.code, 0) << r.out;
  std::ifstream f(dir / "config.toml");
  std::string line, found;
  while (std::getline(f, line))
    if (line.rfind("overlap_p2p_communication = ", 0) == 0) found = line;
  EXPECT_EQ(found, "overlap_p2p_communication = false");
  std::filesystem::remove_all(dir);
}

// The schedule's order of passes (Megatron's 1F1B and interleaved numbering), written out by hand for small cases.
TEST(PipelineSlots, PassOrderFollowsTheSchedules) {
  using Pass = LlamaModel::PipelinePass;
  const auto same = [](const std::vector<Pass>& a, const std::vector<Pass>& b) {
    if (a.size() != b.size()) return false;
    for (size_t i = 0; i < a.size(); ++i)
      if (a[i].micro != b[i].micro || a[i].chunk != b[i].chunk || a[i].forward != b[i].forward) return false;
    return true;
  };
  // 1F1B, P 2, M 3, rank 0: one warm-up forward, then F1 B0, F2 B1, then B2.
  EXPECT_TRUE(same(PipelineSchedule::pass_order(2, 1, 0, 3),
                   {{0, 0, true}, {1, 0, true}, {0, 0, false}, {2, 0, true}, {1, 0, false}, {2, 0, false}}));
  // Interleaved, P 2, V 2, M 2, rank 1: warm-up (2-1-1) x 2 + (2-1) x 2 = 2 forwards (micro-batches 0, 1 of chunk 0),
  // then forwards of chunk 1 beside backwards of chunk 1 (backwards take the chunks in reverse), then chunk 0's.
  EXPECT_TRUE(same(PipelineSchedule::pass_order(2, 2, 1, 2), {{0, 0, true},
                                                              {1, 0, true},
                                                              {0, 1, true},
                                                              {0, 1, false},
                                                              {1, 1, true},
                                                              {1, 1, false},
                                                              {0, 0, false},
                                                              {1, 0, false}}));
}

// Slots sized by replaying the passes: equal chunks need the most passes in flight, each of the chunk's size (what
// one shared size gave before); a larger chunk costs only where its passes are in flight; the plan never holds more
// than the most passes in flight each in a slot of the largest chunk's size.
TEST(PipelineSlots, SlotsAreSizedByReplayingThePasses) {
  for (const auto& [P, V, M] : std::vector<std::tuple<int, int, int64_t>>{{2, 1, 8}, {4, 1, 8}, {4, 2, 8}, {4, 20, 32}})
    for (int rank = 0; rank < P; ++rank) {
      const auto order = PipelineSchedule::pass_order(P, V, rank, M);
      const int64_t in_flight = PipelineSchedule::max_in_flight(P, V, rank, M);
      EXPECT_EQ(LlamaModel::plan_slot_bytes(std::vector<int64_t>(size_t(V), 1000), order),
                std::vector<int64_t>(size_t(in_flight), 1000))
          << P << " " << V << " " << rank;
      std::vector<int64_t> kept(size_t(V), 1000);
      kept[0] = 2000;  // a layout's two-layer first chunk
      int64_t sum = 0;
      for (const int64_t b : LlamaModel::plan_slot_bytes(kept, order)) sum += b;
      EXPECT_LE(sum, 2000 * in_flight);
      EXPECT_GE(sum, 1000 * in_flight);
      const std::vector<int64_t> per_chunk = LlamaModel::chunk_in_flight(V, order);
      EXPECT_LE(*std::max_element(per_chunk.begin(), per_chunk.end()), in_flight);
      if (V == 1) { EXPECT_EQ(per_chunk[0], in_flight); }
    }
  // NeMo's 70B at PP4 VP20, rank 0 (83 passes in flight, 8 of chunks 0-9 and 4 of chunks 10-19 at most): with chunk
  // 0 twice the others, 92 one-layer slots' worth rather than 166.
  std::vector<int64_t> kept(20, 1);
  kept[0] = 2;
  int64_t sum = 0;
  for (const int64_t b : LlamaModel::plan_slot_bytes(kept, PipelineSchedule::pass_order(4, 20, 0, 32))) sum += b;
  EXPECT_EQ(sum, 92);
  const std::vector<int64_t> per_chunk = LlamaModel::chunk_in_flight(20, PipelineSchedule::pass_order(4, 20, 0, 32));
  EXPECT_EQ(per_chunk[0], 8);
  EXPECT_EQ(per_chunk[19], 4);
}
