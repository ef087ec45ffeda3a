// GPT sampling compatibility with Megatron. Every expected array below was printed by
// scripts/megatron_indices_reference.py, which runs numpy's own RandomState / default_rng and mirrors
// Megatron's _build_document_index / build_sample_idx / _build_shuffle_index / build_blending_indices
// statement for statement (numpy 1.24, Debian 12). Re-run it to regenerate.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <numeric>
#include "data/data_test_util.h"
#include "data/gpt_dataset.h"
#include "data/indexed_dataset.h"
#include "data/numpy_random.h"
#include "data/token_source.h"

using namespace nb;

TEST(NumpyRandom, RandomStateRawOutputsAndRandint) {
  LegacyRandomState raw(1234);
  EXPECT_EQ(raw.next_u32(), 822569775u);
  EXPECT_EQ(raw.next_u32(), 2137449171u);
  EXPECT_EQ(raw.next_u32(), 2671936806u);
  LegacyRandomState rs(1234);
  std::vector<int64_t> got;
  for (int i = 0; i < 5; ++i) got.push_back(rs.randint(0, 1000));
  EXPECT_EQ(got, (std::vector<int64_t>{815, 723, 294, 53, 204}));
}

TEST(NumpyRandom, ShuffleAndPermutationOrder) {
  std::vector<int64_t> a(10);
  std::iota(a.begin(), a.end(), 0);
  LegacyRandomState(1234).shuffle(a);
  EXPECT_EQ(a, (std::vector<int64_t>{7, 2, 9, 1, 0, 8, 4, 5, 6, 3}));
  std::vector<int32_t> p(20);
  std::iota(p.begin(), p.end(), 0);
  LegacyRandomState(7).shuffle(p);
  EXPECT_EQ(p, (std::vector<int32_t>{1, 17, 2, 5, 11, 0, 18, 6, 13, 19, 10, 14, 8, 16, 9, 12, 7, 3, 4, 15}));
}

// shuffle() draws its swap partners ahead of the swaps (to prefetch them): the same order as numpy's loop, one draw
// per swap, written here plainly, at sizes around the look-ahead and far past it.
TEST(NumpyRandom, ShuffleDrawingAheadEqualsThePlainLoop) {
  for (const int64_t n : {int64_t{1}, int64_t{2}, int64_t{16}, int64_t{17}, int64_t{18}, int64_t{100003}}) {
    std::vector<int64_t> mine(static_cast<size_t>(n)), plain(static_cast<size_t>(n));
    std::iota(mine.begin(), mine.end(), 0);
    std::iota(plain.begin(), plain.end(), 0);
    LegacyRandomState(99).shuffle(mine);
    LegacyRandomState rs(99);
    for (int64_t i = n - 1; i >= 1; --i) std::swap(plain[size_t(i)], plain[rs.interval(uint64_t(i))]);
    EXPECT_EQ(mine, plain) << "n = " << n;
  }
}

TEST(NumpyRandom, DefaultRngIntegersMatchMockLengths) {
  auto v = Pcg64Generator(0).integers_int32(1, 4096, 100000);
  EXPECT_EQ(std::vector<int32_t>(v.begin(), v.begin() + 8),
            (std::vector<int32_t>{3484, 2609, 2094, 1105, 1261, 168, 309, 68}));
  EXPECT_EQ(std::accumulate(v.begin(), v.end(), int64_t{0}), 204637097);
  EXPECT_EQ(v.back(), 769);
}

namespace {
const std::vector<int32_t> kSizes = {5, 3, 7, 2, 9, 4, 6, 1};
}

TEST(GptIndices, OneEpoch) {
  GptIndices idx;
  ASSERT_TRUE(build_gpt_indices(kSizes, 0, 8, 4, 6, 1234, &idx).is_ok());
  EXPECT_EQ(idx.num_epochs, 1);
  EXPECT_FALSE(idx.separate_final_epoch);
  EXPECT_EQ(idx.document_index, (std::vector<int32_t>{2, 1, 6, 0, 4, 5, 3, 7}));
  EXPECT_EQ(idx.sample_index, (std::vector<int64_t>{0, 0, 0, 4, 1, 1, 2, 2, 3, 0, 3, 4, 4, 3, 4, 7, 5, 2, 7, 0}));
  EXPECT_EQ(idx.shuffle_index, (std::vector<int64_t>{6, 4, 0, 5, 3, 2, 8, 7, 1}));
}

TEST(GptIndices, SeparateFinalEpoch) {
  GptIndices idx;
  ASSERT_TRUE(build_gpt_indices(kSizes, 0, 8, 4, 20, 1234, &idx).is_ok());
  EXPECT_EQ(idx.num_epochs, 3);
  EXPECT_TRUE(idx.separate_final_epoch);
  EXPECT_EQ(idx.document_index,
            (std::vector<int32_t>{5, 3, 0, 4, 6, 2, 2, 7, 1, 1, 0, 4, 5, 6, 3, 7, 5, 1, 3, 4, 0, 7, 6, 2}));
  EXPECT_EQ(idx.sample_index,
            (std::vector<int64_t>{0,  0, 1,  0, 2,  2,  3,  1,  3,  5,  4,  0,  4,  4,  5,  2,  5,  6,  6,
                                  3,  7, 0,  9, 0,  10, 1,  11, 0,  11, 4,  11, 8,  12, 3,  13, 3,  14, 1,
                                  16, 2, 17, 2, 19, 1,  19, 5,  20, 0,  20, 4,  22, 2,  23, 0,  23, 4}));
  EXPECT_EQ(idx.shuffle_index, (std::vector<int64_t>{7, 10, 4, 1,  12, 8,  3,  17, 14, 13, 5,  11, 0, 2,
                                                     6, 15, 9, 16, 18, 23, 26, 24, 25, 19, 22, 21, 20}));
}

TEST(GptIndices, SubRangeManyEpochsNotSeparated) {
  GptIndices idx;
  ASSERT_TRUE(build_gpt_indices(kSizes, 2, 7, 3, 25, 42, &idx).is_ok());
  EXPECT_EQ(idx.num_epochs, 3);
  EXPECT_FALSE(idx.separate_final_epoch);
  EXPECT_EQ(idx.document_index, (std::vector<int32_t>{6, 3, 2, 5, 2, 5, 4, 3, 6, 6, 4, 2, 4, 5, 3}));
  EXPECT_EQ(idx.sample_index, (std::vector<int64_t>{0,  0, 0,  3, 1,  0, 2,  1, 2,  4, 3,  0, 3,  3, 4,  2, 4,  5,  5,
                                                    1,  6, 0,  6, 3,  6, 6,  7, 0,  8, 1,  8, 4,  9, 1,  9, 4,  10, 1,
                                                    10, 4, 10, 7, 11, 1, 11, 4, 12, 0, 12, 3, 12, 6, 13, 0, 13, 3}));
  EXPECT_EQ(idx.shuffle_index, (std::vector<int64_t>{18, 14, 4,  13, 10, 26, 6,  3, 24, 15, 17, 8,  16, 12,
                                                     19, 9,  22, 0,  25, 5,  11, 1, 20, 21, 2,  23, 7}));
}

TEST(GptIndices, BlendingInterleave) {
  std::vector<int16_t> which;
  std::vector<int64_t> index;
  build_blending_indices({0.5, 0.3, 0.2}, 12, &which, &index);
  EXPECT_EQ(which, (std::vector<int16_t>{0, 1, 2, 0, 1, 0, 2, 0, 1, 0, 0, 1}));
  EXPECT_EQ(index, (std::vector<int64_t>{0, 0, 0, 1, 1, 2, 1, 3, 2, 4, 5, 3}));
}

TEST(GptIndices, SplitRangesRoundLikePython) {
  std::array<std::pair<int64_t, int64_t>, 3> r;
  ASSERT_TRUE(split_ranges("969,30,1", 1000, &r).is_ok());
  EXPECT_EQ(r[0], (std::pair<int64_t, int64_t>{0, 969}));
  EXPECT_EQ(r[1], (std::pair<int64_t, int64_t>{969, 999}));
  EXPECT_EQ(r[2], (std::pair<int64_t, int64_t>{999, 1000}));
  // 0.5 * 5 = 2.5 rounds to even (2), as Python's round() does.
  ASSERT_TRUE(split_ranges("1,1", 5, &r).is_ok());
  EXPECT_EQ(r[0].second, 2);
  EXPECT_EQ(r[2].first, r[2].second);
  EXPECT_FALSE(split_ranges("1,2,3,4", 5, &r).is_ok());
  EXPECT_FALSE(split_ranges("0,0,0", 5, &r).is_ok());
  std::vector<BlendEntry> blend;
  ASSERT_TRUE(parse_blend("30 a 10 b", &blend).is_ok());
  ASSERT_EQ(blend.size(), 2u);
  EXPECT_DOUBLE_EQ(blend[0].weight, 0.75);
  EXPECT_EQ(blend[1].prefix, "b");
}

TEST(GptDatasetSamples, SamplesSpanDocumentsWithOverlap) {
  // Sequence i holds tokens 100*i + k; a sample is seq_len + 1 tokens, the next starting at its last token.
  auto dir = unique_temp("nibble_sampling_test");
  std::filesystem::create_directories(dir);
  std::string prefix = (dir / "tiny").string();
  {
    std::unique_ptr<IndexedDatasetWriter> w;
    ASSERT_TRUE(IndexedDatasetWriter::create(prefix, IndexedDtype::u16, &w).is_ok());
    for (size_t i = 0; i < kSizes.size(); ++i) {
      std::vector<int32_t> t;
      for (int k = 0; k < kSizes[i]; ++k) t.push_back(int32_t(100 * i + k));
      ASSERT_TRUE(w->add_document(t.data(), int64_t(t.size())).is_ok());
    }
    ASSERT_TRUE(w->finalize().is_ok());
  }
  std::unique_ptr<IndexedDataset> raw;
  ASSERT_TRUE(IndexedDataset::open(prefix, &raw).is_ok());
  std::unique_ptr<GptDataset> ds;
  ASSERT_TRUE(
      GptDataset::create(wrap_indexed_dataset(std::move(raw)), 0, 8, 4, 6, 1234, (dir / "cache").string(), "train", &ds)
          .is_ok());
  // document_index {2,1,6,0,...}; shuffle_index[0] = 6 -> sample_index rows 6 and 7: (4,3) -> (4,7).
  std::vector<int32_t> s;
  ds->sample(0, &s);
  EXPECT_EQ(s, (std::vector<int32_t>{403, 404, 405, 406, 407}));
  // shuffle_index[2] = 0 -> rows (0,0) -> (0,4): doc 2 tokens 0..4.
  ds->sample(2, &s);
  EXPECT_EQ(s, (std::vector<int32_t>{200, 201, 202, 203, 204}));
  // shuffle_index[1] = 4 -> rows (3,0) -> (3,4): document_index[3] = 0, tokens 0..4.
  ds->sample(1, &s);
  EXPECT_EQ(s, (std::vector<int32_t>{0, 1, 2, 3, 4}));
  // shuffle_index[3] = 5 -> rows (3,4) -> (4,3): doc 0 token 4, then doc 4 tokens 0..3.
  ds->sample(3, &s);
  EXPECT_EQ(s, (std::vector<int32_t>{4, 400, 401, 402, 403}));
  // The second open reads the cache written by the first and must give the same indices.
  std::unique_ptr<IndexedDataset> raw2;
  ASSERT_TRUE(IndexedDataset::open(prefix, &raw2).is_ok());
  std::unique_ptr<GptDataset> cached;
  ASSERT_TRUE(GptDataset::create(wrap_indexed_dataset(std::move(raw2)), 0, 8, 4, 6, 1234, (dir / "cache").string(),
                                 "train", &cached)
                  .is_ok());
  EXPECT_EQ(cached->indices().shuffle_index, ds->indices().shuffle_index);
  EXPECT_EQ(cached->indices().sample_index, ds->indices().sample_index);
  EXPECT_FALSE(std::filesystem::is_empty(dir / "cache"));
  std::filesystem::remove_all(dir);
}

TEST(TokenSources, MockDataMatchesMegatronTokensAndLabels) {
  std::unique_ptr<TokenSource> src;
  ASSERT_TRUE(make_mock_source(1000, 64, 2, 1234, 10, 0, &src).is_ok());
  Batch b;
  ASSERT_TRUE(src->next(&b).is_ok());
  ASSERT_EQ(b.tokens.size(), 128u);
  ASSERT_EQ(b.labels.size(), 128u);
  for (int r = 0; r < 2; ++r)
    for (int t = 0; t + 1 < 64; ++t) EXPECT_EQ(b.labels[r * 64 + t], b.tokens[r * 64 + t + 1]);
  // Mock sequences count up by one (mod vocab) until the eod (vocab - 1) that ends each sequence.
  int breaks = 0;
  for (int t = 0; t + 1 < 64; ++t) {
    int32_t a = b.tokens[t], c = b.tokens[t + 1];
    if (c != (a + 1) % 1000) {
      ++breaks;
      EXPECT_TRUE(a == 999 || c == 1) << a << " -> " << c;
    }
  }
  EXPECT_LE(breaks, 2);
  EXPECT_EQ(src->consumed_samples(), 2);
}

TEST(TokenSources, ResumeFromConsumedSamplesContinuesIdentically) {
  std::unique_ptr<TokenSource> full, resumed;
  ASSERT_TRUE(make_mock_source(50000, 32, 3, 7, 60, 0, &full).is_ok());
  std::vector<Batch> ref(8);
  for (auto& b : ref) ASSERT_TRUE(full->next(&b).is_ok());
  ASSERT_TRUE(make_mock_source(50000, 32, 3, 7, 60, 5 * 3, &resumed).is_ok());
  for (int i = 5; i < 8; ++i) {
    Batch b;
    ASSERT_TRUE(resumed->next(&b).is_ok());
    EXPECT_EQ(b.tokens, ref[i].tokens) << "batch " << i;
    EXPECT_EQ(b.labels, ref[i].labels) << "batch " << i;
  }
  EXPECT_EQ(resumed->consumed_samples(), 24);
  EXPECT_GE(resumed->wait_ms_total(), 0.0);
}

TEST(TokenSources, ExhaustionIsAClearError) {
  std::unique_ptr<TokenSource> src;
  // Split "969,30,1" of 100,000 mock sequences: the test split is 1,000 sequences, about 2 M tokens.
  ASSERT_TRUE(make_mock_source_split(100, 1 << 20, 1, 1, Split::test, 1, 0, &src).is_ok());
  Batch b;
  Status st = Status::ok();
  for (int i = 0; i < 100 && st.is_ok(); ++i) st = src->next(&b);
  EXPECT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("exhausted"), std::string::npos) << st.message();
}

namespace {
// Writes `count` sequences of pseudo-random lengths whose tokens encode (base + sequence, position).
std::string write_dataset(const std::filesystem::path& dir, const std::string& name, int count, int base) {
  std::string prefix = (dir / name).string();
  std::unique_ptr<IndexedDatasetWriter> w;
  EXPECT_TRUE(IndexedDatasetWriter::create(prefix, IndexedDtype::i32, &w).is_ok());
  for (int i = 0; i < count; ++i) {
    std::vector<int32_t> t;
    for (int k = 0; k < 3 + (i * 7) % 11; ++k) t.push_back(base + 100 * i + k);
    EXPECT_TRUE(w->add_document(t.data(), int64_t(t.size())).is_ok());
  }
  EXPECT_TRUE(w->finalize().is_ok());
  return prefix;
}
}  // namespace

TEST(GptBlends, WeightedBlendInterleavesComponentsLikeMegatron) {
  auto dir = unique_temp("nibble_blend_test");
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  std::string a = write_dataset(dir, "a", 40, 0), b = write_dataset(dir, "b", 30, 1000000);
  DataConfig cfg;
  cfg.data_path = "30 " + a + " 10 " + b;
  cfg.split = "90,10";
  cfg.seq_length = 8;
  cfg.seed = 99;
  cfg.num_samples = {20, 4, 0};
  cfg.cache_path = "none";
  std::shared_ptr<SampleSet> set;
  Status st = make_gpt_samples(cfg, Split::train, &set);
  ASSERT_TRUE(st.is_ok()) << st.message();
  // Blend size = ceil(20 * 0.75) + ceil(20 * 0.25) = 20; components are asked for
  // ceil(15 * 1.005) = 16 and ceil(5 * 1.005) = 6 samples of their train splits (36 and 27 sequences).
  EXPECT_EQ(set->size(), 20);
  std::vector<std::unique_ptr<GptDataset>> parts(2);
  for (int d = 0; d < 2; ++d) {
    std::unique_ptr<IndexedDataset> raw;
    ASSERT_TRUE(IndexedDataset::open(d ? b : a, &raw).is_ok());
    ASSERT_TRUE(GptDataset::create(wrap_indexed_dataset(std::move(raw)), 0, d ? 27 : 36, 8, d ? 6 : 16, 99, "", "train",
                                   &parts[d])
                    .is_ok());
  }
  std::vector<int16_t> which;
  std::vector<int64_t> index;
  build_blending_indices({0.75, 0.25}, 20, &which, &index);
  std::vector<int32_t> got, want;
  int from_b = 0;
  for (int64_t k = 0; k < 20; ++k) {
    set->sample(k, &got);
    parts[which[k]]->sample(index[k], &want);
    EXPECT_EQ(got, want) << "blended sample " << k;
    from_b += got[0] >= 1000000;
  }
  EXPECT_EQ(from_b, 5);
  // Several prefixes without weights: one epoch each, weighted by their sizes.
  cfg.data_path = a + " " + b;
  ASSERT_TRUE(make_gpt_samples(cfg, Split::train, &set).is_ok());
  EXPECT_EQ(set->size(), 20);
  std::filesystem::remove_all(dir);
}

TEST(GptDatasetSamples, CorruptCacheIsRebuiltNotTrusted) {
  auto dir = unique_temp("nibble_cache_test");
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  std::string prefix = write_dataset(dir, "c", 20, 0);
  auto open_ds = [&](std::unique_ptr<GptDataset>* ds) {
    std::unique_ptr<IndexedDataset> raw;
    ASSERT_TRUE(IndexedDataset::open(prefix, &raw).is_ok());
    ASSERT_TRUE(
        GptDataset::create(wrap_indexed_dataset(std::move(raw)), 0, 20, 5, 30, 3, (dir / "cache").string(), "train", ds)
            .is_ok());
  };
  std::unique_ptr<GptDataset> first, second;
  open_ds(&first);
  // Overwrite the shuffle index part of every cache file with out-of-range values.
  for (const auto& f : std::filesystem::directory_iterator(dir / "cache")) {
    if (f.path().extension() != ".nbidx") continue;
    auto size = std::filesystem::file_size(f.path());
    std::fstream io(f.path(), std::ios::in | std::ios::out | std::ios::binary);
    io.seekp(std::streamoff(size - 16));
    const char junk[16] = {'\x7f', '\x7f', '\x7f', '\x7f', '\x7f', '\x7f', '\x7f', '\x7f',
                           '\x7f', '\x7f', '\x7f', '\x7f', '\x7f', '\x7f', '\x7f', '\x7f'};
    io.write(junk, 16);
  }
  open_ds(&second);
  EXPECT_EQ(second->indices().shuffle_index, first->indices().shuffle_index);
  std::vector<int32_t> a, b;
  for (int64_t i = 0; i < first->size(); ++i) {
    first->sample(i, &a);
    second->sample(i, &b);
    ASSERT_EQ(a, b);
  }
  std::filesystem::remove_all(dir);
}
