// The tp-cp-dp-pp rank layout (distributed/parallel_layout.h): Megatron's order on worked examples, groups that
// partition the world, and the refusals of sizes a model or sequence cannot split.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <vector>

#include "distributed/parallel_layout.h"
#include "model/tensor_parallel.h"

namespace nb::dist {
namespace {

TEST(ParallelLayout, MegatronOrderTensorFastestPipelineSlowest) {
  // 16 ranks, T2 C2 P2: D = 2. Rank 13 = tp 1 + 2 * (cp 0 + 2 * (dp 1 + 2 * pp 1)).
  ParallelLayout l;
  ASSERT_TRUE(make_parallel_layout(16, 13, {2, 2, 2}, &l).is_ok());
  EXPECT_EQ(l.data, 2);
  EXPECT_EQ((std::vector<int>{l.tp, l.cp, l.dp, l.pp}), (std::vector<int>{1, 0, 1, 1}));
  EXPECT_EQ(l.tp_group, (std::vector<int>{12, 13}));
  EXPECT_EQ(l.cp_group, (std::vector<int>{13, 15}));
  EXPECT_EQ(l.dp_group, (std::vector<int>{9, 13}));
  EXPECT_EQ(l.dp_cp_group, (std::vector<int>{9, 11, 13, 15}));
  EXPECT_EQ(l.pp_group, (std::vector<int>{5, 13}));
}

// Every kind of group partitions the world: each rank in exactly one group of each kind, of the right size.
TEST(ParallelLayout, GroupsPartitionTheWorld) {
  for (const ParallelSizes s :
       {ParallelSizes{1, 1, 1}, ParallelSizes{2, 1, 1}, ParallelSizes{4, 1, 1}, ParallelSizes{1, 2, 1},
        ParallelSizes{1, 4, 1}, ParallelSizes{2, 2, 1}, ParallelSizes{2, 1, 2}}) {
    const int world = 8;
    std::set<std::vector<int>> tp, cp, dp, dpcp;
    for (int r = 0; r < world; ++r) {
      ParallelLayout l;
      ASSERT_TRUE(make_parallel_layout(world, r, s, &l).is_ok());
      for (const auto* g : {&l.tp_group, &l.cp_group, &l.dp_group, &l.dp_cp_group, &l.pp_group})
        EXPECT_NE(std::find(g->begin(), g->end(), r), g->end()) << "rank " << r << " outside its own group";
      EXPECT_EQ(int(l.dp_cp_group.size()), l.data * s.context);
      tp.insert(l.tp_group);
      cp.insert(l.cp_group);
      dp.insert(l.dp_group);
      dpcp.insert(l.dp_cp_group);
    }
    EXPECT_EQ(int(tp.size()) * s.tensor, world);
    EXPECT_EQ(int(cp.size()) * s.context, world);
    EXPECT_EQ(int(dpcp.size()) * s.context * (world / (s.tensor * s.context * s.pipeline)), world);
  }
}

TEST(ParallelLayout, RefusesWhatCannotSplit) {
  ParallelLayout l;
  Status st = make_parallel_layout(6, 0, {4, 1, 1}, &l);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("multiple of 4"), std::string::npos) << st.message();
  LlamaConfig m;
  ASSERT_TRUE(llama_preset("llama3.1-8b", &m).is_ok());
  EXPECT_TRUE(check_model_fits_layout(m, 8192, {8, 4, 1}).is_ok());
  st = check_model_fits_layout(m, 8192, {16, 1, 1});  // 8 KV heads
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("KV heads"), std::string::npos) << st.message();
  st = check_model_fits_layout(m, 8190, {1, 2, 1});
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("not a multiple of 4"), std::string::npos) << st.message();
  EXPECT_EQ(tp::padded_vocab(m, 1), 128256);
  EXPECT_EQ(tp::padded_vocab(m, 2), 128256);
  EXPECT_EQ(tp::padded_vocab(m, 8), 129024);  // what Megatron pads Llama 3's vocabulary to at TP8
}

}  // namespace
}  // namespace nb::dist
