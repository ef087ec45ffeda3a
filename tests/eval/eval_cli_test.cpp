// `nibble eval --tasks / --text` end to end on a small random model written as an HF folder (FP32, with
// the tiny tokenizer as its tokenizer.json): the JSON's log-likelihoods equal the library's scores of the
// same model, the table is printed, and each bad input exits 1 with one sentence.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include "common/nibble_binary.h"
#include "eval/tasks.h"
#include "eval/text_stats.h"
#include "eval_test_util.h"
#include "io/hf_llama.h"
#include "model/hf_layout.h"

using namespace nb;
namespace fs = std::filesystem;

namespace {

const char* kTask = R"({"context": "ab c", "choices": ["a", "bc", "abc ab"], "label": 1}
{"context": "the cat sat on the", "choices": ["mat", "hat"], "label": 0}
{"context": "x", "choices": ["é", "y"], "label": 1}
)";

class EvalCli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = test::temp_dir("eval_cli");
    test::init_model(&model_, {1, 16});
    std::vector<float> host(size_t(model_.params().total()));
    ASSERT_TRUE(model_.params().get_flat(model_.params().flat_master(), host.data()));
    test::write_text(dir_ / "tok.json", test::tiny_tokenizer_json(true));
    HfExportOptions opt;
    opt.dtype = "fp32";
    opt.tokenizer_file = (dir_ / "tok.json").string();
    Status st = write_hf_folder((dir_ / "hf").string(), model_.config(), hf_tensors(model_.params()), host.data(), opt);
    ASSERT_TRUE(st) << st.message();
    opt.tokenizer_file.clear();
    st = write_hf_folder((dir_ / "hf_no_tok").string(), model_.config(), hf_tensors(model_.params()), host.data(), opt);
    ASSERT_TRUE(st) << st.message();
    test::write_text(dir_ / "task.jsonl", kTask);
    test::write_text(dir_ / "doc.txt", "ab c ab bc abc a b c ab ab\nthe cat sat on the mat; the hat sat on the cat\n");
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string p(const std::string& name) const { return std::string("'").append((dir_ / name).string()).append("'"); }
  static void expect_error(const test::CliRun& r, const std::string& part) {
    EXPECT_EQ(r.code, 1) << r.out;
    EXPECT_NE(r.out.find(part), std::string::npos) << r.out;
  }
  fs::path dir_;
  LlamaModel model_;
};

}  // namespace

TEST_F(EvalCli, TaskLogLikelihoodsEqualTheLibrarys) {
  const test::CliRun r =
      test::run_nibble("eval --load-hf " + p("hf") + " --tasks " + p("task.jsonl") + " --text " + p("doc.txt") +
                       " --max-length 16 --out " + p("r.json") + " --log-samples --device cpu");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("| task "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("| text "), std::string::npos) << r.out;
  std::string text;
  ASSERT_TRUE(eval::read_text_file((dir_ / "r.json").string(), &text));
  const auto j = nlohmann::json::parse(text);
  const auto& t = j["tasks"]["task"];
  EXPECT_EQ(t["n"], 3);
  EXPECT_GT(j["text"]["token_perplexity"].get<double>(), 1.0);
  // The same requests scored in-process on the model the folder was written from.
  auto tok = test::tiny_tokenizer(true);
  eval::McTask task;
  ASSERT_TRUE(eval::read_mc_task((dir_ / "task.jsonl").string(), &task));
  eval::TaskEncoder enc;
  enc.tok = tok.get();
  enc.add_bos = true;
  enc.max_length = 16;
  std::vector<eval::LoglikRequest> reqs;
  std::vector<size_t> first;
  ASSERT_TRUE(eval::build_mc_requests(task, enc, &reqs, &first));
  LlamaModel model;
  const int64_t seq = eval::longest_input(reqs);
  test::init_model(&model, {1, seq});
  eval::EvalModel m{&model, {1, seq}};
  std::vector<eval::LoglikResult> want;
  ASSERT_TRUE(eval::score_requests(m, reqs, &want));
  std::vector<double> lls;
  for (size_t d = 0; d < task.docs.size(); ++d) {
    const auto& got = t["samples"][d]["loglikelihoods"];
    ASSERT_EQ(got.size(), task.docs[d].choices.size());
    for (size_t c = 0; c < got.size(); ++c) {
      EXPECT_NEAR(got[c].get<double>(), want[first[d] + c].loglik, 1e-5) << "doc " << d << " choice " << c;
      lls.push_back(want[first[d] + c].loglik);
    }
  }
  const eval::McMetrics mm = eval::mc_metrics(task, lls, first);
  EXPECT_DOUBLE_EQ(t["acc"].get<double>(), mm.acc);
  EXPECT_DOUBLE_EQ(t["acc_norm"].get<double>(), mm.acc_norm);
}

// (The library tests check every bad-line sentence; here they reach the command line with exit code 1.)
TEST_F(EvalCli, BadInputsExitWithOneSentence) {
  const std::string base = "eval --device cpu --load-hf ";
  expect_error(test::run_nibble(base + p("hf_no_tok") + " --tasks " + p("task.jsonl")),
               "--tasks and --text need a tokenizer: pass --tokenizer FILE");
  test::write_text(dir_ / "bad.jsonl", std::string(kTask) + "{\"context\": \"q\", \"choices\": [\"a\"]}\n");
  expect_error(test::run_nibble(base + p("hf") + " --tasks " + p("bad.jsonl")),
               "bad.jsonl:4: \"label\" must be an integer");
}

TEST_F(EvalCli, ModesAreChecked) {
  const std::string base = "eval --device cpu --load-hf ";
  expect_error(test::run_nibble(base + p("hf")), "pass --tokens and --out");
  expect_error(test::run_nibble(base + p("hf") + " --tasks " + p("task.jsonl") + " --tokens x.safetensors"),
               "--tokens (parity mode) does not go with --tasks");
  expect_error(test::run_nibble(base + p("hf") + " --data-path " + p("nothing")), "--data-path needs --seq-length");
}
