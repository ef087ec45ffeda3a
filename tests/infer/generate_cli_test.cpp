// `nibble generate` end to end on the CPU: a small HF folder with its tokenizer.json, greedy and seeded runs
// (the same seed gives the same text), the JSONL record, valid UTF-8 on stdout when a token ends inside a
// character (U+FFFD, as Hugging Face's tokenizer.decode prints it), and bad input answered in one sentence: a
// prompt longer than the context, an unknown tokenizer, text prompts without any tokenizer (a checkpoint whose
// training run named none takes the same path; the sampler's settings are checked in sampler_test.cpp), and
// a PEFT --adapter applied unmerged (equal to the training path's greedy tokens) or with --merge-adapter.
#include <gtest/gtest.h>
#include <unistd.h>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include "common/nibble_binary.h"
#include "infer_test_util.h"
#include "io/hf_llama.h"
#include "tokenizer/bpe_tokenizer.h"
#include "tokenizer/utf8.h"

using namespace nb;
namespace fs = std::filesystem;

class GenerateCli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("nibble_generate_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    std::vector<std::string> texts;
    for (int i = 0; i < 40; ++i)
      texts.push_back("the quick brown fox jumps over the lazy dog number " + std::to_string(i));
    BpeTrainOptions opt;
    opt.vocab_size = 300;
    std::string summary;
    ASSERT_TRUE(train_bpe(texts, opt, path("tok.json"), &summary));
    const LlamaConfig cfg = nb::testing::infer_config(false, 384);
    LlamaModel model;
    ASSERT_TRUE(model.init(cfg, Device::cpu, {1, 8}, Recompute::none, 3));
    nb::testing::scale_weights(model, 9);
    std::vector<float> host(static_cast<size_t>(model.params().total()));
    ASSERT_TRUE(model.params().get_flat(model.params().flat_master(), host.data()));
    HfExportOptions ex;
    ex.dtype = "fp32";
    ex.tokenizer_file = path("tok.json");
    ASSERT_TRUE(write_hf_folder(path("hf"), cfg, hf_tensors(model.params()), host.data(), ex));
    ex.tokenizer_file.clear();
    ASSERT_TRUE(write_hf_folder(path("hf_notok"), cfg, hf_tensors(model.params()), host.data(), ex));
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& n) const { return (dir_ / n).string(); }
  fs::path dir_;
};

TEST_F(GenerateCli, GreedySeededAndRecorded) {
  const std::string base = "generate --device cpu --load-hf " + path("hf") + " --prompt 'the quick brown' ";
  auto r = nb::test::run_nibble(base + "--max-new-tokens 8 --ignore-eos --out " + path("o.jsonl"));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("greedy"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("prefill:"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("tokens/s"), std::string::npos) << r.out;
  std::ifstream in(path("o.jsonl"));
  std::string line;
  ASSERT_TRUE(std::getline(in, line));
  const auto j = nlohmann::json::parse(line);
  EXPECT_EQ(j["ids"].size(), 8u);
  EXPECT_EQ(j["prompt"], "the quick brown");
  EXPECT_EQ(j["finish"], "length");
  const std::string sampled = base + "--max-new-tokens 12 --temperature 0.9 --top-k 40 --top-p 0.95 --seed 7";
  auto a = nb::test::run_nibble(sampled), b = nb::test::run_nibble(sampled);
  ASSERT_EQ(a.code, 0) << a.out;
  auto text = [](const std::string& out) { return out.substr(0, out.find("prefill:")); };  // times differ
  EXPECT_EQ(text(a.out), text(b.out));
}

// A prompt of byte tokens that cuts a character (C3, then 'x'; a lone E2 82 at the end): stdout carries U+FFFD
// for them, never the raw bytes, whatever the continuation is.
TEST_F(GenerateCli, PrintsValidUtf8WhenATokenSplitsACharacter) {
  std::unique_ptr<BpeTokenizer> tok;
  ASSERT_TRUE(BpeTokenizer::load(path("tok.json"), "auto", &tok));
  auto id = [&](const char* bytes) { return tok->token_id(bytes); };
  ASSERT_GE(id("\xC3"), 0);
  {
    std::ofstream p(path("cut.jsonl"));
    p << nlohmann::json{{"ids", {id("a"), id("\xC3"), id("x")}}}.dump() << "\n"
      << nlohmann::json{{"ids", {id("a"), id("\xE2"), id("\x82")}}}.dump() << "\n";
  }
  const auto r = nb::test::run_nibble("generate --device cpu --load-hf " + path("hf") + " --prompts " +
                                      path("cut.jsonl") + " --max-new-tokens 2 --ignore-eos");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("[1] a\xEF\xBF\xBDx"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("\xC3x"), std::string::npos) << r.out;
  EXPECT_EQ(valid_utf8(r.out), r.out);
}

TEST_F(GenerateCli, BadInputIsOneSentence) {
  std::string long_prompt;
  for (int i = 0; i < 100; ++i) long_prompt += "lazy dog " + std::to_string(i * 7919) + " ";
  auto r = nb::test::run_nibble("generate --device cpu --load-hf " + path("hf") + " --prompt '" + long_prompt + "'");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.out.find("context of 128 tokens"), std::string::npos) << r.out;
  r = nb::test::run_nibble("generate --device cpu --load-hf " + path("hf") + " --tokenizer " + path("none.json") +
                           " --prompt hi");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.out.find("error: --tokenizer"), std::string::npos) << r.out;
  r = nb::test::run_nibble("generate --device cpu --load-hf " + path("hf_notok") + " --prompt hi");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.out.find("needs a tokenizer"), std::string::npos) << r.out;
}

// --sample-interval: a greedy sample printed and recorded in metrics.jsonl; without --tokenizer, refused at start.
TEST_F(GenerateCli, TrainingSamples) {
  const std::string train =
      "train --device cpu --model tiny --num-layers 1 --vocab-size 384 --seq-length 16 --micro-batch-size 1 "
      "--global-batch-size 1 --train-iters 2 --log-interval 1 --sample-interval 2 ";
  auto r = nb::test::run_nibble(train);
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.out.find("--sample-interval needs --tokenizer"), std::string::npos) << r.out;
  r = nb::test::run_nibble(train + "--tokenizer " + path("tok.json") + " --sample-prompt 'the lazy' --save " +
                           path("run"));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("sample at iteration 2: the lazy"), std::string::npos) << r.out;
  std::ifstream in(path("run/metrics.jsonl"));
  std::string line, sample;
  while (std::getline(in, line))
    if (line.find("\"sample\"") != std::string::npos) sample = line;
  ASSERT_FALSE(sample.empty());
  const auto j = nlohmann::json::parse(sample);
  EXPECT_EQ(j["iteration"], 2);
  EXPECT_EQ(j["sample_prompt"], "the lazy");
}

// --sample-interval under tensor parallelism: the first T ranks sample together over their shards (vocabulary-
// parallel embedding, the o and down outputs summed, the logits all-gathered), and rank 0 prints the text one
// rank prints after the same steps; with sequence parallelism too (the sample itself runs whole tokens).
TEST_F(GenerateCli, TrainingSamplesUnderTensorParallelism) {
  const std::string train =
      "train --device cpu --model tiny --num-layers 2 --vocab-size 384 --seq-length 16 --micro-batch-size 2 "
      "--global-batch-size 2 --train-iters 3 --log-interval 1 --sample-interval 3 --sample-tokens 12 --tokenizer " +
      path("tok.json") + " --sample-prompt 'the lazy' ";
  auto sample_of = [](const std::string& out) {
    const size_t at = out.find("sample at iteration 3: ");
    return at == std::string::npos ? std::string() : out.substr(at, out.find('\n', at) - at);
  };
  const auto one = nb::test::run_nibble(train);
  ASSERT_EQ(one.code, 0) << one.out;
  ASSERT_FALSE(sample_of(one.out).empty()) << one.out;
  for (const std::string flags : {"", "--sequence-parallel"}) {
    const auto tp = nb::test::run_nibble(train + "--nproc-per-node 2 --tensor-model-parallel-size 2 " + flags);
    ASSERT_EQ(tp.code, 0) << tp.out;
    EXPECT_EQ(sample_of(tp.out), sample_of(one.out)) << flags;
  }
}

// --adapter (a PEFT folder) is applied unmerged: the greedy tokens equal argmax over the training path with
// the same adapter (a LoRA LlamaModel over the same HF folder) re-run on each growing sequence, bit for bit
// on the CPU. --merge-adapter merges it instead, and needs --adapter.
TEST_F(GenerateCli, AdapterIsAppliedUnmerged) {
  const LlamaConfig cfg = nb::testing::infer_config(false, 384);
  LoraSpec spec;
  spec.rank = 4;
  spec.alpha = 8;
  ASSERT_TRUE(write_peft_adapter(path("adapter"), cfg, nb::testing::random_adapter(cfg, spec, 5)));
  const std::vector<std::vector<int32_t>> prompts = {nb::testing::random_tokens(6, cfg.vocab, 1),
                                                     nb::testing::random_tokens(3, cfg.vocab, 2)};
  {
    std::ofstream p(path("prompts.jsonl"));
    for (const auto& ids : prompts) p << nlohmann::json{{"ids", ids}}.dump() << "\n";
  }
  const std::string cmd = "generate --device cpu --load-hf " + path("hf") + " --prompts " + path("prompts.jsonl") +
                          " --adapter " + path("adapter") + " --max-new-tokens 6 --ignore-eos ";
  auto r = nb::test::run_nibble(cmd + "--out " + path("o.jsonl"));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("+ LoRA"), std::string::npos) << r.out;
  HfCheckpointReader reader;
  ASSERT_TRUE(reader.open(path("hf")));
  LoraAdapter ad;
  ASSERT_TRUE(read_peft_adapter(path("adapter"), cfg, &ad));
  const int64_t S = 16, V = cfg.vocab;
  LlamaModel model;
  model.set_lora(ad.spec, &reader);
  ASSERT_TRUE(model.init(cfg, Device::cpu, {1, S}, Recompute::none, 0));
  ASSERT_TRUE(lora_store_from_adapter(ad, cfg, model.params()));
  std::ifstream in(path("o.jsonl"));
  for (const auto& prompt : prompts) {
    std::string line;
    ASSERT_TRUE(std::getline(in, line));
    const std::vector<int32_t> got = nlohmann::json::parse(line)["ids"];
    EXPECT_EQ(got, nb::testing::greedy_by_rerun(model, prompt, int64_t(got.size()), S, V));
  }
  r = nb::test::run_nibble(cmd + "--merge-adapter");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("(merged)"), std::string::npos) << r.out;
  r = nb::test::run_nibble("generate --device cpu --load-hf " + path("hf") + " --prompt hi --merge-adapter");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.out.find("--merge-adapter needs --adapter"), std::string::npos) << r.out;
}
