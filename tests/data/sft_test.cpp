// SFT data (src/data/sft.h and `nibble preprocess --sft`): both input shapes, the Llama 3 and plain
// templates token by token with their answer masks, each truncation rule at its boundary, the drops, the
// file:line errors, and the written token/mask datasets read back. A tiny byte-level tokenizer (256 bytes,
// three merges, Llama 3 specials as added tokens) keeps every expected id readable: text is its bytes.
#include <gtest/gtest.h>
#include "common/byte_vocab.h"
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include "common/nibble_binary.h"
#include "data/data_test_util.h"
#include "data/indexed_dataset.h"
#include "data/sft.h"
#include "tokenizer/bpe_tokenizer.h"

using namespace nb;

namespace {
constexpr int32_t kEod = 259, kBegin = 260, kStart = 261, kEnd = 262, kEot = 263;

// tests/tokenizer's tiny_json, with the Llama 3 specials added when `llama3`.
std::string tiny_json(bool llama3) {
  std::string vocab = test::byte_vocab_entries();
  std::string added = R"({"id": 259, "content": "<|endoftext|>", "special": true})";
  if (llama3)
    added += R"(, {"id": 260, "content": "<|begin_of_text|>", "special": true},
                {"id": 261, "content": "<|start_header_id|>", "special": true},
                {"id": 262, "content": "<|end_header_id|>", "special": true},
                {"id": 263, "content": "<|eot_id|>", "special": true})";
  return R"({"added_tokens": [)" + added + R"(],
             "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "use_regex": true},
             "model": {"type": "BPE", "vocab": {)" +
         vocab + R"(}, "merges": ["b c", "a b", "Ġ a"]}})";
}

std::unique_ptr<BpeTokenizer> tiny(bool llama3 = true) {
  std::unique_ptr<BpeTokenizer> tok;
  Status st = BpeTokenizer::from_hf_json_text(tiny_json(llama3), "tiny.json", &tok);
  EXPECT_TRUE(st.is_ok()) << st.message();
  return tok;
}

// The ids of text without the merged pairs "ab", "bc", " a": its bytes.
std::vector<int32_t> ids(const std::string& s) { return {s.begin(), s.end()}; }

template <class T>
void append(std::vector<T>* v, const std::vector<T>& w) {
  v->insert(v->end(), w.begin(), w.end());
}

SftFormatter formatter(const BpeTokenizer* tok, ChatTemplate t, int64_t seq_length = 1000, bool add_bos = false,
                       SftTruncation tr = SftTruncation::truncate) {
  SftFormatter f;
  Status st = SftFormatter::create(tok, {t, tr, seq_length, add_bos}, &f);
  EXPECT_TRUE(st.is_ok()) << st.message();
  return f;
}

SftSample parse(const std::string& line) {
  SftSample s;
  Status st = parse_sft_sample(line, "t.jsonl:1", &s);
  EXPECT_TRUE(st.is_ok()) << st.message();
  return s;
}

// One Llama 3 message: header (mask 0), content and eot (mask `answer`).
void llama3_turn(const std::string& role, const std::string& content, uint8_t answer, SftTokens* t) {
  append(&t->tokens, {kStart});
  append(&t->tokens, ids(role));
  append(&t->tokens, {kEnd, '\n', '\n'});
  t->mask.resize(t->tokens.size(), 0);
  append(&t->tokens, ids(content));
  t->tokens.push_back(kEot);
  t->mask.resize(t->tokens.size(), answer);
}
}  // namespace

TEST(Sft, ParsesBothShapes) {
  SftSample s = parse(R"({"input": "Hi", "output": "Yo", "id": 7})");
  ASSERT_EQ(s.size(), 2u);
  EXPECT_EQ(s[0].role, "user");
  EXPECT_EQ(s[0].content, "Hi");
  EXPECT_EQ(s[1].role, "assistant");
  EXPECT_EQ(s[1].content, "Yo");
  s = parse(R"({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
                             {"role": "assistant", "content": "A"}]})");
  ASSERT_EQ(s.size(), 3u);
  EXPECT_EQ(s[0].role, "system");
  EXPECT_EQ(s[2].content, "A");
}

TEST(Sft, MalformedLinesNameFileAndLine) {
  for (const char* line :
       {"not json", "[1, 2]", R"({"input": "x"})", R"({"input": 1, "output": "y"})", R"({"messages": []})",
        R"({"messages": [{"role": "bot", "content": "x"}]})", R"({"messages": [{"role": "user"}]})",
        R"({"messages": [{"role": "user", "content": "x"}], "input": "a", "output": "b"})"}) {
    SftSample s;
    Status st = parse_sft_sample(line, "data.jsonl:7", &s);
    ASSERT_FALSE(st.is_ok()) << line;
    EXPECT_EQ(st.message().rfind("data.jsonl:7: ", 0), 0u) << st.message();
    EXPECT_NE(st.message().find("{\"messages\": ["), std::string::npos) << st.message();
  }
}

TEST(Sft, Llama3TemplateIsExact) {
  auto tok = tiny();
  SftTokens t;
  formatter(tok.get(), ChatTemplate::llama3).format(parse(R"({"input": " Hi\n", "output": "Yo"})"), &t);
  // <|begin_of_text|> <|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>
  // <|start_header_id|>assistant<|end_header_id|>\n\nYo<|eot_id|>; contents are trimmed, as Llama 3 does.
  std::vector<int32_t> want = {kBegin, kStart};
  append(&want, ids("user"));
  append(&want, {kEnd, '\n', '\n', 'H', 'i', kEot, kStart});
  append(&want, ids("assistant"));
  append(&want, {kEnd, '\n', '\n', 'Y', 'o', kEot});
  EXPECT_EQ(t.tokens, want);
  std::vector<uint8_t> mask(want.size(), 0);
  mask[want.size() - 3] = mask[want.size() - 2] = mask[want.size() - 1] = 1;  // "Yo" and its eot
  EXPECT_EQ(t.mask, mask);
  EXPECT_EQ(t.answer_content, 2);
  EXPECT_EQ(t.answer_tokens(), 3);
}

TEST(Sft, Llama3MaskCoversEveryAssistantContentAndEot) {
  auto tok = tiny();
  SftTokens t, want;
  formatter(tok.get(), ChatTemplate::llama3)
      .format(parse(R"({"messages": [{"role": "system", "content": "Be nice"}, {"role": "user", "content": "Q1"},
                                     {"role": "assistant", "content": "R1"}, {"role": "user", "content": "Q2"},
                                     {"role": "assistant", "content": "R22"}]})"),
              &t);
  want.tokens = {kBegin};
  want.mask = {0};
  llama3_turn("system", "Be nice", 0, &want);
  llama3_turn("user", "Q1", 0, &want);
  llama3_turn("assistant", "R1", 1, &want);
  llama3_turn("user", "Q2", 0, &want);
  llama3_turn("assistant", "R22", 1, &want);
  EXPECT_EQ(t.tokens, want.tokens);
  EXPECT_EQ(t.mask, want.mask);
  EXPECT_EQ(t.answer_tokens(), 2 + 1 + 3 + 1);
}

TEST(Sft, Llama3NeedsTheSpecialTokens) {
  auto tok = tiny(false);
  SftFormatter f;
  Status st = SftFormatter::create(tok.get(), {ChatTemplate::llama3, SftTruncation::truncate, 100, false}, &f);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("--chat-template plain"), std::string::npos) << st.message();
  EXPECT_TRUE(SftFormatter::create(tok.get(), {ChatTemplate::plain, SftTruncation::truncate, 100, false}, &f).is_ok());
}

TEST(Sft, PlainTemplate) {
  auto tok = tiny(false);
  SftTokens t;
  formatter(tok.get(), ChatTemplate::plain).format(parse(R"({"input": "Hi ", "output": "Yo"})"), &t);
  EXPECT_EQ(t.tokens, (std::vector<int32_t>{'H', 'i', ' ', 'Y', 'o', kEod}));
  EXPECT_EQ(t.mask, (std::vector<uint8_t>{0, 0, 0, 1, 1, 1}));
  auto tok3 = tiny();
  formatter(tok3.get(), ChatTemplate::plain, 1000, true)
      .format(parse(R"({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
                                     {"role": "assistant", "content": "A"}, {"role": "user", "content": "V"}]})"),
              &t);
  EXPECT_EQ(t.tokens, (std::vector<int32_t>{kBegin, 'S', 'U', 'A', 'V', kEod}));
  EXPECT_EQ(t.mask, (std::vector<uint8_t>{0, 0, 0, 1, 0, 1}));
}

TEST(Sft, EmptyAnswersAreDropped) {
  auto tok = tiny();
  for (ChatTemplate ct : {ChatTemplate::llama3, ChatTemplate::plain}) {
    auto f = formatter(tok.get(), ct);
    SftTokens t;
    EXPECT_EQ(f.process(parse(R"({"input": "Hi", "output": ""})"), &t), SftOutcome::dropped_no_answer);
    EXPECT_EQ(f.process(parse(R"({"messages": [{"role": "user", "content": "Hi"}]})"), &t),
              SftOutcome::dropped_no_answer);
    EXPECT_EQ(f.process(parse(R"({"input": "Hi", "output": "Yo"})"), &t), SftOutcome::kept);
  }
  SftTokens t;  // Llama 3 trims, so a blank answer is empty too
  EXPECT_EQ(formatter(tok.get(), ChatTemplate::llama3).process(parse(R"({"input": "Hi", "output": " \n"})"), &t),
            SftOutcome::dropped_no_answer);
}

// Plain template, no BOS: prompt "0123456789" x 4 (P = 40), answer "xyzw" x 3 + eod (A = 13), 53 tokens.
TEST(Sft, TruncationKeepsThePromptsEndAndTheWholeAnswer) {
  auto tok = tiny();
  const SftSample s = parse(R"({"input": "0123456789012345678901234567890123456789", "output": "xyzwxyzwxyzw"})");
  SftTokens full, t;
  formatter(tok.get(), ChatTemplate::plain).format(s, &full);
  ASSERT_EQ(full.tokens.size(), 53u);
  EXPECT_EQ(formatter(tok.get(), ChatTemplate::plain, 53).process(s, &t), SftOutcome::kept);  // N = length
  EXPECT_EQ(t.tokens, full.tokens);
  // N = 52: the prompt keeps its last N - A = 39 tokens, the answer is whole.
  EXPECT_EQ(formatter(tok.get(), ChatTemplate::plain, 52).process(s, &t), SftOutcome::prompt_cut);
  EXPECT_EQ(t.tokens, std::vector<int32_t>(full.tokens.begin() + 1, full.tokens.end()));
  EXPECT_EQ(t.mask, std::vector<uint8_t>(full.mask.begin() + 1, full.mask.end()));
  // N = 17: N - A = 4 = N / 4, the last length with the whole answer; the prompt keeps "6789".
  EXPECT_EQ(formatter(tok.get(), ChatTemplate::plain, 17).process(s, &t), SftOutcome::prompt_cut);
  EXPECT_EQ(t.tokens, std::vector<int32_t>(full.tokens.begin() + 36, full.tokens.end()));
  // N = 16: N - A = 3 < N / 4 = 4: the prompt keeps its last 4, the answer its first 12 (the eod goes).
  EXPECT_EQ(formatter(tok.get(), ChatTemplate::plain, 16).process(s, &t), SftOutcome::answer_cut);
  EXPECT_EQ(t.tokens, std::vector<int32_t>(full.tokens.begin() + 36, full.tokens.end() - 1));
  EXPECT_EQ(t.answer_tokens(), 12);
}

TEST(Sft, TruncationKeepsTheBos) {
  auto tok = tiny();
  const SftSample s = parse(R"({"input": "0123456789", "output": "xyzw"})");
  SftTokens full, t;
  auto f = formatter(tok.get(), ChatTemplate::llama3, 1000);
  f.format(s, &full);
  const int64_t len = int64_t(full.tokens.size());
  EXPECT_EQ(formatter(tok.get(), ChatTemplate::llama3, len).process(s, &t), SftOutcome::kept);
  // N = len - 1: the prompt loses its second token (<|start_header_id|>), never <|begin_of_text|>.
  EXPECT_EQ(formatter(tok.get(), ChatTemplate::llama3, len - 1).process(s, &t), SftOutcome::prompt_cut);
  std::vector<int32_t> want = full.tokens;
  want.erase(want.begin() + 1);
  EXPECT_EQ(t.tokens, want);
  // Plain with --add-bos: the same.
  formatter(tok.get(), ChatTemplate::plain, 1000, true).format(s, &full);
  EXPECT_EQ(formatter(tok.get(), ChatTemplate::plain, 15, true).process(s, &t), SftOutcome::prompt_cut);
  EXPECT_EQ(t.tokens[0], kBegin);
  EXPECT_EQ(t.tokens[1], '1');
  EXPECT_EQ(t.tokens.size(), 15u);
}

TEST(Sft, DropModeDropsEveryLongerSample) {
  auto tok = tiny();
  const SftSample s = parse(R"({"input": "0123456789", "output": "xyzw"})");  // 15 tokens with the eod
  SftTokens t;
  EXPECT_EQ(formatter(tok.get(), ChatTemplate::plain, 15, false, SftTruncation::drop).process(s, &t), SftOutcome::kept);
  EXPECT_EQ(formatter(tok.get(), ChatTemplate::plain, 14, false, SftTruncation::drop).process(s, &t),
            SftOutcome::dropped_too_long);
}

namespace {
struct CliDir {
  std::filesystem::path dir;
  std::string tok;
  explicit CliDir(const std::string& name) : dir(unique_temp(name)) {
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
    tok = (dir / "tok.json").string();
    std::ofstream(tok) << tiny_json(true);
  }
  ~CliDir() { std::filesystem::remove_all(dir); }
  std::string write(const std::string& name, const std::vector<std::string>& lines) const {
    std::ofstream f(dir / name);
    for (const auto& l : lines) f << l << "\n";
    return (dir / name).string();
  }
};
}  // namespace

TEST(SftCli, WritesTokenAndMaskDatasetsWithEqualDocuments) {
  CliDir d("nibble_sft_cli");
  const std::vector<std::string> lines = {
      R"({"input": "Hi", "output": "Yo"})",
      R"({"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "R1"},
                       {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "R2"}]})",
      "",                                                                    // blank lines are skipped
      R"({"input": "Hi", "output": ""})",                                    // dropped: no answer
      R"({"input": ")" + std::string(100, 'p') + R"(", "output": "xyzw"})",  // truncated to 60
  };
  std::string in =
      d.write("in.jsonl", {lines[0], nlohmann::json::parse(lines[1]).dump(), lines[2], lines[3], lines[4]});
  const std::string prefix = (d.dir / "sft").string();
  auto r = nb::test::run_nibble("preprocess --sft -i " + in + " -o " + prefix + " -t " + d.tok +
                                " --seq-length 60 --workers 2");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("3 samples written, 1 truncated"), std::string::npos) << r.out;
  std::unique_ptr<IndexedDataset> toks, mask;
  Status st = IndexedDataset::open(prefix + "_tokens_document", &toks);
  ASSERT_TRUE(st.is_ok()) << st.message();
  st = IndexedDataset::open(prefix + "_mask_document", &mask);
  ASSERT_TRUE(st.is_ok()) << st.message();
  EXPECT_EQ(toks->dtype(), IndexedDtype::u16);
  EXPECT_EQ(mask->dtype(), IndexedDtype::u8);
  ASSERT_EQ(toks->sequence_count(), 3);
  EXPECT_EQ(toks->document_count(), 4);
  EXPECT_EQ(toks->sequence_lengths(), mask->sequence_lengths());
  auto tok = tiny();
  auto f = formatter(tok.get(), ChatTemplate::llama3, 60);
  int64_t seq = 0, answer = 0;
  for (int i : {0, 1, 4}) {
    SftTokens want;
    f.process(parse(lines[size_t(i)]), &want);
    std::vector<int32_t> got_t, got_m;
    toks->read(seq, 0, -1, &got_t);
    mask->read(seq++, 0, -1, &got_m);
    EXPECT_EQ(got_t, want.tokens) << "line " << i;
    EXPECT_EQ(got_m, std::vector<int32_t>(want.mask.begin(), want.mask.end())) << "line " << i;
    answer += want.answer_tokens();
  }
  EXPECT_EQ(toks->sequence_length(2), 60);
  std::ifstream sf(prefix + "_sft_stats.json");
  const auto stats = nlohmann::json::parse(sf);
  EXPECT_EQ(stats["samples"], 3);
  EXPECT_EQ(stats["samples_truncated"], 1);
  EXPECT_EQ(stats["samples_dropped"], 1);
  EXPECT_EQ(stats["answer_tokens"], answer);
}

TEST(SftCli, ErrorsNameTheLineAndTheFlag) {
  CliDir d("nibble_sft_cli_bad");
  std::string in = d.write("bad.jsonl", {R"({"input": "a", "output": "b"})", "", R"({"prompt": "x"})"});
  auto r = nb::test::run_nibble("preprocess --sft -i " + in + " -o " + (d.dir / "o").string() + " -t " + d.tok +
                                " --seq-length 8");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("bad.jsonl:3: "), std::string::npos) << r.out;
  // A failed run leaves no half-written dataset that would later load as if complete.
  for (const char* suffix : {"o_tokens_document.bin", "o_tokens_document.idx", "o_mask_document.idx"})
    EXPECT_FALSE(std::filesystem::exists(d.dir / suffix)) << suffix;
  r = nb::test::run_nibble("preprocess --sft -i " + in + " -o " + (d.dir / "o").string() + " -t " + d.tok);
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("--seq-length"), std::string::npos) << r.out;
  r = nb::test::run_nibble("preprocess -i " + in + " -o " + (d.dir / "o").string() + " -t " + d.tok +
                           " --seq-length 8");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("add --sft"), std::string::npos) << r.out;
}
