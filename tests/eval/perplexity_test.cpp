// Perplexity (src/eval/perplexity.h): the harness's rolling windows on a hand-checked case, text
// perplexity equal to the log-likelihood sums of its windows, and dataset perplexity equal to
// exp(mean loss) of a validation pass done as the trainer's evaluate() does it (the same GPT source,
// staged micro-batches, forward_loss_staged, take_loss_sum) over the same samples.
#include <gtest/gtest.h>
#include <cmath>
#include "data/indexed_dataset.h"
#include "eval/perplexity.h"
#include "eval_test_util.h"

using namespace nb;
using namespace nb::eval;

TEST(EvalPerplexity, RollingWindowsAreTheHarness) {
  // get_rolling_token_windows([1..7], prefix 0, max_seq_len 3, context_len 1), made disjoint.
  const std::vector<LoglikRequest> w = rolling_windows({1, 2, 3, 4, 5, 6, 7}, 0, 3);
  ASSERT_EQ(w.size(), 3u);
  EXPECT_EQ(w[0].input, (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(w[0].targets, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(w[1].input, (std::vector<int32_t>{3, 4, 5}));
  EXPECT_EQ(w[1].targets, (std::vector<int32_t>{4, 5, 6}));
  EXPECT_EQ(w[2].input, (std::vector<int32_t>{4, 5, 6}));  // the last window keeps a full context
  EXPECT_EQ(w[2].targets, (std::vector<int32_t>{7}));
  const std::vector<LoglikRequest> one = rolling_windows({5, 6}, 9, 8);
  ASSERT_EQ(one.size(), 1u);
  EXPECT_EQ(one[0].input, (std::vector<int32_t>{9, 5}));
  EXPECT_EQ(one[0].targets, (std::vector<int32_t>{5, 6}));
  EXPECT_TRUE(rolling_windows({}, 9, 8).empty());
}

TEST(EvalPerplexity, TextIsTheSumOfItsWindows) {
  auto tok = test::tiny_tokenizer(true);
  const std::vector<std::string> docs = {"ab c ab bc abc a b c ab ab", "x", ""};
  std::vector<LoglikRequest> windows;
  PerplexityResult r;
  ASSERT_TRUE(text_windows(docs, *tok, 8, &windows, &r));
  EXPECT_EQ(r.documents, 3);
  EXPECT_EQ(r.words, 10 + 1 + 1);  // "" is one word to re.split
  EXPECT_EQ(r.bytes, 26 + 1);
  EXPECT_EQ(windows[0].input[0], 260);  // each document starts from the BOS, and holds none itself
  LlamaModel model;
  test::init_model(&model, {2, 8});
  EvalModel m{&model, {2, 8}};
  ASSERT_TRUE(score_windows(m, windows, &r));
  std::vector<LoglikResult> each;
  ASSERT_TRUE(score_requests(m, windows, &each));
  double ll = 0;
  int64_t tokens = 0;
  for (size_t i = 0; i < windows.size(); ++i) {
    ll += each[i].loglik;
    tokens += int64_t(windows[i].targets.size());
  }
  EXPECT_EQ(r.tokens, tokens);
  EXPECT_NEAR(r.nll, -ll, 1e-5 * std::abs(ll));
  EXPECT_NEAR(r.token_perplexity(), std::exp(-ll / double(tokens)), 1e-4 * r.token_perplexity());
  EXPECT_NEAR(r.word_perplexity(), std::exp(-ll / 12.0), 1e-4 * r.word_perplexity());
  EXPECT_NEAR(r.bits_per_byte(), -ll / 27.0 / std::log(2.0), 1e-5);
}

TEST(EvalPerplexity, DatasetEqualsTheTrainersValidationLoss) {
  const auto dir = test::temp_dir("eval_ppl");
  const std::string prefix = (dir / "corpus").string();
  {
    std::unique_ptr<IndexedDatasetWriter> w;
    ASSERT_TRUE(IndexedDatasetWriter::create(prefix, IndexedDtype::u16, &w));
    std::vector<int32_t> doc;
    for (int d = 0; d < 40; ++d) {
      doc.clear();
      for (int i = 0; i < 20 + 7 * (d % 5); ++i) doc.push_back((d * 31 + i * 17) % 259);
      ASSERT_TRUE(w->add_document(doc.data(), int64_t(doc.size())));
    }
    ASSERT_TRUE(w->finalize());
  }
  DataConfig dc;
  dc.data_path = prefix;
  dc.split = "50,50,0";
  dc.seq_length = 16;
  dc.cache_path = "none";
  const int64_t samples = 6, mb = 2;
  dc.num_samples[1] = samples;
  std::shared_ptr<SampleSet> set;
  ASSERT_TRUE(make_gpt_samples(dc, Split::valid, &set));
  ASSERT_GE(set->size(), samples);
  LlamaModel model;
  test::init_model(&model, {mb, 16});
  EvalModel m{&model, {mb, 16}};
  PerplexityResult r;
  ASSERT_TRUE(dataset_perplexity(m, *set, samples, &r));
  EXPECT_EQ(r.tokens, samples * 16);
  // The trainer's evaluate(): micro-batches from the validation source, losses summed on the device.
  std::unique_ptr<TokenSource> src;
  ASSERT_TRUE(make_gpt_source(dc, Split::valid, mb, 0, &src));
  int64_t n = 0;
  for (int64_t i = 0; i < samples / mb; ++i) {
    Batch b;
    ASSERT_TRUE(src->next(&b));
    ASSERT_TRUE(model.stage_batches(b.tokens.data(), b.labels.data(), 1));
    ASSERT_TRUE(model.forward_loss_staged(0));
    for (int32_t l : b.labels) n += l >= 0 ? 1 : 0;
  }
  double sum = 0;
  ASSERT_TRUE(model.take_loss_sum(&sum));
  EXPECT_EQ(n, r.tokens);
  EXPECT_NEAR(r.token_perplexity(), std::exp(sum / double(n)), 1e-5 * r.token_perplexity());
  std::filesystem::remove_all(dir);
}
