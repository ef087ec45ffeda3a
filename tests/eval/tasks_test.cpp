// Multiple-choice evaluation (src/eval/tasks.h, loglik.h): the harness's request encoding token by token
// (whitespace moved from context to continuation, BOS rule, empty context, left truncation), scores equal
// to an independent log-softmax sum over forward_logits of each request alone, acc / acc_norm / acc_bytes
// and their standard errors on a hand-made case, and every bad-input sentence.
#include <gtest/gtest.h>
#include <cmath>
#include "eval/tasks.h"
#include "eval/text_stats.h"
#include "eval_test_util.h"

using namespace nb;
using namespace nb::eval;

namespace {

TaskEncoder encoder(const BpeTokenizer* tok, bool add_bos, int64_t max_length = 2048) {
  TaskEncoder e;
  e.tok = tok;
  e.add_bos = add_bos;
  e.max_length = max_length;
  return e;
}

McTask task_of(const std::string& jsonl) {
  McTask t;
  t.name = t.path = "t.jsonl";
  Status st = parse_mc_task(jsonl, "t.jsonl", &t);
  EXPECT_TRUE(st) << st.message();
  return t;
}

// log p(targets | input) by the definition: log(exp(x_y) / sum_v exp(x_v)) in long double, no shift.
double reference_loglik(LlamaModel& model, int64_t seq, const LoglikRequest& r) {
  const int64_t V = model.config().vocab, n = int64_t(r.input.size()), k = int64_t(r.targets.size());
  std::vector<int32_t> tokens(size_t(seq), 0), labels(size_t(seq), -1);
  std::copy(r.input.begin(), r.input.end(), tokens.begin());
  std::vector<float> logits(size_t(seq * V));
  double loss = 0;
  EXPECT_TRUE(model.forward_logits(tokens.data(), labels.data(), logits.data(), &loss));
  long double total = 0;
  for (int64_t i = 0; i < k; ++i) {
    const float* row = logits.data() + (n - k + i) * V;
    long double z = 0;
    for (int64_t v = 0; v < V; ++v) z += std::exp((long double)row[v]);
    total += std::log(std::exp((long double)row[r.targets[size_t(i)]]) / z);
  }
  return double(total);
}

}  // namespace

TEST(EvalTasks, EncodesAsTheHarness) {
  auto tok = test::tiny_tokenizer(/*adds_bos=*/true);
  TaskEncoder e = encoder(tok.get(), true);
  std::vector<int32_t> ctx, cont;
  // "ab c" + " a": pieces "ab", " c" | " a" -> [BOS, 256, 32, 99] and [258].
  ASSERT_TRUE(e.encode_pair("ab c", " a", &ctx, &cont));
  EXPECT_EQ(ctx, (std::vector<int32_t>{260, 256, 32, 99}));
  EXPECT_EQ(cont, (std::vector<int32_t>{258}));
  // The context's trailing space moves to the continuation: "ab c " + "a" encodes as "ab c" + " a".
  ASSERT_TRUE(e.encode_pair("ab c ", "a", &ctx, &cont));
  EXPECT_EQ(ctx, (std::vector<int32_t>{260, 256, 32, 99}));
  EXPECT_EQ(cont, (std::vector<int32_t>{258}));
  // " bc": the merge "b c" inside the continuation's piece.
  ASSERT_TRUE(e.encode_pair("ab", " bc", &ctx, &cont));
  EXPECT_EQ(cont, (std::vector<int32_t>{32, 257}));
  // No BOS where the text starts with the BOS token's text, nor when the tokenizer adds none.
  ASSERT_TRUE(e.encode_pair("<|begin_of_text|>ab", " a", &ctx, &cont));
  EXPECT_EQ(ctx, (std::vector<int32_t>{260, 256}));
  e.add_bos = false;
  ASSERT_TRUE(e.encode_pair("ab", " a", &ctx, &cont));
  EXPECT_EQ(ctx, (std::vector<int32_t>{256}));
  // An empty context conditions on the prefix token (BOS), the continuation without BOS.
  ASSERT_TRUE(e.encode_pair("", " a", &ctx, &cont));
  EXPECT_EQ(ctx, (std::vector<int32_t>{260}));
  EXPECT_EQ(cont, (std::vector<int32_t>{258}));
}

TEST(EvalTasks, TruncatesFromTheLeft) {
  auto tok = test::tiny_tokenizer(true);
  McTask t = task_of(R"({"context": "x y z w", "choices": ["a", "bc"], "label": 0})");
  std::vector<LoglikRequest> reqs;
  std::vector<size_t> first;
  // [BOS x ' ' y ' ' z ' ' w] + [258]: 8 + 1 tokens; max length 4 keeps the last 5 and drops the last.
  ASSERT_TRUE(build_mc_requests(t, encoder(tok.get(), true, 4), &reqs, &first));
  ASSERT_EQ(reqs.size(), 2u);
  EXPECT_EQ(first, (std::vector<size_t>{0}));
  EXPECT_EQ(reqs[0].input, (std::vector<int32_t>{32, 'z', 32, 'w'}));
  EXPECT_EQ(reqs[0].targets, (std::vector<int32_t>{258}));
  EXPECT_EQ(reqs[1].input, (std::vector<int32_t>{'z', 32, 'w', 32}));
  EXPECT_EQ(reqs[1].targets, (std::vector<int32_t>{32, 257}));
  ASSERT_TRUE(build_mc_requests(t, encoder(tok.get(), true, 64), &reqs, &first));
  EXPECT_EQ(reqs[0].input.size(), 8u);  // untruncated: context + continuation minus the last token
}

TEST(EvalTasks, ScoresEqualIndependentLogSoftmaxSums) {
  auto tok = test::tiny_tokenizer(true);
  McTask t = task_of(
      R"({"context": "ab c", "choices": ["a", "bc", "abc ab"], "label": 1}
{"context": "the cat sat on the ", "choices": ["mat", "hat"], "label": 0}

{"context": "", "choices": ["é ab", "x"], "label": 1})");
  std::vector<LoglikRequest> reqs;
  std::vector<size_t> first;
  ASSERT_TRUE(build_mc_requests(t, encoder(tok.get(), true), &reqs, &first));
  ASSERT_EQ(reqs.size(), 7u);
  EXPECT_EQ(first, (std::vector<size_t>{0, 3, 5}));
  // The context's trailing space joins the delimiter: "  mat" is the pieces " " and " mat".
  EXPECT_EQ(reqs[3].targets, (std::vector<int32_t>{32, 32, 'm', 'a', 't'}));
  // Empty context: the BOS, then the continuation " é ab" without BOS (its last token is only predicted).
  EXPECT_EQ(reqs[5].input, (std::vector<int32_t>{260, 32, 0xc3, 0xa9, 32}));
  EXPECT_EQ(reqs[5].targets, (std::vector<int32_t>{32, 0xc3, 0xa9, 32, 256}));
  const int64_t seq = longest_input(reqs);
  LlamaModel model, single;
  test::init_model(&model, {3, seq});  // three rows per forward: the last batch is padded
  test::init_model(&single, {1, seq});
  EvalModel m{&model, {3, seq}};
  std::vector<LoglikResult> got;
  ASSERT_TRUE(score_requests(m, reqs, &got));
  double sum = 0;
  int64_t targets = 0;
  for (size_t i = 0; i < reqs.size(); ++i) {
    targets += int64_t(reqs[i].targets.size());
    const double want = reference_loglik(single, seq, reqs[i]);
    EXPECT_NEAR(got[i].loglik, want, 1e-9 * std::abs(want) + 1e-12) << "request " << i;
    EXPECT_LT(got[i].loglik, 0);
    sum += got[i].loglik;
  }
  // The model's own loss over the same targets (FP32 per-token losses) is the negated sum.
  double nll = 0;
  int64_t n = 0;
  ASSERT_TRUE(sum_nll(m, reqs, &nll, &n));
  EXPECT_EQ(n, targets);
  EXPECT_NEAR(nll, -sum, 1e-5 * std::abs(sum));
}

TEST(EvalTasks, AccuracyAndNormalizationsOnAHandMadeCase) {
  McTask t = task_of(
      R"({"context": "q", "choices": ["é", "ab"], "label": 1}
{"context": "q", "choices": ["é", "ab"], "label": 0}
{"context": "q", "choices": ["a", "bbbb", "c"], "label": 1}
{"context": "q", "choices": ["a", "b"], "label": 0})");
  // Doc 0: acc picks 0 (-1.5 > -2.5); per code point 1 wins (-1.25 > -1.5); per byte 0 (-0.75 > -1.25).
  // Doc 2: acc picks 0; per length 1 (-1 > -2). Doc 3: a tie goes to the first choice everywhere.
  const std::vector<double> lls = {-1.5, -2.5, -1.5, -2.5, -2, -4, -3, -1, -1};
  const std::vector<size_t> first = {0, 2, 4, 7};
  McPrediction p = predict(t.docs[0], lls.data());
  EXPECT_EQ(p.pred, 0);
  EXPECT_EQ(p.pred_norm, 1);
  EXPECT_EQ(p.pred_bytes, 0);
  p = predict(t.docs[2], lls.data() + 4);
  EXPECT_EQ(p.pred, 0);
  EXPECT_EQ(p.pred_norm, 1);
  EXPECT_EQ(p.pred_bytes, 1);
  const McMetrics m = mc_metrics(t, lls, first);
  EXPECT_EQ(m.n, 4);
  EXPECT_DOUBLE_EQ(m.acc, 0.5);         // docs 1, 3
  EXPECT_DOUBLE_EQ(m.acc_norm, 0.75);   // docs 0, 2, 3
  EXPECT_DOUBLE_EQ(m.acc_bytes, 0.75);  // docs 1, 2, 3
  EXPECT_DOUBLE_EQ(m.acc_stderr, std::sqrt(0.25 / 3));
  EXPECT_DOUBLE_EQ(m.acc_norm_stderr, std::sqrt(0.75 * 0.25 / 3));
  EXPECT_TRUE(
      std::isnan(mc_metrics(task_of(R"({"context": "q", "choices": ["a"], "label": 0})"), {-1.0}, {0}).acc_stderr));
}

TEST(EvalTasks, TextMeasuresArePython) {
  EXPECT_EQ(trailing_space_bytes("ab \t\n"), 3);
  EXPECT_EQ(trailing_space_bytes("ab\xc2\xa0"), 2);  // U+00A0 is whitespace to str.rstrip
  EXPECT_EQ(trailing_space_bytes("   "), 3);
  EXPECT_EQ(count_code_points("é日a"), 3);
  EXPECT_EQ(count_words(""), 1);  // len(re.split(r"\s+", "")) == 1
  EXPECT_EQ(count_words("a b"), 2);
  EXPECT_EQ(count_words(" a  b\n"), 4);  // ['', 'a', 'b', '']
}

TEST(EvalTasks, BadInputIsOneSentenceWithTheLine) {
  auto expect_error = [](const std::string& jsonl, const std::string& part) {
    McTask t;
    Status st = parse_mc_task(jsonl, "t.jsonl", &t);
    ASSERT_FALSE(st);
    EXPECT_NE(st.message().find(part), std::string::npos) << st.message();
  };
  const std::string good = R"({"context": "q", "choices": ["a"], "label": 0})";
  expect_error(good + "\n{\"context\": \"q\", ", "t.jsonl:2: not valid JSON");
  expect_error(good + "\n\n[1, 2]", "t.jsonl:3: not a JSON object");
  expect_error(R"({"context": "q", "choices": ["a", "b"], "label": 2})", "t.jsonl:1: label 2 is out of range for 2");
  expect_error(R"({"context": "q", "choices": ["a"], "label": -1})", "label -1 is out of range");
  expect_error(R"({"context": "q", "choices": [], "label": 0})", "t.jsonl:1: \"choices\" must be a non-empty list");
  expect_error(R"({"context": "q", "choices": ["a", 3], "label": 0})", "\"choices\" must be a non-empty list");
  expect_error(R"({"choices": ["a"], "label": 0})", "\"context\" must be a string");
  expect_error(R"({"context": "q", "choices": ["a"], "label": "a"})", "\"label\" must be an integer");
  expect_error("\n  \n", "t.jsonl holds no documents");
  // A continuation longer than the maximum length names the file, line and choice.
  auto tok = test::tiny_tokenizer(true);
  McTask t = task_of(R"({"context": "q", "choices": ["x y z"], "label": 0})");
  std::vector<LoglikRequest> reqs;
  std::vector<size_t> first;
  Status st = build_mc_requests(t, encoder(tok.get(), true, 3), &reqs, &first);
  ASSERT_FALSE(st);
  EXPECT_NE(st.message().find("t.jsonl:1, choice 0: the continuation is 6 tokens, more than the maximum length 3"),
            std::string::npos)
      << st.message();
}
