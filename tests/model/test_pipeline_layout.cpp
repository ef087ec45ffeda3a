// Megatron's --pipeline-model-parallel-layout (model/pipeline_layout.h, pipeline_split.h): the grammar as
// Megatron-Core's parse_str_to_list unrolls it (groups, single-letter repeats, cosmetic commas, empty stages), V as the
// stages over P, the split in virtual-stage order, and each refusal naming the flag and what is wrong. The expected
// stages are written out by hand from the grammar.
#include <gtest/gtest.h>
#include <string>
#include <utility>
#include <vector>
#include "model/pipeline_layout.h"
#include "model/pipeline_split.h"

using nb::Status;
using namespace nb::pp;

namespace {

// Each stage as its decoder-layer count, with 'E' / 'L' marked as -1 / -2 entries around it, for one-line checks:
// "Ett|tL" -> {{-1, 2}, {1, -2}}.
std::vector<std::vector<int64_t>> layout_rows(const std::string& layout) {
  std::vector<LayoutStage> stages;
  const Status st = parse_pipeline_layout(layout, &stages);
  EXPECT_TRUE(st.is_ok()) << st.message();
  std::vector<std::vector<int64_t>> rows;
  for (const LayoutStage& s : stages) {
    std::vector<int64_t> row;
    if (s.embedding) row.push_back(-1);
    row.push_back(s.decoder_layers);
    if (s.loss) row.push_back(-2);
    rows.push_back(row);
  }
  return rows;
}

std::string layout_refusal(const std::string& layout) {
  std::vector<LayoutStage> stages;
  const Status st = parse_pipeline_layout(layout, &stages);
  return st ? "" : st.message();
}

using Rows = std::vector<std::vector<int64_t>>;

SplitOptions layout_opts(int pipeline, const std::string& layout) {
  SplitOptions o;
  o.pipeline = pipeline;
  o.layout = layout;
  EXPECT_TRUE(layout_virtual_stages(layout, pipeline, &o.virtual_stages).is_ok());
  return o;
}

}  // namespace

TEST(PipelineLayout, UnrollsGroupsLettersAndCommasAsMegatron) {
  EXPECT_EQ(layout_rows("EttttL"), (Rows{{-1, 4, -2}}));
  EXPECT_EQ(layout_rows("Ettt|tt||ttL"), (Rows{{-1, 3}, {2}, {0}, {2, -2}}));  // an empty stage
  EXPECT_EQ(layout_rows("Et*3|t*2|t|t*2,L"), (Rows{{-1, 3}, {2}, {1}, {2, -2}}));
  // Megatron's documented example less its 'm' (DeepSeek-V3's MTP): "Et*3|(tt|)*29,m|L" -> 31 stages before "|L".
  const Rows deepseek = layout_rows("Et*3|(tt|)*29L");
  ASSERT_EQ(deepseek.size(), 31u);
  EXPECT_EQ(deepseek.front(), (std::vector<int64_t>{-1, 3}));
  EXPECT_EQ(deepseek[1], (std::vector<int64_t>{2}));
  EXPECT_EQ(deepseek.back(), (std::vector<int64_t>{0, -2}));
  EXPECT_EQ(layout_rows("E|(t|)*3,tL"), (Rows{{-1, 0}, {1}, {1}, {1}, {1, -2}}));
  EXPECT_EQ(layout_rows("Et|*3tL"), (Rows{{-1, 1}, {0}, {0}, {1, -2}}));  // '|' repeats like a letter
  EXPECT_EQ(layout_rows("(Et|t)*1,L"), (Rows{{-1, 1}, {1, -2}}));
}

TEST(PipelineLayout, RefusalsNameTheFlagAndTheFault) {
  const auto has = [](const std::string& layout, const std::string& part) {
    const std::string msg = layout_refusal(layout);
    EXPECT_NE(msg.find(part), std::string::npos) << layout << ": " << msg;
    EXPECT_NE(msg.find("--pipeline-model-parallel-layout"), std::string::npos) << msg;
  };
  has("", "is empty");
  has(",", "is empty");
  has("Ettmt|L", "'m' is a multi-token-prediction layer");
  has("Ett x|tL", "' ' names no layer");
  has("Ett|t*|L", "'*' must be followed by a count");
  has("*3Et|L", "'*' must follow the letter it repeats");
  has("Et(t|)L", "must be followed by its count");
  has("Et((t|)*2)*2L", "groups do not nest");
  has("Et(t|*2L", "'(' without its ')'");
  has("Ett)|L", "')' without its '('");
  has("Et()*2|L", "an empty group");
  has("Et*0|tL", "a repeat's count must be from 1");
  has("Et*99999999999|tL", "a repeat's count must be from 1");
  has("E(t*1000)*2000|L", "unrolls to more than");
  has("tE|tL", "the embedding 'E' must open the first stage");
  has("Et|EtL", "the embedding 'E' must open the first stage");
  has("t|tL", "the embedding 'E' must be given once");
  has("Et|tL|", "the loss 'L' must be given once, closing the last stage");
  has("Et|Lt", "the loss 'L' must close the last stage");
  has("EtL|tL", "the loss 'L' must be given once");
  has("Et|t", "the loss 'L' must be given once");
}

TEST(PipelineLayout, SplitsInVirtualStageOrder) {
  // P 2, 4 stages: V 2; stage s on rank s % 2 as its chunk s / 2.
  const SplitOptions o = layout_opts(2, "Ettt|tt||ttL");
  EXPECT_EQ(o.virtual_stages, 2);
  std::vector<LayerRange> stages;
  ASSERT_TRUE(split_layers(7, o, &stages).is_ok());
  std::vector<std::pair<int64_t, int64_t>> got;
  for (const LayerRange& s : stages) got.emplace_back(s.begin, s.end);
  EXPECT_EQ(got, (std::vector<std::pair<int64_t, int64_t>>{{0, 3}, {3, 5}, {5, 5}, {5, 7}}));
  const auto rank1 = rank_chunks(stages, 1, 2);
  EXPECT_EQ(rank1[0].count(), 2);
  EXPECT_EQ(rank1[1].count(), 2);
  // One stage per rank (V 1), uneven by one layer: what --decoder-first-pipeline-num-layers 3 gives at P 2.
  const SplitOptions first = layout_opts(2, "Ettt|tttttL");
  EXPECT_EQ(first.virtual_stages, 1);
  ASSERT_TRUE(split_layers(8, first, &stages).is_ok());
  EXPECT_EQ(stages[0].count(), 3);
  EXPECT_EQ(stages[1].count(), 5);
}

TEST(PipelineLayout, SplitRefusals) {
  int V = 0;
  const Status not_multiple = layout_virtual_stages("Et|t|tL", 2, &V);
  EXPECT_NE(not_multiple.message().find("has 3 stages, not a multiple of --pipeline-model-parallel-size 2"),
            std::string::npos)
      << not_multiple.message();
  const Status one_rank = layout_virtual_stages("Et|tL", 1, &V);
  EXPECT_NE(one_rank.message().find("need --pipeline-model-parallel-size > 1"), std::string::npos)
      << one_rank.message();
  ASSERT_TRUE(layout_virtual_stages("EttL", 1, &V).is_ok());
  EXPECT_EQ(V, 1);

  std::vector<LayerRange> stages;
  const Status short_by_one = split_layers(8, layout_opts(2, "Ettt|ttL"), &stages);
  EXPECT_NE(short_by_one.message().find("places 5 decoder layers ('t'); the model has 8"), std::string::npos)
      << short_by_one.message();
  SplitOptions wrong_v = layout_opts(2, "Ettt|ttL");
  wrong_v.virtual_stages = 2;
  EXPECT_NE(split_layers(5, wrong_v, &stages).message().find("has 2 stages, but 2 pipeline ranks x 2 virtual"),
            std::string::npos);
  SplitOptions both = layout_opts(2, "Ettt|ttL");
  both.first_stage_layers = 3;
  EXPECT_NE(split_layers(5, both, &stages).message().find("places every layer itself"), std::string::npos);
  both = layout_opts(2, "Ettt|ttL");
  both.account_for_loss = true;
  EXPECT_NE(split_layers(5, both, &stages).message().find("places every layer itself"), std::string::npos);
}
