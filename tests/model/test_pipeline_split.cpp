// Pipeline parallelism's layer split (model/pipeline_split.h) against Megatron-Core's semantics: the even split,
// the interleaved placement, V from either flag, the embedding / loss counted as layers, the first / last stage
// counts with and without virtual stages, each refusal naming its flag, and the bubble formula.
#include <gtest/gtest.h>
#include <string>
#include <utility>
#include <vector>
#include "model/pipeline_split.h"

using nb::Status;
using namespace nb::pp;

namespace {

// The stages as [begin, end) pairs, for one-line expectations.
std::vector<std::pair<int64_t, int64_t>> pp_split_pairs(int64_t layers, const SplitOptions& o) {
  std::vector<LayerRange> stages;
  Status st = split_layers(layers, o, &stages);
  EXPECT_TRUE(st.is_ok()) << st.message();
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const auto& s : stages) out.emplace_back(s.begin, s.end);
  return out;
}

// The refusal's message ("" when the split is accepted).
std::string pp_split_refusal(int64_t layers, const SplitOptions& o) {
  std::vector<LayerRange> stages;
  Status st = split_layers(layers, o, &stages);
  return st ? "" : st.message();
}

SplitOptions pp_opts(int pipeline, int virtual_stages = 1) {
  SplitOptions o;
  o.pipeline = pipeline;
  o.virtual_stages = virtual_stages;
  return o;
}

using PpPairs = std::vector<std::pair<int64_t, int64_t>>;

}  // namespace

TEST(PipelineSplit, EvenSplitOverTwoAndFourStages) {
  EXPECT_EQ(pp_split_pairs(8, pp_opts(2)), (PpPairs{{0, 4}, {4, 8}}));
  EXPECT_EQ(pp_split_pairs(32, pp_opts(4)), (PpPairs{{0, 8}, {8, 16}, {16, 24}, {24, 32}}));
  EXPECT_EQ(pp_split_pairs(5, pp_opts(1)), (PpPairs{{0, 5}}));
  std::vector<LayerRange> stages;
  ASSERT_TRUE(split_layers(32, pp_opts(4), &stages).is_ok());
  EXPECT_EQ(stages[3].count(), 8);
}

TEST(PipelineSplit, InterleavedPlacementMatchesMegatron) {
  // Megatron's example: P 4, V 2, 16 layers -> rank 0 holds layers 0-1 and 8-9.
  std::vector<LayerRange> stages;
  ASSERT_TRUE(split_layers(16, pp_opts(4, 2), &stages).is_ok());
  ASSERT_EQ(stages.size(), 8u);
  for (size_t s = 0; s < stages.size(); ++s) {
    EXPECT_EQ(stages[s].begin, int64_t(2 * s));
    EXPECT_EQ(stages[s].end, int64_t(2 * s + 2));
  }
  const auto rank0 = rank_chunks(stages, 0, 4);
  ASSERT_EQ(rank0.size(), 2u);
  EXPECT_EQ(rank0[0].begin, 0);
  EXPECT_EQ(rank0[0].end, 2);
  EXPECT_EQ(rank0[1].begin, 8);
  EXPECT_EQ(rank0[1].end, 10);
  const auto rank3 = rank_chunks(stages, 3, 4);
  ASSERT_EQ(rank3.size(), 2u);
  EXPECT_EQ(rank3[0].begin, 6);
  EXPECT_EQ(rank3[1].begin, 14);
  EXPECT_EQ(rank3[1].end, 16);
  // transformer_block.py's comment: 8 layers, P 2, V 4 -> rank 0 [0] [2] [4] [6], rank 1 [1] [3] [5] [7].
  ASSERT_TRUE(split_layers(8, pp_opts(2, 4), &stages).is_ok());
  const auto r1 = rank_chunks(stages, 1, 2);
  ASSERT_EQ(r1.size(), 4u);
  for (size_t k = 0; k < r1.size(); ++k) {
    EXPECT_EQ(r1[k].begin, int64_t(2 * k + 1));
    EXPECT_EQ(r1[k].count(), 1);
  }
}

TEST(PipelineSplit, VirtualStagesFromEitherFlag) {
  int V = 0;
  ASSERT_TRUE(resolve_virtual_stages(16, 4, 2, 0, &V).is_ok());  // 16 / (4 x 2)
  EXPECT_EQ(V, 2);
  ASSERT_TRUE(resolve_virtual_stages(32, 4, 1, 0, &V).is_ok());
  EXPECT_EQ(V, 8);
  ASSERT_TRUE(resolve_virtual_stages(16, 4, 0, 3, &V).is_ok());  // given directly, checked by the split
  EXPECT_EQ(V, 3);
  ASSERT_TRUE(resolve_virtual_stages(16, 4, 4, 0, &V).is_ok());  // a chunk per rank: not interleaved
  EXPECT_EQ(V, 1);
  V = 7;
  ASSERT_TRUE(resolve_virtual_stages(16, 4, 0, 0, &V).is_ok());
  EXPECT_EQ(V, 1);
}

TEST(PipelineSplit, VirtualStageFlagsRefusals) {
  int V = 0;
  Status both = resolve_virtual_stages(16, 4, 2, 2, &V);
  EXPECT_NE(both.message().find("give only one"), std::string::npos) << both.message();
  EXPECT_NE(both.message().find("--num-layers-per-virtual-pipeline-stage 2"), std::string::npos);
  Status rank_split = resolve_virtual_stages(16, 4, 3, 0, &V);  // 4 layers per rank, chunks of 3
  EXPECT_NE(rank_split.message().find("--num-layers-per-virtual-pipeline-stage 3 does not divide the 4 layers"),
            std::string::npos)
      << rank_split.message();
  Status world_split = resolve_virtual_stages(18, 4, 1, 0, &V);
  EXPECT_NE(world_split.message().find("--pipeline-model-parallel-size 4 to divide the 18 layers"), std::string::npos)
      << world_split.message();
  Status negative = resolve_virtual_stages(16, 4, 0, -2, &V);
  EXPECT_NE(negative.message().find("--num-virtual-stages-per-pipeline-rank must be positive"), std::string::npos)
      << negative.message();
  Status too_many = resolve_virtual_stages(16, 4, 0, 17, &V);
  EXPECT_NE(too_many.message().find("--num-virtual-stages-per-pipeline-rank 17 exceeds"), std::string::npos)
      << too_many.message();
}

TEST(PipelineSplit, EmbeddingAndLossCountAsLayers) {
  SplitOptions o = pp_opts(4);
  o.account_for_embedding = true;
  o.account_for_loss = true;
  // 30 layers + 2 = 32 over 4 ranks: the embedding and the loss take a layer's place on the first and last.
  EXPECT_EQ(pp_split_pairs(30, o), (PpPairs{{0, 7}, {7, 15}, {15, 23}, {23, 30}}));
  o.account_for_loss = false;  // 31 + 1 = 32
  EXPECT_EQ(pp_split_pairs(31, o), (PpPairs{{0, 7}, {7, 15}, {15, 23}, {23, 31}}));
  // Interleaved: 14 + 2 = 16 over P 2 x V 2 = 4 per chunk; only virtual stages 0 and 3 give up a layer.
  o = pp_opts(2, 2);
  o.account_for_embedding = o.account_for_loss = true;
  EXPECT_EQ(pp_split_pairs(14, o), (PpPairs{{0, 3}, {3, 7}, {7, 11}, {11, 14}}));
  // Megatron allows a first / last stage holding only the embedding / loss.
  o = pp_opts(4);
  o.account_for_embedding = o.account_for_loss = true;
  EXPECT_EQ(pp_split_pairs(2, o), (PpPairs{{0, 0}, {0, 1}, {1, 2}, {2, 2}}));
  // The accounted layers change what must divide: 31 alone is refused by P 4, 31 + 1 is not.
  EXPECT_NE(pp_split_refusal(31, pp_opts(4)).find("does not divide the 31 decoder layers"), std::string::npos);
  o = pp_opts(4);
  o.account_for_embedding = true;
  const std::string msg = pp_split_refusal(30, o);  // 31 counted
  EXPECT_NE(msg.find("--account-for-embedding-in-pipeline-split"), std::string::npos) << msg;
  EXPECT_NE(msg.find("= 31 layers"), std::string::npos) << msg;
}

TEST(PipelineSplit, FirstAndLastStageCounts) {
  SplitOptions o = pp_opts(4);
  o.first_stage_layers = 2;
  o.last_stage_layers = 4;
  EXPECT_EQ(pp_split_pairs(16, o), (PpPairs{{0, 2}, {2, 7}, {7, 12}, {12, 16}}));  // 10 over 2 middle ranks
  o.last_stage_layers = 0;  // 14 over the 3 other ranks is refused, 15 is not
  EXPECT_EQ(pp_split_pairs(17, o), (PpPairs{{0, 2}, {2, 7}, {7, 12}, {12, 17}}));
  o = pp_opts(4);
  o.last_stage_layers = 1;
  EXPECT_EQ(pp_split_pairs(10, o), (PpPairs{{0, 3}, {3, 6}, {6, 9}, {9, 10}}));
  o = pp_opts(2);
  o.first_stage_layers = 3;
  o.last_stage_layers = 5;
  EXPECT_EQ(pp_split_pairs(8, o), (PpPairs{{0, 3}, {3, 8}}));
}

TEST(PipelineSplit, FirstAndLastStageCountsWithVirtualStages) {
  // P 4, V 2, first 4, last 2: 22 layers leave 8 per middle rank, 4 per chunk; each round of chunks holds
  // 2 (rank 0) + 4 + 4 + 1 (rank 3) = 11 layers, where get_transformer_layer_offset places them.
  SplitOptions o = pp_opts(4, 2);
  o.first_stage_layers = 4;
  o.last_stage_layers = 2;
  EXPECT_EQ(pp_split_pairs(22, o),
            (PpPairs{{0, 2}, {2, 6}, {6, 10}, {10, 11}, {11, 13}, {13, 17}, {17, 21}, {21, 22}}));
  std::vector<LayerRange> stages;
  ASSERT_TRUE(split_layers(22, o, &stages).is_ok());
  const auto rank0 = rank_chunks(stages, 0, 4);
  EXPECT_EQ(rank0[0].count() + rank0[1].count(), 4);  // --decoder-first-pipeline-num-layers counts the whole rank
  const std::string odd = pp_split_refusal(20, o);    // 7 per middle rank, odd for V 2
  EXPECT_NE(odd.find("holds 7 decoder layers"), std::string::npos) << odd;
  EXPECT_NE(odd.find("2 virtual stages"), std::string::npos) << odd;
  o.first_stage_layers = 3;
  const std::string first_odd = pp_split_refusal(21, o);
  EXPECT_NE(first_odd.find("--decoder-first-pipeline-num-layers 3 is not a multiple of the 2 virtual stages"),
            std::string::npos)
      << first_odd;
}

TEST(PipelineSplit, RefusalsNameTheirFlags) {
  const std::string uneven = pp_split_refusal(10, pp_opts(4));
  EXPECT_NE(uneven.find("--pipeline-model-parallel-size 4 does not divide the 10 decoder layers"), std::string::npos)
      << uneven;
  EXPECT_NE(uneven.find("--decoder-first-pipeline-num-layers"), std::string::npos) << uneven;  // what would work
  EXPECT_NE(pp_split_refusal(12, pp_opts(4, 2)).find("3 of the 12 decoder layers, which its 2 virtual stages"),
            std::string::npos)
      << pp_split_refusal(12, pp_opts(4, 2));
  EXPECT_NE(pp_split_refusal(8, pp_opts(1, 2)).find("needs --pipeline-model-parallel-size > 1"), std::string::npos);
  EXPECT_NE(pp_split_refusal(8, pp_opts(0)).find("--pipeline-model-parallel-size must be at least 1"),
            std::string::npos);

  SplitOptions o = pp_opts(4);
  o.first_stage_layers = 2;
  o.account_for_loss = true;
  EXPECT_NE(pp_split_refusal(16, o).find("cannot be combined with --account-for-embedding-in-pipeline-split"),
            std::string::npos)
      << pp_split_refusal(16, o);
  o = pp_opts(1);
  o.last_stage_layers = 4;
  EXPECT_NE(pp_split_refusal(4, o).find("--decoder-last-pipeline-num-layers 4 sets the layers of a pipeline stage"),
            std::string::npos)
      << pp_split_refusal(4, o);
  o = pp_opts(4);
  o.first_stage_layers = -1;
  EXPECT_NE(pp_split_refusal(16, o).find("must be positive"), std::string::npos);
  o = pp_opts(4);
  o.first_stage_layers = 10;
  o.last_stage_layers = 10;
  EXPECT_NE(pp_split_refusal(16, o).find("add up to more than the model's 16 decoder layers"), std::string::npos)
      << pp_split_refusal(16, o);
  o.first_stage_layers = 8;
  o.last_stage_layers = 8;  // nothing left for ranks 1 and 2
  EXPECT_NE(pp_split_refusal(16, o).find("leave no decoder layers for the other 2 pipeline ranks"), std::string::npos)
      << pp_split_refusal(16, o);
  o = pp_opts(2);
  o.first_stage_layers = 3;
  o.last_stage_layers = 4;
  EXPECT_NE(pp_split_refusal(8, o).find("no middle stage for the other 1 decoder layers"), std::string::npos)
      << pp_split_refusal(8, o);
  o = pp_opts(4);
  o.first_stage_layers = 2;
  EXPECT_NE(pp_split_refusal(16, o).find("the 14 decoder layers left after --decoder-first-pipeline-num-layers 2 "
                                         "do not divide evenly over the other 3 pipeline ranks"),
            std::string::npos)
      << pp_split_refusal(16, o);
  EXPECT_NE(pp_split_refusal(0, pp_opts(1)).find("needs decoder layers"), std::string::npos);
}

TEST(PipelineSplit, BubbleFraction) {
  EXPECT_DOUBLE_EQ(bubble_fraction(1, 1, 8), 0.0);
  EXPECT_DOUBLE_EQ(bubble_fraction(4, 1, 8), 3.0 / 8.0);
  EXPECT_DOUBLE_EQ(bubble_fraction(4, 2, 8), 3.0 / 16.0);  // interleaving divides the bubble by V
  EXPECT_DOUBLE_EQ(bubble_fraction(8, 4, 32), 7.0 / 128.0);
}
