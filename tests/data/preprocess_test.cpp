// `nibble preprocess` end to end: JSONL -> .bin/.idx read back must equal the tokenizer's own encoding
// of each document plus EOD, with empty documents recorded like Megatron does, whatever --workers is.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include "common/nibble_binary.h"
#include "data/data_test_util.h"
#include "data/indexed_dataset.h"
#include "data/token_source.h"
#include "tokenizer/bpe_tokenizer.h"

using namespace nb;

namespace {
std::vector<std::string> documents() {
  std::vector<std::string> docs;
  for (int i = 0; i < 300; ++i)
    docs.push_back("Document " + std::to_string(i) + ": the quick brown fox jumps over the lazy dog. " +
                   std::string(size_t(i % 17), 'x') + (i % 5 == 0 ? "\nnaïve café 東京 🚀" : ""));
  docs[7] = "";  // empty: Megatron records a document with no sequence
  return docs;
}
}  // namespace

TEST(Preprocess, JsonlToIndexedDatasetReadsBackTheSameTokens) {
  auto dir = unique_temp("nibble_preprocess_test");
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  auto docs = documents();
  std::string tok_path = (dir / "tok.json").string();
  BpeTrainOptions opt;
  opt.vocab_size = 400;
  ASSERT_TRUE(train_bpe(docs, opt, tok_path, nullptr).is_ok());
  std::unique_ptr<BpeTokenizer> tok;
  ASSERT_TRUE(BpeTokenizer::from_hf_json(tok_path, &tok).is_ok());
  {
    std::ofstream f(dir / "in.jsonl");
    for (const auto& d : docs) f << nlohmann::json({{"id", 1}, {"text", d}}).dump() << "\n";
  }
  for (int workers : {1, 2}) {
    std::string prefix = (dir / ("out" + std::to_string(workers))).string();
    std::string cmd = nb::test::nibble_binary() + " preprocess -i " + (dir / "in.jsonl").string() + " -o " + prefix +
                      " -t " + tok_path + " --append-eod --workers " + std::to_string(workers) + " > " +
                      (dir / "log.txt").string() + " 2>&1";
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
    std::unique_ptr<IndexedDataset> ds;
    Status st = IndexedDataset::open(prefix + "_text_document", &ds);
    ASSERT_TRUE(st.is_ok()) << st.message();
    EXPECT_EQ(ds->dtype(), IndexedDtype::u16);
    ASSERT_EQ(ds->sequence_count(), int64_t(docs.size()) - 1);
    ASSERT_EQ(ds->document_count(), int64_t(docs.size()) + 1);
    EXPECT_EQ(ds->document_index(7), 7);
    EXPECT_EQ(ds->document_index(8), 7);  // the empty document 7 adds no sequence
    int64_t seq = 0;
    for (size_t i = 0; i < docs.size(); ++i) {
      if (docs[i].empty()) continue;
      std::vector<int32_t> want, got;
      tok->encode(docs[i], &want);
      want.push_back(tok->eod());
      ds->read(seq++, 0, -1, &got);
      ASSERT_EQ(got, want) << "document " << i;
    }
  }
  // Both runs wrote identical files.
  for (const char* ext : {".bin", ".idx"}) {
    std::ifstream a(dir / (std::string("out1_text_document") + ext), std::ios::binary),
        b(dir / (std::string("out2_text_document") + ext), std::ios::binary);
    std::string sa((std::istreambuf_iterator<char>(a)), {}), sb((std::istreambuf_iterator<char>(b)), {});
    EXPECT_EQ(sa, sb) << ext;
  }
  // The GPT sampler reads it: every sample is seq_len + 1 tokens.
  DataConfig cfg;
  cfg.data_path = (dir / "out1_text_document").string();
  cfg.seq_length = 16;
  cfg.num_samples = {50, 5, 1};
  std::unique_ptr<TokenSource> src;
  Status st = make_gpt_source(cfg, Split::train, 4, 0, &src);
  ASSERT_TRUE(st.is_ok()) << st.message();
  Batch b;
  ASSERT_TRUE(src->next(&b).is_ok());
  EXPECT_EQ(b.tokens.size(), 64u);
  // Data parallelism: ranks 0 and 1 of 2 with micro-batch 2 see the rows of one rank with micro-batch 4,
  // also when resumed mid-way (consumed = 8 global samples).
  for (int64_t consumed : {0, 8}) {
    std::unique_ptr<TokenSource> one, r0, r1;
    ASSERT_TRUE(make_gpt_source(cfg, Split::train, 4, consumed, &one).is_ok());
    ASSERT_TRUE(make_gpt_source_dp(cfg, Split::train, 2, 0, 2, consumed, &r0).is_ok());
    ASSERT_TRUE(make_gpt_source_dp(cfg, Split::train, 2, 1, 2, consumed, &r1).is_ok());
    for (int step = 0; step < 3; ++step) {
      Batch all, a0, a1;
      ASSERT_TRUE(one->next(&all).is_ok());
      ASSERT_TRUE(r0->next(&a0).is_ok());
      ASSERT_TRUE(r1->next(&a1).is_ok());
      a0.tokens.insert(a0.tokens.end(), a1.tokens.begin(), a1.tokens.end());
      EXPECT_EQ(a0.tokens, all.tokens) << "consumed " << consumed << " step " << step;
    }
    EXPECT_EQ(r1->consumed_samples(), consumed + 12);
  }
  std::unique_ptr<TokenSource> bad;
  EXPECT_FALSE(make_gpt_source_dp(cfg, Split::train, 2, 2, 2, 0, &bad).is_ok());
  std::unique_ptr<TokenSource> valid;
  ASSERT_TRUE(make_gpt_source(cfg, Split::valid, 1, 0, &valid).is_ok());
  EXPECT_TRUE(std::filesystem::exists(dir / "cache" / "nibble_indices"));
  std::filesystem::remove_all(dir);
}

TEST(Preprocess, BadInputIsAClearError) {
  auto dir = unique_temp("nibble_preprocess_bad");
  std::filesystem::create_directories(dir);
  {
    std::ofstream f(dir / "in.jsonl");
    f << "{\"content\": \"no text key\"}\n";
  }
  std::string tok_path = (dir / "tok.json").string();
  BpeTrainOptions opt;
  opt.vocab_size = 260;
  ASSERT_TRUE(train_bpe({"abc abc"}, opt, tok_path, nullptr).is_ok());
  std::string log = (dir / "log.txt").string();
  std::string cmd = nb::test::nibble_binary() + " preprocess -i " + (dir / "in.jsonl").string() + " -o " +
                    (dir / "o").string() + " -t " + tok_path + " > " + log + " 2>&1";
  EXPECT_NE(std::system(cmd.c_str()), 0);
  std::ifstream f(log);
  std::string text((std::istreambuf_iterator<char>(f)), {});
  EXPECT_NE(text.find("\"text\""), std::string::npos) << text;
  std::filesystem::remove_all(dir);
}
