// Packed SFT rows: best-fit-decreasing packing, labels only on answer tokens, segment starts, the
// epoch order, data-parallel slicing, and the checks on the token/mask pair.
#include <gtest/gtest.h>

#include <filesystem>
#include <numeric>
#include <set>
#include "data/indexed_dataset.h"
#include "data/sft_dataset.h"

namespace nb {
namespace {

namespace fs = std::filesystem;

// Writes PREFIX_tokens_document / PREFIX_mask_document with the given samples.
void write_sft(const std::string& prefix, const std::vector<std::vector<int32_t>>& tokens,
               const std::vector<std::vector<uint8_t>>& masks) {
  std::unique_ptr<IndexedDatasetWriter> t, m;
  ASSERT_TRUE(IndexedDatasetWriter::create(prefix + "_tokens_document", IndexedDtype::u16, &t).is_ok());
  ASSERT_TRUE(IndexedDatasetWriter::create(prefix + "_mask_document", IndexedDtype::u8, &m).is_ok());
  for (size_t i = 0; i < tokens.size(); ++i) {
    ASSERT_TRUE(t->add_document(tokens[i].data(), int64_t(tokens[i].size())).is_ok());
    std::vector<int32_t> mi(masks[i].begin(), masks[i].end());
    ASSERT_TRUE(m->add_document(mi.data(), int64_t(mi.size())).is_ok());
  }
  ASSERT_TRUE(t->finalize().is_ok());
  ASSERT_TRUE(m->finalize().is_ok());
}

class SftDataTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("nibble_sft_ds_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
    prefix_ = (dir_ / "chat").string();
  }
  void TearDown() override { fs::remove_all(dir_); }
  // Sample i: tokens 100*i + 1 .. 100*i + len, the second half is the answer.
  void write_lengths(const std::vector<int>& lengths) {
    std::vector<std::vector<int32_t>> t;
    std::vector<std::vector<uint8_t>> m;
    for (size_t i = 0; i < lengths.size(); ++i) {
      t.emplace_back(size_t(lengths[i]));
      std::iota(t.back().begin(), t.back().end(), int32_t(100 * i + 1));
      m.emplace_back(size_t(lengths[i]), uint8_t{0});
      for (int j = lengths[i] / 2; j < lengths[i]; ++j) m.back()[size_t(j)] = 1;
    }
    write_sft(prefix_, t, m);
  }
  fs::path dir_;
  std::string prefix_;
};

TEST(SftPacking, BestFitDecreasingFillsRowsAndCountsEfficiency) {
  // positions = length - 1: 7, 5, 4, 3, 2, 1 into rows of 8 -> {7,1}, {5,3}, {4,2}
  const std::vector<int32_t> lengths{3, 8, 5, 6, 4, 2, 1};  // sample 6 (one token) has no prediction
  std::vector<int64_t> ids(lengths.size());
  std::iota(ids.begin(), ids.end(), 0);
  SftPacking p;
  pack_sft_samples(ids, lengths, 8, true, &p);
  ASSERT_EQ(p.rows(), 3);
  EXPECT_EQ(p.real_tokens, 7 + 5 + 4 + 3 + 2 + 1);
  EXPECT_DOUBLE_EQ(p.efficiency(), 22.0 / 24.0);
  std::set<int64_t> seen(p.samples.begin(), p.samples.end());
  EXPECT_EQ(seen, (std::set<int64_t>{0, 1, 2, 3, 4, 5}));
  for (int64_t r = 0; r < p.rows(); ++r) {
    int64_t used = 0;
    for (int64_t k = p.row_begin[size_t(r)]; k < p.row_begin[size_t(r) + 1]; ++k)
      used += sft_positions(lengths[size_t(p.samples[size_t(k)])], 8);
    EXPECT_LE(used, 8) << "row " << r;
  }
  EXPECT_EQ(p.samples[0], 1);  // the longest sample opens the first row
  SftPacking one;
  pack_sft_samples(ids, lengths, 8, false, &one);
  EXPECT_EQ(one.rows(), 6);
}

TEST(SftPacking, LongSamplesAreCutAndCounted) {
  SftPacking p;
  pack_sft_samples({0, 1}, {20, 4}, 8, true, &p);
  EXPECT_EQ(p.cut, 1);
  EXPECT_EQ(p.rows(), 2);
  EXPECT_EQ(p.real_tokens, 8 + 3);
}

TEST_F(SftDataTest, RowsHoldAnswerLabelsAndSegmentStarts) {
  write_lengths({5, 4});  // positions 4 and 3 -> one row of 8 with a padding tail of 1
  std::unique_ptr<SftDataset> ds;
  ASSERT_TRUE(SftDataset::open(prefix_, &ds).is_ok());
  SftPacking p;
  pack_sft_samples({0, 1}, ds->lengths(), 8, true, &p);
  ASSERT_EQ(p.rows(), 1);
  std::vector<int32_t> tokens(8), labels(8), starts;
  fill_sft_row(*ds, p, 0, 7, 16, tokens.data(), labels.data(), &starts);
  // sample 0: tokens 1..5, mask 0 0 1 1 1; sample 1: 101..104, mask 0 0 1 1
  EXPECT_EQ(tokens, (std::vector<int32_t>{1, 2, 3, 4, 101, 102, 103, 7}));
  EXPECT_EQ(labels, (std::vector<int32_t>{-1, 3, 4, 5, -1, 103, 104, -1}));
  EXPECT_EQ(starts, (std::vector<int32_t>{16, 20, 23}));
}

// --pad-seq-to-mult (context parallelism's 2C): each sample's segment is padded, untrained, to a multiple of 4.
TEST_F(SftDataTest, SamplesArePaddedToTheMultiple) {
  write_lengths({5, 4});  // positions 4 and 3 -> segments of 4 and 4 (1 padding) in a row of 8
  std::unique_ptr<SftDataset> ds;
  ASSERT_TRUE(SftDataset::open(prefix_, &ds).is_ok());
  SftPacking p;
  pack_sft_samples({0, 1}, ds->lengths(), 8, true, &p, 4);
  ASSERT_EQ(p.rows(), 1);
  EXPECT_EQ(p.real_tokens, 7);
  std::vector<int32_t> tokens(8), labels(8), starts;
  fill_sft_row(*ds, p, 0, 7, 0, tokens.data(), labels.data(), &starts);
  EXPECT_EQ(tokens, (std::vector<int32_t>{1, 2, 3, 4, 101, 102, 103, 7}));
  EXPECT_EQ(labels, (std::vector<int32_t>{-1, 3, 4, 5, -1, 103, 104, -1}));
  EXPECT_EQ(starts, (std::vector<int32_t>{0, 4}));   // the padding is the second sample's, no tail segment
  pack_sft_samples({0, 1}, {6, 4}, 8, true, &p, 4);  // 5 positions take 8: the second sample needs a row
  EXPECT_EQ(p.rows(), 2);
}

TEST_F(SftDataTest, SourceWalksEveryRowOncePerEpochAndSlicesRanks) {
  write_lengths({9, 9, 9, 9, 9, 9});  // six rows of 8 positions each
  SftDataConfig cfg;
  cfg.prefix = prefix_;
  cfg.split = "1,0,0";
  cfg.seq_length = 8;
  std::unique_ptr<TokenSource> src;
  SftPacking p;
  ASSERT_TRUE(make_sft_source(cfg, Split::train, 2, 0, 1, 0, &src, &p).is_ok());
  EXPECT_EQ(p.rows(), 6);
  std::set<int32_t> first;
  std::vector<int32_t> order;
  for (int i = 0; i < 3; ++i) {
    Batch b;
    ASSERT_TRUE(src->next(&b).is_ok());
    EXPECT_EQ(b.segment_starts, (std::vector<int32_t>{0, 8, 16}));
    first.insert(b.tokens[0]);
    first.insert(b.tokens[8]);
    order.push_back(b.tokens[0]);
    order.push_back(b.tokens[8]);
  }
  EXPECT_EQ(first.size(), 6u);  // one epoch: every row once
  EXPECT_EQ(src->consumed_samples(), 6);
  // Ranks: rank 1 of 2 with micro-batch 1 reads the second row of each global micro-batch of 2.
  std::unique_ptr<TokenSource> r1;
  ASSERT_TRUE(make_sft_source(cfg, Split::train, 1, 1, 2, 0, &r1).is_ok());
  Batch b;
  ASSERT_TRUE(r1->next(&b).is_ok());
  EXPECT_EQ(b.tokens[0], order[1]);
  // Resuming from a consumed count continues the same order.
  std::unique_ptr<TokenSource> resumed;
  ASSERT_TRUE(make_sft_source(cfg, Split::train, 2, 0, 1, 4, &resumed).is_ok());
  ASSERT_TRUE(resumed->next(&b).is_ok());
  EXPECT_EQ(b.tokens[0], order[4]);
  EXPECT_EQ(b.tokens[8], order[5]);
}

TEST_F(SftDataTest, MismatchedMaskIsRefused) {
  write_sft(prefix_, {{1, 2, 3}}, {{0, 1}});
  std::unique_ptr<SftDataset> ds;
  Status st = SftDataset::open(prefix_, &ds);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("describe different samples"), std::string::npos) << st.message();
}

TEST_F(SftDataTest, MissingFilesAndBlendsAreRefused) {
  SftDataConfig cfg;
  cfg.prefix = prefix_;
  cfg.seq_length = 8;
  std::unique_ptr<TokenSource> src;
  Status st = make_sft_source(cfg, Split::train, 1, 0, 1, 0, &src);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("preprocess --sft"), std::string::npos) << st.message();
  cfg.prefix = "0.5 " + prefix_ + " 0.5 " + prefix_;
  st = make_sft_source(cfg, Split::train, 1, 0, 1, 0, &src);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("not a blend"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace nb
