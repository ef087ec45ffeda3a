// Byte-level BPE: the published GPT-2 / Llama 3 test vectors (real rank files from scripts/setup_data.sh;
// those tests skip with the reason when the files are absent), byte-exact round trips including invalid
// UTF-8, HF tokenizer.json merge-order semantics, and training.
#include <gtest/gtest.h>
#include "common/byte_vocab.h"
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include "tokenizer/bpe_tokenizer.h"

using namespace nb;

// Per-process folder names: CTest may run the cases of this file in parallel processes.
static std::filesystem::path unique_temp(const std::string& name) {
  return std::filesystem::temp_directory_path() / (name + "_" + std::to_string(::getpid()));
}

namespace {
std::string data_dir() {
  if (const char* d = std::getenv("NIBBLE_DATA_DIR")) return d;
  const char* home = std::getenv("HOME");
  return std::string(home ? home : "/root") + "/.cache/nibble";
}

std::unique_ptr<BpeTokenizer> load_or_null(const std::string& name, const std::string& family) {
  std::string path = data_dir() + "/" + name;
  if (!std::filesystem::exists(path)) return nullptr;
  std::unique_ptr<BpeTokenizer> tok;
  Status st = BpeTokenizer::load(path, family, &tok);
  EXPECT_TRUE(st.is_ok()) << st.message();
  return tok;
}

#define LOAD_OR_SKIP(var, file, family)  \
  auto var = load_or_null(file, family); \
  if (!var) GTEST_SKIP() << data_dir() << "/" << file << " is absent: run scripts/setup_data.sh to fetch it"

std::vector<int32_t> enc(const BpeTokenizer& t, const std::string& s) {
  std::vector<int32_t> ids;
  t.encode(s, &ids);
  return ids;
}

void expect_round_trip(const BpeTokenizer& t, const std::string& s) {
  std::string back;
  ASSERT_TRUE(t.decode(enc(t, s), &back).is_ok());
  EXPECT_EQ(back, s);
}

std::vector<std::string> tricky_strings() {
  std::mt19937 rng(123);
  std::vector<std::string> v = {"",
                                " ",
                                "Hello world!",
                                "  leading and trailing  \n\n\t",
                                "naïve café — 東京 🚀 Привет!",
                                "it's we've they'll I'D 123456789 3.14159",
                                "line1\r\nline2\n\n\nend",
                                std::string("\xff\xfe invalid \xc3 bytes \x80\x80", 22),
                                std::string("nul\0inside", 10),
                                "<|endoftext|> is plain text here"};
  for (int n = 0; n < 20; ++n) {  // random byte strings: mostly invalid UTF-8
    std::string s;
    for (int k = 0; k < 200; ++k) s.push_back(char(rng() & 0xff));
    v.push_back(s);
  }
  return v;
}
}  // namespace

TEST(Gpt2Tokenizer, HelloWorldVector) {
  LOAD_OR_SKIP(tok, "gpt2.tiktoken", "gpt2");
  EXPECT_EQ(enc(*tok, "Hello world!"), (std::vector<int32_t>{15496, 995, 0}));
  EXPECT_EQ(tok->eod(), 50256);
  EXPECT_EQ(tok->vocab_size(), 50257);
}

TEST(Gpt2Tokenizer, RoundTripsAnyBytes) {
  LOAD_OR_SKIP(tok, "gpt2.tiktoken", "gpt2");
  for (const auto& s : tricky_strings()) expect_round_trip(*tok, s);
}

TEST(Llama3Tokenizer, HelloWorldVector) {
  LOAD_OR_SKIP(tok, "llama3.tiktoken", "llama3");
  EXPECT_EQ(enc(*tok, "Hello world!"), (std::vector<int32_t>{9906, 1917, 0}));
  EXPECT_EQ(tok->bos(), 128000);
  EXPECT_EQ(tok->eod(), 128001);
  EXPECT_EQ(tok->vocab_size(), 128256);
  std::vector<int32_t> ids;
  tok->encode_with_specials("<|begin_of_text|>Hello world!<|eot_id|>", &ids);
  EXPECT_EQ(ids, (std::vector<int32_t>{128000, 9906, 1917, 0, 128009}));
}

TEST(Llama3Tokenizer, RoundTripsAnyBytes) {
  LOAD_OR_SKIP(tok, "llama3.tiktoken", "llama3");
  for (const auto& s : tricky_strings()) expect_round_trip(*tok, s);
}

// A tiny byte-level tokenizer.json: every byte, plus merges whose ORDER differs from the merged
// tokens' ids, so merge-priority BPE (HF) and rank BPE would disagree: "abc" must become "a"+"bc".
namespace {
std::string tiny_json() {
  const std::string vocab = test::byte_vocab_entries();
  return R"({"added_tokens": [{"id": 259, "content": "<|endoftext|>", "special": true}],
             "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "use_regex": true},
             "model": {"type": "BPE", "vocab": {)" +
         vocab + R"(}, "merges": ["b c", "a b", "Ġ a"]}})";
}
}  // namespace

TEST(HfTokenizerJson, MergeOrderDecides) {
  std::unique_ptr<BpeTokenizer> tok;
  Status st = BpeTokenizer::from_hf_json_text(tiny_json(), "tiny.json", &tok);
  ASSERT_TRUE(st.is_ok()) << st.message();
  EXPECT_EQ(enc(*tok, "abc"), (std::vector<int32_t>{'a', 257}));
  EXPECT_EQ(enc(*tok, "ab abc"), (std::vector<int32_t>{256, 258, 257}));
  EXPECT_EQ(tok->eod(), 259);
  for (const auto& s : tricky_strings()) expect_round_trip(*tok, s);
}

TEST(HfTokenizerJson, RejectsBrokenFiles) {
  std::unique_ptr<BpeTokenizer> tok;
  EXPECT_FALSE(BpeTokenizer::from_hf_json_text("{not json", "x.json", &tok).is_ok());
  EXPECT_FALSE(
      BpeTokenizer::from_hf_json_text(R"({"model": {"type": "Unigram", "vocab": {}}})", "x.json", &tok).is_ok());
  Status st =
      BpeTokenizer::from_hf_json_text(R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}})", "x.json", &tok);
  EXPECT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("256 bytes"), std::string::npos) << st.message();
  // Two tokens sharing an id (found by fuzzing): merges are keyed by id pairs, so "l" + "d" would have
  // merged as "l" + "e" into a token the vocabulary lacks.
  std::string shared = tiny_json();
  const std::string own = "\"bc\": 257";
  shared.replace(shared.find(own), own.size(), "\"bc\": 256");
  st = BpeTokenizer::from_hf_json_text(shared, "x.json", &tok);
  EXPECT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("vocabulary id 256 belongs to two entries"), std::string::npos) << st.message();
}

TEST(BpeTraining, LearnsFrequentWordsAndRoundTrips) {
  std::vector<std::string> corpus;
  for (int i = 0; i < 200; ++i)
    corpus.push_back("the lowest lower low newest widest the the low " + std::to_string(i % 7));
  auto out = (unique_temp("nibble_bpe_train_test.json")).string();
  BpeTrainOptions opt;
  opt.vocab_size = 300;
  std::string summary;
  ASSERT_TRUE(train_bpe(corpus, opt, out, &summary).is_ok());
  std::unique_ptr<BpeTokenizer> tok;
  Status st = BpeTokenizer::from_hf_json(out, &tok);
  ASSERT_TRUE(st.is_ok()) << st.message();
  EXPECT_LE(tok->vocab_size(), 300);
  EXPECT_GT(tok->vocab_size(), 256 + 10) << summary;
  EXPECT_EQ(tok->eod(), tok->vocab_size() - 1);
  // " the" and " lowest" are frequent pieces: each must have become a single token.
  EXPECT_EQ(enc(*tok, " the").size(), 1u);
  EXPECT_EQ(enc(*tok, " lowest").size(), 1u);
  EXPECT_GT(enc(*tok, " zebra").size(), 1u);  // never seen: stays (mostly) bytes
  for (const auto& s : tricky_strings()) expect_round_trip(*tok, s);
  std::filesystem::remove(out);
}

// Expected ids printed by the npm packages' own JavaScript encoders (gpt-tokenizer 4.0.0
// r50k_base.encode and llama3-tokenizer-js 1.2.0 encode(t, {bos: false, eos: false})).
namespace {
const char* kLongText =
    "The quick brown fox jumps over the lazy dog.\n\n  It's 2024: numbers 1234567 and   spaces\ttabs!";
const char* kUnicodeText = "naïve café — 東京 🚀 Привет! I'VE don't";
}  // namespace

TEST(Gpt2Tokenizer, MatchesReferenceEncoder) {
  LOAD_OR_SKIP(tok, "gpt2.tiktoken", "gpt2");
  EXPECT_EQ(enc(*tok, kLongText),
            (std::vector<int32_t>{464,   2068, 7586, 21831, 18045, 625,  262, 16931, 3290, 13,   628, 220,  632, 338,
                                  48609, 25,   3146, 17031, 2231,  3134, 290, 220,   220,  9029, 197, 8658, 82,  0}));
  EXPECT_EQ(enc(*tok, kUnicodeText),
            (std::vector<int32_t>{2616, 38776, 40304, 851,   10545, 251,   109, 12859, 105, 12520, 248, 222, 12466,
                                  253,  21169, 18849, 38857, 16843, 20375, 0,   314,   6,   6089,  836, 470}));
}

TEST(Llama3Tokenizer, MatchesReferenceEncoder) {
  LOAD_OR_SKIP(tok, "llama3.tiktoken", "llama3");
  EXPECT_EQ(enc(*tok, kLongText), (std::vector<int32_t>{791,   4062, 14198, 39935, 35308, 927,  279,  16053, 5679, 382,
                                                        220,   1102, 596,   220,   2366,  19,   25,   5219,  220,  4513,
                                                        10961, 22,   323,   256,   12908, 3324, 3518, 0}));
  EXPECT_EQ(enc(*tok, kUnicodeText), (std::vector<int32_t>{3458, 38672, 588, 53050, 2001, 119109, 11410, 248, 222,
                                                           80584, 28089, 8341, 0, 358, 6, 4592, 1541, 956}));
}

TEST(BpeTraining, Gpt2StyleVocabAndMergesFilesEncodeLikeTheTokenizerJson) {
  // Splits a trained tokenizer.json into GPT-2's vocab.json + merges.txt and loads that pair.
  auto dir = unique_temp("nibble_vocab_merges_test");
  std::filesystem::create_directories(dir);
  std::vector<std::string> corpus(50, "merges are applied in order: the theme of these themes is the thesis");
  BpeTrainOptions opt;
  opt.vocab_size = 290;
  std::string json_path = (dir / "tok.json").string();
  ASSERT_TRUE(train_bpe(corpus, opt, json_path, nullptr).is_ok());
  std::ifstream f(json_path);
  auto j = nlohmann::json::parse(f);
  nlohmann::json vocab = j["model"]["vocab"];
  vocab["<|endoftext|>"] = j["added_tokens"][0]["id"];
  std::ofstream(dir / "vocab.json") << vocab.dump();
  {
    std::ofstream m(dir / "merges.txt");
    m << "#version: 0.2\n";
    for (const auto& pair : j["model"]["merges"])
      m << pair[0].get<std::string>() << " " << pair[1].get<std::string>() << "\n";
  }
  std::unique_ptr<BpeTokenizer> a, b;
  ASSERT_TRUE(BpeTokenizer::from_hf_json(json_path, &a).is_ok());
  Status st = BpeTokenizer::load((dir / "vocab.json").string(), "auto", &b);
  ASSERT_TRUE(st.is_ok()) << st.message();
  EXPECT_EQ(b->eod(), a->eod());
  for (const std::string s : {"the theme of these themes", "thesis: merges applied", "unseen words, too"})
    EXPECT_EQ(enc(*b, s), enc(*a, s)) << s;
  EXPECT_GT(enc(*a, "the theme of these themes").size(), 0u);
  std::filesystem::remove_all(dir);
}

// llama3-tokenizer.json (HF form: vocab + 280,147 merges applied in order, ignore_merges) must encode
// exactly like the rank file; vectors from llama3-tokenizer-js's own test suite, then real prose.
TEST(Llama3Tokenizer, HfJsonWithMergesEqualsRankFile) {
  LOAD_OR_SKIP(ranks, "llama3.tiktoken", "llama3");
  LOAD_OR_SKIP(hf, "llama3-tokenizer.json", "auto");
  EXPECT_TRUE(hf->adds_bos());
  EXPECT_EQ(hf->bos(), 128000);
  EXPECT_EQ(hf->eod(), 128001);
  EXPECT_EQ(hf->vocab_size(), 128256);
  EXPECT_EQ(enc(*hf, "grabbed"), (std::vector<int32_t>{59312, 2788}));
  EXPECT_EQ(enc(*hf, "           grabbed"), (std::vector<int32_t>{1881, 30418}));
  EXPECT_EQ(enc(*hf, "\ttabs\t\t\t\tout here"), (std::vector<int32_t>{3324, 3518, 573, 14294, 1618}));
  EXPECT_EQ(enc(*hf, "ax\n####\nboo"), (std::vector<int32_t>{710, 198, 71050, 34093}));
  EXPECT_EQ(enc(*hf, "🦙Ꙋ"), (std::vector<int32_t>{9468, 99, 247, 166, 247, 232}));
  EXPECT_EQ(enc(*hf, "This is a test sentence."), (std::vector<int32_t>{2028, 374, 264, 1296, 11914, 13}));
  std::ifstream corpus(data_dir() + "/corpus.jsonl");
  std::string line;
  int checked = 0;
  for (; checked < 200 && std::getline(corpus, line); ++checked) {
    std::string text = nlohmann::json::parse(line)["text"].get<std::string>();
    ASSERT_EQ(enc(*hf, text), enc(*ranks, text)) << "corpus document " << checked;
  }
  for (const auto& s : tricky_strings()) ASSERT_EQ(enc(*hf, s), enc(*ranks, s));
}
